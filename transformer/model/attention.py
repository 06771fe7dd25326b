"""Multi-head attention: self- and cross-attention, with and without the decoding cache.

With `use_cache`, the module keeps a 'cache' collection. The first call creates it: the
self-attention K/V buffers, sized by that call's length C, or the cross-attention K/V,
projected once from the final encoder output. Later self-attention calls feed one token
per sentence ([B, 1]) and write its K/V at `cache_position`.
"""

from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.model.primitives import (MASKED_LOGIT, Array, ModelConfig, apply_rope,
                                          attention_mask, dense_init)


class MultiHeadAttention(nn.Module):
  """h heads, d_k for queries and keys, d_v for values, scores scaled by 1/sqrt(d_k).

  Self-attention projects Q, K and V with one fused matmul ([D, H, 2K+E]);
  cross-attention projects Q alone and K, V fused ([D, H, K+E]) from the encoder output.
  """
  config: ModelConfig
  self_attention: bool = True

  @nn.compact
  def __call__(self, x_BxLxD: Array, mask_Bx1xLxS: Optional[Array], *,
               positions_BxL: Optional[Array] = None, memory_BxSxD: Optional[Array] = None,
               deterministic: bool = True, use_cache: bool = False,
               cache_position: Optional[Array] = None) -> Array:
    if self.self_attention:
      q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, mask_Bx1xLxS = self._self_qkv(
          x_BxLxD, mask_Bx1xLxS, positions_BxL, use_cache, cache_position)
    else:
      q_BxLxHxK, k_BxSxHxK, v_BxSxHxE = self._cross_qkv(x_BxLxD, memory_BxSxD, use_cache)
    if q_BxLxHxK is None:  # the call that creates the cache only sizes it
      return jnp.zeros_like(x_BxLxD)
    out_BxLxHxE = self._attend(q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, mask_Bx1xLxS, deterministic)
    return self._dense(self.config.d_model, ("heads", "kv", "embed"), "out",
                       axis=(-2, -1))(out_BxLxHxE)

  def _dense(self, features, axes: tuple[str, ...], name: str, axis=-1) -> nn.DenseGeneral:
    cfg = self.config
    return nn.DenseGeneral(features, axis=axis, use_bias=False, kernel_init=dense_init(axes),
                           name=name, dtype=cfg.dtype, param_dtype=cfg.param_dtype)

  def _self_qkv(self, x_BxLxD, mask_Bx1xLxS, positions_BxL, use_cache, cache_position):
    """Q, K, V (and the mask) of self-attention; with the cache, K/V of all written slots."""
    h, k, e = self.config.num_heads, self.config.d_k, self.config.d_v
    qkv_BxLxHx2KE = self._dense((h, 2 * k + e), ("embed", "heads", "kv"), "qkv")(x_BxLxD)
    q_BxLxHxK, k_BxSxHxK, v_BxSxHxE = jnp.split(qkv_BxLxHx2KE, [k, 2 * k], axis=-1)
    if self.config.positional == "rope":
      q_BxLxHxK = apply_rope(q_BxLxHxK, positions_BxL)
      k_BxSxHxK = apply_rope(k_BxSxHxK, positions_BxL)
    if not use_cache:
      return q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, mask_Bx1xLxS
    is_created = self.has_variable("cache", "key")
    key_cache = self.variable("cache", "key", jnp.zeros, k_BxSxHxK.shape, k_BxSxHxK.dtype)
    value_cache = self.variable("cache", "value", jnp.zeros, v_BxSxHxE.shape, v_BxSxHxE.dtype)
    if not is_created:
      return None, None, None, None
    # One new token per sentence: write its K/V at the current position and attend over
    # the buffer, masking the slots not yet written.
    start = (0, cache_position, 0, 0)
    key_cache.value = jax.lax.dynamic_update_slice(key_cache.value, k_BxSxHxK, start)
    value_cache.value = jax.lax.dynamic_update_slice(value_cache.value, v_BxSxHxE, start)
    batch, cache_len = key_cache.value.shape[:2]
    written_BxC = jnp.broadcast_to(jnp.arange(cache_len) <= cache_position,
                                   (batch, cache_len)).astype(jnp.int32)
    mask_Bx1x1xC = attention_mask(jnp.ones((batch, 1), jnp.int32), written_BxC, causal=False)
    return q_BxLxHxK, key_cache.value, value_cache.value, mask_Bx1x1xC

  def _cross_qkv(self, x_BxLxD, memory_BxSxD, use_cache):
    """Q from the decoder, K and V from the final encoder output (cached once per source)."""
    h, k, e = self.config.num_heads, self.config.d_k, self.config.d_v
    q_BxLxHxK = self._dense((h, k), ("embed", "heads", "kv"), "query")(x_BxLxD)
    project_kv = self._dense((h, k + e), ("embed", "heads", "kv"), "kv")
    if not use_cache:
      kv_BxSxHxKE = project_kv(memory_BxSxD)
    elif not self.has_variable("cache", "cross_kv"):
      # K/V depend on the source only: projected once, when the cache is created, and
      # reused at every step.
      kv_BxSxHxKE = project_kv(memory_BxSxD)
      self.variable("cache", "cross_kv", lambda: kv_BxSxHxKE)
      return None, None, None
    else:
      kv_BxSxHxKE = self.get_variable("cache", "cross_kv")
    k_BxSxHxK, v_BxSxHxE = jnp.split(kv_BxSxHxKE, [k], axis=-1)
    return q_BxLxHxK, k_BxSxHxK, v_BxSxHxE

  def _attend(self, q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, mask_Bx1xLxS, deterministic):
    """softmax(Q K^T / sqrt(d_k)) V: written out, or jax.nn.dot_product_attention."""
    cfg = self.config
    if cfg.attention_kernel != "einsum" and not self.is_mutable_collection("intermediates"):
      # XLA's fused form, or cuDNN flash attention on GPU. The attention weights never
      # materialize, so attention maps (intermediates) take the einsum path.
      return jax.nn.dot_product_attention(
          q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, mask=mask_Bx1xLxS, scale=1.0 / math.sqrt(cfg.d_k),
          implementation=cfg.attention_kernel)
    # Explicit weights: sown for attention maps, and dropout-able.
    q_BxLxHxK = q_BxLxHxK / jnp.sqrt(cfg.d_k).astype(q_BxLxHxK.dtype)
    logits_BxHxLxS = jnp.einsum("blhk,bshk->bhls", q_BxLxHxK, k_BxSxHxK)
    logits_BxHxLxS = jnp.where(mask_Bx1xLxS, logits_BxHxLxS.astype(jnp.float32), MASKED_LOGIT)
    weights_BxHxLxS = jax.nn.softmax(logits_BxHxLxS, axis=-1)
    self.sow("intermediates", "attention_weights", weights_BxHxLxS)
    weights_BxHxLxS = weights_BxHxLxS.astype(cfg.dtype)
    if cfg.attention_dropout_rate > 0:
      weights_BxHxLxS = nn.Dropout(cfg.attention_dropout_rate)(
          weights_BxHxLxS, deterministic=deterministic)
    return jnp.einsum("bhls,bshe->blhe", weights_BxHxLxS, v_BxSxHxE)
