"""`setup(config, mesh)`: the model, the optimizer, and the train state's shapes and
shardings; `init_state` and `restore_target` place arrays exactly as those say."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from transformer import config as config_lib
from transformer.inference import model_setup, sharding
from transformer.model import Transformer
from transformer.training import state

VOCAB, D_MODEL, D_FF, HEADS, D_K, D_V = 32, 16, 24, 4, 4, 6  # d_k != d_v on purpose


def tiny_config(**overrides):
  config = config_lib.base_config()
  config_lib.apply_overrides(
    config,
    {
      "vocab_size": VOCAB,
      "max_len": 8,
      "model.num_layers": 1,
      "model.d_model": D_MODEL,
      "model.d_ff": D_FF,
      "model.num_heads": HEADS,
      "model.d_k": D_K,
      "model.d_v": D_V,
      **overrides,
    },
  )
  return config


def one_device_setup(config):
  return state.setup(config, sharding.create_mesh(config, jax.devices()[:1]))


def hand_param_count(decoder_only=False):
  """Parameters of a one-layer post-LN model with a tied embedding, from the paper's shapes."""
  d, f, h, k, e = D_MODEL, D_FF, HEADS, D_K, D_V
  layer_norm = 2 * d  # scale and bias
  self_attention = d * h * (k + k + e) + h * e * d  # W_Q, W_K, W_V, then W_O
  cross_attention = d * h * k + d * h * (k + e) + h * e * d
  ffn = d * f + f + f * d + d  # W_1, b_1, W_2, b_2
  encoder_layer = self_attention + ffn + 2 * layer_norm
  decoder_layer = self_attention + ffn + 2 * layer_norm
  if not decoder_only:
    decoder_layer += cross_attention + layer_norm
  return VOCAB * d + decoder_layer + (0 if decoder_only else encoder_layer)


@pytest.mark.parametrize("decoder_only", [False, True])
def test_num_params_matches_the_hand_count_and_the_initialized_params(decoder_only):
  run = one_device_setup(tiny_config(**{"model.decoder_only": decoder_only}))
  assert run.num_params == hand_param_count(decoder_only)
  params = run.init_state(jax.random.key(0)).params
  assert run.num_params == sum(x.size for x in jax.tree.leaves(params))
  assert ("encoder" in params) == (not decoder_only)


def test_build_model_and_dummy_inputs_follow_the_config():
  """The model reads config.model; dummy inputs drop the source for a decoder-only model."""
  config = tiny_config(**{"model.activation": "swiglu", "model.norm": "pre"})
  model = model_setup.build_model(config)
  assert isinstance(model, Transformer)
  cfg = model.config
  assert (cfg.vocab_size, cfg.num_layers, cfg.d_model, cfg.d_ff) == (VOCAB, 1, D_MODEL, D_FF)
  assert (cfg.num_heads, cfg.d_k, cfg.d_v) == (HEADS, D_K, D_V)
  assert (cfg.activation, cfg.norm) == ("swiglu", "pre")
  inputs = model_setup.dummy_inputs(config)
  assert inputs["source"].shape == (1, 8) and inputs["decoder_input"].shape == (1, 8)
  assert inputs["source"].dtype == jnp.int32
  config.model.decoder_only = True
  inputs = model_setup.dummy_inputs(config)
  assert inputs["source"] is None and inputs["decoder_input"].shape == (1, 8)


def test_abstract_state_is_shapes_only_and_mirrors_the_params():
  """Nothing is allocated by setup; Adam's moments have the parameters' shapes."""
  run = one_device_setup(tiny_config())
  leaves = jax.tree.leaves(run.abstract_state)
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  assert run.abstract_state.step.shape == () and run.abstract_state.step.dtype == jnp.int32
  embedding = run.abstract_state.params["shared_embedding"]["embedding"]
  assert embedding.shape == (VOCAB, D_MODEL)
  assert jax.tree.structure(run.state_shardings) == jax.tree.structure(run.abstract_state)
  param_shapes = [x.shape for x in jax.tree.leaves(run.abstract_state.params)]
  moment_shapes = [x.shape for x in jax.tree.leaves(run.abstract_state.opt_state) if x.ndim]
  assert sorted(moment_shapes) == sorted(param_shapes * 2)  # mu and nu


def test_setup_defaults_to_the_configs_mesh_over_all_devices():
  run = state.setup(tiny_config(**{"mesh.data": 2, "mesh.fsdp": -1, "mesh.tensor": 2}))
  assert dict(run.mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert run.rules == sharding.axis_rules(run.config)


def test_init_state_places_every_array_as_state_shardings_say():
  config = tiny_config(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
  run = state.setup(config, sharding.create_mesh(config))
  train_state = run.init_state(jax.random.key(0))
  assert jax.tree.structure(train_state) == jax.tree.structure(run.state_shardings)
  for x, s, abstract in zip(
    jax.tree.leaves(train_state),
    jax.tree.leaves(run.state_shardings),
    jax.tree.leaves(run.abstract_state),
  ):
    assert x.sharding == s
    assert (x.shape, x.dtype) == (abstract.shape, abstract.dtype)
  assert int(train_state.step) == 0
  moments = [x for x in jax.tree.leaves(train_state.opt_state) if x.ndim]
  assert all(not np.any(np.asarray(m)) for m in moments)  # Adam starts from zero moments


def test_init_state_depends_on_the_rng_only():
  run = one_device_setup(tiny_config())
  first, again = run.init_state(jax.random.key(3)), run.init_state(jax.random.key(3))
  other = run.init_state(jax.random.key(4))
  embedding = lambda s: np.asarray(s.params["shared_embedding"]["embedding"])
  np.testing.assert_array_equal(embedding(first), embedding(again))
  assert not np.allclose(embedding(first), embedding(other))


def test_restore_target_carries_the_abstract_shapes_and_the_shardings():
  config = tiny_config(**{"mesh.data": 1, "mesh.fsdp": 2, "mesh.tensor": 4})
  run = state.setup(config, sharding.create_mesh(config))
  target = run.restore_target()
  assert jax.tree.structure(target) == jax.tree.structure(run.abstract_state)
  for x, abstract, s in zip(
    jax.tree.leaves(target),
    jax.tree.leaves(run.abstract_state),
    jax.tree.leaves(run.state_shardings),
  ):
    assert isinstance(x, jax.ShapeDtypeStruct)
    assert (x.shape, x.dtype) == (abstract.shape, abstract.dtype)
    assert x.sharding == s


def test_fsdp_tensor_mesh_shards_parameters_by_the_logical_rules():
  """embedding (vocab, embed) -> (tensor, fsdp); W_1 (embed, mlp) -> (fsdp, tensor);
  the step counter has no logical names and is replicated."""
  config = tiny_config(**{"mesh.data": 1, "mesh.fsdp": 2, "mesh.tensor": 4})
  run = state.setup(config, sharding.create_mesh(config))
  params = run.state_shardings.params
  embedding = params["shared_embedding"]["embedding"]
  assert embedding.spec == PartitionSpec("tensor", "fsdp")
  assert params["encoder"]["layer_0"]["ffn"]["wi"]["kernel"].spec == PartitionSpec("fsdp", "tensor")
  assert params["encoder"]["layer_0"]["ffn"]["wo"]["kernel"].spec == PartitionSpec("tensor", "fsdp")
  assert run.state_shardings.step.spec == PartitionSpec()
  train_state = run.init_state(jax.random.key(0))
  shard = train_state.params["shared_embedding"]["embedding"].addressable_shards[0]
  assert shard.data.shape == (VOCAB // 4, D_MODEL // 2)
  # Adam's moments of the embedding are split the same way as the embedding.
  moments = {
    jax.tree_util.keystr(path): s.spec
    for path, s in jax.tree_util.tree_leaves_with_path(run.state_shardings.opt_state)
    if jax.tree_util.keystr(path).endswith("['shared_embedding']['embedding']")
  }
  assert len(moments) == 2  # mu and nu
  assert set(moments.values()) == {PartitionSpec("tensor", "fsdp")}


def test_other_rules_give_other_shardings():
  """The shardings come from config.logical_axis_rules, not from fixed names."""
  config = tiny_config(**{"mesh.data": 1, "mesh.fsdp": 2, "mesh.tensor": 4})
  config.logical_axis_rules = [
    ("vocab", None) if r[0] == "vocab" else ("embed", "tensor") if r[0] == "embed" else r
    for r in config.logical_axis_rules
  ]
  run = state.setup(config, sharding.create_mesh(config))
  embedding = run.state_shardings.params["shared_embedding"]["embedding"]
  assert embedding.spec == PartitionSpec(None, "tensor")
