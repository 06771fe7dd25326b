"""transformer/model/layers.py: embeddings, the tied output projection, feed-forward, dropout."""

from __future__ import annotations

import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import numpy_reference
from tests.helpers.model_helpers import (
  BATCH,
  D_FF,
  D_MODEL,
  POSITIONAL_KINDS,
  SOURCE_LEN,
  TARGET_LEN,
  VOCAB,
  abstract_variables,
  boxed_params,
  example_inputs,
  param_shapes,
  random_params,
  run,
  tiny_config,
)
from transformer.model.layers import (
  DecoderLayer,
  FeedForward,
  InputEmbedding,
  OutputProjection,
  tied_projection,
  untied_projection,
)
from transformer.model.primitives import dense_init


@pytest.mark.parametrize(
  "activation, expected_params",
  [
    (
      "relu",
      {
        "wi/kernel": (D_MODEL, D_FF),
        "wi/bias": (D_FF,),
        "wo/kernel": (D_FF, D_MODEL),
        "wo/bias": (D_MODEL,),
      },
    ),
    (
      "gelu",
      {
        "wi/kernel": (D_MODEL, D_FF),
        "wi/bias": (D_FF,),
        "wo/kernel": (D_FF, D_MODEL),
        "wo/bias": (D_MODEL,),
      },
    ),
    (
      "swiglu",
      {
        "wi_gate/kernel": (D_MODEL, D_FF),
        "wi_up/kernel": (D_MODEL, D_FF),
        "wo/kernel": (D_FF, D_MODEL),
      },
    ),
  ],
  ids=["relu", "gelu", "swiglu"],
)
def test_feed_forward_shapes(activation, expected_params):
  cfg = tiny_config(activation=activation)
  out, variables = jax.eval_shape(
    lambda key: FeedForward(cfg).init_with_output(key, jnp.zeros((BATCH, TARGET_LEN, D_MODEL))),
    jax.random.key(0),
  )
  chex.assert_shape(out, (BATCH, TARGET_LEN, D_MODEL))
  assert param_shapes(variables) == expected_params


@pytest.mark.parametrize("positional", POSITIONAL_KINDS)
def test_input_embedding_is_scaled_token_embedding_plus_position(positional):
  cfg = tiny_config(positional=positional)
  params = random_params(cfg)
  if positional == "learned":  # a zero table leaves the scaled token embedding alone
    params["encoder"]["input"]["position_embedding"] = jnp.zeros((cfg.max_position, D_MODEL))
  source, decoder_input = example_inputs(cfg)
  _, state = run(
    cfg,
    params,
    source,
    decoder_input,
    mutable=["intermediates"],
    capture_intermediates=lambda module, _: isinstance(module, InputEmbedding),
  )
  embedded = np.asarray(state["intermediates"]["encoder"]["input"]["__call__"][0])

  expected = np.asarray(params["shared_embedding"]["embedding"])[np.asarray(source)]
  expected = expected * math.sqrt(D_MODEL)
  if positional == "sinusoidal":
    expected = expected + numpy_reference.sinusoidal_table(SOURCE_LEN, D_MODEL)[None]
  np.testing.assert_allclose(embedded, expected, atol=1e-5, rtol=1e-5)


def final_decoder_state(cfg, params, source, decoder_input):
  """The decoder's last hidden state [B, T, D], just before the output projection."""
  _, state = run(
    cfg,
    params,
    source,
    decoder_input,
    mutable=["intermediates"],
    capture_intermediates=lambda module, _: isinstance(module, (DecoderLayer, nn.LayerNorm)),
  )
  decoder = state["intermediates"]["decoder"]
  last = decoder["final_norm"] if cfg.norm == "pre" else decoder[f"layer_{cfg.num_layers - 1}"]
  return np.asarray(last["__call__"][0])


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_output_projection_is_the_shared_embedding(norm):
  cfg = tiny_config(norm=norm)
  variables = abstract_variables(cfg)
  vocab_params = [
    path
    for path, box in zip(param_shapes(variables), boxed_params(variables))
    if "vocab" in box.names
  ]
  assert vocab_params == ["shared_embedding/embedding"]  # the only [V, D] matrix

  params = random_params(cfg)
  source, decoder_input = example_inputs(cfg)
  embedding_VxD = np.asarray(params["shared_embedding"]["embedding"])
  logits = np.asarray(run(cfg, params, source, decoder_input))
  hidden = final_decoder_state(cfg, params, source, decoder_input)
  np.testing.assert_allclose(logits, hidden @ embedding_VxD.T, atol=1e-5, rtol=1e-5)

  # A token absent from the inputs: its row moves that token's logit and nothing else.
  unused = int(
    np.setdiff1d(
      np.arange(1, VOCAB),
      np.concatenate([np.asarray(source).ravel(), np.asarray(decoder_input).ravel()]),
    )[0]
  )
  shift_D = jnp.asarray(np.random.default_rng(7).normal(size=D_MODEL), jnp.float32)
  moved = dict(
    params,
    shared_embedding={"embedding": params["shared_embedding"]["embedding"].at[unused].add(shift_D)},
  )
  moved_logits = np.asarray(run(cfg, moved, source, decoder_input))
  others = np.arange(VOCAB) != unused
  np.testing.assert_array_equal(moved_logits[..., others], logits[..., others])
  assert not np.allclose(moved_logits[..., unused], logits[..., unused])
  # A token in the source: its row moves the encoder's input.
  used = int(source[0, 0])
  moved = dict(
    params,
    shared_embedding={"embedding": params["shared_embedding"]["embedding"].at[used].add(shift_D)},
  )
  assert not np.allclose(
    run(cfg, moved, source, method="encode"), run(cfg, params, source, method="encode")
  )


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
  moved_target = dict(
    params, target_embedding={"embedding": params["target_embedding"]["embedding"] + shift_VxD}
  )
  np.testing.assert_array_equal(run(cfg, moved_target, source, method="encode"), encoded)
  assert not np.allclose(run(cfg, moved_target, source, decoder_input), logits)
  moved_source = dict(
    params, source_embedding={"embedding": params["source_embedding"]["embedding"] + shift_VxD}
  )
  assert not np.allclose(run(cfg, moved_source, source, method="encode"), encoded)


@pytest.mark.parametrize(
  "dropout_rate, attention_dropout_rate",
  [(0.2, 0.0), (0.0, 0.3)],
  ids=["dropout", "attention_dropout"],
)
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
    return run(
      cfg,
      params,
      source,
      decoder_input,
      deterministic=False,
      rngs={"dropout": jax.random.key(seed, impl="rbg")},
    )

  first = dropped(1)
  assert not np.allclose(first, deterministic)
  np.testing.assert_array_equal(dropped(1), first)  # same rng, same mask
  assert not np.allclose(dropped(2), first)


def _bf16_rounded(x):
  return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)


def test_untied_output_projection_gives_float32_accumulated_logits():
  """Logits of bf16 hidden states come out in f32, as the exact products of the bf16
  inputs, not rounded to bf16."""
  cfg = tiny_config(dtype="bfloat16", tie_embeddings=False)
  rng = np.random.default_rng(3)
  hidden_BxTxD = jnp.asarray(rng.normal(scale=3.0, size=(BATCH, TARGET_LEN, D_MODEL)), jnp.bfloat16)
  kernel_DxV = jnp.asarray(rng.normal(size=(D_MODEL, VOCAB)), jnp.float32)
  logits_BxTxV = OutputProjection(cfg).apply({"params": {"kernel": kernel_DxV}}, hidden_BxTxD)
  assert logits_BxTxV.dtype == jnp.float32
  exact = np.asarray(hidden_BxTxD, np.float64) @ _bf16_rounded(kernel_DxV)
  rounded = _bf16_rounded(exact)
  error, rounding_error = np.abs(logits_BxTxV - exact).max(), np.abs(rounded - exact).max()
  assert rounding_error > 1e-2  # the case tells the two apart
  assert error < 1e-3 * rounding_error
  # The parameter is the one nn.DenseGeneral made: checkpoints still load.
  dense = nn.DenseGeneral(VOCAB, use_bias=False, kernel_init=dense_init(("embed", "vocab")))
  assert jax.eval_shape(dense.init, jax.random.key(0), hidden_BxTxD) == jax.eval_shape(
    OutputProjection(cfg).init, jax.random.key(0), hidden_BxTxD
  )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_projection_gradients_match_autodiff(tied, dtype):
  """The written-out backward passes of both output projections against autodiff of the
  plain einsum: the tied weight is [V, D], the untied one [D, V]."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(6, D_MODEL)), dtype)
  shape, spec = ((VOCAB, D_MODEL), "nd,vd->nv") if tied else ((D_MODEL, VOCAB), "nd,dv->nv")
  weight = jnp.asarray(np.random.default_rng(1).normal(size=shape), dtype)
  weights = jnp.asarray(np.random.default_rng(2).normal(size=(6, VOCAB)), jnp.float32)
  projection = tied_projection if tied else untied_projection
  reference = lambda x, w: jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
  ours = jax.grad(lambda x, w: jnp.sum(projection(x, w) * weights), argnums=(0, 1))(x, weight)
  expected = jax.grad(lambda x, w: jnp.sum(reference(x, w) * weights), argnums=(0, 1))(x, weight)
  tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
  for got, want in zip(ours, expected):
    assert got.dtype == dtype
    np.testing.assert_allclose(
      np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tolerance, atol=tolerance
    )


@pytest.mark.parametrize("tie_embeddings", [True, False], ids=["tied", "untied"])
def test_bfloat16_model_logits_are_float32(tie_embeddings):
  cfg = tiny_config(dtype="bfloat16", tie_embeddings=tie_embeddings)
  params = random_params(tiny_config(tie_embeddings=tie_embeddings))
  source, decoder_input = example_inputs(cfg)
  # Compiled once, the hidden state with the logits: XLA may fuse bf16 ops differently.
  logits, state = jax.jit(
    lambda p: run(
      cfg,
      p,
      source,
      decoder_input,
      mutable=["intermediates"],
      capture_intermediates=lambda module, _: isinstance(module, DecoderLayer),
    )
  )(params)
  assert logits.dtype == jnp.float32
  # The final hidden state (the residual stream's float32) rounded to the compute dtype,
  # times E^T (tied) or W (untied), accumulated in f32.
  last_layer = state["intermediates"]["decoder"][f"layer_{cfg.num_layers - 1}"]
  assert last_layer["__call__"][0].dtype == jnp.float32
  hidden = _bf16_rounded(last_layer["__call__"][0])
  if tie_embeddings:
    matrix_DxV = _bf16_rounded(params["shared_embedding"]["embedding"]).T
  else:
    matrix_DxV = _bf16_rounded(params["decoder"]["output_projection"]["kernel"])
  exact = hidden @ matrix_DxV
  np.testing.assert_allclose(logits, exact, rtol=1e-5, atol=1e-5)
  assert not np.allclose(logits, _bf16_rounded(exact), rtol=1e-5, atol=1e-5)
