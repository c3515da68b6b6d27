"""Backbone sweep: pretrain candidates on the captions corpus, then the quickstart protocol for
each (backbone, fine-tuning setting, suite seed), every job its own process, many at once.

  python docs/experiments/captions_backbone_sweep.py     # SWEEP_SCALE=tiny: a CPU dry run
  SWEEP_BACKBONES=b30k SWEEP_SEEDS=0 python docs/experiments/captions_backbone_sweep.py
  python docs/experiments/captions_backbone_sweep.py collect   # the table of what finished

Run on one H200 (16 CPU cores) for issue 12; its results are captions_backbone_sweep.json
beside this file. The quickstart protocol here evaluates ξ on a 3×3 grid only.
"""

import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
OUT = os.environ.get('OUT') or '/tmp/sweep_out'
ROOT = os.environ.get('SWEEP_ROOT', '/tmp/sweep')
TINY = os.environ.get('SWEEP_SCALE') == 'tiny'

BACKBONES = {'b10k': dict(steps=10_000), 'b30k': dict(steps=30_000)}
FINETUNES = {'lr1e-4_s300': dict(learning_rate=1e-4, steps=300),
             'lr3e-4_s100': dict(learning_rate=3e-4, steps=100),
             'lr3e-4_s300': dict(learning_rate=3e-4, steps=300),
             'lr1e-3_s100': dict(learning_rate=1e-3, steps=100),
             'lr3e-5_s300': dict(learning_rate=3e-5, steps=300),
             'lr1e-4_s100': dict(learning_rate=1e-4, steps=100)}
SEEDS = tuple(int(s) for s in os.environ.get('SWEEP_SEEDS', '0,1').split(','))


def config_for(backbone, finetune=None, seed=0):
  from configs import quickstart  # pylint: disable=g-import-not-at-top
  config = quickstart.get_config('tiny' if TINY else None)
  config.pretrain.corpus = 'captions'
  if TINY:
    config.pretrain.update(steps=BACKBONES[backbone]['steps'] // 1000, corpus_size=3000)
  else:
    config.pretrain.update(batch_size=256, learning_rate=1e-3, warmup_steps=500,
                           checkpoint_every=5000, log_every=1000, **BACKBONES[backbone])
  if finetune:
    settings = dict(FINETUNES[finetune])
    if TINY:
      settings['steps'] //= 25
    config.finetune.update(warmup_steps=min(10, settings['steps'] - 1), **settings)
  config.suite.seed = seed
  config.eval.disentanglement_points = 3
  config.eval.disentanglement_size = 100
  return config


def pretrain(backbone):
  from editing.jobs import pretrain as job  # pylint: disable=g-import-not-at-top
  start = time.time()
  job.run(config_for(backbone), os.path.join(ROOT, backbone))
  with open(os.path.join(ROOT, backbone, 'seconds'), 'w') as f:
    f.write(str(time.time() - start))


def finetune(backbone, setting, seed):
  import numpy as np  # pylint: disable=g-import-not-at-top
  from editing.jobs import quickstart  # pylint: disable=g-import-not-at-top
  name = f'{backbone}_{setting}_s{seed}'
  workdir = os.path.join(ROOT, name)
  os.makedirs(os.path.join(workdir, 'pretrain'), exist_ok=True)
  for f in ('params.safetensors', 'job_config.json'):
    shutil.copy(os.path.join(ROOT, backbone, 'pretrain', f), os.path.join(workdir, 'pretrain', f))
  results = quickstart.run(config_for(backbone, setting, seed), workdir)
  r = results['regimes']['full']
  tasks = r['tasks']
  mean = lambda xs: float(np.mean(xs))
  summary = {
      'backbone': backbone, 'finetune': setting, 'seed': seed,
      'pretrained': mean([r['pretrained'][t] for t in tasks]),
      'finetuned': mean([r['finetuned'][t]['test'] for t in tasks]),
      'addition': r['addition']['mean_test'],
      'addition_normalized': r['addition']['mean_normalized_test'],
      'addition_alpha': r['addition']['alpha'],
      'negation_target': mean([r['negation'][t]['target_test'] for t in tasks]),
      'negation_control': mean([r['negation'][t]['control_test'] for t in tasks]),
      'control_pretrained': r['pretrained'][r['control_task']],
      'per_task': {t: {'pretrained': r['pretrained'][t], 'finetuned': r['finetuned'][t]['test'],
                       'addition': r['addition']['test'][t],
                       'negation': r['negation'][t]['target_test'],
                       'negation_alpha': r['negation'][t]['alpha']} for t in tasks},
      'seconds': results['seconds'],
  }
  with open(os.path.join(ROOT, f'{name}.json'), 'w') as f:
    json.dump(summary, f)


def run_all(jobs):
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE='false', PYTHONUNBUFFERED='1',
             PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get('PYTHONPATH')])))
  procs = []
  for args in jobs:
    path = os.path.join(ROOT, 'log_' + '_'.join(map(str, args)) + '.txt')
    procs.append((args, path, subprocess.Popen(
        [sys.executable, __file__] + list(map(str, args)), env=env, stdout=open(path, 'w'),
        stderr=subprocess.STDOUT)))
  for args, path, proc in procs:
    code = proc.wait()
    print(args, 'exit', code, flush=True)
    if code:
      print(''.join(open(path).readlines()[-25:]), flush=True)


def collect():
  rows = []
  for name in sorted(os.listdir(ROOT)):
    if name.endswith('.json'):
      with open(os.path.join(ROOT, name)) as f:
        rows.append(json.load(f))
  os.makedirs(OUT, exist_ok=True)
  with open(os.path.join(OUT, 'sweep.json'), 'w') as f:
    json.dump(rows, f, indent=1)
  for r in rows:
    print(f"{r['backbone']:5} {r['finetune']:12} s{r['seed']}  pre {100*r['pretrained']:5.1f}  "
          f"ft {100*r['finetuned']:5.1f}  add {100*r['addition']:5.1f} "
          f"({100*r['addition_normalized']:5.1f} n, a={r['addition_alpha']})  "
          f"neg {100*r['negation_target']:5.1f}/{100*r['negation_control']:5.1f} "
          f"(ctl pre {100*r['control_pretrained']:5.1f})", flush=True)


def main():
  start = time.time()
  os.makedirs(ROOT, exist_ok=True)
  run_all([('pretrain', b) for b in BACKBONES])
  print(f'pretrained in {time.time() - start:.0f} s', flush=True)
  for b in BACKBONES:
    os.makedirs(OUT, exist_ok=True)
    shutil.copy(os.path.join(ROOT, b, 'pretrain', 'params.safetensors'),
                os.path.join(OUT, f'{b}.safetensors'))
  chosen = os.environ.get('SWEEP_BACKBONES', ','.join(BACKBONES)).split(',')
  run_all([('finetune', b, f, s) for b in chosen for f in FINETUNES for s in SEEDS])
  collect()
  print(f'done in {time.time() - start:.0f} s', flush=True)


if __name__ == '__main__':
  if len(sys.argv) == 1:
    main()
  elif sys.argv[1] == 'collect':
    collect()
  elif sys.argv[1] == 'pretrain':
    pretrain(sys.argv[2])
  else:
    finetune(sys.argv[2], sys.argv[3], int(sys.argv[4]))
