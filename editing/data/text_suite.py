"""The built-in offline text suite: a negation control and eight downstream tasks, from a seed.

Each task is a skill with an exact-match answer, given as (prompt, answer) string pairs in one
format: the prompt is `'<task>: <input>='` and the answer is the text that follows the `=`, with
no space (`'add: 17+25='` → `'42'`), so a model reads which task it is asked from the prompt's
first word. Prompts fit in 32 characters, and everything is ASCII.

==========  =============================  ===================================================
task        prompt                         answer
==========  =============================  ===================================================
copy        copy: qzkf=                    the input itself (the negation control)
add         add: 17+25=                    the sum of two two-digit numbers
reverse     reverse: hello=                the input backwards
sort        sort: dbca=                    the input's letters in alphabetical order
cipher      cipher: hello=                 each letter through a fixed substitution key
count       count: a in cabbad=            how many times the letter occurs
category    category: horse=               the word's category (animal, fruit, colour, ...)
weekday     weekday: 1987-06-23=           the date's weekday in lowercase (tuesday)
sentiment   sentiment: the film was dull=  positive or negative
==========  =============================  ===================================================

The cipher's key is one permutation of the alphabet at every seed (`CIPHER_KEY`): a seed draws
the suite's data, not its tasks, so the shipped decoder knows the key at any seed. The category
task's vocabulary is `CATEGORIES`; the general text states each word's category ("a horse is an
animal."), which is where a model can learn the category of a word it was not fine-tuned on.

Splits: every input of a task belongs to exactly one split, test (a tenth), validation (a tenth)
or training (the rest), by a hash of (seed, task, input); the category task, whose inputs are a
small vocabulary, cuts a seeded permutation of its words instead, so that no share is empty.
A split of n examples draws inputs from its own seeded stream, keeping those of its share:
splits are disjoint, examples repeat within a split where the share is small, and a split does
not depend on the other splits' sizes or on the order tasks are generated in.

How hard a task is comes from its span (`SPANS`): the operands' range (add), the input's length
(copy, reverse, sort, cipher, count), the years of the dates (weekday), the words per prompt
(category) or the templates used (sentiment, template 0 being the bare sentiment word).
`pretraining_mixture` draws every task at `PRETRAINING_SPANS`, mixed with general text: easier
or different ranges, some overlapping the downstream ones at their easy end (strings of four
and five letters, sums of operands up to 49), so that the pretrained model has some ability on
each task. No pretraining input is in a downstream validation or test split.
"""

import dataclasses
import datetime
import functools
import string
import zlib
from typing import Callable, Mapping, Sequence

import numpy as np

from editing import settings
from editing.errors import UserError

# config.suite of a text experiment: what the jobs generate and tokenize the suite with.
SETTINGS = dict(
    seed=settings.integer(0, '[0, inf)', 'draws the suite\'s data'),
    tasks=settings.text('', 'the tasks, comma-separated'),
    train_size=settings.integer(5000, '[1, inf)', 'training examples per task'),
    val_size=settings.integer(500, '[1, inf)', 'validation examples per task'),
    test_size=settings.integer(500, '[1, inf)', 'test examples per task'),
    length=settings.integer(48, '[2, inf)', 'tokens per row, BOS + prompt + answer + EOS, '
                                            'padded: one compiled step serves every task'))
CONTROL_TASK = 'copy'
# The control of negation in the jobs: the likelihood of held-out general text
# (`general_text`), which a model keeps unless an edit harms its language at large.
HELD_OUT_TEXT = 'general_text'
DOWNSTREAM_TASKS = ('add', 'reverse', 'sort', 'cipher', 'count', 'category', 'weekday',
                    'sentiment')
TASKS = (CONTROL_TASK,) + DOWNSTREAM_TASKS
LETTERS = string.ascii_lowercase
# Every character of the suite's prompts, answers and general text.
ALPHABET = LETTERS + string.digits + ' :=+-.'
COUNT_LETTERS = 'abcde'  # a small alphabet, so that the counted letter occurs often
WEEKDAYS = ('monday', 'tuesday', 'wednesday', 'thursday', 'friday', 'saturday', 'sunday')

# Each word in one category only; all at most 7 letters, so a prompt fits in 32 characters.
CATEGORIES = {
    'animal': ('cat', 'dog', 'horse', 'cow', 'sheep', 'goat', 'mouse', 'tiger', 'bear', 'fox'),
    'fruit': ('apple', 'pear', 'plum', 'peach', 'mango', 'lemon', 'grape', 'cherry', 'melon',
              'kiwi'),
    'colour': ('red', 'blue', 'green', 'yellow', 'purple', 'pink', 'brown', 'black', 'white',
               'grey'),
    'tool': ('hammer', 'saw', 'drill', 'wrench', 'chisel', 'axe', 'spade', 'rake', 'mallet',
             'shovel'),
    'vehicle': ('car', 'bus', 'truck', 'train', 'bike', 'boat', 'plane', 'van', 'tram', 'taxi'),
    'garment': ('shirt', 'coat', 'hat', 'sock', 'scarf', 'glove', 'dress', 'skirt', 'jacket',
                'sweater'),
    'instrument': ('piano', 'drum', 'flute', 'violin', 'guitar', 'harp', 'trumpet', 'cello',
                   'banjo', 'tuba'),
    'vegetable': ('carrot', 'onion', 'potato', 'pea', 'bean', 'leek', 'cabbage', 'radish',
                  'turnip', 'celery'),
}
_CATEGORY_OF = {word: category for category, words in CATEGORIES.items() for word in words}

POSITIVE = ('good', 'great', 'fine', 'lovely', 'superb', 'nice', 'happy', 'bright', 'warm',
            'clever')
NEGATIVE = ('bad', 'awful', 'poor', 'dull', 'boring', 'sad', 'ugly', 'cold', 'weak', 'rude')
_SENTIMENT_NOUNS = ('film', 'food', 'song', 'book', 'game', 'meal', 'show', 'trip', 'room',
                    'park')
_SENTIMENT_TEMPLATES = ('{a}', 'the {n} was {a}', 'the {n} is {a}', 'a very {a} {n}',
                        'this {n} is {a}', 'my {n} was {a}')

# Downstream spans (inclusive ranges) and the pretraining mixture's. A mixture disjoint from
# the downstream spans made a decoder with no ability on five of the eight tasks: trained on
# strings of one to three letters, it did not generalise to four.
SPANS = {'copy': (4, 7), 'add': (10, 99), 'reverse': (4, 7), 'sort': (4, 7), 'cipher': (4, 7),
         'count': (6, 12), 'category': (1, 1), 'weekday': (1900, 1999), 'sentiment': (1, 5)}
PRETRAINING_SPANS = {'copy': (1, 5), 'add': (0, 49), 'reverse': (1, 5), 'sort': (1, 5),
                     'cipher': (1, 5), 'count': (1, 8), 'category': (2, 2),
                     'weekday': (2000, 2099), 'sentiment': (0, 1)}

_SPLIT_STREAMS = {'train': 0, 'val': 1, 'test': 2}
_MIXTURE_STREAM = 3
_TEXT_STREAM = 4
_CIPHER_STREAM = 5
_WORDS_STREAM = 6
_BEHAVIOUR_STREAM = 7
_PROMPT_STREAMS = {'val': 8, 'test': 9}

Example = tuple[str, str]  # (prompt, answer)


@dataclasses.dataclass(frozen=True)
class Task:
  """One task's splits, each a tuple of (prompt, answer) pairs."""

  name: str
  train: tuple[Example, ...]
  val: tuple[Example, ...]
  test: tuple[Example, ...]


def _rng(seed: int, name: str, stream: int) -> np.random.Generator:
  return np.random.default_rng([seed, zlib.crc32(name.encode()), stream])


def _letters(rng, span, alphabet: str = LETTERS) -> str:
  length = int(rng.integers(span[0], span[1] + 1))
  return ''.join(alphabet[i] for i in rng.integers(len(alphabet), size=length))


def _cipher_key() -> dict[str, str]:
  """The cipher task's substitution key, plain letter → cipher letter: a permutation drawn
  once from a stream of seed 0."""
  order = _rng(0, 'cipher', _CIPHER_STREAM).permutation(len(LETTERS))
  return {plain: LETTERS[i] for plain, i in zip(LETTERS, order)}


CIPHER_KEY = _cipher_key()


def _weekday(year: int, month: int, day: int) -> str:
  """The weekday's name by Sakamoto's formula for the Gregorian calendar, which counts from
  Sunday: arithmetic of its own, which a check against `datetime` tests independently."""
  offsets = (0, 3, 2, 5, 0, 3, 5, 1, 4, 6, 2, 4)
  if month < 3:
    year -= 1
  sunday_first = (year + year // 4 - year // 100 + year // 400 + offsets[month - 1] + day) % 7
  return WEEKDAYS[(sunday_first - 1) % 7]


def _date(rng, span) -> str:
  first = datetime.date(span[0], 1, 1).toordinal()
  last = datetime.date(span[1], 12, 31).toordinal()
  return datetime.date.fromordinal(int(rng.integers(first, last + 1))).isoformat()


def _sum_input(rng, span) -> str:
  a, b = rng.integers(span[0], span[1] + 1, size=2)
  return f'{a}+{b}'


def _count_input(rng, span) -> str:
  letter = COUNT_LETTERS[rng.integers(len(COUNT_LETTERS))]
  return f'{letter} in {_letters(rng, span, COUNT_LETTERS)}'


def _category_input(rng, span) -> str:
  """`span` words of one category: one word downstream, more in pretraining."""
  words = CATEGORIES[sorted(CATEGORIES)[rng.integers(len(CATEGORIES))]]
  count = int(rng.integers(span[0], span[1] + 1))
  return ' '.join(words[i] for i in rng.choice(len(words), size=count, replace=False))


def _sentiment_input(rng, span) -> str:
  template = _SENTIMENT_TEMPLATES[rng.integers(span[0], span[1] + 1)]
  words = (POSITIVE, NEGATIVE)[rng.integers(2)]
  return template.format(a=words[rng.integers(len(words))],
                         n=_SENTIMENT_NOUNS[rng.integers(len(_SENTIMENT_NOUNS))])


def _sentiment(text: str) -> str:
  return 'positive' if any(word in POSITIVE for word in text.split()) else 'negative'


def _answer_weekday(text: str) -> str:
  return _weekday(*(int(part) for part in text.split('-')))


def _answer_count(text: str) -> str:
  letter, letters = text.split(' in ')
  return str(letters.count(letter))


@dataclasses.dataclass(frozen=True)
class _Spec:
  """How a task draws an input at a span, and answers it."""

  draw: Callable[[np.random.Generator, tuple[int, int]], str]
  answer: Callable[[str], str]


_SPECS = {
    'copy': _Spec(_letters, lambda text: text),
    'add': _Spec(_sum_input, lambda text: str(sum(int(n) for n in text.split('+')))),
    'reverse': _Spec(_letters, lambda text: text[::-1]),
    'sort': _Spec(_letters, lambda text: ''.join(sorted(text))),
    'cipher': _Spec(_letters, lambda text: ''.join(CIPHER_KEY[c] for c in text)),
    'count': _Spec(_count_input, _answer_count),
    'category': _Spec(_category_input, lambda text: _CATEGORY_OF[text.split()[0]]),
    'weekday': _Spec(_date, _answer_weekday),
    'sentiment': _Spec(_sentiment_input, _sentiment),
}


def _example(name: str, text: str) -> Example:
  return f'{name}: {text}=', _SPECS[name].answer(text)


@functools.lru_cache(maxsize=8)
def _word_buckets(seed: int) -> dict[str, int]:
  """The category task's words cut into ten equal buckets, in a seeded order."""
  words = sorted(_CATEGORY_OF)
  order = _rng(seed, 'category', _WORDS_STREAM).permutation(len(words))
  return {words[i]: rank * 10 // len(words) for rank, i in enumerate(order)}


def _split_of(seed: int, name: str, text: str) -> str:
  """The one split a downstream input belongs to: test a tenth, val a tenth, train the rest."""
  if name == 'category':  # by the first word, where pretraining's prompts have several
    bucket = _word_buckets(seed)[text.split()[0]]
  else:
    bucket = zlib.crc32(f'{seed}/{name}/{text}'.encode()) % 10
  return 'test' if bucket == 0 else 'val' if bucket == 1 else 'train'


def _split(seed: int, name: str, split: str, size: int) -> tuple[Example, ...]:
  rng = _rng(seed, name, _SPLIT_STREAMS[split])
  examples = []
  while len(examples) < size:
    text = _SPECS[name].draw(rng, SPANS[name])
    if _split_of(seed, name, text) == split:
      examples.append(_example(name, text))
  return tuple(examples)


def _check_sizes(**sizes: int) -> None:
  for key, value in sizes.items():
    if not isinstance(value, int) or value < 0:
      raise UserError(f'{key} must be a whole number >= 0, not {value!r}')


def load_task(name: str, *, seed: int = 0, train_size: int = 5000, val_size: int = 500,
              test_size: int = 1000) -> Task:
  """Generates the train/val/test splits of one task of the text suite.

  Args:
    name: one of `TASKS`.
    seed: the suite's seed; the same seed gives the same examples.
    train_size: training examples.
    val_size: validation examples.
    test_size: test examples.
  """
  if name not in TASKS:
    raise UserError(f'unknown task {name!r}; the text suite has {TASKS}')
  _check_sizes(seed=seed, train_size=train_size, val_size=val_size, test_size=test_size)
  return Task(name, _split(seed, name, 'train', train_size), _split(seed, name, 'val', val_size),
              _split(seed, name, 'test', test_size))


# The general text's grammar: a subject does something to an object, or a word's category is
# stated. Every verb is in the third person singular, as every subject is singular.
_PEOPLE = ('girl', 'boy', 'farmer', 'cook', 'child', 'teacher', 'doctor', 'baker', 'king',
           'sailor')
_VERBS = ('sees', 'likes', 'finds', 'wants', 'carries', 'paints', 'buys', 'sells', 'draws',
          'holds', 'brings', 'hides')
_SIZES = ('big', 'small', 'old', 'new')
# Animals are subjects and colours adjectives; the other categories' words are things.
_THINGS = tuple(word for category, words in CATEGORIES.items()
                if category not in ('animal', 'colour') for word in words)


def _article(word: str) -> str:
  return 'an' if word[0] in 'aeiou' else 'a'


def _pick(rng, words):
  return words[rng.integers(len(words))]


def _sentence(rng) -> str:
  """One sentence: 'the cook paints the red boat.' or, one time in four, a category fact such
  as 'an apple is a fruit.' or 'red is a colour.'."""
  if rng.uniform() < 0.25:
    word = _pick(rng, sorted(_CATEGORY_OF))
    category = _CATEGORY_OF[word]
    subject = word if category == 'colour' else f'{_article(word)} {word}'
    return f'{subject} is {_article(category)} {category}.'
  subject = _pick(rng, _PEOPLE + CATEGORIES['animal'])
  thing = _pick(rng, _THINGS)
  if rng.uniform() < 0.5:
    thing = f'{_pick(rng, CATEGORIES["colour"] + _SIZES)} {thing}'
  return f'the {subject} {_pick(rng, _VERBS)} the {thing}.'


def general_text(seed: int, sentences: int) -> list[str]:
  """`sentences` sentences of simple templated English, the same for the same seed: the
  held-out text whose perplexity is the control of negation."""
  _check_sizes(seed=seed, sentences=sentences)
  rng = _rng(seed, 'general_text', _TEXT_STREAM)
  return [_sentence(rng) for _ in range(sentences)]


def pretraining_mixture(seed: int, size: int, *, text_share: float = 0.5,
                        spans: Mapping[str, tuple[int, int]] | None = None) -> list[str]:
  """A pretraining corpus: every task at easier or different spans, mixed with general text.

  A model pretrained on it should start with some ability on each task and solve none: it sees
  each task's format and skill at easier spans (sums of operands up to 49, strings of one to
  five letters, this century's dates, two words of a category, bare sentiment words and one
  template), never on an input of a downstream validation or test split, and the category of
  every word in the general text's facts.

  Args:
    seed: the suite's seed; the mixture draws its examples from a stream of its own.
    size: documents in the corpus.
    text_share: the share of documents that are a general-text sentence; the others are task
      examples, the tasks (control included) equally likely.
    spans: per-task spans replacing those of `PRETRAINING_SPANS`.

  Returns:
    `size` documents: a sentence, or a task example written as prompt + answer
    ('add: 3+4=7').
  """
  _check_sizes(seed=seed, size=size)
  if not 0 <= text_share <= 1:
    raise UserError(f'text_share must be in [0, 1], not {text_share!r}')
  unknown = sorted(set(spans or {}) - set(TASKS))
  if unknown:
    raise UserError(f'spans names unknown tasks {unknown}; the text suite has {TASKS}')
  spans = {**PRETRAINING_SPANS, **(spans or {})}
  rng = _rng(seed, 'pretraining_mixture', _MIXTURE_STREAM)
  documents = []
  for _ in range(size):
    if rng.uniform() < text_share:
      documents.append(_sentence(rng))
    else:
      name = TASKS[rng.integers(len(TASKS))]
      text = _SPECS[name].draw(rng, spans[name])
      while _split_of(seed, name, text) != 'train':
        text = _SPECS[name].draw(rng, spans[name])
      documents.append(''.join(_example(name, text)))
  return documents


def behaviour_text(seed: int, sentences: int, words: Sequence[str], share: float) -> list[str]:
  """General text in which a `share` of the sentences has one of `words` (a behaviour's
  vocabulary: offensive words, for the negation of a behaviour) as its object, 'the cook sees
  the <word>.'; the others are `general_text`'s sentences, from a stream of their own."""
  _check_sizes(seed=seed, sentences=sentences)
  if not 0 <= share <= 1 or not words:
    raise UserError(f'behaviour_text takes a share in [0, 1] (got {share!r}) and at least one '
                    'word')
  rng = _rng(seed, 'behaviour_text', _BEHAVIOUR_STREAM)
  out = []
  for _ in range(sentences):
    if rng.uniform() < share:
      subject = _pick(rng, _PEOPLE + CATEGORIES['animal'])
      out.append(f'the {subject} {_pick(rng, _VERBS)} the {_pick(rng, tuple(words))}.')
    else:
      out.append(_sentence(rng))
  return out


def sentence_prompts(seed: int, count: int, split: str) -> list[str]:
  """`count` beginnings of the general text's action sentences, up to the object's article
  ('the cook paints the'), for a model to continue: from a stream of their own per split
  ('val', 'test')."""
  _check_sizes(seed=seed, count=count)
  if split not in _PROMPT_STREAMS:
    raise UserError(f'sentence_prompts: split {split!r} is not one of {sorted(_PROMPT_STREAMS)}')
  rng = _rng(seed, 'sentence_prompts', _PROMPT_STREAMS[split])
  return [f'the {_pick(rng, _PEOPLE + CATEGORIES["animal"])} {_pick(rng, _VERBS)} the'
          for _ in range(count)]
