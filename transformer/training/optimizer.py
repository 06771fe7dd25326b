"""The paper's learning-rate schedule and Adam, with optional clipping, decay, accumulation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

Array = jax.Array

# Weight decay by parameter name (the last key of its path), not by rank: under
# model.scan_layers every layer parameter gains a leading [layers] axis, so rank cannot
# tell a stacked LayerNorm scale from a matrix. Decayed: dense kernels and the token
# embedding tables (the shared one is also the output projection's weight matrix), as
# AdamW setups for Transformers do. Never decayed: biases, LayerNorm scales and the
# learned position table. An unknown name raises, so a new parameter gets a decision.
DECAYED_NAMES = frozenset({"kernel", "embedding"})
UNDECAYED_NAMES = frozenset({"bias", "scale", "position_embedding"})


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


def _parameter_name(path) -> str:
  """The innermost dict key of a tree path; skips the `.value` of flax's boxed params."""
  keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
  return str(keys[-1]) if keys else ""


def weight_decay_mask(params) -> Any:
  """True where decoupled weight decay applies; same tree as `params` (boxed or not)."""

  def decayed(path, _):
    name = _parameter_name(path)
    if name in DECAYED_NAMES:
      return True
    if name in UNDECAYED_NAMES:
      return False
    raise ValueError(
      f"weight_decay: no decay rule for parameter {jax.tree_util.keystr(path)}; "
      "add its name to DECAYED_NAMES or UNDECAYED_NAMES in "
      "transformer/training/optimizer.py"
    )

  return jax.tree_util.tree_map_with_path(decayed, params)


class TokenAccumulationState(NamedTuple):
  """Running sums between updates; arrays only, so checkpoints save it as is."""

  micro_step: Array  # int32 []: microbatches summed since the last update
  grad_sum: Any  # params tree: sum of the microbatches' loss-sum gradients
  num_tokens: Array  # float32 []: real (non-padding) target tokens in those microbatches
  inner_state: Any


def accumulate_by_tokens(
  inner: optax.GradientTransformation, every_k: int
) -> optax.GradientTransformationExtraArgs:
  """Applies `inner` once per `every_k` microbatches to the per-token mean gradient.

  Each call takes the gradient of a microbatch's loss SUM and, as the extra argument
  `num_tokens`, its real target tokens. The k-th call hands (sum of gradients) / (sum of
  tokens) to `inner`, the gradient of the one big batch made of the k microbatches, so
  a microbatch with more real tokens weighs more, unlike averaging per-microbatch means
  (optax.MultiSteps). Other calls return zero updates and leave `inner` untouched, so its
  step count (and the learning-rate schedule) counts updates, not microbatches.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return TokenAccumulationState(
      micro_step=jnp.zeros([], jnp.int32),
      grad_sum=jax.tree.map(jnp.zeros_like, params),
      num_tokens=jnp.zeros([], jnp.float32),
      inner_state=inner.init(params),
    )

  def update_fn(grads, state, params=None, *, num_tokens, **extra_args):
    grad_sum = jax.tree.map(jnp.add, state.grad_sum, grads)
    total_tokens = state.num_tokens + jnp.asarray(num_tokens, jnp.float32)

    def apply_update(_):
      # max(., 1): k all-padding microbatches give a zero gradient rather than NaN.
      mean_grads = jax.tree.map(lambda g: g / jnp.maximum(total_tokens, 1.0), grad_sum)
      updates, inner_state = inner.update(mean_grads, state.inner_state, params, **extra_args)
      return updates, TokenAccumulationState(
        micro_step=jnp.zeros_like(state.micro_step),
        grad_sum=jax.tree.map(jnp.zeros_like, grad_sum),
        num_tokens=jnp.zeros_like(total_tokens),
        inner_state=inner_state,
      )

    def keep_summing(_):
      return jax.tree.map(jnp.zeros_like, grads), TokenAccumulationState(
        micro_step=state.micro_step + 1,
        grad_sum=grad_sum,
        num_tokens=total_tokens,
        inner_state=state.inner_state,
      )

    return jax.lax.cond(state.micro_step == every_k - 1, apply_update, keep_summing, None)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Adam(0.9, 0.98, 1e-9) on the paper's schedule; optional clipping, decay, accumulation.

  With grad_accum_steps > 1 the optimizer is `accumulate_by_tokens`: `update` then wants
  loss-sum gradients and `num_tokens=` (steps.train_step passes both).
  """
  schedule = learning_rate_schedule(config)
  parts = []
  if config.grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(config.grad_clip_norm))
  if config.weight_decay > 0:
    # Decoupled decay (AdamW) on weight matrices and token embeddings only.
    parts.append(
      optax.adamw(
        schedule,
        b1=config.adam_b1,
        b2=config.adam_b2,
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        mask=weight_decay_mask,
      )
    )
  else:
    parts.append(optax.adam(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps))
  optimizer = optax.chain(*parts) if len(parts) > 1 else parts[0]
  if config.grad_accum_steps > 1:
    # Clipping sits inside, so it clips the accumulated per-token mean gradient.
    optimizer = accumulate_by_tokens(optimizer, config.grad_accum_steps)
  return optimizer
