"""Loss, learning-rate schedule, optimizer, and the sharded train and eval steps.

Pure functions of (state, batch); `transformer/train_loop.py` drives them. A step is
`jax.jit`-compiled with the state's shardings in and out and the state donated, so
parameters and Adam moments are updated in place wherever the mesh put them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from transformer import sharding
from transformer.config import PAD_ID
from transformer.model import ModelConfig, Transformer, model_inputs

Array = jax.Array


@flax.struct.dataclass
class TrainState:
  step: Array  # train steps taken (microbatches when accumulating gradients)
  params: Any
  opt_state: Any


def learning_rate_schedule(config: ml_collections.ConfigDict) -> Callable[[Array], Array]:
  """lr(step) = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step from 1.

  Linear warmup for `warmup_steps`, then inverse square root decay (paper, eq. 3).
  Optax counts updates from 0, so update n uses step n + 1.
  """
  scale = config.learning_rate_scale * config.model.d_model**-0.5
  warmup = float(config.warmup_steps)

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return scale * jnp.minimum(step**-0.5, step * warmup**-1.5)
  return schedule


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Adam(0.9, 0.98, 1e-9) on the paper's schedule; optional clipping, decay, accumulation."""
  schedule = learning_rate_schedule(config)
  parts = []
  if config.grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(config.grad_clip_norm))
  if config.weight_decay > 0:
    # Decoupled decay (AdamW) on matrices only: not on biases, norms or positions.
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    parts.append(optax.adamw(schedule, b1=config.adam_b1, b2=config.adam_b2,
                             eps=config.adam_eps, weight_decay=config.weight_decay,
                             mask=decay_mask))
  else:
    parts.append(optax.adam(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps))
  optimizer = optax.chain(*parts) if len(parts) > 1 else parts[0]
  if config.grad_accum_steps > 1:
    # Averages gradients over k successive calls and applies one update; the schedule
    # sees update counts, so warmup means the same with and without accumulation.
    optimizer = optax.MultiSteps(optimizer, every_k_schedule=config.grad_accum_steps)
  return optimizer


def cross_entropy_sums(logits_BxTxV: Array, targets_BxT: Array,
                       label_smoothing: float) -> dict[str, Array]:
  """Sums over non-padding target tokens of the smoothed loss, plain CE and accuracy.

  Label smoothing puts 1 - eps on the target and eps / (V - 1) on every other token;
  the loss is the cross-entropy to that distribution minus its entropy (a KL, zero at
  the optimum), as Tensor2Tensor does. `ce` is the unsmoothed cross-entropy, whose
  exponential is the perplexity the paper reports.
  """
  vocab = logits_BxTxV.shape[-1]
  weights_BxT = (targets_BxT != PAD_ID).astype(jnp.float32)
  log_probs_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
  target_log_prob_BxT = jnp.take_along_axis(log_probs_BxTxV, targets_BxT[..., None], -1)[..., 0]
  ce_BxT = -target_log_prob_BxT
  if label_smoothing > 0:
    confidence, low = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
    entropy = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low))
    others_BxT = -(jnp.sum(log_probs_BxTxV, axis=-1) - target_log_prob_BxT)
    smoothed_BxT = confidence * ce_BxT + low * others_BxT - entropy
  else:
    smoothed_BxT = ce_BxT
  correct_BxT = (jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT).astype(jnp.float32)
  return {
      "loss_sum": jnp.sum(smoothed_BxT * weights_BxT),
      "ce_sum": jnp.sum(ce_BxT * weights_BxT),
      "correct_sum": jnp.sum(correct_BxT * weights_BxT),
      "num_tokens": jnp.sum(weights_BxT),
  }


def build_model(config: ml_collections.ConfigDict) -> Transformer:
  return Transformer(ModelConfig.from_config(config))


def dummy_inputs(config: ml_collections.ConfigDict) -> dict[str, Array]:
  tokens = jnp.ones((1, 8), jnp.int32)
  return {"source": None if config.model.decoder_only else tokens, "decoder_input": tokens}


def init_boxed_state(model: Transformer, optimizer, config, rng: Array) -> TrainState:
  """The state with parameters still wrapped in their logical axis names."""
  params = model.init(rng, **dummy_inputs(config))["params"]
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params))


def state_shardings(model, optimizer, config, mesh: Mesh) -> tuple[Any, Any]:
  """(abstract unboxed state, its NamedShardings), without allocating anything."""
  boxed = jax.eval_shape(functools.partial(init_boxed_state, model, optimizer, config),
                         jax.random.key(0))
  shardings = sharding.logical_to_sharding(boxed, mesh, sharding.axis_rules(config))
  return nn.unbox(boxed), shardings


def create_train_state(model, optimizer, config, state_sharding_tree, rng: Array) -> TrainState:
  """Initializes parameters and Adam moments directly in their sharded places."""
  init = lambda r: nn.unbox(init_boxed_state(model, optimizer, config, r))
  return jax.jit(init, out_shardings=state_sharding_tree)(rng)


def loss_fn(params, batch: dict[str, Array], dropout_rng: Array, *, model: Transformer,
            label_smoothing: float, nan_at_step: Array | None = None):
  logits_BxTxV = model.apply({"params": params}, **model_inputs(batch), deterministic=False,
                             rngs={"dropout": dropout_rng})
  sums = cross_entropy_sums(logits_BxTxV, batch["target"], label_smoothing)
  loss = sums["loss_sum"] / jnp.maximum(sums["num_tokens"], 1.0)
  if nan_at_step is not None:  # fault injection for tests: config.debug_nan_step
    loss = loss * jnp.where(nan_at_step, jnp.nan, 1.0)
  return loss, sums


def train_step(state: TrainState, batch: dict[str, Array], *, model: Transformer,
               optimizer, config: ml_collections.ConfigDict) -> tuple[TrainState, dict]:
  """One update on a global batch. Returns the new state and summed metrics."""
  # Dropout masks depend only on (seed, step): a resumed run draws the same ones.
  dropout_rng = jax.random.fold_in(
      jax.random.key(config.seed + 1, impl=config.dropout_rng_impl), state.step)
  nan_at_step = None
  if config.debug_nan_step > 0:
    nan_at_step = state.step + 1 == config.debug_nan_step
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  (loss, sums), grads = grad_fn(state.params, batch, dropout_rng, model=model,
                                label_smoothing=config.label_smoothing,
                                nan_at_step=nan_at_step)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  update_count = state.step // config.grad_accum_steps
  metrics = dict(sums, loss=loss, grad_norm=optax.tree_utils.tree_norm(grads),
                 lr=learning_rate_schedule(config)(update_count))
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params, batch: dict[str, Array], *, model: Transformer,
              config: ml_collections.ConfigDict) -> dict[str, Array]:
  logits_BxTxV = model.apply({"params": params}, **model_inputs(batch), deterministic=True)
  return cross_entropy_sums(logits_BxTxV, batch["target"], config.label_smoothing)


def jit_train_step(model, optimizer, config, state_sharding_tree, mesh: Mesh):
  """train_step compiled over the mesh: state sharded in and out, and donated."""
  step = functools.partial(train_step, model=model, optimizer=optimizer, config=config)
  batch_sharding = sharding.batch_sharding(mesh, sharding.axis_rules(config))
  return jax.jit(step, in_shardings=(state_sharding_tree, batch_sharding),
                 out_shardings=(state_sharding_tree, sharding.replicated(mesh)),
                 donate_argnums=0)


def jit_eval_step(model, config, params_sharding_tree, mesh: Mesh):
  """eval_step over the mesh; batches hold only [B, L] arrays (drop 'index' first)."""
  step = functools.partial(eval_step, model=model, config=config)
  batch_sharding = sharding.batch_sharding(mesh, sharding.axis_rules(config))
  return jax.jit(step, in_shardings=(params_sharding_tree, batch_sharding),
                 out_shardings=sharding.replicated(mesh))
