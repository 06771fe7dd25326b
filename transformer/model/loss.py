"""The cross-entropy with label smoothing of a batch's logits: the plain form (the eval step's,
transformer/inference/scoring.py, and the unfused train step's) and the fused projection
and loss that training differentiates (transformer/training/steps.py), each with its
gradient in closed form.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from transformer.config import PAD_ID
from transformer.model.primitives import BLV, constrain

Array = jax.Array


def cross_entropy_sums(
  logits_BxTxV: Array, targets_BxT: Array, label_smoothing: float
) -> dict[str, Array]:
  """Sums over non-padding target tokens of the smoothed loss, plain CE and accuracy.

  Label smoothing puts 1 - eps on the target and eps / (V - 1) on every other token;
  the loss is the cross-entropy to that distribution minus its entropy (a KL, zero at
  the optimum), as Tensor2Tensor does. `ce` is the unsmoothed cross-entropy, whose
  exponential is the perplexity the paper reports. A token counts as correct when the
  target's logit is the largest (on an exact tie with another token, too).
  """
  weights_BxT = (targets_BxT != PAD_ID).astype(jnp.float32)
  smoothed_BxT, ce_BxT, correct_BxT = token_losses(
    logits_BxTxV.astype(jnp.float32), targets_BxT, label_smoothing
  )
  return {
    "loss_sum": jnp.sum(smoothed_BxT * weights_BxT),
    "ce_sum": jnp.sum(ce_BxT * weights_BxT),
    "correct_sum": jnp.sum(correct_BxT * weights_BxT),
    "num_tokens": jnp.sum(weights_BxT),
  }


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def token_losses(
  logits_BxTxV: Array, targets_BxT: Array, label_smoothing: float
) -> tuple[Array, Array, Array]:
  """Per token: (smoothed loss, cross-entropy, 1.0 if the target's logit is the largest).

  Written from the log-sum-exp rather than through log_softmax, with the gradient of
  the smoothed loss in closed form, softmax - eps / (V - 1) - (1 - eps - eps / (V - 1))
  * onehot(target): the [B, T, V] arrays (the largest of a step) are read a few times
  and written once, where autodiff of log_softmax, a gather and a sum wrote several of
  them, and the accuracy takes a max, not an argmax (a slow variadic reduction on CPU).
  The cross-entropy and the accuracy are metrics: their cotangents are not used.
  """
  return _token_losses_forward(logits_BxTxV, targets_BxT, label_smoothing)[0]


def _token_losses_forward(logits_BxTxV, targets_BxT, label_smoothing):
  max_BxT = jnp.max(logits_BxTxV, axis=-1)
  log_normalizer_BxT = max_BxT + jnp.log(
    jnp.sum(jnp.exp(logits_BxTxV - max_BxT[..., None]), axis=-1)
  )
  losses = _losses_given_normalizer(
    logits_BxTxV, targets_BxT, max_BxT, log_normalizer_BxT, label_smoothing
  )
  return losses, (logits_BxTxV, targets_BxT, log_normalizer_BxT)


def _losses_given_normalizer(logits_BxTxV, targets_BxT, max_BxT, log_normalizer_BxT, eps):
  """(smoothed loss, cross-entropy, correct) per token, from the logits, their max and
  their log-sum-exp however that was summed."""
  vocab = logits_BxTxV.shape[-1]
  target_logit_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], -1)[..., 0]
  ce_BxT = log_normalizer_BxT - target_logit_BxT
  smoothed_BxT = ce_BxT
  if eps > 0:
    confidence, low = 1.0 - eps, _smoothing(eps, vocab)[0]
    entropy = -(confidence * math.log(confidence) + (vocab - 1) * low * math.log(low))
    # -(sum of the other tokens' log-probs) = (V - 1) lse - (sum of logits - target's).
    others_BxT = (vocab - 1) * log_normalizer_BxT - (
      jnp.sum(logits_BxTxV, axis=-1) - target_logit_BxT
    )
    smoothed_BxT = confidence * ce_BxT + low * others_BxT - entropy
  correct_BxT = (target_logit_BxT >= max_BxT).astype(jnp.float32)
  return smoothed_BxT, ce_BxT, correct_BxT


def _token_losses_backward(label_smoothing, residuals, cotangents):
  logits_BxTxV, targets_BxT, log_normalizer_BxT = residuals
  grad_smoothed_BxT, grad_ce_BxT, _ = cotangents
  vocab = logits_BxTxV.shape[-1]
  low, on_target = _smoothing(label_smoothing, vocab)
  probs_BxTxV = jnp.exp(logits_BxTxV - log_normalizer_BxT[..., None])
  is_target_BxTxV = jnp.arange(vocab) == targets_BxT[..., None]
  # d smoothed / d logits = p - low - on_target * onehot; d ce / d logits = p - onehot.
  grad_BxTxV = grad_smoothed_BxT[..., None] * (
    probs_BxTxV - low - jnp.where(is_target_BxTxV, on_target, 0.0)
  ) + grad_ce_BxT[..., None] * (probs_BxTxV - is_target_BxTxV)
  return grad_BxTxV, None


token_losses.defvjp(_token_losses_forward, _token_losses_backward)


def fused_cross_entropy_sums(
  hidden_BxTxD: Array,
  weight: Array,
  weight_is_VxD: bool,
  targets_BxT: Array,
  label_smoothing: float,
  chunk_len: int,
) -> dict[str, Array]:
  """cross_entropy_sums of the logits hidden x weight^T (weight [V, D]) or hidden x weight
  ([D, V]), for training, the projection and the loss made together, chunk by chunk.

  The targets go through in chunks of `chunk_len` positions (a scan; T padded up to a
  multiple with padding targets, which count nothing; a chunk_len of T or more is one
  chunk). Each chunk's logits [B, c, V] are made in f32 and reduced to its sums, and the
  gradient of the smoothed loss sum with respect to the hidden states [B, c, D] is made
  at once, in closed form, from the same matmul that sums the softmax's denominator
  (_chunk_sums). With several chunks the weight's gradient is a running sum through the
  loop, the backward pass only scales the two by the loss sum's cotangent, and neither
  the f32 logits nor their gradient, the largest arrays of a step, is ever whole. With
  one chunk the logits are kept for the backward pass, which makes the weight's gradient,
  as the unfused projection does: the fastest form where the memory allows (on a v5e-8
  the per-op profile puts the vocabulary end of base's step at 3.0 ms this way against
  3.9 ms unfused, docs/performance.md).

  Only `loss_sum` is differentiated: `ce_sum`, `correct_sum` and `num_tokens` are metrics,
  and their cotangents are dropped. Equal to cross_entropy_sums of the unfused logits,
  with gradients, to float32 rounding (tests/test_model_loss.py).
  """
  _, length, _ = hidden_BxTxD.shape
  chunk_len = min(chunk_len, length)
  pad = -length % chunk_len
  if pad:
    hidden_BxTxD = jnp.pad(hidden_BxTxD, ((0, 0), (0, pad), (0, 0)))
    targets_BxT = jnp.pad(targets_BxT, ((0, 0), (0, pad)), constant_values=PAD_ID)
  sums_4 = _fused_sums(hidden_BxTxD, weight, targets_BxT, label_smoothing, chunk_len, weight_is_VxD)
  return dict(zip(("loss_sum", "ce_sum", "correct_sum", "num_tokens"), sums_4))


def _chunk_sums(hidden_BxCxD, targets_BxC, weight, weight_is_VxD, label_smoothing):
  """One chunk of c positions: (sums [4], d loss_sum / d hidden [B, c, D], and what the
  weight's gradient needs: the parts for _chunk_weight_gradient).

  The weight with a column of ones beside its D features, [V, D + 1]: one matmul of the
  softmax's numerators exp(logit - max) [B, c, V] with it gives both their sum (the
  log-normalizer's, the last column) and sum_v exp(...) w_v, the softmax term of the
  hidden states' gradient, so the numerators are never summed on their own: a
  reduction over the largest array of the step that costs the MXU one output column.

  Label smoothing's uniform part needs sum_v w_v, which is a matmul too: rows of ones
  [8, V] times the weight (8 rows, a tile's height). On a v5e the per-op profile puts
  it at 8 us, against 381 us for the same sum as a reduction over the vocabulary; taken
  from one more position per row with a zero hidden state (numerators all 1), it made
  each row 257 positions, past a tile's edge, and base's loss 0.19 ms slower.
  """
  batch, length, d_model = hidden_BxCxD.shape
  weight_VxD = weight if weight_is_VxD else weight.T
  vocab = weight_VxD.shape[0]
  # Written out once: left to fuse, XLA recomputed the final LayerNorm inside the logits'
  # matmul and the weight gradient's, tile by tile of the vocabulary (on a v5e-8 the
  # per-op profile puts base's step 0.15 ms faster this way).
  hidden_BxCxD = jax.lax.optimization_barrier(hidden_BxCxD)
  weight_and_ones_VxD1 = jnp.concatenate(
    [weight_VxD, jnp.ones((vocab, 1), weight_VxD.dtype)], axis=1
  )
  logits_BxCxV = jnp.einsum(
    "bcd,vd->bcv", hidden_BxCxD, weight_VxD, preferred_element_type=jnp.float32
  )
  logits_BxCxV = constrain(logits_BxCxV, BLV)  # the vocabulary over the tensor axis
  max_BxC = jnp.max(logits_BxCxV, axis=-1)
  numerators_BxCxV = jnp.exp(logits_BxCxV - max_BxC[..., None])
  # Rounded to the compute dtype for the matmul, which sums in f32 (as the gradient's).
  sums_BxCxD1 = jnp.einsum(
    "bcv,vd->bcd",
    numerators_BxCxV.astype(hidden_BxCxD.dtype),
    weight_and_ones_VxD1,
    preferred_element_type=jnp.float32,
  )
  weighted_rows_BxCxD, normalizer_BxC = sums_BxCxD1[..., :d_model], sums_BxCxD1[..., d_model]
  smoothed_BxC, ce_BxC, correct_BxC = _losses_given_normalizer(
    logits_BxCxV, targets_BxC, max_BxC, max_BxC + jnp.log(normalizer_BxC), label_smoothing
  )
  weights_BxC = (targets_BxC != PAD_ID).astype(jnp.float32)
  sums_4 = jnp.stack(
    [
      jnp.sum(smoothed_BxC * weights_BxC),
      jnp.sum(ce_BxC * weights_BxC),
      jnp.sum(correct_BxC * weights_BxC),
      jnp.sum(weights_BxC),
    ]
  )
  inverse_BxC = weights_BxC / normalizer_BxC
  grad_hidden_BxCxD = _hidden_gradient(
    weighted_rows_BxCxD, inverse_BxC, weights_BxC, targets_BxC, weight_VxD, label_smoothing
  )
  parts = (hidden_BxCxD, targets_BxC, logits_BxCxV, max_BxC, inverse_BxC, weights_BxC)
  return sums_4, grad_hidden_BxCxD.astype(hidden_BxCxD.dtype), parts


def _hidden_gradient(
  weighted_rows_BxCxD, inverse_BxC, weights_BxC, targets_BxC, weight_VxD, label_smoothing
):
  """d loss_sum / d hidden [B, c, D] (f32) of one chunk, from _chunk_sums's matmul.

  d loss_sum / d logits in closed form (as _token_losses_backward) is
  weight x (p - low - on_target x onehot(target)), p = numerators / normalizer; through
  the matrix, the hidden states' gradient is that times w_v summed over v:
  weight x (weighted_rows / normalizer - low x sum_v w_v - on_target x w_target)."""
  vocab = weight_VxD.shape[0]
  low, on_target = _smoothing(label_smoothing, vocab)
  grad_hidden_BxCxD = inverse_BxC[..., None] * weighted_rows_BxCxD - weights_BxC[..., None] * (
    on_target * jnp.take(weight_VxD, targets_BxC, axis=0).astype(jnp.float32)
  )
  if low:
    ones_8xV = jnp.ones((8, vocab), weight_VxD.dtype)
    weight_sum_D = jnp.einsum(
      "kv,vd->kd", ones_8xV, weight_VxD, preferred_element_type=jnp.float32
    )[0]
    grad_hidden_BxCxD -= weights_BxC[..., None] * low * weight_sum_D
  return grad_hidden_BxCxD


def _smoothing(label_smoothing: float, vocab: int) -> tuple[float, float]:
  """(low, on_target): the smoothed target puts low on every token, low + on_target on the
  target."""
  if label_smoothing == 0:
    return 0.0, 1.0
  low = label_smoothing / (vocab - 1)
  return low, 1.0 - label_smoothing - low


def _chunk_weight_gradient(parts, label_smoothing, scale=None):
  """d loss_sum / d weight [D, V] of one chunk (times `scale`), from _chunk_sums's parts.
  A scale is applied to the hidden states, before the matmul: after it, it would stand
  between the matmul's sum over the data axis and the embedding lookups' gradients,
  which XLA then no longer sums before reducing."""
  hidden_BxCxD, targets_BxC, logits_BxCxV, max_BxC, inverse_BxC, weights_BxC = parts
  if scale is not None:
    hidden_BxCxD = (scale * hidden_BxCxD).astype(hidden_BxCxD.dtype)
  low, on_target = _smoothing(label_smoothing, logits_BxCxV.shape[-1])
  probs_BxCxV = inverse_BxC[..., None] * jnp.exp(logits_BxCxV - max_BxC[..., None])
  is_target_BxCxV = jnp.arange(logits_BxCxV.shape[-1]) == targets_BxC[..., None]
  # Rounded to the compute dtype for the matmul, which sums in f32.
  grad_BxCxV = (
    probs_BxCxV - weights_BxC[..., None] * (low + jnp.where(is_target_BxCxV, on_target, 0.0))
  ).astype(hidden_BxCxD.dtype)
  # As [B c, D] and [B c, V]: XLA:CPU has no bf16 x bf16 -> f32 kernel for a dot that
  # contracts two dimensions, and the unfused projection's backward has this form.
  batch, length, d_model = hidden_BxCxD.shape
  return jnp.einsum(
    "nd,nv->dv",
    hidden_BxCxD.reshape(batch * length, d_model),
    grad_BxCxV.reshape(batch * length, -1),
    preferred_element_type=jnp.float32,
  )


def _fused_sums_forward(
  hidden_BxTxD, weight, targets_BxT, label_smoothing, chunk_len, weight_is_VxD
):
  """(sums [4], residuals), chunk by chunk.

  With one chunk, the residuals keep the logits and the weight's gradient is made in the
  backward pass, where its sum over the data axis meets the embedding lookups' gradients
  and the three are reduced once: made here, the partitioner reduced it on its own (on a
  v5e-8 the per-op profile put two more [V, D] reductions in base's step). With several,
  each chunk's logits are gone once the chunk is done, and the weight's gradient is a
  running sum carried through the loop."""
  batch, length, d_model = hidden_BxTxD.shape
  chunks = length // chunk_len
  if chunks == 1:
    sums_4, grad_hidden_BxTxD, parts = _chunk_sums(
      hidden_BxTxD, targets_BxT, weight, weight_is_VxD, label_smoothing
    )
    return sums_4, (grad_hidden_BxTxD, parts)
  hidden_NxBxCxD = hidden_BxTxD.reshape(batch, chunks, chunk_len, d_model).swapaxes(0, 1)
  targets_NxBxC = targets_BxT.reshape(batch, chunks, chunk_len).swapaxes(0, 1)
  vocab = weight.shape[0] if weight_is_VxD else weight.shape[1]

  def chunk(grad_weight_DxV, inputs):
    hidden_BxCxD, targets_BxC = inputs
    sums_4, grad_hidden_BxCxD, parts = _chunk_sums(
      hidden_BxCxD, targets_BxC, weight, weight_is_VxD, label_smoothing
    )
    grad_weight_DxV += _chunk_weight_gradient(parts, label_smoothing)
    return grad_weight_DxV, (sums_4, grad_hidden_BxCxD)

  grad_weight_DxV, (sums_Nx4, grad_hidden_NxBxCxD) = jax.lax.scan(
    chunk, jnp.zeros((d_model, vocab), jnp.float32), (hidden_NxBxCxD, targets_NxBxC)
  )
  grad_hidden_BxTxD = grad_hidden_NxBxCxD.swapaxes(0, 1).reshape(batch, length, d_model)
  return jnp.sum(sums_Nx4, axis=0), (grad_hidden_BxTxD, grad_weight_DxV)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused_sums(hidden_BxTxD, weight, targets_BxT, label_smoothing, chunk_len, weight_is_VxD):
  return _fused_sums_forward(
    hidden_BxTxD, weight, targets_BxT, label_smoothing, chunk_len, weight_is_VxD
  )[0]


def _fused_sums_backward(label_smoothing, chunk_len, weight_is_VxD, residuals, grad_sums_4):
  scale = grad_sums_4[0]  # the loss sum's cotangent; the metrics' are dropped
  grad_hidden_BxTxD, weight_part = residuals
  if grad_hidden_BxTxD.shape[1] == chunk_len:  # one chunk: the weight's gradient is made here
    grad_weight_DxV = _chunk_weight_gradient(weight_part, label_smoothing, scale)
  else:
    grad_weight_DxV = scale * weight_part
  grad_weight = grad_weight_DxV.T if weight_is_VxD else grad_weight_DxV
  return (
    (scale * grad_hidden_BxTxD).astype(grad_hidden_BxTxD.dtype),
    grad_weight.astype(grad_hidden_BxTxD.dtype),
    None,
  )


_fused_sums.defvjp(_fused_sums_forward, _fused_sums_backward)
