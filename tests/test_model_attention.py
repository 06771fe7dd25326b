"""transformer/model/attention.py: shapes, the decoding cache, the model part scopes, the
scores in f32 (every kernel against einsum: test_model_attention_kernels.py)."""

from __future__ import annotations

import re

import chex
import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.model_helpers import (
  BATCH,
  D_K,
  D_MODEL,
  D_V,
  NUM_HEADS,
  POSITION_VARIANTS,
  SOURCE_LEN,
  TARGET_LEN,
  VOCAB,
  example_inputs,
  packed_batch,
  param_shapes,
  random_params,
  run,
  tiny_config,
)
from transformer.model import Transformer, parts
from transformer.model.attention import MultiHeadAttention, Projection
from transformer.model.attention_kernels import AttentionMask, attention_scores


def _attention_inputs(self_attention):
  """(queries [B, T, D] of zeros, the mask, the call's keyword arguments) for self- or
  cross-attention over a zero encoder output [B, S, D]."""
  queries_BxTxD = jnp.zeros((BATCH, TARGET_LEN, D_MODEL))
  kv_len = TARGET_LEN if self_attention else SOURCE_LEN
  mask = AttentionMask(
    jnp.ones((BATCH, TARGET_LEN), jnp.int32),
    jnp.ones((BATCH, kv_len), jnp.int32),
    causal=self_attention,
  )
  kwargs = {} if self_attention else {"memory_BxSxD": jnp.zeros((BATCH, SOURCE_LEN, D_MODEL))}
  return queries_BxTxD, mask, kwargs


@pytest.mark.parametrize(
  "self_attention, expected_params",
  [
    (
      True,
      {"qkv/kernel": (D_MODEL, NUM_HEADS, 2 * D_K + D_V), "out/kernel": (NUM_HEADS, D_V, D_MODEL)},
    ),
    (
      False,
      {
        "query/kernel": (D_MODEL, NUM_HEADS, D_K),
        "kv/kernel": (D_MODEL, NUM_HEADS, D_K + D_V),
        "out/kernel": (NUM_HEADS, D_V, D_MODEL),
      },
    ),
  ],
  ids=["self", "cross"],
)
def test_attention_output_and_projection_shapes(self_attention, expected_params):
  cfg = tiny_config()
  queries_BxTxD, mask, kwargs = _attention_inputs(self_attention)
  out, variables = jax.eval_shape(
    lambda key: MultiHeadAttention(cfg, self_attention=self_attention).init_with_output(
      key, queries_BxTxD, mask, **kwargs
    ),
    jax.random.key(0),
  )
  chex.assert_shape(out, (BATCH, TARGET_LEN, D_MODEL))
  assert param_shapes(variables) == expected_params


@pytest.mark.parametrize("positional, decoder_only", POSITION_VARIANTS)
def test_cached_decoding_matches_full_forward_pass(positional, decoder_only):
  cfg = tiny_config(positional=positional, decoder_only=decoder_only)
  params = random_params(cfg)
  source, decoder_input = example_inputs(cfg)
  if not decoder_only:
    source = source.at[0, 4:].set(0)  # padding must stay masked in cached cross-attention
  full_logits = run(cfg, params, source, decoder_input)

  encoded = None if decoder_only else run(cfg, params, source, method="encode")
  _, state = run(
    cfg,
    params,
    encoded,
    source,
    jnp.zeros((BATCH, TARGET_LEN), jnp.int32),
    use_cache=True,
    mutable=["cache"],
    method="decode",
  )
  for t in range(TARGET_LEN):
    step_logits, state = Transformer(cfg).apply(
      {"params": params, "cache": state["cache"]},
      encoded,
      source,
      decoder_input[:, t : t + 1],
      use_cache=True,
      mutable=["cache"],
      method="decode",
    )
    assert step_logits.shape == (BATCH, 1, VOCAB)
    np.testing.assert_allclose(step_logits[:, 0], full_logits[:, t], atol=1e-5, rtol=1e-5)


def test_projection_with_a_ones_column_is_the_projection_and_a_column_of_ones():
  """The same parameter; the output gains a last feature of ones, whose cotangent is
  dropped: x's and the kernel's gradients are the plain projection's."""
  cfg = tiny_config()
  x_BxLxD = jnp.asarray(np.random.default_rng(0).normal(size=(BATCH, TARGET_LEN, D_MODEL)))
  plain = Projection(cfg, (NUM_HEADS, D_V), ("embed", "heads", "kv"))
  with_ones = Projection(cfg, (NUM_HEADS, D_V), ("embed", "heads", "kv"), ones_column=True)
  params = nn.unbox(plain.init(jax.random.PRNGKey(0), x_BxLxD))
  assert jax.tree.map(jnp.shape, nn.unbox(with_ones.init(jax.random.PRNGKey(0), x_BxLxD))) == (
    jax.tree.map(jnp.shape, params)
  )
  out = with_ones.apply(params, x_BxLxD)
  assert out.shape == (BATCH, TARGET_LEN, NUM_HEADS, D_V + 1)
  np.testing.assert_array_equal(out[..., -1], 1.0)
  np.testing.assert_allclose(out[..., :-1], plain.apply(params, x_BxLxD), atol=1e-6)
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=out.shape), jnp.float32)
  _, backward = jax.vjp(with_ones.apply, params, x_BxLxD)
  _, plain_backward = jax.vjp(plain.apply, params, x_BxLxD)
  chex.assert_trees_all_close(backward(cotangent), plain_backward(cotangent[..., :-1]), atol=1e-6)


@pytest.mark.parametrize("attention_dropout_rate", [0.0, 0.1], ids=["ones_column", "dropout"])
def test_attention_ops_run_under_the_model_part_scopes(attention_dropout_rate):
  """Every op of the attention modules in a training step, forward and backward, names
  its part on its source path (parts.py): the matmuls of Q, K, V and the output are
  projections, those of the scores and the weights attention core, and the weights'
  dropout dropout, inside attention core."""
  cfg = tiny_config(num_layers=1, attention_dropout_rate=attention_dropout_rate)
  params = random_params(cfg)
  batch = packed_batch(decoder_only=False)

  def loss(params):
    rngs = {"dropout": jax.random.key(0)}
    return jnp.sum(run(cfg, params, **batch, deterministic=False, rngs=rngs) ** 2)

  text = jax.jit(jax.grad(loss)).lower(params).as_text(debug_info=True)
  op_names = set(re.findall(r'loc\("([^"]+)"', text))
  in_attention = {name for name in op_names if re.search(r"/(self|cross)_attention/", name)}
  matmuls = {name for name in in_attention if name.endswith("dot_general")}
  assert {parts.part_of_op_name(name) for name in matmuls} == {
    parts.PROJECTIONS,
    parts.ATTENTION_CORE,
  }
  assert {name for name in in_attention if parts.part_of_op_name(name) is None} == set()
  for name in matmuls:
    projection = re.search(r"/(qkv|query|kv|out)/", name) is not None
    assert parts.part_of_op_name(name) == (
      parts.PROJECTIONS if projection else parts.ATTENTION_CORE
    ), name
  dropout = {name for name in in_attention if "Dropout" in name}
  assert bool(dropout) == (attention_dropout_rate > 0)
  assert {parts.part_of_op_name(name) for name in dropout} <= {parts.DROPOUT}
  assert all("part.attention_core" in name for name in dropout)


def _bf16_rounded(x):
  return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)


def test_attention_scores_are_float32_products_of_bfloat16_inputs():
  rng = np.random.default_rng(0)
  q_BxLxHxK = jnp.asarray(
    rng.normal(scale=2.0, size=(BATCH, TARGET_LEN, NUM_HEADS, 16)), jnp.bfloat16
  )
  k_BxSxHxK = jnp.asarray(
    rng.normal(scale=2.0, size=(BATCH, SOURCE_LEN, NUM_HEADS, 16)), jnp.bfloat16
  )
  scores_BxHxLxS = attention_scores(q_BxLxHxK, k_BxSxHxK)
  assert scores_BxHxLxS.dtype == jnp.float32
  # Products of bf16 numbers are exact in f64: the f32-accumulated reference.
  exact = np.einsum(
    "blhk,bshk->bhls", np.asarray(q_BxLxHxK, np.float64), np.asarray(k_BxSxHxK, np.float64)
  )
  np.testing.assert_allclose(scores_BxHxLxS, exact, rtol=1e-6, atol=1e-5)
  # Scores of tens rounded to bf16 move by up to ~0.1: visibly not what came out.
  assert np.abs(_bf16_rounded(exact) - exact).max() > 1e-2
  assert not np.allclose(scores_BxHxLxS, _bf16_rounded(exact), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_scores_gradients_match_autodiff(dtype):
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(BATCH, TARGET_LEN, NUM_HEADS, D_K)), dtype)
  k = jnp.asarray(rng.normal(size=(BATCH, SOURCE_LEN, NUM_HEADS, D_K)), dtype)
  weights = jnp.asarray(rng.normal(size=(BATCH, NUM_HEADS, TARGET_LEN, SOURCE_LEN)))
  reference = lambda q, k: jnp.einsum("blhk,bshk->bhls", q, k, preferred_element_type=jnp.float32)
  ours = jax.grad(lambda q, k: jnp.sum(attention_scores(q, k) * weights), argnums=(0, 1))(q, k)
  expected = jax.grad(lambda q, k: jnp.sum(reference(q, k) * weights), argnums=(0, 1))(q, k)
  tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
  for got, want in zip(ours, expected):
    assert got.dtype == dtype
    np.testing.assert_allclose(
      np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tolerance, atol=tolerance
    )


def test_bfloat16_attention_softmax_sees_unrounded_scores():
  """The weights sown by the module are the softmax of f32 products of its bf16 Q and K
  (captured as the qkv projection returns them), not of scores rounded to bf16."""
  cfg = tiny_config(dtype="bfloat16")
  rng = np.random.default_rng(2)
  x_BxTxD = jnp.asarray(rng.normal(size=(BATCH, TARGET_LEN, D_MODEL)), jnp.float32)
  mask = AttentionMask(
    jnp.ones((BATCH, TARGET_LEN), jnp.int32), jnp.ones((BATCH, TARGET_LEN), jnp.int32), causal=False
  )
  module = MultiHeadAttention(cfg)
  # Small enough weights that the softmax is not one-hot, so rounding the scores shows.
  shapes = nn.unbox(jax.eval_shape(module.init, jax.random.key(0), x_BxTxD, mask))["params"]
  params = jax.tree.map(
    lambda leaf: jnp.asarray(rng.normal(scale=0.5, size=leaf.shape), leaf.dtype), shapes
  )
  _, state = module.apply(
    {"params": params},
    x_BxTxD,
    mask,
    mutable=["intermediates"],
    capture_intermediates=lambda m, _: isinstance(m, Projection),
  )
  qkv_BxTxHx2KE = np.asarray(state["intermediates"]["qkv"]["__call__"][0], np.float64)
  (weights_BxHxTxT,) = state["intermediates"]["attention_weights"]
  assert weights_BxHxTxT.dtype == jnp.float32

  def softmax(scores):
    e = np.exp(scores - scores.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

  q, k = qkv_BxTxHx2KE[..., :D_K], qkv_BxTxHx2KE[..., D_K : 2 * D_K]
  exact = np.einsum("blhk,bshk->bhls", q, k)
  expected, rounded = softmax(exact / np.sqrt(D_K)), softmax(_bf16_rounded(exact) / np.sqrt(D_K))
  assert np.abs(rounded - expected).max() > 1e-3  # the case tells the two apart
  np.testing.assert_allclose(weights_BxHxTxT, expected, rtol=1e-5, atol=1e-6)


def _all_equations(jaxpr):
  """Every equation of a jaxpr and of the jaxprs nested in it (jit, custom_vjp, ...)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, jax.extend.core.Jaxpr):
          yield from _all_equations(sub)


@pytest.mark.parametrize("self_attention", [True, False], ids=["self", "cross"])
def test_bfloat16_forward_never_widens_bfloat16_scores(self_attention):
  cfg = tiny_config(dtype="bfloat16", d_v=5)  # weights x V must not look like [B, H, T, S]
  x_BxTxD, mask, kwargs = _attention_inputs(self_attention)
  module = MultiHeadAttention(cfg, self_attention=self_attention)
  variables = jax.eval_shape(module.init, jax.random.key(0), x_BxTxD, mask, **kwargs)
  jaxpr = jax.make_jaxpr(lambda v: module.apply(v, x_BxTxD, mask, **kwargs))(variables).jaxpr
  scores_shape = (BATCH, NUM_HEADS, TARGET_LEN, mask.kv_segment_ids_BxS.shape[-1])
  score_dots = [
    eqn
    for eqn in _all_equations(jaxpr)
    if eqn.primitive.name == "dot_general" and eqn.outvars[0].aval.shape == scores_shape
  ]
  assert score_dots and all(eqn.outvars[0].aval.dtype == jnp.float32 for eqn in score_dots)
  widened = [
    eqn
    for eqn in _all_equations(jaxpr)
    if eqn.primitive.name == "convert_element_type"
    and eqn.invars[0].aval.shape == scores_shape
    and eqn.invars[0].aval.dtype == jnp.bfloat16
  ]
  assert not widened
