"""Zero-shot heads: CLIP's text tower over prompts gives the head whose logits are
transformers' CLIPModel logits, on a tiny random CLIPModel with a tokenizer the test builds."""

import jax
import numpy as np
import pytest
import tokenizers
import torch

from editing.errors import UserError
from editing.models import head as head_lib
from editing.models import hf
from editing.models import text
from editing.models import zero_shot
from tests.test_hf import TEXT, clip_model, images, ours

CLASSNAMES = ['cat', 'dog', 'red bird']
TEMPLATES = ['a photo of a {} .', 'a {} in the wild .', '{}']
BOS, PAD, EOS = 0, 1, TEXT['eos_token_id']


def save_tokenizer(directory, texts):
  """A word-level tokenizer.json over the words of `texts`, with CLIP's start and end tokens,
  padded to the context."""
  words = sorted({w for t in texts for w in t.split()})
  vocab = {'<|startoftext|>': BOS, '<pad>': PAD, '<|endoftext|>': EOS,
           **{w: i + 2 for i, w in enumerate(words)}}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token='<pad>'))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
      single='<|startoftext|> $A <|endoftext|>',
      special_tokens=[('<|startoftext|>', BOS), ('<|endoftext|>', EOS)])
  tokenizer.enable_truncation(TEXT['max_position_embeddings'])
  tokenizer.enable_padding(pad_id=PAD, pad_token='<pad>',
                           length=TEXT['max_position_embeddings'])
  tokenizer.save(str(directory / 'tokenizer.json'))


@pytest.fixture(scope='module')
def clip(tmp_path_factory):
  directory = tmp_path_factory.mktemp('clip')
  model = clip_model()
  model.save_pretrained(directory)
  save_tokenizer(directory, [t.format(n) for t in TEMPLATES for n in CLASSNAMES])
  return model, str(directory)


def their_text_embeddings(model, tokenizer, prompts):
  tokens = tokenizer(prompts)
  with torch.no_grad():
    out = model.get_text_features(input_ids=torch.from_numpy(tokens['input_ids']).long(),
                                  attention_mask=torch.from_numpy(tokens['attention_mask']).long())
  out = getattr(out, 'pooler_output', out)
  return out.numpy() / np.linalg.norm(out.numpy(), axis=-1, keepdims=True)


def test_the_head_averages_normalised_prompt_embeddings_per_class(clip):
  model, directory = clip
  tokenizer = text.Tokenizer(directory)
  params, config = hf.load(directory, 'clip_text')
  with jax.default_matmul_precision('highest'):
    weights = zero_shot.head(params, config, tokenizer, CLASSNAMES, TEMPLATES, batch_size=4)
  assert weights.shape == (len(CLASSNAMES), 16)
  summed = sum(their_text_embeddings(model, tokenizer, [t.format(n) for n in CLASSNAMES])
               for t in TEMPLATES)
  expected = summed / np.linalg.norm(summed, axis=-1, keepdims=True)
  assert np.abs(weights - expected).max() < 1e-5
  # Each template matters: a head from one template alone is another head.
  one = zero_shot.head(params, config, tokenizer, CLASSNAMES, TEMPLATES[:1])
  assert np.abs(one - weights).max() > 1e-3


def test_its_logits_are_clip_models_zero_shot_logits(clip):
  model, directory = clip
  tokenizer = text.Tokenizer(directory)
  text_params, text_config = hf.load(directory, 'clip_text')
  vision_params, vision_config = hf.load(directory, 'clip_vision')
  template = TEMPLATES[:1]
  with jax.default_matmul_precision('highest'):
    weights = zero_shot.head(text_params, text_config, tokenizer, CLASSNAMES, template)
  _, image_embeddings = ours(vision_params, vision_config, images())
  scale = float(np.exp(hf.Checkpoint(directory).tensor('logit_scale')))
  logits = np.asarray(head_lib.logits(image_embeddings, weights, scale))
  tokens = tokenizer([template[0].format(n) for n in CLASSNAMES])
  pixels = (images() - np.asarray(vision_config['pixel_mean'], np.float32)) / np.asarray(
      vision_config['pixel_std'], np.float32)
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens['input_ids']).long(),
                attention_mask=torch.from_numpy(tokens['attention_mask']).long(),
                pixel_values=torch.from_numpy(pixels.transpose(0, 3, 1, 2)))
  np.testing.assert_allclose(logits, out.logits_per_image.numpy(), atol=1e-4 * scale)


@pytest.mark.parametrize('classnames, templates, message', [
    ([], TEMPLATES, 'needs class names and templates'),
    (CLASSNAMES, ['a photo'], r"one \{\} for the class name; these do not: \['a photo'\]"),
    (CLASSNAMES, ['{} and {}'], 'these do not'),
])
def test_bad_names_or_templates_are_refused(clip, classnames, templates, message):
  _, directory = clip
  params, config = hf.load(directory, 'clip_text')
  with pytest.raises(UserError, match=message):
    zero_shot.head(params, config, text.Tokenizer(directory), classnames, templates)
