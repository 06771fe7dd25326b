"""transformer/model/primitives.py: masks (causality, padding, packed segments) and
positions, seen through the model."""

from __future__ import annotations

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import numpy_reference
from tests.helpers.model_helpers import (
  BATCH,
  D_MODEL,
  POSITION_VARIANTS,
  POSITIONAL_KINDS,
  SOURCE_LEN,
  TARGET_LEN,
  VOCAB,
  example_inputs,
  other_tokens,
  packed_batch,
  random_params,
  run,
  tiny_config,
)
from transformer import config as config_lib
from transformer.inference import sharding
from transformer.model.layers import InputEmbedding
from transformer.model.primitives import BLD, Dropout, keep_mask, relu, sinusoidal_encoding
from transformer.model.transformer import Encoder


@pytest.mark.parametrize("positional, decoder_only", POSITION_VARIANTS)
def test_later_target_tokens_leave_earlier_logits_unchanged(positional, decoder_only):
  cfg = tiny_config(positional=positional, decoder_only=decoder_only)
  params = random_params(cfg)
  source, decoder_input = example_inputs(cfg)
  logits = run(cfg, params, source, decoder_input)
  for t in (0, 3):  # every (t, t') pair is checked by the gradient test below
    changed_input = decoder_input.at[:, t + 1 :].set(other_tokens(decoder_input[:, t + 1 :]))
    changed_logits = run(cfg, params, source, changed_input)
    np.testing.assert_array_equal(changed_logits[:, : t + 1], logits[:, : t + 1])
    assert not np.allclose(changed_logits[:, t + 1 :], logits[:, t + 1 :])


def logits_with_input_offsets(cfg, params, batch, source_offset_BxSxD, target_offset_BxTxD):
  """The model's logits with continuous offsets added to its input embeddings."""

  def add_offset(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if isinstance(context.module, InputEmbedding) and context.method_name == "__call__":
      is_source = isinstance(context.module.parent, Encoder)
      out = out + (source_offset_BxSxD if is_source else target_offset_BxTxD)
    return out

  with nn.intercept_methods(add_offset):
    return run(cfg, params, **batch)


def test_logit_gradients_respect_causality_padding_and_segments():
  """d logits[b, t] / d input embedding[b', t'] is exactly zero wherever attention is masked.

  Target t may depend on target t' only in the same row and segment with t' <= t, and on
  source s only in the same row and segment; padding (segment 0) reaches nothing.
  """
  cfg = tiny_config(positional="rope")
  params = random_params(cfg)
  batch = packed_batch(decoder_only=False)
  vocab_weights_V = jnp.asarray(np.random.default_rng(4).normal(size=VOCAB), jnp.float32)

  def summed_logits_BxT(source_offset, target_offset):
    logits = logits_with_input_offsets(cfg, params, batch, source_offset, target_offset)
    return logits @ vocab_weights_V

  jacobians = jax.jit(jax.jacrev(summed_logits_BxT, argnums=(0, 1)))(
    jnp.zeros((BATCH, SOURCE_LEN, D_MODEL)), jnp.zeros((BATCH, TARGET_LEN, D_MODEL))
  )
  on_source_BxTxBxS, on_target_BxTxBxT = (np.abs(np.asarray(j)).sum(-1) for j in jacobians)

  target_segments = np.asarray(batch["target_segment_ids"])
  same_row = np.eye(BATCH, dtype=bool)[:, None, :, None]
  causal = np.tril(np.ones((TARGET_LEN, TARGET_LEN), bool))[None, :, None, :]
  same_target_segment = target_segments[:, :, None, None] == target_segments[None, None]
  may_see_target = same_row & causal & same_target_segment
  real_query = target_segments != 0  # padding queries are not scored, so not checked
  assert np.all(on_target_BxTxBxT[real_query][~may_see_target[real_query]] == 0)
  assert np.all(on_target_BxTxBxT[real_query][may_see_target[real_query]] > 0)
  source_segments = np.asarray(batch["source_segment_ids"])
  may_see_source = (
    same_row
    & (target_segments[:, :, None, None] == source_segments[None, None])
    & (source_segments != 0)[None, None]
  )
  assert np.all(on_source_BxTxBxS[real_query][~may_see_source[real_query]] == 0)
  assert np.all(on_source_BxTxBxS[real_query][may_see_source[real_query]] > 0)


@pytest.mark.parametrize("positional", POSITIONAL_KINDS)
def test_tokens_marked_as_source_padding_are_invisible(positional):
  cfg = tiny_config(positional=positional)
  params = random_params(cfg)
  source, decoder_input = example_inputs(cfg)
  num_real = np.array([4, 6])
  is_real_BxS = np.arange(SOURCE_LEN)[None, :] < num_real[:, None]
  source_segment_ids = jnp.asarray(is_real_BxS, jnp.int32)
  other_source = jnp.where(is_real_BxS, source, other_tokens(source))
  zero_padded_source = jnp.where(is_real_BxS, source, 0)

  encoded = run(cfg, params, source, source_segment_ids, method="encode")
  logits = run(cfg, params, source, decoder_input, source_segment_ids=source_segment_ids)
  np.testing.assert_array_equal(
    run(cfg, params, other_source, source_segment_ids, method="encode")[is_real_BxS],
    encoded[is_real_BxS],
  )
  np.testing.assert_array_equal(
    run(cfg, params, other_source, decoder_input, source_segment_ids=source_segment_ids), logits
  )
  # Pad ids (0) with default segment ids are the same thing as explicit padding.
  np.testing.assert_array_equal(run(cfg, params, zero_padded_source, decoder_input), logits)
  # The marked positions do matter once they are real.
  assert not np.allclose(run(cfg, params, other_source, decoder_input), logits)


@pytest.mark.parametrize("positional, decoder_only", POSITION_VARIANTS)
def test_packed_segments_are_isolated_and_match_unpacked(positional, decoder_only):
  cfg = tiny_config(positional=positional, decoder_only=decoder_only)
  params = random_params(cfg)
  batch = packed_batch(decoder_only)
  logits = run(cfg, params, **batch)

  # Exact isolation: new tokens in segment 2 (both sides) leave segment 1 untouched.
  changed = dict(batch)
  in_second_target = batch["target_segment_ids"] == 2
  changed["decoder_input"] = jnp.where(
    in_second_target, other_tokens(batch["decoder_input"]), batch["decoder_input"]
  )
  if not decoder_only:
    changed["source"] = jnp.where(
      batch["source_segment_ids"] == 2, other_tokens(batch["source"]), batch["source"]
    )
  changed_logits = run(cfg, params, **changed)
  np.testing.assert_array_equal(changed_logits[0, :3], logits[0, :3])
  assert not np.allclose(changed_logits[0, 3:5], logits[0, 3:5])

  # Each packed pair gives the logits it gives alone, zero-padded, in its own row.
  source_spans, target_spans = [(0, 3), (3, 6)], [(0, 3), (3, 5)]
  alone_source = np.zeros((2, SOURCE_LEN), np.int32)
  alone_target = np.zeros((2, TARGET_LEN), np.int32)
  for row, ((s0, s1), (t0, t1)) in enumerate(zip(source_spans, target_spans)):
    if not decoder_only:
      alone_source[row, : s1 - s0] = batch["source"][0, s0:s1]
    alone_target[row, : t1 - t0] = batch["decoder_input"][0, t0:t1]
  alone_logits = run(
    cfg, params, None if decoder_only else jnp.asarray(alone_source), jnp.asarray(alone_target)
  )
  for row, (t0, t1) in enumerate(target_spans):
    np.testing.assert_allclose(logits[0, t0:t1], alone_logits[row, : t1 - t0], atol=1e-5, rtol=1e-5)


def test_sinusoidal_encoding_matches_formula():
  positions = jnp.array([[0, 1, 5, 40]])
  table = np.asarray(sinusoidal_encoding(positions, D_MODEL))[0]
  assert table.shape == (4, D_MODEL)
  np.testing.assert_allclose(table[0], [0, 1] * (D_MODEL // 2), atol=1e-7)  # sin 0, cos 0
  np.testing.assert_allclose(table[1, :2], [math.sin(1.0), math.cos(1.0)], rtol=1e-6)
  # Entry 2i uses sin, entry 2i + 1 uses cos, both of pos / 10000^(2i / d_model).
  np.testing.assert_allclose(table[2, 2:4], [math.sin(5 / 10.0), math.cos(5 / 10.0)], rtol=1e-6)
  np.testing.assert_allclose(
    table[3, 6:8], [math.sin(40 / 1000.0), math.cos(40 / 1000.0)], rtol=1e-6
  )
  np.testing.assert_allclose(
    table, numpy_reference.sinusoidal_table(41, D_MODEL)[[0, 1, 5, 40]], atol=1e-5
  )


def test_relu_and_its_gradient_are_jax_nn_relus():
  x = jnp.array([-2.0, -0.0, 0.0, 1e-30, 0.5, 3.0])
  w = jnp.arange(1.0, 7.0)
  np.testing.assert_array_equal(relu(x), jax.nn.relu(x))
  ours = jax.grad(lambda x: jnp.sum(relu(x) * w))(x)
  np.testing.assert_array_equal(ours, jax.grad(lambda x: jnp.sum(jax.nn.relu(x) * w))(x))
  np.testing.assert_array_equal(ours, [0, 0, 0, 4, 5, 6])  # 1 exactly where x > 0


def test_dropout_keeps_bits_below_the_threshold_and_scales_in_float32():
  x = jax.random.normal(jax.random.key(1), (4, 16, 32))
  key = jax.random.key(2)
  ours = Dropout(0.1).apply({}, x, False, rngs={"dropout": key})
  # flax hands a top-level module's make_rng this key folded with the call's count.
  drawn = nn.Dropout(0.1).apply({}, x, False, rngs={"dropout": key}, method=_first_rng)
  kept = jax.random.bits(drawn, x.shape, jnp.uint32) < jnp.uint32(round(0.9 * 2**32))
  np.testing.assert_array_equal(ours != 0, kept)
  np.testing.assert_array_equal(ours[kept], (x / 0.9)[kept])
  assert 0.85 < float(jnp.mean(kept)) < 0.95
  np.testing.assert_array_equal(Dropout(0.1).apply({}, x, True), x)
  half = Dropout(0.1).apply({}, x.astype(jnp.bfloat16), False, rngs={"dropout": key})
  np.testing.assert_array_equal(half != 0, kept)
  # x / 0.9 rounded once: in bf16, 1 / 0.9 would be 1.109.
  np.testing.assert_array_equal(
    half[kept], (x.astype(jnp.bfloat16).astype(jnp.float32) / 0.9).astype(jnp.bfloat16)[kept]
  )


def _first_rng(module, x, deterministic):
  return module.make_rng("dropout")


def _mask_under_mesh(key, shape, mesh_shape):
  """keep_mask of an activation [B, L, D] traced under a data x fsdp x tensor mesh of 8
  devices: (the mask, the lowered program's text, before XLA:CPU expands its random bit
  generators into arithmetic)."""
  config = config_lib.base_config()
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_shape
  mesh = sharding.create_mesh(config, jax.devices()[:8])
  rules = sharding.axis_rules(config)
  draw = sharding.with_activation_sharding(lambda key: keep_mask(key, 0.9, shape, BLD), mesh, rules)
  lowered = jax.jit(
    draw,
    in_shardings=sharding.replicated(mesh),
    out_shardings=sharding.batch_sharding(mesh, rules, ndim=3),
  ).lower(key)
  return lowered.compile()(key), lowered.as_text()


def test_rbg_masks_under_a_mesh_are_drawn_a_part_per_device():
  """XLA does not split an RngBitGenerator: each device would draw the bits of the whole
  batch. keep_mask draws each device's rows only, from a key of its own."""
  assert jax.device_count() == 8
  shape = (16, 8, 128)
  key = jax.random.key(3, impl="rbg")
  mask, hlo = _mask_under_mesh(key, shape, (4, 2, 1))
  generated = re.findall(r"rng_bit_generator .* -> \(tensor<2xui64>, tensor<([\dx]+)xui32>\)", hlo)
  assert generated == ["2x8x128"]  # 16 rows over 4 x 2 devices; not 16x8x128
  assert mask.shape == shape and mask.dtype == jnp.bool_
  assert 0.88 < float(jnp.mean(mask)) < 0.92
  parts = np.asarray(mask).reshape(8, 2, 8, 128)
  assert len({part.tobytes() for part in parts}) == 8  # each device its own bits
  np.testing.assert_array_equal(_mask_under_mesh(key, shape, (4, 2, 1))[0], mask)
  # On a tensor axis that holds the activation whole, its devices draw the same part.
  mask, hlo = _mask_under_mesh(key, shape, (2, 1, 4))
  generated = re.findall(r"rng_bit_generator .* -> \(tensor<2xui64>, tensor<([\dx]+)xui32>\)", hlo)
  assert generated == ["8x8x128"]
  halves = np.asarray(mask).reshape(2, 8, 8, 128)
  assert halves[0].tobytes() != halves[1].tobytes()
  # Threefry's bits are split by JAX itself, the same on any mesh: drawn whole.
  key = jax.random.key(3)
  np.testing.assert_array_equal(
    _mask_under_mesh(key, shape, (4, 2, 1))[0], jax.random.bernoulli(key, 0.9, shape)
  )
