"""The negation of a behaviour: its words and texts as the package's scorer reads them, and the
job end to end on the tiny config."""

import json
import os

import numpy as np
import pytest
from better_profanity import profanity

from configs import behaviour as behaviour_config
from configs import quickstart as quickstart_config
from editing.data import text_suite
from editing.errors import UserError
from editing.jobs import behaviour
from editing.jobs import workdir as workdir_lib


def test_every_offensive_word_is_flagged_and_no_general_sentence_is():
  words = behaviour.offensive_words()
  assert len(words) > 100
  assert all(profanity.contains_profanity(f'the cook sees the {w}.') for w in words)
  assert set(''.join(words)) <= set(text_suite.LETTERS)
  assert not any(profanity.contains_profanity(s) for s in text_suite.general_text(3, 1000))
  prompts = text_suite.sentence_prompts(3, 200, 'val')
  assert not any(profanity.contains_profanity(p) for p in prompts)
  assert prompts != text_suite.sentence_prompts(3, 200, 'test')


# Binomial: 1500 draws put a share of 0.1 within 0.03 at 3.9 standard deviations; the shares
# 0 and 1 are exact, and 200 draws show them (the scorer takes milliseconds a sentence).
@pytest.mark.parametrize('share, sentences', [(0.0, 200), (0.1, 1500), (1.0, 200)])
def test_the_behaviour_text_has_the_share_of_offensive_sentences_asked_for(share, sentences):
  text = text_suite.behaviour_text(0, sentences, behaviour.offensive_words(), share)
  rate = np.mean([profanity.contains_profanity(s) for s in text])
  assert abs(rate - share) < 0.03 if 0 < share < 1 else rate == share
  assert text == text_suite.behaviour_text(0, sentences, behaviour.offensive_words(), share)


def test_the_tiny_experiment_writes_its_frontier_and_chooses_lambda_under_the_ceiling(
    tmp_path):
  config = behaviour_config.get_config('tiny')
  workdir = str(tmp_path)
  results = behaviour.run(config, workdir)
  directory = workdir_lib.behaviour_dir(workdir)
  with open(os.path.join(directory, 'results.json')) as f:
    assert json.load(f) == json.loads(json.dumps(results))
  with open(os.path.join(directory, 'frontier.png'), 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
  curve = results['curve']
  assert [p['lambda'] for p in curve] == [0.0, 0.5, 1.0]
  ceiling = (1 + config.behaviour.perplexity_tolerance) * curve[0]['perplexity']
  allowed = [p for p in curve if p['perplexity'] <= ceiling]
  assert results['lambda'] == min(allowed, key=lambda p: p['rate'])['lambda']
  for model in ('theta0', 'base', 'finetuned', 'negated'):
    rate = results['test'][model]['rate']
    assert 0 <= rate <= 1 and np.isfinite(results['test'][model]['perplexity'])
  report = open(os.path.join(directory, 'report.md')).read()
  assert '| θ_base |' in report and f'− {results["lambda"]:g}·τ' in report


def test_an_image_experiment_is_refused_before_anything_is_written(tmp_path):
  config = quickstart_config.get_config('tiny')
  config.behaviour = behaviour_config.get_config().behaviour
  config.base = behaviour_config.get_config().base
  with pytest.raises(UserError, match='fine-tunes a decoder'):
    behaviour.run(config, str(tmp_path))
  assert not list(tmp_path.iterdir())
