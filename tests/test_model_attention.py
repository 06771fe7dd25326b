"""transformer/model/attention.py: shapes, the decoding cache, the fused kernels."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.model import Transformer
from transformer.model.attention import MultiHeadAttention
from transformer.model.primitives import attention_mask
from tests.model_helpers import (tiny_config, example_inputs, random_params, run, param_shapes,
                                packed_batch, BATCH, SOURCE_LEN, TARGET_LEN, VOCAB, D_MODEL,
                                NUM_HEADS, D_K, D_V, POSITION_VARIANTS)


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
