"""The loss of a batch under a model's parameters: the sharded eval step (validation during
training, perplexity in eval.py), over a model set-up alone. The cross-entropy itself,
and the fused form training differentiates, is the model's (transformer/model/loss.py).
"""

from __future__ import annotations

import functools
from typing import cast

import jax
import ml_collections

from transformer.inference import sharding
from transformer.inference.model_setup import Model, ModelSetup
from transformer.model import model_inputs
from transformer.model.loss import cross_entropy_sums

Array = jax.Array


def eval_step(
  params, batch: dict[str, Array], *, model: Model, config: ml_collections.ConfigDict
) -> dict[str, Array]:
  logits_BxTxV = cast(  # the output alone: no mutable=
    Array, model.apply({"params": params}, **model_inputs(batch), deterministic=True)
  )
  return cross_entropy_sums(logits_BxTxV, batch["target"], config.label_smoothing)


def jit_eval_step(setup: ModelSetup):
  """eval_step over the mesh; batches hold only [B, L] arrays (drop 'index' first).
  `setup`: a model set-up (inference.ModelSetup), or training's (its `model_setup`)."""
  step = sharding.with_activation_sharding(
    functools.partial(eval_step, model=setup.model, config=setup.config), setup.mesh, setup.rules
  )
  batch_sharding = sharding.batch_sharding(setup.mesh, setup.rules)
  return jax.jit(
    step,
    in_shardings=(setup.param_shardings, batch_sharding),
    out_shardings=sharding.replicated(setup.mesh),
  )
