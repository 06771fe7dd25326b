"""transformer/model/transformer.py: the stacks and the Transformer: shapes, logical axes,
a NumPy reference, scanned and rematerialized layers, bf16."""

from __future__ import annotations

import dataclasses
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import numpy_reference
from tests.helpers.model_helpers import (
  BATCH,
  D_MODEL,
  SOURCE_LEN,
  TARGET_LEN,
  VOCAB,
  abstract_variables,
  boxed_params,
  example_inputs,
  packed_batch,
  param_shapes,
  random_params,
  random_tokens,
  run,
  tiny_config,
)
from transformer import config as config_lib
from transformer.inference import sharding
from transformer.model import Transformer, stack_layer_params
from transformer.model.layers import Embed
from transformer.model.transformer import Decoder, Encoder


@pytest.mark.parametrize("decoder_only", [False, True], ids=["encoder_decoder", "decoder_only"])
def test_transformer_output_shapes(decoder_only):
  cfg = tiny_config(decoder_only=decoder_only)
  model = Transformer(cfg)
  source, decoder_input = example_inputs(cfg)
  logits, variables = jax.eval_shape(
    lambda key: model.init_with_output(key, source, decoder_input), jax.random.key(0)
  )
  chex.assert_shape(logits, (BATCH, TARGET_LEN, VOCAB))
  chex.assert_type(logits, jnp.float32)

  paths = param_shapes(variables)
  assert any(path.startswith("decoder/") for path in paths)
  has_encoder = any(path.startswith("encoder/") for path in paths)
  has_cross_attention = any("cross_attention" in path for path in paths)
  assert has_encoder == has_cross_attention == (not decoder_only)
  encoded = None
  if not decoder_only:
    encoded = jax.eval_shape(lambda v: model.apply(v, source, method="encode"), variables)
    chex.assert_shape(encoded, (BATCH, SOURCE_LEN, D_MODEL))
  decoded = jax.eval_shape(
    lambda v, e: model.apply(v, e, source, decoder_input, method="decode"), variables, encoded
  )
  chex.assert_shape(decoded, (BATCH, TARGET_LEN, VOCAB))
  chex.assert_type(decoded, jnp.float32)


@pytest.mark.parametrize(
  "cfg",
  [tiny_config(positional="learned"), tiny_config(norm="pre", tie_embeddings=False)],
  ids=["tied-learned", "untied-pre"],
)
def test_every_parameter_names_its_logical_axes(cfg):
  boxes = boxed_params(abstract_variables(cfg))
  assert boxes and all(isinstance(box, nn.LogicallyPartitioned) for box in boxes)
  for box in boxes:
    assert len(box.names) == box.value.ndim
    assert set(box.names) <= {"vocab", "embed", "heads", "kv", "mlp", "length"}


def test_encoder_and_decoder_output_shapes():
  cfg = tiny_config()
  source, decoder_input = example_inputs(cfg)
  source_segment_ids = jnp.ones_like(source)
  source_positions = jnp.broadcast_to(jnp.arange(SOURCE_LEN), source.shape)
  encoded, _ = jax.eval_shape(
    lambda key: Encoder(cfg, Embed(cfg)).init_with_output(
      key, source, source_segment_ids, source_positions
    ),
    jax.random.key(0),
  )
  chex.assert_shape(encoded, (BATCH, SOURCE_LEN, D_MODEL))

  logits, _ = jax.eval_shape(
    lambda key: Decoder(cfg, Embed(cfg)).init_with_output(
      key,
      decoder_input,
      jnp.ones_like(decoder_input),
      jnp.broadcast_to(jnp.arange(TARGET_LEN), decoder_input.shape),
      jnp.zeros((BATCH, SOURCE_LEN, D_MODEL)),
      source_segment_ids,
    ),
    jax.random.key(0),
  )
  chex.assert_shape(logits, (BATCH, TARGET_LEN, VOCAB))


def padded_source() -> jax.Array:
  """Row 0 has 5 real tokens then padding (id 0), row 1 has none."""
  source = random_tokens(5, (BATCH, SOURCE_LEN))
  return source.at[0, 5:].set(0)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_encoder_matches_numpy_reference(norm):
  cfg = tiny_config(norm=norm)
  params = random_params(cfg)
  source = padded_source()
  encoded = np.asarray(run(cfg, params, source, method="encode"))
  reference_params = numpy_reference.to_float64(params)
  for row in range(BATCH):
    row_source = np.asarray(source[row])
    expected = numpy_reference.encoder(reference_params, row_source, cfg)
    is_real = row_source != 0  # padding positions' own outputs are never read
    np.testing.assert_allclose(encoded[row][is_real], expected[is_real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_decoder_matches_numpy_reference(norm):
  cfg = tiny_config(norm=norm)
  params = random_params(cfg)
  source = padded_source()
  _, decoder_input = example_inputs(cfg)
  memory = jnp.asarray(
    np.random.default_rng(6).normal(size=(BATCH, SOURCE_LEN, D_MODEL)), jnp.float32
  )
  logits = np.asarray(run(cfg, params, memory, source, decoder_input, method="decode"))
  reference_params = numpy_reference.to_float64(params)
  for row in range(BATCH):
    expected = numpy_reference.decoder(
      reference_params,
      np.asarray(decoder_input[row]),
      np.asarray(memory[row], np.float64),
      np.asarray(source[row]),
      cfg,
    )
    np.testing.assert_allclose(logits[row], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_transformer_matches_numpy_reference(norm):
  cfg = tiny_config(norm=norm)
  params = random_params(cfg)
  source = padded_source()
  _, decoder_input = example_inputs(cfg)
  logits = np.asarray(run(cfg, params, source, decoder_input))
  reference_params = numpy_reference.to_float64(params)
  for row in range(BATCH):
    expected = numpy_reference.transformer(
      reference_params, np.asarray(source[row]), np.asarray(decoder_input[row]), cfg
    )
    np.testing.assert_allclose(logits[row], expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_compute_keeps_float32_params_and_logits():
  mixed = tiny_config(dtype="bfloat16", param_dtype="float32")
  param_dtypes = {
    leaf.dtype for leaf in jax.tree_util.tree_leaves(nn.unbox(abstract_variables(mixed))["params"])
  }
  assert param_dtypes == {jnp.dtype(jnp.float32)}

  params = random_params(tiny_config())
  source, decoder_input = example_inputs(mixed)
  # Compiled once: run op by op, every bfloat16 op would compile on its own.
  encoded, mixed_logits = jax.jit(
    lambda p: (run(mixed, p, source, method="encode"), run(mixed, p, source, decoder_input))
  )(params)
  # The residual stream, the encoder output among it, stays float32 in mixed precision.
  assert encoded.dtype == jnp.float32
  full_logits = run(tiny_config(), params, source, decoder_input)
  assert mixed_logits.dtype == jnp.float32
  assert np.all(np.isfinite(mixed_logits))
  assert not np.array_equal(mixed_logits, full_logits)  # bfloat16 really was used
  np.testing.assert_allclose(mixed_logits, full_logits, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("decoder_only", [False, True], ids=["encoder_decoder", "decoder_only"])
def test_scanned_layers_compute_the_same_function(decoder_only):
  looped = tiny_config(decoder_only=decoder_only, num_layers=3)
  scanned = tiny_config(decoder_only=decoder_only, num_layers=3, scan_layers=True)
  params = random_params(looped)
  stacked = stack_layer_params(params, 3)
  scanned_variables = abstract_variables(scanned)
  assert jax.tree.structure(nn.unbox(scanned_variables)["params"]) == jax.tree.structure(stacked)
  # The stacked axis is named, so the mesh rules can place it (replicated by default).
  names = {
    "/".join(str(k.key) for k in path): leaf.names
    for path, leaf in jax.tree_util.tree_leaves_with_path(
      scanned_variables["params"], is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )
  }
  assert names["decoder/layers/ffn/wi/kernel"] == ("layers", "embed", "mlp")
  source, decoder_input = example_inputs(looped)

  def loss(cfg, p):
    return jnp.sum(run(cfg, p, source, decoder_input) ** 2)

  np.testing.assert_allclose(
    run(scanned, stacked, source, decoder_input),
    run(looped, params, source, decoder_input),
    rtol=1e-5,
    atol=1e-5,
  )
  looped_grads = stack_layer_params(jax.grad(functools.partial(loss, looped))(params), 3)
  scanned_grads = jax.grad(functools.partial(loss, scanned))(stacked)
  chex.assert_trees_all_close(scanned_grads, looped_grads, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scan_layers", [False, True], ids=["looped", "scanned"])
@pytest.mark.parametrize("remat", ["full", "dots", "dots_no_batch"])
def test_remat_keeps_values_and_gradients(scan_layers, remat):
  plain = tiny_config(scan_layers=scan_layers)
  rematted = tiny_config(scan_layers=scan_layers, remat=remat)
  params = random_params(plain)
  source, decoder_input = example_inputs(plain)

  def loss(cfg, p):  # dropout on: remat must replay the same masks in the backward pass
    logits = run(
      cfg, p, source, decoder_input, deterministic=False, rngs={"dropout": jax.random.key(3)}
    )
    return jnp.sum(logits**2)

  plain_cfg = dataclasses.replace(plain, dropout_rate=0.2)
  rematted_cfg = dataclasses.replace(rematted, dropout_rate=0.2)
  # The same float32 sums in another order: each gradient is off by a few units in the
  # last place of its parameter's largest entries, which an entry that cancels to near 0
  # shows in full (one of -0.03 beside 24.6 moved 9e-6). So the bound scales with each
  # parameter's largest gradient, not each entry's own (a per-entry 1e-5 was 86% used on
  # one CPU). Measured: 4e-7 of that scale; other dropout masks move gradients 2e5 times
  # the bound.
  jax.tree.map(
    lambda got, want: np.testing.assert_allclose(
      got, want, rtol=0, atol=1e-5 * (1 + np.abs(want).max())
    ),
    jax.grad(functools.partial(loss, rematted_cfg))(params),
    jax.grad(functools.partial(loss, plain_cfg))(params),
  )


def test_scanned_program_size_does_not_grow_with_depth():
  """What keeps compile time flat: one layer body in the program whatever N is."""

  def program_size(num_layers, scan_layers):
    cfg = tiny_config(num_layers=num_layers, scan_layers=scan_layers)
    source, decoder_input = example_inputs(cfg)
    params = nn.unbox(abstract_variables(cfg))["params"]
    grad = jax.jit(jax.grad(lambda p: jnp.sum(run(cfg, p, source, decoder_input))))
    return len(grad.lower(params).as_text())

  assert program_size(12, True) < 1.05 * program_size(2, True)
  assert program_size(12, False) > 3 * program_size(2, False)


def _layer_gradients(cfg, mesh_shape):
  """Each stacked layer parameter's gradient and its placement, from one jitted grad on a
  mesh of mesh_shape with the axis rules in context and every input replicated."""
  mesh = jax.sharding.Mesh(np.reshape(jax.devices(), mesh_shape), config_lib.MESH_AXES)
  rules = config_lib.logical_axis_rules()
  params, batch = random_params(cfg), packed_batch(decoder_only=False)
  loss = lambda p, b: jnp.sum(run(cfg, p, **b) ** 2)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  grads = jax.jit(jax.grad(sharding.with_activation_sharding(loss, mesh, rules)))(
    jax.device_put(params, replicated), jax.device_put(batch, replicated)
  )
  return mesh, {
    jax.tree_util.keystr(path): leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads)
    if "['layers']" in jax.tree_util.keystr(path)
  }


def test_scanned_layers_split_their_gradients_over_data_as_the_optimizer_state_is():
  """split_layer_grads (config.shard_optimizer_state): on an all data-parallel mesh each
  layer's gradient leaves the layer loop split over data, by the rule that splits the
  optimizer's state (run/sharding.py: split_over on the stacked shape), with the same
  values and the same parameters as without it; on a mesh with fsdp it changes nothing."""
  cfg = tiny_config(scan_layers=True, d_model=16, d_ff=32)
  split_cfg = dataclasses.replace(cfg, split_layer_grads=True)
  mesh, plain = _layer_gradients(cfg, (8, 1, 1))
  _, split = _layer_gradients(split_cfg, (8, 1, 1))
  assert split.keys() == plain.keys() and len(split) > 10
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  for name, grad in split.items():
    # The same sums in another order: equal to float32 rounding, in the whole array's norm.
    error = np.linalg.norm(np.asarray(grad) - plain[name]) / np.linalg.norm(plain[name])
    assert error <= 1e-5, f"{name}: relative error {error:.1e}"
    assert plain[name].sharding.spec == jax.sharding.PartitionSpec(), name
    want = sharding.split_over(replicated, grad.shape, "data")
    assert grad.sharding.is_equivalent_to(want, grad.ndim), (name, grad.sharding.spec, want.spec)
  assert any("data" in jax.tree.leaves(tuple(g.sharding.spec)) for g in split.values())
  # The parameters themselves, their names and initial values, are the same.
  chex.assert_trees_all_equal(random_params(split_cfg), random_params(cfg))
  init = lambda c: Transformer(c).init(jax.random.key(0), **packed_batch(False))
  chex.assert_trees_all_equal(init(split_cfg), init(cfg))
  # Cached decoding (the cache collection passes the wrapper) is unchanged too.
  from transformer.model import decoding

  source = jnp.array([[5, 6, 7, config_lib.EOS_ID]], jnp.int32)
  searched = [
    decoding.decode(
      Transformer(c),
      random_params(cfg),
      decoding.translation_prompts(source, 6, False),
      decoding.BeamSearch(beam_size=2, alpha=0.6),
    )
    for c in (cfg, split_cfg)
  ]
  np.testing.assert_array_equal(searched[1].tokens_BxO, searched[0].tokens_BxO)
  np.testing.assert_array_equal(searched[1].scores_B, searched[0].scores_B)
  # Beside fsdp the layers' parameters are not whole on every device: left as they were.
  _, with_fsdp = _layer_gradients(split_cfg, (4, 2, 1))
  _, plain_fsdp = _layer_gradients(cfg, (4, 2, 1))
  for name, grad in with_fsdp.items():
    assert grad.sharding.is_equivalent_to(plain_fsdp[name].sharding, grad.ndim), name
