"""The paper's learning-rate schedule and Adam, with optional clipping, decay, accumulation."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax

Array = jax.Array


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
