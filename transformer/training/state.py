"""The train state, and `setup`: the model, optimizer and sharded state shapes of a config.

Training starts with `setup(config)`: the model set-up every user of a model has
(`transformer.inference.setup`: model, mesh, rules, parameter shapes), plus the optimizer and
its state's shapes and shardings. Nothing is allocated until `init_state` or a restore.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from transformer import inference
from transformer.inference import sharding
from transformer.inference.model_setup import Model, init_boxed_params
from transformer.training.optimizer import make_optimizer

Array = jax.Array


@flax.struct.dataclass
class TrainState:
  step: Array  # train steps taken (microbatches when accumulating gradients)
  params: Any
  opt_state: Any


def init_boxed_state(model: Model, optimizer, config, rng: Array) -> TrainState:
  """The state with parameters still wrapped in their logical axis names."""
  params = init_boxed_params(model, config, rng)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


@dataclasses.dataclass(frozen=True)
class Setup:
  """A config's model set-up (`inference.ModelSetup`) plus its optimizer, and the train state's
  shapes and shardings."""

  model_setup: inference.ModelSetup
  optimizer: optax.GradientTransformation
  abstract_state: TrainState  # ShapeDtypeStructs, unboxed
  state_shardings: TrainState  # NamedShardings, same tree
  # The gradients' shardings, a tree like the parameters', where the update is split
  # over the data axis (config.shard_optimizer_state); None: as the partitioner chooses.
  grad_shardings: Any = None

  @property
  def config(self) -> ml_collections.ConfigDict:
    return self.model_setup.config

  @property
  def mesh(self) -> Mesh:
    return self.model_setup.mesh

  @property
  def rules(self) -> tuple:
    return self.model_setup.rules

  @property
  def model(self) -> Model:
    return self.model_setup.model

  @property
  def num_params(self) -> int:
    return self.model_setup.num_params

  def init_state(self, rng: Array) -> TrainState:
    """Parameters and Adam moments, initialized directly in their sharded places."""
    init = lambda r: nn.unbox(init_boxed_state(self.model, self.optimizer, self.config, r))
    return jax.jit(init, out_shardings=self.state_shardings)(rng)

  def params_target(self) -> Any:
    """The parameters' restore target alone (inference.ModelSetup's)."""
    return self.model_setup.params_target()

  def restore_target(self) -> TrainState:
    """ShapeDtypeStructs carrying shardings: what a checkpoint restores into."""
    return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      self.abstract_state,
      self.state_shardings,
    )


def setup(config: ml_collections.ConfigDict, mesh: Mesh | None = None) -> Setup:
  """Builds everything but the arrays; `mesh` defaults to the config's over all devices."""
  model_setup = inference.setup(config, mesh)
  optimizer = make_optimizer(config)
  boxed = jax.eval_shape(
    lambda rng: init_boxed_state(model_setup.model, optimizer, config, rng), jax.random.key(0)
  )
  shardings = sharding.logical_to_sharding(boxed, model_setup.mesh, model_setup.rules)
  abstract = nn.unbox(boxed)
  grad_shardings = None
  if config.shard_optimizer_state:
    # Every array of the optimizer's state is per parameter (Adam's moments, an
    # accumulated gradient) and splits over data as the gradient does; scalars (Adam's
    # count) stay replicated.
    def over_data(x, s):
      return sharding.split_over(s, x.shape, "data")

    shardings = shardings.replace(
      opt_state=jax.tree.map(over_data, abstract.opt_state, shardings.opt_state)
    )
    grad_shardings = jax.tree.map(over_data, abstract.params, shardings.params)
  return Setup(model_setup, optimizer, abstract, shardings, grad_shardings)
