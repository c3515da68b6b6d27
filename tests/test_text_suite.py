"""The text suite: determinism, disjoint splits, and every answer recomputed from its prompt."""

import datetime
import re
import string

import pytest

from editing.data import text_suite
from editing.errors import UserError

SMALL = dict(train_size=300, val_size=60, test_size=60)
PROMPT = re.compile(r'^([a-z]+): ([^=]+)=$')

# The test's own copies of a few words of the category and sentiment vocabularies.
CATEGORY_OF = {'horse': 'animal', 'mango': 'fruit', 'purple': 'colour', 'hammer': 'tool',
               'truck': 'vehicle', 'scarf': 'garment', 'violin': 'instrument',
               'carrot': 'vegetable', 'cat': 'animal', 'lemon': 'fruit', 'bus': 'vehicle',
               'potato': 'vegetable'}
SENTIMENT_OF = {'great': 'positive', 'lovely': 'positive', 'superb': 'positive',
                'awful': 'negative', 'boring': 'negative', 'rude': 'negative'}


def parse(prompt):
  match = PROMPT.match(prompt)
  assert match, f'{prompt!r} is not in the format "task: input="'
  return match.group(1), match.group(2)


def weekday(text):
  return datetime.date.fromisoformat(text).strftime('%A').lower()


def count(text):
  letter, letters = text.split(' in ')
  assert len(letter) == 1 and letters.isalpha()
  return str(letters.count(letter))


def sentiment(text):
  """The sentiment of a text holding one of the test's words, None if it holds none."""
  found = {SENTIMENT_OF[word] for word in text.split() if word in SENTIMENT_OF}
  assert len(found) <= 1, text
  return found.pop() if found else None


# The answer of each task from its input, by plain Python; None where the test cannot tell
# (a word the test does not know), the cipher checked on its own.
EXPECTED = {
    'copy': lambda text: text,
    'add': lambda text: str(eval(text)),  # check_answer first matches text against 'digits+digits'
    'reverse': lambda text: ''.join(reversed(text)),
    'sort': lambda text: ''.join(sorted(text)),
    'count': count,
    'category': lambda text: CATEGORY_OF.get(text.split()[0]),
    'weekday': weekday,
    'sentiment': sentiment,
}


def check_answer(prompt, answer):
  """Whether `answer` is right (None where the test cannot tell), and asserts the format."""
  name, text = parse(prompt)
  assert prompt.isascii() and answer.isascii() and answer and '=' not in answer
  if name == 'add':
    assert re.fullmatch(r'\d+\+\d+', text), text
  if name == 'cipher':
    return None
  expected = EXPECTED[name](text)
  return None if expected is None else answer == expected


def examples(task):
  return task.train + task.val + task.test


def test_task_lists_name_every_task_once():
  assert text_suite.CONTROL_TASK == text_suite.TASKS[0]
  assert len(set(text_suite.TASKS)) == len(text_suite.TASKS) >= 9
  assert set(text_suite.TASKS) == set(EXPECTED) | {'cipher'}


@pytest.mark.parametrize('name', text_suite.TASKS)
def test_every_answer_is_right_and_prompts_are_short(name):
  task = text_suite.load_task(name, seed=0, **SMALL)
  assert (len(task.train), len(task.val), len(task.test)) == (300, 60, 60)
  verdicts = [check_answer(prompt, answer) for prompt, answer in examples(task)]
  assert all(parse(prompt)[0] == name for prompt, _ in examples(task))
  assert False not in verdicts
  if name != 'cipher':  # most answers are checked; the cipher has its own test
    assert verdicts.count(True) >= 40, verdicts.count(True)
  assert max(len(prompt) for prompt, _ in examples(task)) <= 32


def test_weekdays_span_the_week_and_the_century():
  texts = [parse(prompt)[1] for prompt, _ in examples(text_suite.load_task('weekday', **SMALL))]
  assert {weekday(text) for text in texts} == set(text_suite.WEEKDAYS)
  assert min(texts) < '1920' and max(texts) > '1980'


def test_categories_are_consistent_and_complete():
  words = {}
  for prompt, answer in examples(text_suite.load_task('category', seed=2, **SMALL)):
    word = parse(prompt)[1]
    assert words.setdefault(word, answer) == answer, word
  assert set(words.values()) == set(CATEGORY_OF.values())
  assert set(CATEGORY_OF) & set(words)  # the test's own words do occur


def cipher_table(seed):
  """The cipher's letter map read off all examples, checked consistent and one-to-one."""
  table = {}
  for prompt, answer in examples(text_suite.load_task('cipher', seed=seed, **SMALL)):
    text = parse(prompt)[1]
    assert len(text) == len(answer) and text.isalpha() and answer.isalpha()
    for plain, coded in zip(text, answer):
      assert table.setdefault(plain, coded) == coded, (plain, coded, table[plain])
  return table


def test_cipher_is_one_bijection_of_the_alphabet_at_every_seed():
  table = cipher_table(0)
  assert sorted(table) == sorted(table.values()) == list(string.ascii_lowercase)
  inverse = {coded: plain for plain, coded in table.items()}
  for prompt, answer in text_suite.load_task('cipher', seed=0, **SMALL).test:
    assert ''.join(inverse[c] for c in answer) == parse(prompt)[1]
  assert table == cipher_table(1)  # a seed draws the data, not the task


@pytest.mark.parametrize('name', text_suite.TASKS)
def test_splits_share_no_prompt(name):
  task = text_suite.load_task(name, seed=0, **SMALL)
  seen = {}
  for split in ('train', 'val', 'test'):
    for prompt, _ in getattr(task, split):
      assert seen.setdefault(prompt, split) == split, f'{prompt!r} in {split} and {seen[prompt]}'
  assert set(seen.values()) == {'train', 'val', 'test'}


@pytest.mark.parametrize('name', ['cipher', 'category', 'weekday'])
def test_same_seed_gives_the_same_examples_and_another_seed_does_not(name):
  first = text_suite.load_task(name, seed=3, **SMALL)
  text_suite.load_task('add', seed=3, **SMALL)  # another task in between changes nothing
  again = text_suite.load_task(name, seed=3, **SMALL)
  other = text_suite.load_task(name, seed=4, **SMALL)
  for split in ('train', 'val', 'test'):
    assert getattr(first, split) == getattr(again, split)
    assert getattr(first, split) != getattr(other, split)


def test_a_split_does_not_depend_on_the_sizes_of_the_others():
  small = text_suite.load_task('reverse', seed=5, train_size=10, val_size=5, test_size=7)
  large = text_suite.load_task('reverse', seed=5, train_size=40, val_size=1, test_size=30)
  assert large.train[:10] == small.train and large.test[:7] == small.test


def test_general_text_is_seeded_ascii_sentences():
  text = text_suite.general_text(0, 200)
  assert len(text) == 200 and text == text_suite.general_text(0, 200)
  assert text != text_suite.general_text(1, 200)
  for sentence in text:
    assert sentence.isascii() and re.fullmatch(r'[a-z]+( [a-z]+)+\.', sentence), sentence
  # It states categories ('a horse is an animal.'), in agreement with the test's own copy.
  facts = [re.fullmatch(r'(?:an? )?([a-z]+) is an? ([a-z]+)\.', s) for s in text]
  facts = {fact.group(1): fact.group(2) for fact in facts if fact}
  assert set(facts) & set(CATEGORY_OF)
  assert all(CATEGORY_OF.get(word, category) == category for word, category in facts.items())


def test_pretraining_mixture_mixes_every_task_with_text_and_no_held_out_prompt():
  mixture = text_suite.pretraining_mixture(0, 1200, text_share=0.5)
  assert mixture == text_suite.pretraining_mixture(0, 1200, text_share=0.5)
  assert mixture != text_suite.pretraining_mixture(1, 1200, text_share=0.5)
  sentences = [doc for doc in mixture if '=' not in doc]
  assert 500 < len(sentences) < 700
  pairs = [doc.partition('=') for doc in mixture if '=' in doc]
  assert {parse(prompt + eq)[0] for prompt, eq, _ in pairs} == set(text_suite.TASKS)
  assert False not in [check_answer(prompt + eq, answer) for prompt, eq, answer in pairs]
  held_out = set()
  for name in text_suite.TASKS:
    task = text_suite.load_task(name, seed=0, train_size=1, val_size=400, test_size=400)
    held_out |= {prompt for prompt, _ in task.val + task.test}
  pretraining = {prompt + eq for prompt, eq, _ in pairs}
  assert not held_out & pretraining
  lengths = {len(parse(prompt)[1]) for prompt in pretraining if prompt.startswith('reverse')}
  assert {4, 5} <= lengths  # the easy end of the downstream span, where ability can start
  only_text = text_suite.pretraining_mixture(0, 50, text_share=1.0)
  assert all('=' not in doc for doc in only_text)


def test_pretraining_mixture_enciphers_with_the_suites_key():
  table = cipher_table(0)
  for doc in text_suite.pretraining_mixture(0, 600):
    if doc.startswith('cipher: '):
      plain, _, coded = doc[len('cipher: '):].partition('=')
      assert ''.join(table[c] for c in plain) == coded


@pytest.mark.parametrize('call, key', [
    (lambda: text_suite.load_task('nope'), 'nope'),
    (lambda: text_suite.load_task('add', train_size=-1), 'train_size'),
    (lambda: text_suite.pretraining_mixture(0, 10, text_share=2.0), 'text_share'),
    (lambda: text_suite.pretraining_mixture(0, 10, spans={'nope': (1, 2)}), 'nope'),
])
def test_mistakes_are_refused_by_name(call, key):
  with pytest.raises(UserError, match=key):
    call()
