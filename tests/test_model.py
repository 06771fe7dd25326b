"""Tests for transformer/model.py, on configurations tiny enough for a CPU.

Parameters are drawn with NumPy into the tree `init` would build (found with
`jax.eval_shape`, which compiles nothing): far cheaper than `init` on a CPU, and the
LayerNorm scales and biases are not their trivial initial values, so the comparisons
against `numpy_reference` exercise them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_reference
from transformer.model import ModelConfig, Transformer, stack_layer_params
from transformer.model.attention import MultiHeadAttention
from transformer.model.layers import (DecoderLayer, Embed, FeedForward, InputEmbedding,
                                      tied_projection)
from transformer.model.primitives import attention_mask, sinusoidal_encoding
from transformer.model.transformer import Decoder, Encoder

BATCH, SOURCE_LEN, TARGET_LEN = 2, 7, 6
VOCAB, D_MODEL, NUM_HEADS, D_K, D_V, D_FF = 13, 8, 2, 4, 6, 12  # d_k != d_v on purpose
POSITIONAL_KINDS = ("sinusoidal", "learned", "rope")
# Every position kind with an encoder, and the decoder-only model with rope.
POSITION_VARIANTS = [
    pytest.param("sinusoidal", False, id="sinusoidal"),
    pytest.param("learned", False, id="learned"),
    pytest.param("rope", False, id="rope"),
    pytest.param("rope", True, id="rope-decoder_only"),
]


def tiny_config(**overrides) -> ModelConfig:
  fields = dict(vocab_size=VOCAB, max_position=16, num_layers=2, d_model=D_MODEL, d_ff=D_FF,
                num_heads=NUM_HEADS, d_k=D_K, d_v=D_V)
  fields.update(overrides)
  return ModelConfig(**fields)


def random_tokens(seed: int, shape) -> jax.Array:
  """Ids in [1, VOCAB): never padding."""
  return jnp.asarray(np.random.default_rng(seed).integers(1, VOCAB, size=shape), jnp.int32)


def other_tokens(ids: jax.Array) -> jax.Array:
  """Different ids at every position, still in [1, VOCAB)."""
  return ids % (VOCAB - 1) + 1


def example_inputs(cfg: ModelConfig):
  source = None if cfg.decoder_only else random_tokens(0, (BATCH, SOURCE_LEN))
  return source, random_tokens(1, (BATCH, TARGET_LEN))


def abstract_variables(cfg: ModelConfig):
  """What `init` returns (boxed), as shapes and dtypes only."""
  return jax.eval_shape(Transformer(cfg).init, jax.random.key(0), *example_inputs(cfg))


def random_params(cfg: ModelConfig, seed: int = 0):
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    values = rng.normal(scale=0.3, size=leaf.shape)
    if path[-1].key == "scale":  # LayerNorm gains around 1
      values += 1.0
    return jnp.asarray(values, leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, nn.unbox(abstract_variables(cfg))["params"])


def run(cfg: ModelConfig, params, *args, **kwargs):
  return Transformer(cfg).apply({"params": params}, *args, **kwargs)


def boxed_params(variables) -> list[nn.LogicallyPartitioned]:
  return jax.tree_util.tree_leaves(variables["params"],
                                   is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def param_shapes(variables) -> dict[str, tuple[int, ...]]:
  """{"decoder/layer_0/ffn/wi/kernel": (D, F), ...}."""
  leaves = jax.tree_util.tree_leaves_with_path(nn.unbox(variables["params"]))
  return {"/".join(str(key.key) for key in path): leaf.shape for path, leaf in leaves}


def packed_batch(decoder_only: bool):
  """Row 0 packs two sentence pairs and ends in padding; row 1 holds one padded pair.

  Row 0: source segments [1 1 1 2 2 2 0], target segments [1 1 1 2 2 0]; positions
  restart at 0 in every segment.
  """
  source_segment_ids = jnp.array([[1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 0, 0]], jnp.int32)
  source_positions = jnp.array([[0, 1, 2, 0, 1, 2, 0], [0, 1, 2, 3, 4, 0, 0]], jnp.int32)
  target_segment_ids = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]], jnp.int32)
  target_positions = jnp.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]], jnp.int32)
  batch = dict(decoder_input=random_tokens(3, (BATCH, TARGET_LEN)),
               target_segment_ids=target_segment_ids, target_positions=target_positions)
  if decoder_only:
    batch["source"] = None
  else:
    batch.update(source=random_tokens(2, (BATCH, SOURCE_LEN)),
                 source_segment_ids=source_segment_ids, source_positions=source_positions)
  return batch


# ----------------------------------------------------------------------------------
# Shapes and parameters (abstract evaluation: nothing is compiled).


@pytest.mark.parametrize("decoder_only", [False, True], ids=["encoder_decoder", "decoder_only"])
def test_transformer_output_shapes(decoder_only):
  cfg = tiny_config(decoder_only=decoder_only)
  model = Transformer(cfg)
  source, decoder_input = example_inputs(cfg)
  logits, variables = jax.eval_shape(
      lambda key: model.init_with_output(key, source, decoder_input), jax.random.key(0))
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
      lambda v, e: model.apply(v, e, source, decoder_input, method="decode"), variables, encoded)
  chex.assert_shape(decoded, (BATCH, TARGET_LEN, VOCAB))
  chex.assert_type(decoded, jnp.float32)


@pytest.mark.parametrize("cfg", [tiny_config(positional="learned"),
                                 tiny_config(norm="pre", tie_embeddings=False)],
                         ids=["tied-learned", "untied-pre"])
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
          key, source, source_segment_ids, source_positions), jax.random.key(0))
  chex.assert_shape(encoded, (BATCH, SOURCE_LEN, D_MODEL))

  logits, _ = jax.eval_shape(
      lambda key: Decoder(cfg, Embed(cfg)).init_with_output(
          key, decoder_input, jnp.ones_like(decoder_input),
          jnp.broadcast_to(jnp.arange(TARGET_LEN), decoder_input.shape),
          jnp.zeros((BATCH, SOURCE_LEN, D_MODEL)), source_segment_ids), jax.random.key(0))
  chex.assert_shape(logits, (BATCH, TARGET_LEN, VOCAB))


@pytest.mark.parametrize("self_attention, expected_params", [
    (True, {"qkv/kernel": (D_MODEL, NUM_HEADS, 2 * D_K + D_V),
            "out/kernel": (NUM_HEADS, D_V, D_MODEL)}),
    (False, {"query/kernel": (D_MODEL, NUM_HEADS, D_K),
             "kv/kernel": (D_MODEL, NUM_HEADS, D_K + D_V),
             "out/kernel": (NUM_HEADS, D_V, D_MODEL)}),
], ids=["self", "cross"])
def test_attention_output_and_projection_shapes(self_attention, expected_params):
  cfg = tiny_config()
  queries_BxTxD = jnp.zeros((BATCH, TARGET_LEN, D_MODEL))
  memory_BxSxD = jnp.zeros((BATCH, SOURCE_LEN, D_MODEL))
  kv_len = TARGET_LEN if self_attention else SOURCE_LEN
  mask = attention_mask(jnp.ones((BATCH, TARGET_LEN), jnp.int32),
                        jnp.ones((BATCH, kv_len), jnp.int32), causal=self_attention)
  kwargs = {} if self_attention else {"memory_BxSxD": memory_BxSxD}
  out, variables = jax.eval_shape(
      lambda key: MultiHeadAttention(cfg, self_attention=self_attention).init_with_output(
          key, queries_BxTxD, mask, **kwargs), jax.random.key(0))
  chex.assert_shape(out, (BATCH, TARGET_LEN, D_MODEL))
  assert param_shapes(variables) == expected_params


@pytest.mark.parametrize("activation, expected_params", [
    ("relu", {"wi/kernel": (D_MODEL, D_FF), "wi/bias": (D_FF,), "wo/kernel": (D_FF, D_MODEL),
              "wo/bias": (D_MODEL,)}),
    ("gelu", {"wi/kernel": (D_MODEL, D_FF), "wi/bias": (D_FF,), "wo/kernel": (D_FF, D_MODEL),
              "wo/bias": (D_MODEL,)}),
    ("swiglu", {"wi_gate/kernel": (D_MODEL, D_FF), "wi_up/kernel": (D_MODEL, D_FF),
                "wo/kernel": (D_FF, D_MODEL)}),
], ids=["relu", "gelu", "swiglu"])
def test_feed_forward_shapes(activation, expected_params):
  cfg = tiny_config(activation=activation)
  out, variables = jax.eval_shape(
      lambda key: FeedForward(cfg).init_with_output(key, jnp.zeros((BATCH, TARGET_LEN, D_MODEL))),
      jax.random.key(0))
  chex.assert_shape(out, (BATCH, TARGET_LEN, D_MODEL))
  assert param_shapes(variables) == expected_params


# ----------------------------------------------------------------------------------
# Nothing flows where the masks forbid it.


@pytest.mark.parametrize("positional, decoder_only", POSITION_VARIANTS)
def test_later_target_tokens_leave_earlier_logits_unchanged(positional, decoder_only):
  cfg = tiny_config(positional=positional, decoder_only=decoder_only)
  params = random_params(cfg)
  source, decoder_input = example_inputs(cfg)
  logits = run(cfg, params, source, decoder_input)
  for t in (0, 3):  # every (t, t') pair is checked by the gradient test below
    changed_input = decoder_input.at[:, t + 1:].set(other_tokens(decoder_input[:, t + 1:]))
    changed_logits = run(cfg, params, source, changed_input)
    np.testing.assert_array_equal(changed_logits[:, :t + 1], logits[:, :t + 1])
    assert not np.allclose(changed_logits[:, t + 1:], logits[:, t + 1:])


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
      jnp.zeros((BATCH, SOURCE_LEN, D_MODEL)), jnp.zeros((BATCH, TARGET_LEN, D_MODEL)))
  on_source_BxTxBxS, on_target_BxTxBxT = (np.abs(np.asarray(j)).sum(-1) for j in jacobians)

  target_segments = np.asarray(batch["target_segment_ids"])
  same_row = np.eye(BATCH, dtype=bool)[:, None, :, None]
  causal = np.tril(np.ones((TARGET_LEN, TARGET_LEN), bool))[None, :, None, :]
  same_target_segment = (target_segments[:, :, None, None] == target_segments[None, None])
  may_see_target = same_row & causal & same_target_segment
  real_query = target_segments != 0  # padding queries are not scored, so not checked
  assert np.all(on_target_BxTxBxT[real_query][~may_see_target[real_query]] == 0)
  assert np.all(on_target_BxTxBxT[real_query][may_see_target[real_query]] > 0)
  source_segments = np.asarray(batch["source_segment_ids"])
  may_see_source = (same_row & (target_segments[:, :, None, None] == source_segments[None, None])
                    & (source_segments != 0)[None, None])
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
      encoded[is_real_BxS])
  np.testing.assert_array_equal(
      run(cfg, params, other_source, decoder_input, source_segment_ids=source_segment_ids),
      logits)
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
  changed["decoder_input"] = jnp.where(in_second_target, other_tokens(batch["decoder_input"]),
                                       batch["decoder_input"])
  if not decoder_only:
    changed["source"] = jnp.where(batch["source_segment_ids"] == 2,
                                  other_tokens(batch["source"]), batch["source"])
  changed_logits = run(cfg, params, **changed)
  np.testing.assert_array_equal(changed_logits[0, :3], logits[0, :3])
  assert not np.allclose(changed_logits[0, 3:5], logits[0, 3:5])

  # Each packed pair gives the logits it gives alone, zero-padded, in its own row.
  source_spans, target_spans = [(0, 3), (3, 6)], [(0, 3), (3, 5)]
  alone_source = np.zeros((2, SOURCE_LEN), np.int32)
  alone_target = np.zeros((2, TARGET_LEN), np.int32)
  for row, ((s0, s1), (t0, t1)) in enumerate(zip(source_spans, target_spans)):
    if not decoder_only:
      alone_source[row, :s1 - s0] = batch["source"][0, s0:s1]
    alone_target[row, :t1 - t0] = batch["decoder_input"][0, t0:t1]
  alone_logits = run(cfg, params, None if decoder_only else jnp.asarray(alone_source),
                     jnp.asarray(alone_target))
  for row, (t0, t1) in enumerate(target_spans):
    np.testing.assert_allclose(logits[0, t0:t1], alone_logits[row, :t1 - t0], atol=1e-5,
                               rtol=1e-5)


# ----------------------------------------------------------------------------------
# The paper's equations, in NumPy.


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
  memory = jnp.asarray(np.random.default_rng(6).normal(size=(BATCH, SOURCE_LEN, D_MODEL)),
                       jnp.float32)
  logits = np.asarray(run(cfg, params, memory, source, decoder_input, method="decode"))
  reference_params = numpy_reference.to_float64(params)
  for row in range(BATCH):
    expected = numpy_reference.decoder(reference_params, np.asarray(decoder_input[row]),
                                       np.asarray(memory[row], np.float64),
                                       np.asarray(source[row]), cfg)
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
    expected = numpy_reference.transformer(reference_params, np.asarray(source[row]),
                                           np.asarray(decoder_input[row]), cfg)
    np.testing.assert_allclose(logits[row], expected, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------
# Cached decoding.


@pytest.mark.parametrize("positional, decoder_only", POSITION_VARIANTS)
def test_cached_decoding_matches_full_forward_pass(positional, decoder_only):
  cfg = tiny_config(positional=positional, decoder_only=decoder_only)
  params = random_params(cfg)
  source, decoder_input = example_inputs(cfg)
  if not decoder_only:
    source = source.at[0, 4:].set(0)  # padding must stay masked in cached cross-attention
  full_logits = run(cfg, params, source, decoder_input)

  encoded = None if decoder_only else run(cfg, params, source, method="encode")
  _, state = run(cfg, params, encoded, source, jnp.zeros((BATCH, TARGET_LEN), jnp.int32),
                 use_cache=True, mutable=["cache"], method="decode")
  for t in range(TARGET_LEN):
    step_logits, state = Transformer(cfg).apply(
        {"params": params, "cache": state["cache"]}, encoded, source, decoder_input[:, t:t + 1],
        use_cache=True, mutable=["cache"], method="decode")
    assert step_logits.shape == (BATCH, 1, VOCAB)
    np.testing.assert_allclose(step_logits[:, 0], full_logits[:, t], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------
# Embeddings, positions and the tied output projection.


def test_sinusoidal_encoding_matches_formula():
  positions = jnp.array([[0, 1, 5, 40]])
  table = np.asarray(sinusoidal_encoding(positions, D_MODEL))[0]
  assert table.shape == (4, D_MODEL)
  np.testing.assert_allclose(table[0], [0, 1] * (D_MODEL // 2), atol=1e-7)  # sin 0, cos 0
  np.testing.assert_allclose(table[1, :2], [math.sin(1.0), math.cos(1.0)], rtol=1e-6)
  # Entry 2i uses sin, entry 2i + 1 uses cos, both of pos / 10000^(2i / d_model).
  np.testing.assert_allclose(table[2, 2:4], [math.sin(5 / 10.0), math.cos(5 / 10.0)], rtol=1e-6)
  np.testing.assert_allclose(table[3, 6:8], [math.sin(40 / 1000.0), math.cos(40 / 1000.0)],
                             rtol=1e-6)
  np.testing.assert_allclose(table, numpy_reference.sinusoidal_table(41, D_MODEL)[[0, 1, 5, 40]],
                             atol=1e-5)


@pytest.mark.parametrize("positional", POSITIONAL_KINDS)
def test_input_embedding_is_scaled_token_embedding_plus_position(positional):
  cfg = tiny_config(positional=positional)
  params = random_params(cfg)
  if positional == "learned":  # a zero table leaves the scaled token embedding alone
    params["encoder"]["input"]["position_embedding"] = jnp.zeros((cfg.max_position, D_MODEL))
  source, decoder_input = example_inputs(cfg)
  _, state = run(cfg, params, source, decoder_input, mutable=["intermediates"],
                 capture_intermediates=lambda module, _: isinstance(module, InputEmbedding))
  embedded = np.asarray(state["intermediates"]["encoder"]["input"]["__call__"][0])

  expected = np.asarray(params["shared_embedding"]["embedding"])[np.asarray(source)]
  expected = expected * math.sqrt(D_MODEL)
  if positional == "sinusoidal":
    expected = expected + numpy_reference.sinusoidal_table(SOURCE_LEN, D_MODEL)[None]
  np.testing.assert_allclose(embedded, expected, atol=1e-5, rtol=1e-5)


def final_decoder_state(cfg, params, source, decoder_input):
  """The decoder's last hidden state [B, T, D], just before the output projection."""
  _, state = run(cfg, params, source, decoder_input, mutable=["intermediates"],
                 capture_intermediates=lambda module, _: isinstance(module, (DecoderLayer,
                                                                             nn.LayerNorm)))
  decoder = state["intermediates"]["decoder"]
  last = decoder["final_norm"] if cfg.norm == "pre" else decoder[f"layer_{cfg.num_layers - 1}"]
  return np.asarray(last["__call__"][0])


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_output_projection_is_the_shared_embedding(norm):
  cfg = tiny_config(norm=norm)
  variables = abstract_variables(cfg)
  vocab_params = [path for path, box in zip(param_shapes(variables), boxed_params(variables))
                  if "vocab" in box.names]
  assert vocab_params == ["shared_embedding/embedding"]  # the only [V, D] matrix

  params = random_params(cfg)
  source, decoder_input = example_inputs(cfg)
  embedding_VxD = np.asarray(params["shared_embedding"]["embedding"])
  logits = np.asarray(run(cfg, params, source, decoder_input))
  hidden = final_decoder_state(cfg, params, source, decoder_input)
  np.testing.assert_allclose(logits, hidden @ embedding_VxD.T, atol=1e-5, rtol=1e-5)

  # A token absent from the inputs: its row moves that token's logit and nothing else.
  unused = int(np.setdiff1d(np.arange(1, VOCAB), np.concatenate(
      [np.asarray(source).ravel(), np.asarray(decoder_input).ravel()]))[0])
  shift_D = jnp.asarray(np.random.default_rng(7).normal(size=D_MODEL), jnp.float32)
  moved = dict(params, shared_embedding={"embedding": params["shared_embedding"]["embedding"]
                                         .at[unused].add(shift_D)})
  moved_logits = np.asarray(run(cfg, moved, source, decoder_input))
  others = np.arange(VOCAB) != unused
  np.testing.assert_array_equal(moved_logits[..., others], logits[..., others])
  assert not np.allclose(moved_logits[..., unused], logits[..., unused])
  # A token in the source: its row moves the encoder's input.
  used = int(source[0, 0])
  moved = dict(params, shared_embedding={"embedding": params["shared_embedding"]["embedding"]
                                         .at[used].add(shift_D)})
  assert not np.allclose(run(cfg, moved, source, method="encode"),
                         run(cfg, params, source, method="encode"))


def test_untied_embeddings_are_three_matrices():
  cfg = tiny_config(tie_embeddings=False)
  shapes = param_shapes(abstract_variables(cfg))
  assert shapes["source_embedding/embedding"] == (VOCAB, D_MODEL)
  assert shapes["target_embedding/embedding"] == (VOCAB, D_MODEL)
  assert shapes["decoder/output_projection/kernel"] == (D_MODEL, VOCAB)
  assert not any(path.startswith("shared_embedding") for path in shapes)

  params = random_params(cfg)
  source, decoder_input = example_inputs(cfg)
  logits = np.asarray(run(cfg, params, source, decoder_input))
  hidden = final_decoder_state(cfg, params, source, decoder_input)
  output_projection_DxV = np.asarray(params["decoder"]["output_projection"]["kernel"])
  np.testing.assert_allclose(logits, hidden @ output_projection_DxV, atol=1e-5, rtol=1e-5)
  encoded = run(cfg, params, source, method="encode")
  # Random shifts: a shift that is the same in every dimension would vanish in LayerNorm.
  shift_VxD = jnp.asarray(np.random.default_rng(8).normal(size=(VOCAB, D_MODEL)), jnp.float32)
  moved_target = dict(params, target_embedding={
      "embedding": params["target_embedding"]["embedding"] + shift_VxD})
  np.testing.assert_array_equal(run(cfg, moved_target, source, method="encode"), encoded)
  assert not np.allclose(run(cfg, moved_target, source, decoder_input), logits)
  moved_source = dict(params, source_embedding={
      "embedding": params["source_embedding"]["embedding"] + shift_VxD})
  assert not np.allclose(run(cfg, moved_source, source, method="encode"), encoded)


# ----------------------------------------------------------------------------------
# Mixed precision and dropout.


def test_bfloat16_compute_keeps_float32_params_and_logits():
  mixed = tiny_config(dtype="bfloat16", param_dtype="float32")
  param_dtypes = {leaf.dtype for leaf in jax.tree_util.tree_leaves(
      nn.unbox(abstract_variables(mixed))["params"])}
  assert param_dtypes == {jnp.dtype(jnp.float32)}

  params = random_params(tiny_config())
  source, decoder_input = example_inputs(mixed)
  # Compiled once: run op by op, every bfloat16 op would compile on its own.
  encoded, mixed_logits = jax.jit(lambda p: (run(mixed, p, source, method="encode"),
                                             run(mixed, p, source, decoder_input)))(params)
  assert encoded.dtype == jnp.bfloat16
  full_logits = run(tiny_config(), params, source, decoder_input)
  assert mixed_logits.dtype == jnp.float32
  assert np.all(np.isfinite(mixed_logits))
  assert not np.array_equal(mixed_logits, full_logits)  # bfloat16 really was used
  np.testing.assert_allclose(mixed_logits, full_logits, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("dropout_rate, attention_dropout_rate", [(0.2, 0.0), (0.0, 0.3)],
                         ids=["dropout", "attention_dropout"])
def test_dropout_acts_only_when_not_deterministic(dropout_rate, attention_dropout_rate):
  cfg = tiny_config(dropout_rate=dropout_rate, attention_dropout_rate=attention_dropout_rate)
  params = random_params(cfg)
  source, decoder_input = example_inputs(cfg)
  without_dropout = run(tiny_config(dropout_rate=0.0), params, source, decoder_input)

  deterministic = run(cfg, params, source, decoder_input, deterministic=True)
  np.testing.assert_array_equal(deterministic, without_dropout)
  np.testing.assert_array_equal(run(cfg, params, source, decoder_input), deterministic)

  def dropped(seed):
    # The rbg generator compiles far faster on a CPU than the default threefry.
    return run(cfg, params, source, decoder_input, deterministic=False,
               rngs={"dropout": jax.random.key(seed, impl="rbg")})

  first = dropped(1)
  assert not np.allclose(first, deterministic)
  np.testing.assert_array_equal(dropped(1), first)  # same rng, same mask
  assert not np.allclose(dropped(2), first)


# ----------------------------------------------------------------------------------
# Scanned layer stacks and rematerialization: the same function, other compiled forms.


@pytest.mark.parametrize("decoder_only", [False, True], ids=["encoder_decoder", "decoder_only"])
def test_scanned_layers_compute_the_same_function(decoder_only):
  looped = tiny_config(decoder_only=decoder_only, num_layers=3)
  scanned = tiny_config(decoder_only=decoder_only, num_layers=3, scan_layers=True)
  params = random_params(looped)
  stacked = stack_layer_params(params, 3)
  scanned_variables = abstract_variables(scanned)
  assert (jax.tree.structure(nn.unbox(scanned_variables)["params"]) ==
          jax.tree.structure(stacked))
  # The stacked axis is named, so the mesh rules can place it (replicated by default).
  names = {"/".join(str(k.key) for k in path): leaf.names
           for path, leaf in jax.tree_util.tree_leaves_with_path(
               scanned_variables["params"],
               is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))}
  assert names["decoder/layers/ffn/wi/kernel"] == ("layers", "embed", "mlp")
  source, decoder_input = example_inputs(looped)

  def loss(cfg, p):
    return jnp.sum(run(cfg, p, source, decoder_input) ** 2)

  np.testing.assert_allclose(run(scanned, stacked, source, decoder_input),
                             run(looped, params, source, decoder_input), rtol=1e-5, atol=1e-5)
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
    logits = run(cfg, p, source, decoder_input, deterministic=False,
                 rngs={"dropout": jax.random.key(3)})
    return jnp.sum(logits ** 2)

  plain_cfg = dataclasses.replace(plain, dropout_rate=0.2)
  rematted_cfg = dataclasses.replace(rematted, dropout_rate=0.2)
  chex.assert_trees_all_close(jax.grad(functools.partial(loss, rematted_cfg))(params),
                              jax.grad(functools.partial(loss, plain_cfg))(params),
                              rtol=1e-5, atol=1e-5)


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


@pytest.mark.parametrize("decoder_only", [False, True], ids=["encoder_decoder", "decoder_only"])
def test_dot_product_attention_kernel_matches_einsum(decoder_only):
  einsum = tiny_config(decoder_only=decoder_only, d_v=D_K)
  fused = tiny_config(decoder_only=decoder_only, d_v=D_K, attention_kernel="xla")
  params = random_params(einsum)
  batch = packed_batch(decoder_only)  # segments and padding exercise the mask

  def loss(cfg, p):
    return jnp.sum(run(cfg, p, **batch) ** 2)

  np.testing.assert_allclose(run(fused, params, **batch), run(einsum, params, **batch),
                             rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(jax.grad(functools.partial(loss, fused))(params),
                              jax.grad(functools.partial(loss, einsum))(params),
                              rtol=1e-4, atol=1e-4)
  # Asking for the weights falls back to einsum, which sows them.
  _, state = run(fused, params, **batch, mutable=["intermediates"])
  assert "attention_weights" in state["intermediates"]["decoder"]["layer_0"]["self_attention"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tied_projection_gradients_match_autodiff(dtype):
  x = jnp.asarray(np.random.default_rng(0).normal(size=(6, D_MODEL)), dtype)
  table = jnp.asarray(np.random.default_rng(1).normal(size=(VOCAB, D_MODEL)), dtype)
  weights = jnp.asarray(np.random.default_rng(2).normal(size=(6, VOCAB)), jnp.float32)
  reference = lambda x, t: jnp.einsum("nd,vd->nv", x, t, preferred_element_type=jnp.float32)
  ours = jax.grad(lambda x, t: jnp.sum(tied_projection(x, t) * weights), argnums=(0, 1))(
      x, table)
  expected = jax.grad(lambda x, t: jnp.sum(reference(x, t) * weights), argnums=(0, 1))(
      x, table)
  tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
  for got, want in zip(ours, expected):
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tolerance, atol=tolerance)
