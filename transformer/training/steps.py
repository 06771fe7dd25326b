"""The loss and the sharded train and eval steps.

Pure functions of (state, batch); `transformer/training/loop.py` drives them. A step is
`jax.jit`-compiled with the state's shardings in and out and the state donated, so
parameters and Adam moments are updated in place wherever the mesh put them.
"""

from __future__ import annotations

import functools
import math
from typing import cast

import jax
import jax.numpy as jnp
import ml_collections
import optax

from transformer.config import PAD_ID
from transformer.model import model_inputs
from transformer.training import flops, sharding
from transformer.training.optimizer import learning_rate_schedule
from transformer.training.state import Model, Setup, TrainState

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


def loss_fn(
  params,
  batch: dict[str, Array],
  dropout_rng: Array,
  *,
  model: Model,
  label_smoothing: float,
):
  # apply without mutable= returns the model's output alone, not (output, variables).
  logits_BxTxV = cast(
    Array,
    model.apply(
      {"params": params}, **model_inputs(batch), deterministic=False, rngs={"dropout": dropout_rng}
    ),
  )
  sums = cross_entropy_sums(logits_BxTxV, batch["target"], label_smoothing)
  loss = sums["loss_sum"] / jnp.maximum(sums["num_tokens"], 1.0)
  return loss, sums


def _summed_loss_fn(params, batch: dict[str, Array], dropout_rng: Array, **kwargs):
  """loss_fn with the microbatch's loss SUM as the objective (gradient accumulation).

  Returns (loss_sum, (per-token loss, sums)).
  """
  loss, sums = loss_fn(params, batch, dropout_rng, **kwargs)
  return sums["loss_sum"], (loss, sums)


def train_step(
  state: TrainState,
  batch: dict[str, Array],
  *,
  model: Model,
  optimizer,
  config: ml_collections.ConfigDict,
) -> tuple[TrainState, dict]:
  """One update on a global batch, or one microbatch of it. Returns the new state and metrics.

  With grad_accum_steps > 1 the step differentiates the microbatch's loss sum and the
  optimizer (optimizer.accumulate_by_tokens) divides the k microbatches' summed gradient
  by their summed token count, so the update equals the one big batch's. Metrics are the
  microbatch's sums; `loss` is its per-token loss, and `grad_norm` the global norm of its
  per-token mean gradient (with or without accumulation; before clipping); `token_counts`
  is flops.count_tokens of the batch (for MFU on real tokens), a dict of its own.
  """
  # Dropout masks depend only on (seed, step): a resumed run draws the same ones.
  dropout_rng = jax.random.fold_in(
    jax.random.key(config.seed + 1, impl=config.dropout_rng_impl), state.step
  )
  loss_kwargs = dict(model=model, label_smoothing=config.label_smoothing)
  if config.grad_accum_steps > 1:
    grad_fn = jax.value_and_grad(_summed_loss_fn, has_aux=True)
    (_, (loss, sums)), grads = grad_fn(state.params, batch, dropout_rng, **loss_kwargs)
    updates, opt_state = optimizer.update(
      grads, state.opt_state, state.params, num_tokens=sums["num_tokens"]
    )
    grad_norm = optax.tree_utils.tree_norm(grads) / jnp.maximum(sums["num_tokens"], 1.0)
  else:
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, sums), grads = grad_fn(state.params, batch, dropout_rng, **loss_kwargs)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    grad_norm = optax.tree_utils.tree_norm(grads)
  params = optax.apply_updates(state.params, updates)
  update_count = state.step // config.grad_accum_steps
  metrics = dict(
    sums,
    loss=loss,
    grad_norm=grad_norm,
    lr=learning_rate_schedule(config)(update_count),
    # Computed here rather than by a jit of its own: one dispatch per step.
    token_counts=flops.count_tokens(batch),
  )
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(
  params, batch: dict[str, Array], *, model: Model, config: ml_collections.ConfigDict
) -> dict[str, Array]:
  logits_BxTxV = cast(  # the output alone: no mutable=
    Array, model.apply({"params": params}, **model_inputs(batch), deterministic=True)
  )
  return cross_entropy_sums(logits_BxTxV, batch["target"], config.label_smoothing)


def jit_train_step(setup: Setup):
  """train_step compiled over the mesh: state sharded in and out, and donated."""
  step = sharding.with_activation_sharding(
    functools.partial(
      train_step, model=setup.model, optimizer=setup.optimizer, config=setup.config
    ),
    setup.mesh,
    setup.rules,
  )
  batch_sharding = sharding.batch_sharding(setup.mesh, setup.rules)
  return jax.jit(
    step,
    in_shardings=(setup.state_shardings, batch_sharding),
    out_shardings=(setup.state_shardings, sharding.replicated(setup.mesh)),
    donate_argnums=0,
  )


def jit_eval_step(setup: Setup):
  """eval_step over the mesh; batches hold only [B, L] arrays (drop 'index' first)."""
  step = sharding.with_activation_sharding(
    functools.partial(eval_step, model=setup.model, config=setup.config), setup.mesh, setup.rules
  )
  batch_sharding = sharding.batch_sharding(setup.mesh, setup.rules)
  return jax.jit(
    step,
    in_shardings=(setup.state_shardings.params, batch_sharding),
    out_shardings=sharding.replicated(setup.mesh),
  )
