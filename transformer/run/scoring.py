"""The loss of a batch under a model's parameters: the cross-entropy with label smoothing
(which training differentiates, transformer/training/steps.py) and the sharded eval step
(validation during training, perplexity in eval.py), over a model set-up alone.
"""

from __future__ import annotations

import functools
import math
from typing import cast

import jax
import jax.numpy as jnp
import ml_collections

from transformer.config import PAD_ID
from transformer.model import model_inputs
from transformer.model.primitives import BLV, constrain
from transformer.run import sharding
from transformer.run.model_setup import Model, ModelSetup

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
  vocab = logits_BxTxV.shape[-1]
  max_BxT = jnp.max(logits_BxTxV, axis=-1)
  log_normalizer_BxT = max_BxT + jnp.log(
    jnp.sum(jnp.exp(logits_BxTxV - max_BxT[..., None]), axis=-1)
  )
  target_logit_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], -1)[..., 0]
  ce_BxT = log_normalizer_BxT - target_logit_BxT
  smoothed_BxT = ce_BxT
  if label_smoothing > 0:
    confidence, low = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
    entropy = -(confidence * math.log(confidence) + (vocab - 1) * low * math.log(low))
    # -(sum of the other tokens' log-probs) = (V - 1) lse - (sum of logits - target's).
    others_BxT = (vocab - 1) * log_normalizer_BxT - (
      jnp.sum(logits_BxTxV, axis=-1) - target_logit_BxT
    )
    smoothed_BxT = confidence * ce_BxT + low * others_BxT - entropy
  correct_BxT = (target_logit_BxT >= max_BxT).astype(jnp.float32)
  return (smoothed_BxT, ce_BxT, correct_BxT), (logits_BxTxV, targets_BxT, log_normalizer_BxT)


def _token_losses_backward(label_smoothing, residuals, cotangents):
  logits_BxTxV, targets_BxT, log_normalizer_BxT = residuals
  grad_smoothed_BxT, grad_ce_BxT, _ = cotangents
  vocab = logits_BxTxV.shape[-1]
  low = label_smoothing / (vocab - 1) if label_smoothing > 0 else 0.0
  on_target = 1.0 - label_smoothing - low if label_smoothing > 0 else 1.0
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
  ([D, V]), for training, without a [B, T, V] array ever whole.

  The targets go through in chunks of `chunk_len` positions (a scan; T padded up to a
  multiple with padding targets, which count nothing). Each chunk's logits [B, c, V] are
  made in f32, reduced to its sums, and turned at once into the chunk's part of the
  gradients of the smoothed loss sum, which is the end of the graph: the gradient of the
  hidden states [B, c, D] and a running sum of the weight's. The backward pass only
  scales them by the loss sum's cotangent. So the step keeps the three vocabulary matmuls
  of the unfused projection and loss (the logits, and the two of their backward) and
  never writes the f32 logits or their gradient, the largest arrays of a step, to memory.

  Only `loss_sum` is differentiated: `ce_sum`, `correct_sum` and `num_tokens` are metrics,
  and their cotangents are dropped. Equal to cross_entropy_sums of the unfused logits,
  with gradients, to float32 rounding (tests/test_run_fused_loss.py).
  """
  _, length, _ = hidden_BxTxD.shape
  pad = -length % chunk_len
  if pad:
    hidden_BxTxD = jnp.pad(hidden_BxTxD, ((0, 0), (0, pad), (0, 0)))
    targets_BxT = jnp.pad(targets_BxT, ((0, 0), (0, pad)), constant_values=PAD_ID)
  sums_4 = _fused_sums(hidden_BxTxD, weight, targets_BxT, label_smoothing, chunk_len, weight_is_VxD)
  return dict(zip(("loss_sum", "ce_sum", "correct_sum", "num_tokens"), sums_4))


def _fused_sums_and_gradients(
  hidden_BxTxD, weight, targets_BxT, label_smoothing, chunk_len, weight_is_VxD
):
  """(sums [4], (d loss_sum / d hidden, d loss_sum / d weight)), chunk by chunk."""
  batch, length, d_model = hidden_BxTxD.shape
  chunks = length // chunk_len
  hidden_NxBxCxD = hidden_BxTxD.reshape(batch, chunks, chunk_len, d_model).swapaxes(0, 1)
  targets_NxBxC = targets_BxT.reshape(batch, chunks, chunk_len).swapaxes(0, 1)
  w = "vd" if weight_is_VxD else "dv"
  vocab = weight.shape[0] if weight_is_VxD else weight.shape[1]
  low = label_smoothing / (vocab - 1) if label_smoothing > 0 else 0.0
  on_target = 1.0 - label_smoothing - low if label_smoothing > 0 else 1.0

  def chunk(grad_weight_DxV, inputs):
    hidden_BxCxD, targets_BxC = inputs
    logits_BxCxV = jnp.einsum(
      f"bcd,{w}->bcv", hidden_BxCxD, weight, preferred_element_type=jnp.float32
    )
    logits_BxCxV = constrain(logits_BxCxV, BLV)  # the vocabulary over the tensor axis
    (smoothed_BxC, ce_BxC, correct_BxC), (_, _, log_normalizer_BxC) = _token_losses_forward(
      logits_BxCxV, targets_BxC, label_smoothing
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
    # d loss_sum / d logits in closed form (as _token_losses_backward), rounded to the
    # compute dtype for the two matmuls, which sum in f32 (as layers._logits_backward).
    probs_BxCxV = jnp.exp(logits_BxCxV - log_normalizer_BxC[..., None])
    is_target_BxCxV = jnp.arange(vocab) == targets_BxC[..., None]
    grad_BxCxV = weights_BxC[..., None] * (
      probs_BxCxV - low - jnp.where(is_target_BxCxV, on_target, 0.0)
    )
    grad_BxCxV = grad_BxCxV.astype(hidden_BxCxD.dtype)
    grad_hidden_BxCxD = jnp.einsum(
      f"bcv,{w}->bcd", grad_BxCxV, weight, preferred_element_type=jnp.float32
    ).astype(hidden_BxCxD.dtype)
    grad_weight_DxV += jnp.einsum(
      "bcd,bcv->dv", hidden_BxCxD, grad_BxCxV, preferred_element_type=jnp.float32
    )
    return grad_weight_DxV, (sums_4, grad_hidden_BxCxD)

  grad_weight_DxV, (sums_Nx4, grad_hidden_NxBxCxD) = jax.lax.scan(
    chunk, jnp.zeros((d_model, vocab), jnp.float32), (hidden_NxBxCxD, targets_NxBxC)
  )
  grad_hidden_BxTxD = grad_hidden_NxBxCxD.swapaxes(0, 1).reshape(batch, length, d_model)
  grad_weight = grad_weight_DxV.T if weight_is_VxD else grad_weight_DxV
  return jnp.sum(sums_Nx4, axis=0), (grad_hidden_BxTxD, grad_weight.astype(weight.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused_sums(hidden_BxTxD, weight, targets_BxT, label_smoothing, chunk_len, weight_is_VxD):
  return _fused_sums_and_gradients(
    hidden_BxTxD, weight, targets_BxT, label_smoothing, chunk_len, weight_is_VxD
  )[0]


def _fused_sums_backward(label_smoothing, chunk_len, weight_is_VxD, gradients, grad_sums_4):
  grad_hidden_BxTxD, grad_weight = gradients
  scale = grad_sums_4[0]  # the loss sum's cotangent; the metrics' are dropped
  return (
    (scale * grad_hidden_BxTxD).astype(grad_hidden_BxTxD.dtype),
    (scale * grad_weight).astype(grad_weight.dtype),
    None,
  )


_fused_sums.defvjp(_fused_sums_and_gradients, _fused_sums_backward)


def eval_step(
  params, batch: dict[str, Array], *, model: Model, config: ml_collections.ConfigDict
) -> dict[str, Array]:
  logits_BxTxV = cast(  # the output alone: no mutable=
    Array, model.apply({"params": params}, **model_inputs(batch), deterministic=True)
  )
  return cross_entropy_sums(logits_BxTxV, batch["target"], config.label_smoothing)


def jit_eval_step(setup: ModelSetup):
  """eval_step over the mesh; batches hold only [B, L] arrays (drop 'index' first).
  `setup`: a model set-up (run.ModelSetup), or training's (its `model_setup`)."""
  step = sharding.with_activation_sharding(
    functools.partial(eval_step, model=setup.model, config=setup.config), setup.mesh, setup.rules
  )
  batch_sharding = sharding.batch_sharding(setup.mesh, setup.rules)
  return jax.jit(
    step,
    in_shardings=(setup.param_shardings, batch_sharding),
    out_shardings=sharding.replicated(setup.mesh),
  )
