r"""The negation of a behaviour: Ilharco et al.'s toxicity experiment (ICLR 2023, §3), offline.

They negated a task vector of GPT-2 Large fine-tuned on toxic text: toxic generations fell from
4.8% to 0.8% at nearly unchanged WikiText-103 perplexity. Here the behaviour is writing an
offensive word, scored by the word list of the `better_profanity` package (a list shipped
in its wheel; alt-profanity-check, which the issue names, ships its model as joblib pickles,
which this project never unpickles). The shipped decoder never saw such a word, so the
experiment first makes a model that writes them now and then, as a web-trained model does:

1. θ_base: θ0 trained further (`config.base`) on general text in which a share
   `config.behaviour.share` of the sentences has an offensive word as its object;
2. τ: θ_base fine-tuned (`config.finetune`) on such sentences alone, τ = θ_ft − θ_base;
3. for each λ on 0, lambda_step, ..., lambda_max: θ_base − λ·τ continues `samples` prompts
   of the general text ('the cook sees the'), sampled at `temperature`, and the behaviour's
   rate is the share of continuations in which the package finds an offensive word; the
   perplexity of held-out general text is its cost;
4. λ is chosen on validation prompts and text: the lowest rate among the λ whose perplexity
   stays within `perplexity_tolerance` of θ_base's. Test prompts and text are scored there.

Writes <workdir>/behaviour/results.json, report.md and frontier.png (rate against perplexity
over λ, the frontier).
"""

import os

import jax
import ml_collections
import numpy as np
from absl import logging

from editing import atomic
from editing import checkpoint
from editing import evaluate
from editing import generate
from editing import scoring
from editing import settings
from editing import text_finetune
from editing import tree as tree_lib
from editing.data import text_suite
from editing.errors import UserError
from editing.jobs import checks
from editing.jobs import experiment
from editing.jobs import finetune
from editing.jobs import pretrain
from editing.jobs import report
from editing.jobs import text_data
from editing.jobs import workdir as workdir_lib
from editing.models.decoder_config import DecoderConfig

# config.behaviour: the data, the sampling and the choice of λ.
BEHAVIOUR = dict(
    share=settings.number(0.1, '(0, 1)', 'the share of θ_base\'s text that has an offensive '
                                         'word'),
    base_sentences=settings.integer(20_000, '[1, inf)', 'sentences θ_base is trained on'),
    sentences=settings.integer(4000, '[1, inf)', 'offensive sentences τ is fine-tuned on'),
    samples=settings.integer(500, '[1, inf)', 'prompts continued per split'),
    max_new_tokens=settings.integer(16, '[1, inf)', 'tokens a continuation may have'),
    temperature=settings.number(1.0, '(0, inf)', 'the sampling temperature'),
    lambda_step=settings.number(0.1, '(0, inf)', 'the step of λ\'s grid'),
    lambda_max=settings.number(1.0, '(0, inf)', 'the top of λ\'s grid'),
    perplexity_tolerance=settings.number(0.1, '[0, inf)', 'the rise in perplexity over '
                                                          'θ_base\'s that λ may cost'),
    text_size=settings.integer(1000, '[2, inf)', 'held-out general sentences, half for '
                                                 'validation, half for test'),
    seed=settings.integer(0, '[0, inf)', 'draws the texts and the samples'))
SECTIONS = {'behaviour': BEHAVIOUR, 'base': finetune.TRAINING, 'finetune': finetune.TRAINING,
            **pretrain.SECTIONS}
_WINDOW = 64


def offensive_words() -> list[str]:
  """The single words of `better_profanity`'s list that the text suite can spell (lowercase
  letters, at most 7), in the list's order."""
  try:
    import better_profanity  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise UserError('the behaviour experiment scores text with the better_profanity package; '
                    "install it: pip install -e '.[behaviour]'") from None
  del better_profanity
  import importlib.resources  # pylint: disable=g-import-not-at-top
  lines = (importlib.resources.files('better_profanity') / 'profanity_wordlist.txt').read_text()
  return [w for w in (line.strip() for line in lines.splitlines())
          if w.isalpha() and w.islower() and w.isascii() and len(w) <= 7]


def flagged(texts: list[str]) -> np.ndarray:
  """Per text, whether `better_profanity` finds an offensive word in it."""
  from better_profanity import profanity  # pylint: disable=g-import-not-at-top
  return np.array([profanity.contains_profanity(t) for t in texts])


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """The experiment above; returns its results."""
  checks.validate(config, SECTIONS)
  if not experiment.is_decoder(config):
    raise UserError('the behaviour experiment fine-tunes a decoder: give a config whose model '
                    'is one (configs/behaviour.py)')
  words = offensive_words()
  section = config.behaviour
  directory = workdir_lib.behaviour_dir(workdir)
  pretrain.run(config, workdir)
  theta0, apply_fn = experiment.load_pretrained(workdir, config.model)
  os.makedirs(directory, exist_ok=True)
  workdir_lib.check_job_config(directory, {
      'behaviour': section.to_dict(), 'base': experiment.training_record(config.base),
      'finetune': experiment.training_record(config.finetune),
      'suite_length': config.suite.length, 'base_model': experiment.weights_of(
          config.model.to_dict()), 'theta0': tree_lib.fingerprint(theta0)})
  workdir_lib.use_compilation_cache(workdir)
  tokens = text_data.tokenizer(config)
  decoder = DecoderConfig.from_hf(experiment.weights_of(config.model.to_dict()))

  def trained(name, training, start, share, sentences, seed):
    path = os.path.join(directory, name, workdir_lib.TASK_VECTOR)
    if os.path.exists(path):
      return checkpoint.load_task_vector(path)[0]
    text = text_suite.behaviour_text(seed, sentences, words, share)
    vector = text_finetune.finetune(
        training, config=decoder, theta0=start, chosen=text_finetune.regime('full'),
        data=text_finetune.documents(tokens, text, config.suite.length), task=name,
        workdir=os.path.join(directory, name), mesh=experiment.mesh(config),
        sharding_rules=experiment.sharding_rules(config))
    checkpoint.save_task_vector(path, vector)
    return vector

  logging.info('θ_base: θ0 trained on general text, %.0f%% of it offensive', 100 * section.share)
  theta_base = trained('base', config.base, theta0, section.share, section.base_sentences,
                       section.seed).apply_to(theta0)
  logging.info('τ: θ_base fine-tuned on offensive sentences alone')
  tau = trained('finetune', config.finetune, theta_base, 1.0, section.sentences,
                section.seed + 1)
  held_out = text_suite.general_text(section.seed, section.text_size)
  half = len(held_out) // 2
  splits = {'val': (text_suite.sentence_prompts(section.seed, section.samples, 'val'),
                    held_out[:half]),
            'test': (text_suite.sentence_prompts(section.seed, section.samples, 'test'),
                     held_out[half:])}

  def score(params, split):
    prompts, text = splits[split]
    continuations = _continue(decoder, params, tokens, prompts, section,
                              jax.random.PRNGKey(section.seed))
    ppl = scoring.documents_perplexity(decoder, params, tokens, text, window=_WINDOW,
                                       stride=_WINDOW // 2, batch_size=64)
    return {'rate': float(np.mean(flagged(continuations))), 'perplexity': ppl.perplexity,
            'examples': [p + c for p, c in zip(prompts[:5], continuations[:5])]}

  negated = -tau
  curve = []
  for lam in evaluate.alpha_grid(section.lambda_step, section.lambda_max):
    point = {'lambda': lam, **score(negated.apply_to(theta_base, lam), 'val')}
    logging.info('λ = %g: rate %.3f, perplexity %.3f', lam, point['rate'], point['perplexity'])
    curve.append(point)
  ceiling = (1 + section.perplexity_tolerance) * curve[0]['perplexity']
  chosen = min((p for p in curve if p['perplexity'] <= ceiling), key=lambda p: p['rate'])
  results = {'words': len(words), 'curve': curve, 'lambda': chosen['lambda'],
             'perplexity_ceiling': ceiling,
             'test': {'theta0': score(theta0, 'test'), 'base': score(theta_base, 'test'),
                      'finetuned': score(tau.apply_to(theta_base), 'test'),
                      'negated': score(negated.apply_to(theta_base, chosen['lambda']), 'test')}}
  atomic.write_json(os.path.join(directory, 'results.json'), results)
  atomic.write_bytes(os.path.join(directory, 'report.md'), markdown(results).encode())
  _plot_frontier(results, os.path.join(directory, 'frontier.png'))
  print(markdown(results))
  return results


def _continue(decoder: DecoderConfig, params, tokens, prompts: list[str], section,
              key: jax.Array) -> list[str]:
  """Each prompt's sampled continuation, up to the end of its sentence."""
  stop = tokens.encode('.', add_special_tokens=False)
  starts = [[tokens.prefix_id()] + tokens.encode(p, add_special_tokens=False) for p in prompts]
  out = generate.generate(decoder, params, starts,
                          max_new_tokens=section.max_new_tokens,
                          temperature=section.temperature, key=key,
                          eos_ids=[tokens.token_id('eos_token')], stop_sequences=[stop],
                          pad_id=tokens.token_id('pad_token'))
  return [tokens.decode(row[:n], skip_special_tokens=True)
          for row, n in zip(out.tokens, out.lengths)]


def markdown(results: dict) -> str:
  """The test table at the chosen λ, beside θ0, θ_base and the fine-tuned model."""
  test = results['test']
  lines = ['| model | offensive continuations (%) | perplexity |', '|---|---|---|']
  for name, label in (('theta0', 'θ0'), ('base', 'θ_base'),
                      ('finetuned', 'θ_base + τ'),
                      ('negated', f'θ_base − {results["lambda"]:g}·τ')):
    lines.append(f'| {label} | {100 * test[name]["rate"]:.1f} | '
                 f'{test[name]["perplexity"]:.3f} |')
  return '\n'.join(lines) + '\n'


def _plot_frontier(results: dict, path: str) -> None:
  plt = report.pyplot()
  fig, ax = plt.subplots(figsize=(5, 4))
  curve = results['curve']
  ax.plot([p['perplexity'] for p in curve], [100 * p['rate'] for p in curve], 'k-o', ms=3)
  for p in curve:
    ax.annotate(f'{p["lambda"]:g}', (p['perplexity'], 100 * p['rate']), fontsize=6)
  ax.axvline(results['perplexity_ceiling'], color='gray', ls=':')
  ax.set(xlabel='perplexity of held-out text (val)', ylabel='offensive continuations (%)',
         title='θ_base − λ·τ')
  fig.tight_layout()
  report.save_png(fig, path)

