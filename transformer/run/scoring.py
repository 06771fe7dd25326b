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
