"""The train state, and `setup`: the model, optimizer and sharded state shapes of a config.

Every command that runs the model (training, evaluation, checkpoint averaging, the
benchmark) starts with `setup(config)`; nothing is allocated until `init_state` or a
restore.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from transformer.config import ConfigError
from transformer.model import ModelConfig, Transformer
from transformer.model.draft import ShallowDraft, draft_decoder_config
from transformer.training import sharding
from transformer.training.optimizer import make_optimizer

# What a run trains: the Transformer, or a shallow draft on a trained one's encoder.
Model = Transformer | ShallowDraft

Array = jax.Array


@flax.struct.dataclass
class TrainState:
  step: Array  # train steps taken (microbatches when accumulating gradients)
  params: Any
  opt_state: Any


def build_model(config: ml_collections.ConfigDict) -> Model:
  """The config's Transformer, or with draft.num_layers its shallow draft (model/draft.py)."""
  model_config = ModelConfig.from_config(config)
  if config.draft.num_layers:
    return ShallowDraft(
      draft_decoder_config(model_config, config.draft.num_layers, config.draft.d_ff),
      model_config,
      tuple(int(i) for i in config.draft.shortlist),
    )
  return Transformer(model_config)


def dummy_inputs(config: ml_collections.ConfigDict) -> dict[str, Array | None]:
  """The smallest inputs that create every parameter (shapes do not depend on length)."""
  tokens = jnp.ones((1, 8), jnp.int32)
  return {"source": None if config.model.decoder_only else tokens, "decoder_input": tokens}


def init_boxed_state(model: Model, optimizer, config, rng: Array) -> TrainState:
  """The state with parameters still wrapped in their logical axis names."""
  inputs = dummy_inputs(config)
  params = model.init(rng, inputs["source"], inputs["decoder_input"])["params"]
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


@dataclasses.dataclass(frozen=True)
class Setup:
  """A config's model, optimizer and mesh, and the train state's shapes and shardings."""

  config: ml_collections.ConfigDict
  mesh: Mesh
  rules: tuple  # logical axis rules, as flax takes them
  model: Model
  optimizer: optax.GradientTransformation
  abstract_state: TrainState  # ShapeDtypeStructs, unboxed
  state_shardings: TrainState  # NamedShardings, same tree

  @property
  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.abstract_state.params))

  def init_state(self, rng: Array) -> TrainState:
    """Parameters and Adam moments, initialized directly in their sharded places."""
    init = lambda r: nn.unbox(init_boxed_state(self.model, self.optimizer, self.config, r))
    return jax.jit(init, out_shardings=self.state_shardings)(rng)

  def restore_target(self) -> TrainState:
    """ShapeDtypeStructs carrying shardings: what a checkpoint restores into."""
    return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      self.abstract_state,
      self.state_shardings,
    )


def setup(config: ml_collections.ConfigDict, mesh: Mesh | None = None) -> Setup:
  """Builds everything but the arrays; `mesh` defaults to the config's over all devices."""
  mesh = mesh if mesh is not None else sharding.create_mesh(config)
  rules = sharding.axis_rules(config)
  row_shards = sharding.batch_row_shards(mesh, rules)
  if config.eval_batch_size % row_shards:
    raise ConfigError(
      f"eval_batch_size: {config.eval_batch_size} sentences do not split "
      f"over the {row_shards} devices a batch's rows are spread over"
    )
  model = build_model(config)
  optimizer = make_optimizer(config)
  boxed = jax.eval_shape(
    functools.partial(init_boxed_state, model, optimizer, config), jax.random.key(0)
  )
  shardings = sharding.logical_to_sharding(boxed, mesh, rules)
  return Setup(config, mesh, rules, model, optimizer, nn.unbox(boxed), shardings)
