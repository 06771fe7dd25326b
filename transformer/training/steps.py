"""The sharded train step (its loss, the cross-entropy, is run.scoring's).

Pure functions of (state, batch); `transformer/training/loop.py` drives them. A step is
`jax.jit`-compiled with the state's shardings in and out and the state donated, so
parameters and Adam moments are updated in place wherever the mesh put them.
"""

from __future__ import annotations

import functools
from typing import cast

import jax
import jax.numpy as jnp
import ml_collections
import optax

from transformer.inference import sharding
from transformer.inference.model_setup import Model
from transformer.model import model_inputs
from transformer.model.loss import cross_entropy_sums, fused_cross_entropy_sums
from transformer.training import flops
from transformer.training.optimizer import learning_rate_schedule
from transformer.training.state import Setup, TrainState

Array = jax.Array


def loss_fn(
  params,
  batch: dict[str, Array],
  dropout_rng: Array,
  *,
  model: Model,
  label_smoothing: float,
  loss_chunk_len: int = 0,
):
  """(per-token loss, sums) of a batch; with loss_chunk_len > 0 the pre-softmax
  projection and the loss are fused (model/loss.py: fused_cross_entropy_sums)."""
  inputs = dict(model_inputs(batch), deterministic=False, rngs={"dropout": dropout_rng})
  # The names reach the compiled program's op metadata, where compile_check's per-op
  # profile (transformer/tools/op_profile.py) reads which model part an op belongs to.
  if loss_chunk_len:
    # apply without mutable= returns the model's output alone, not (output, variables).
    hidden_BxTxD, weight, weight_is_VxD = cast(
      tuple[Array, Array, bool], model.apply({"params": params}, **inputs, features_only=True)
    )
    with jax.named_scope("loss"):
      sums = fused_cross_entropy_sums(
        hidden_BxTxD, weight, weight_is_VxD, batch["target"], label_smoothing, loss_chunk_len
      )
  else:
    logits_BxTxV = cast(Array, model.apply({"params": params}, **inputs))
    with jax.named_scope("loss"):
      sums = cross_entropy_sums(logits_BxTxV, batch["target"], label_smoothing)
  loss = sums["loss_sum"] / jnp.maximum(sums["num_tokens"], 1.0)
  return loss, sums


def _summed_loss_fn(params, batch: dict[str, Array], dropout_rng: Array, **kwargs):
  """loss_fn with the microbatch's loss SUM as the objective (gradient accumulation).

  Returns (loss_sum, (per-token loss, sums)).
  """
  loss, sums = loss_fn(params, batch, dropout_rng, **kwargs)
  return sums["loss_sum"], (loss, sums)


def _dropout_rng(config: ml_collections.ConfigDict, step: Array) -> Array:
  """The step's dropout key: masks depend only on (seed, step), so a resumed run draws
  the same ones."""
  return jax.random.fold_in(jax.random.key(config.seed + 1, impl=config.dropout_rng_impl), step)


def _placed(grads, param_shardings, grad_shardings):
  """The gradients split over the data axis as grad_shardings says (None: as they are)."""
  if grad_shardings is None:
    return grads
  # Summed as the parameters are placed first: a constraint on the backward pass's
  # result alone reaches back into it, and the partitioner then split its matmuls too.
  grads = jax.lax.with_sharding_constraint(grads, param_shardings)
  return jax.lax.with_sharding_constraint(grads, grad_shardings)


def train_step(
  state: TrainState,
  batch: dict[str, Array],
  *,
  model: Model,
  optimizer,
  config: ml_collections.ConfigDict,
  grad_shardings=None,
  param_shardings=None,
) -> tuple[TrainState, dict]:
  """One update on a global batch, or one microbatch of it. Returns the new state and metrics.

  With grad_accum_steps > 1 the step differentiates the microbatch's loss sum and the
  optimizer (optimizer.accumulate_by_tokens) divides the k microbatches' summed gradient
  by their summed token count, so the update equals the one big batch's. Metrics are the
  microbatch's sums; `loss` is its per-token loss, and `grad_norm` the global norm of its
  per-token mean gradient (with or without accumulation; before clipping); `token_counts`
  is flops.count_tokens of the batch (for MFU on real tokens), a dict of its own.

  grad_shardings (Setup.grad_shardings): where given, the gradients, summed as the
  parameters are placed (`param_shardings`), are then split over the data axis: each
  device updates its part, and the new parameters are gathered.
  """
  dropout_rng = _dropout_rng(config, state.step)
  loss_kwargs = dict(
    model=model, label_smoothing=config.label_smoothing, loss_chunk_len=config.loss_chunk_len
  )

  if config.grad_accum_steps > 1:
    grad_fn = jax.value_and_grad(_summed_loss_fn, has_aux=True)
    (_, (loss, sums)), grads = grad_fn(state.params, batch, dropout_rng, **loss_kwargs)
    grads = _placed(grads, param_shardings, grad_shardings)
    with jax.named_scope("optimizer"):
      updates, opt_state = optimizer.update(
        grads, state.opt_state, state.params, num_tokens=sums["num_tokens"]
      )
      grad_norm = optax.tree_utils.tree_norm(grads) / jnp.maximum(sums["num_tokens"], 1.0)
  else:
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, sums), grads = grad_fn(state.params, batch, dropout_rng, **loss_kwargs)
    grads = _placed(grads, param_shardings, grad_shardings)
    with jax.named_scope("optimizer"):
      updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
      grad_norm = optax.tree_utils.tree_norm(grads)
  with jax.named_scope("optimizer"):
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


def jit_train_step(setup: Setup):
  """train_step compiled over the mesh: state sharded in and out, and donated."""
  step = sharding.with_activation_sharding(
    functools.partial(
      train_step,
      model=setup.model,
      optimizer=setup.optimizer,
      config=setup.config,
      grad_shardings=setup.grad_shardings,
      param_shardings=setup.state_shardings.params,
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
