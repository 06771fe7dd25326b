"""`setup(config)`: a config's model on its mesh, and its parameters' shapes and shardings.

What every user of a model starts from, serving and training alike: nothing is allocated
until parameters are initialized (training) or restored (`transformer.inference.restore`).
Training's set-up (transformer/training/state.py) adds the optimizer and its state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh

from transformer.config import ConfigError
from transformer.inference import sharding
from transformer.model import ModelConfig, Transformer
from transformer.model.draft import ShallowDraft, draft_decoder_config

# What a run trains: the Transformer, or a shallow draft on a trained one's encoder.
Model = Transformer | ShallowDraft

Array = jax.Array


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


def init_boxed_params(model: Model, config: ml_collections.ConfigDict, rng: Array) -> Any:
  """The parameters, still wrapped in their logical axis names."""
  inputs = dummy_inputs(config)
  return model.init(rng, inputs["source"], inputs["decoder_input"])["params"]


@dataclasses.dataclass(frozen=True)
class ModelSetup:
  """A config's model and mesh, and its parameters' shapes and shardings."""

  config: ml_collections.ConfigDict
  mesh: Mesh
  rules: tuple  # logical axis rules, as flax takes them
  model: Model
  abstract_params: Any  # ShapeDtypeStructs, unboxed
  param_shardings: Any  # NamedShardings, same tree

  @property
  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.abstract_params))

  def init_params(self, rng: Array) -> Any:
    """Fresh parameters (what training starts from, the same for the same rng), initialized
    directly in their sharded places."""
    init = lambda r: nn.unbox(init_boxed_params(self.model, self.config, r))
    return jax.jit(init, out_shardings=self.param_shardings)(rng)

  def params_target(self) -> Any:
    """ShapeDtypeStructs carrying shardings: what a checkpoint's parameters restore into."""
    return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      self.abstract_params,
      self.param_shardings,
    )


def check_batch_split(config: ml_collections.ConfigDict, mesh: Mesh, rules: tuple) -> None:
  """One-line ConfigError unless an evaluation batch's rows split over the mesh."""
  row_shards = sharding.batch_row_shards(mesh, rules)
  if config.eval_batch_size % row_shards:
    raise ConfigError(
      f"eval_batch_size: {config.eval_batch_size} sentences do not split "
      f"over the {row_shards} devices a batch's rows are spread over"
    )


def setup(config: ml_collections.ConfigDict, mesh: Mesh | None = None) -> ModelSetup:
  """Builds everything but the arrays; `mesh` defaults to the config's over all devices."""
  mesh = mesh if mesh is not None else sharding.create_mesh(config)
  rules = sharding.axis_rules(config)
  check_batch_split(config, mesh, rules)
  model = build_model(config)
  boxed = jax.eval_shape(lambda rng: init_boxed_params(model, config, rng), jax.random.key(0))
  shardings = sharding.logical_to_sharding(boxed, mesh, rules)
  return ModelSetup(config, mesh, rules, model, nn.unbox(boxed), shardings)
