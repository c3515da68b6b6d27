"""The benchmark's PyTorch reference: the suite's fine-tuning step in eager PyTorch.

The same ViT as `editing.models.vit` (CLIP layout, pre-LN, tanh GELU, separate q/k/v/out
projections), written functionally over the flax params' own leaves, the same frozen cosine
head and cross-entropy, global-norm clipping and AdamW. `linearized=True` trains the NTK
linearization f(θ0) + J(θ0)(θ − θ0) through `torch.func.jvp`, as Ortiz-Jimenez et al.'s code
does. `Step` checks its forward pass against the JAX model's before it is timed, so a ratio
is always one of the same computation.

It needs torch (a test extra), and serves `editing.jobs.benchmark` only.
"""

import numpy as np
import torch
import torch.nn.functional as F

from editing import tree as tree_lib


def encode(p: dict, images: torch.Tensor, *, depth: int, num_heads: int,
           pixel_mean=0.5, pixel_std=0.25, epsilon: float = 1e-6) -> torch.Tensor:
  """The suite's ViT on (batch, H, W, 3) images in [0, 1]; `p` holds the flat flax leaves."""
  x = ((images - pixel_mean) / pixel_std).permute(0, 3, 1, 2)
  kernel = p['patch_embed/kernel']  # (p, p, 3, width), HWIO
  x = F.conv2d(x, kernel.permute(3, 2, 0, 1), stride=kernel.shape[0])
  x = x.flatten(2).transpose(1, 2)
  batch, _, width = x.shape
  x = torch.cat([p['class_embedding'].expand(batch, 1, width), x], 1) + p['position_embedding']
  norm = lambda x, name: F.layer_norm(x, (width,), p[f'{name}/scale'], p[f'{name}/bias'],
                                      epsilon)
  x = norm(x, 'ln_pre')
  heads = lambda y: y.reshape(batch, -1, num_heads, width // num_heads).transpose(1, 2)
  for i in range(depth):
    b = f'blocks_{i}'
    h = norm(x, f'{b}/ln_1')
    q, k, v = (heads(h @ p[f'{b}/attn/{n}/kernel'].reshape(width, width)
                     + p[f'{b}/attn/{n}/bias'].reshape(width)) for n in ('query', 'key', 'value'))
    # Written out: forward-mode AD (the linearized step) has no rule for the fused kernel.
    weights = torch.softmax(q @ k.transpose(-2, -1) / (width // num_heads)**0.5, dim=-1)
    y = (weights @ v).transpose(1, 2).reshape(batch, -1, width)
    x = x + y @ p[f'{b}/attn/out/kernel'].reshape(width, width) + p[f'{b}/attn/out/bias']
    h = norm(x, f'{b}/ln_2')
    h = F.gelu(h @ p[f'{b}/mlp_fc/kernel'] + p[f'{b}/mlp_fc/bias'], approximate='tanh')
    x = x + h @ p[f'{b}/mlp_proj/kernel'] + p[f'{b}/mlp_proj/bias']
  return norm(x[:, 0], 'ln_post') @ p['proj/kernel']


class Step:
  """One fine-tuning step of the suite's ViT in eager PyTorch, on a fixed batch.

  Args:
    theta0: the flax params (numpy or jax arrays).
    head: the frozen (classes, embed_dim) head.
    images, labels: the batch.
    model: the `config.model` section (depth, num_heads).
    expected: the JAX model's embeddings of `images` at θ0; the reference must match them.
    logit_scale, learning_rate, weight_decay, grad_clip: as the fine-tuning config.
    linearized: train f_lin through torch.func.jvp instead of f.
  """

  def __init__(self, theta0, head, images, labels, *, model, expected, logit_scale: float,
               learning_rate: float, weight_decay: float, grad_clip: float,
               linearized: bool = False):
    tensor = lambda x: torch.from_numpy(np.array(x, np.float32))
    self._theta0 = {k: tensor(v) for k, v in tree_lib.flatten(theta0).items()}
    self._params = {k: v.clone().requires_grad_() for k, v in self._theta0.items()}
    self._head = F.normalize(tensor(head), dim=-1)
    self._images, self._labels = tensor(images), torch.from_numpy(np.asarray(labels, np.int64))
    self._encode = lambda p, x: encode(p, x, depth=model.depth, num_heads=model.num_heads)
    self._scale, self._clip, self._linearized = logit_scale, grad_clip, linearized
    self._optimizer = torch.optim.AdamW(list(self._params.values()), lr=learning_rate,
                                        weight_decay=weight_decay, foreach=True)
    with torch.no_grad():
      got = self._encode(self._theta0, self._images).numpy()
    if not np.allclose(got, np.asarray(expected), rtol=1e-3, atol=1e-3):
      raise AssertionError('the PyTorch reference does not compute the JAX model: max '
                           f'difference {np.abs(got - np.asarray(expected)).max():.3g}')

  def _features(self) -> torch.Tensor:
    if not self._linearized:
      return self._encode(self._params, self._images)
    tangent = {k: self._params[k] - self._theta0[k] for k in self._params}
    out, jvp = torch.func.jvp(lambda p: self._encode(p, self._images), (self._theta0,),
                              (tangent,))
    return out + jvp

  def __call__(self) -> float:
    """Runs one step; returns its loss."""
    self._optimizer.zero_grad(set_to_none=True)
    logits = self._scale * F.normalize(self._features(), dim=-1) @ self._head.T
    loss = F.cross_entropy(logits, self._labels)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(self._params.values()), self._clip)
    self._optimizer.step()
    return float(loss.detach())
