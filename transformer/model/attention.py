"""Multi-head attention: self- and cross-attention, with and without the decoding cache.

With `use_cache`, the module keeps a 'cache' collection. The first call creates it: the
self-attention K/V buffers, sized by that call's length C, or the cross-attention K/V,
projected once from the final encoder output. Later self-attention calls feed L tokens
per row ([B, L]) and write their K/V at slots `cache_position` .. + L - 1, where the
position is a scalar shared by the batch or an int32 [B] vector, one per row (prompts of
different lengths, speculative rollback); each query sees the slots up to its own.
The cache keeps K as [B, H, K, C] and V as [B, H, C, E] ('key', 'value'; 'cross_key',
'cross_value'), the layouts its two matmuls read without a transpose. The cross-attention
K/V may hold one row per group of G query rows (beam search: one per sentence for its
G hypotheses).

softmax(Q K^T / sqrt(d_k)) V is computed by the kernel the config names, through its
record (attention_kernels.Kernel): its `attend` (or the form of it that takes V's ones
column, or forms the weights for attention maps and dropout) without the cache, reading
the mask as an AttentionMask (segment ids and causality); its `decode` over the cache. A
kernel without a form this call needs lends it from the default kernel. Q, K, V, the
attention logits and the output carry sharding constraints (`constrain`): rows over the
batch axes, heads over the tensor axis, under the config's rules. The projections run
under the model part scope PROJECTIONS, the kernel under ATTENTION_CORE (parts.py).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype

from transformer.model import parts
from transformer.model.attention_kernels import AttentionMask, Kernel, kernel_for
from transformer.model.primitives import (
  BATCH,
  BLD,
  BLHK,
  HEADS,
  KV,
  LENGTH,
  Array,
  Dropout,
  ModelConfig,
  apply_rope,
  attention_mask,
  constrain,
)

# The decoding cache's layouts: K as [B, H, K, S], V as [B, H, S, E].
_BHKL = (BATCH, HEADS, KV, LENGTH)
_BHLK = (BATCH, HEADS, LENGTH, KV)


class Projection(nn.Module):
  """x W without bias, contracting the last `num_in` dimensions of x with W's first.

  What nn.DenseGeneral computes, with the same parameter ('kernel') and the same initial
  values, but DenseGeneral draws a multi-dimensional kernel flat and reshapes it, and
  flax reruns that initializer at every apply to check shapes: under a mesh and axis
  rules (transformer/inference/sharding.py) the flat draw meets the kernel's 3-axis
  sharding and fails. This kernel is drawn in its final shape.
  """

  config: ModelConfig
  features: tuple[int, ...]
  axes: tuple[str, ...]  # the kernel's logical axes: contracted dimensions, then features
  num_in: int = 1
  # One more output feature along the last axis, always 1 (the kernel is unchanged):
  # V with the ones column that a kernel's `attend_with_ones` takes.
  ones_column: bool = False

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    shape = x.shape[x.ndim - self.num_in :] + self.features
    init = nn.initializers.xavier_uniform(
      in_axis=tuple(range(self.num_in)), out_axis=tuple(range(self.num_in, len(shape)))
    )
    kernel = self.param(
      "kernel", nn.with_logical_partitioning(init, self.axes), shape, cfg.param_dtype
    )
    x, kernel = promote_dtype(x, kernel, dtype=cfg.dtype)
    if self.ones_column:
      return _project_with_ones_column(x, kernel, self.num_in)
    return jnp.tensordot(x, kernel, axes=self.num_in)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _project_with_ones_column(x: Array, kernel: Array, num_in: int) -> Array:
  """x W with a last output feature of ones: x [W | 0] + [0 ... 0 1], one matmul whose
  output the ones column joins in place (appended after it, the column would cost a copy
  of the whole output). Its gradient is that of x W: the ones column's is dropped before
  the matmuls, so the kernel's gradient keeps the kernel's shape (a padded gradient
  would be reduced across devices padded)."""
  zero_column = [(0, 0)] * (kernel.ndim - 1) + [(0, 1)]
  features = kernel.shape[-1] + 1
  ones = jax.nn.one_hot(features - 1, features, dtype=x.dtype)
  return jnp.tensordot(x, jnp.pad(kernel, zero_column), axes=num_in) + ones


def _project_with_ones_column_forward(x, kernel, num_in):
  return _project_with_ones_column(x, kernel, num_in), (x, kernel)


def _project_with_ones_column_backward(num_in, residuals, grad_out):
  x, kernel = residuals
  _, project_backward = jax.vjp(lambda x, w: jnp.tensordot(x, w, axes=num_in), x, kernel)
  return project_backward(grad_out[..., :-1])


_project_with_ones_column.defvjp(
  _project_with_ones_column_forward, _project_with_ones_column_backward
)


class MultiHeadAttention(nn.Module):
  """h heads, d_k for queries and keys, d_v for values, scores scaled by 1/sqrt(d_k).

  Self-attention projects Q, K and V with one fused matmul ([D, H, 2K+E]);
  cross-attention projects Q alone and K, V fused ([D, H, K+E]) from the encoder output.
  """

  config: ModelConfig
  self_attention: bool = True

  @nn.compact
  def __call__(
    self,
    x_BxLxD: Array,
    mask: AttentionMask,
    *,
    positions_BxL: Array | None = None,
    memory_BxSxD: Array | None = None,
    deterministic: bool = True,
    use_cache: bool = False,
    cache_position: Array | None = None,
  ) -> Array:
    kernel = kernel_for(self.config)
    # The kernel's form is chosen first: the one that takes V with a column of ones
    # has the projection write that column.
    needs_weights = not use_cache and self._needs_weights(deterministic)
    with_ones = not (use_cache or needs_weights) and kernel.attend_with_ones is not None
    with parts.scope(parts.PROJECTIONS):
      if self.self_attention:
        q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, cache_mask_Bx1xLxC = self._self_qkv(
          x_BxLxD, positions_BxL, use_cache, cache_position, with_ones
        )
      else:
        q_BxLxHxK, k_BxSxHxK, v_BxSxHxE = self._cross_qkv(
          x_BxLxD, memory_BxSxD, use_cache, with_ones
        )
    if q_BxLxHxK is None:  # the call that creates the cache only sizes it
      return jnp.zeros_like(x_BxLxD)
    with parts.scope(parts.ATTENTION_CORE):
      if use_cache:  # K [R, H, K, S] and V [R, H, S, E], as the cache stores them
        if not self.self_attention:
          cache_mask_Bx1xLxC = mask.dense()
        out_BxLxHxE = kernel.decode_or_default()(
          q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, cache_mask_Bx1xLxC
        )
      elif needs_weights:
        out_BxLxHxE = self._attend_with_weights(
          kernel, q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, mask, deterministic
        )
      else:  # V [B, S, H, E+1] with_ones, else [B, S, H, E]
        attend = (kernel.attend_with_ones if with_ones else None) or kernel.attend
        out_BxLxHxE = attend(q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, mask)
      out_BxLxHxE = constrain(out_BxLxHxE, BLHK)
    with parts.scope(parts.PROJECTIONS):
      project_out = self._dense(self.config.d_model, ("heads", "kv", "embed"), "out", (-2, -1))
      out_BxLxD = project_out(out_BxLxHxE)
    return constrain(out_BxLxD, BLD)

  def _dense(
    self, features, axes: tuple[str, ...], name: str, axis=-1, ones_column=False
  ) -> Projection:
    features = features if isinstance(features, tuple) else (features,)
    num_in = len(axis) if isinstance(axis, tuple) else 1
    return Projection(self.config, features, axes, num_in, ones_column, name=name)

  def _needs_weights(self, deterministic: bool) -> bool:
    """Whether this call uses the attention weights themselves: attention maps (the
    'intermediates' collection) or attention dropout applied."""
    return self.is_mutable_collection("intermediates") or (
      self.config.attention_dropout_rate > 0 and not deterministic
    )

  def _self_qkv(self, x_BxLxD, positions_BxL, use_cache, cache_position, with_ones=False):
    """Q, K, V of self-attention; with the cache, K/V of all written slots and the mask
    of the slots each query sees (bool [B, 1, L, C]; None without the cache). With
    `with_ones`, V [B, L, H, E+1] ends in a column of ones."""
    h, k, e = self.config.num_heads, self.config.d_k, self.config.d_v
    project_qkv = self._dense((h, 2 * k + e), ("embed", "heads", "kv"), "qkv", -1, with_ones)
    qkv_BxLxHx2KE = constrain(project_qkv(x_BxLxD), BLHK)
    q_BxLxHxK, k_BxSxHxK, v_BxSxHxE = jnp.split(qkv_BxLxHx2KE, [k, 2 * k], axis=-1)
    if self.config.positional == "rope":
      q_BxLxHxK = apply_rope(q_BxLxHxK, positions_BxL)
      k_BxSxHxK = apply_rope(k_BxSxHxK, positions_BxL)
    if not use_cache:
      return q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, None
    # The buffers are stored as the cached attention's matmuls read them (see
    # `attention_kernels.Decode`): K as [B, H, K, C] and V as [B, H, C, E].
    batch, length = k_BxSxHxK.shape[:2]
    k_BxHxKxL = jnp.transpose(k_BxSxHxK, (0, 2, 3, 1))
    v_BxHxLxE = jnp.transpose(v_BxSxHxE, (0, 2, 1, 3))
    is_created = self.has_variable("cache", "key")
    key_cache = self.variable("cache", "key", jnp.zeros, k_BxHxKxL.shape, k_BxHxKxL.dtype)
    value_cache = self.variable("cache", "value", jnp.zeros, v_BxHxLxE.shape, v_BxHxLxE.dtype)
    if not is_created:
      return None, None, None, None
    # L new tokens per sentence: write their K/V at slots position .. position + L - 1
    # and attend over the buffer, masking the slots after each query. Writes past the
    # end are clamped by XLA (landing on the wrong slots): callers size the buffer.
    if cache_position.ndim == 0:
      # One shared position (greedy, sampling, beam search): one contiguous write.
      write = lambda buffer, new, axis: jax.lax.dynamic_update_slice_in_dim(
        buffer, new, cache_position, axis
      )
    else:
      # A position per row [B]: speculative decoding rolls rows back by different
      # amounts, so each row writes at its own slot.
      write = lambda buffer, new, axis: jax.vmap(
        lambda row_buffer, row_new, at: jax.lax.dynamic_update_slice_in_dim(
          row_buffer, row_new, at, axis - 1
        )
      )(buffer, new, cache_position)
    # Constrained as they are stored: the buffers are the loop carry of the search.
    key_cache.value = constrain(write(key_cache.value, k_BxHxKxL, 3), _BHKL)
    value_cache.value = constrain(write(value_cache.value, v_BxHxLxE, 2), _BHLK)
    cache_len = key_cache.value.shape[3]
    if cache_position.ndim == 0 and length == 1:
      written_BxC = jnp.broadcast_to(
        jnp.arange(cache_len) <= cache_position, (batch, cache_len)
      ).astype(jnp.int32)
      mask_Bx1x1xC = attention_mask(jnp.ones((batch, 1), jnp.int32), written_BxC, causal=False)
      return q_BxLxHxK, key_cache.value, value_cache.value, mask_Bx1x1xC
    # Query i of row b sits at position_b + i and sees the slots up to it: the prefix
    # written before, its own block causally, and none of the stale slots behind it
    # that a rollback left.
    query_positions_BxL = jnp.reshape(cache_position, (-1, 1)) + jnp.arange(length)
    mask_BxLxC = jnp.arange(cache_len) <= query_positions_BxL[:, :, None]
    mask_Bx1xLxC = jnp.broadcast_to(mask_BxLxC, (batch, length, cache_len))[:, None]
    return q_BxLxHxK, key_cache.value, value_cache.value, mask_Bx1xLxC

  def _cross_qkv(self, x_BxLxD, memory_BxSxD, use_cache, with_ones=False):
    """Q from the decoder, K and V from the final encoder output (cached once per source).
    With `with_ones`, V [B, S, H, E+1] ends in a column of ones."""
    h, k, e = self.config.num_heads, self.config.d_k, self.config.d_v
    q_BxLxHxK = constrain(self._dense((h, k), ("embed", "heads", "kv"), "query")(x_BxLxD), BLHK)
    project_kv = self._dense((h, k + e), ("embed", "heads", "kv"), "kv", -1, with_ones)
    if not use_cache:
      kv_BxSxHxKE = constrain(project_kv(memory_BxSxD), BLHK)
      k_BxSxHxK, v_BxSxHxE = jnp.split(kv_BxSxHxKE, [k], axis=-1)
      return q_BxLxHxK, k_BxSxHxK, v_BxSxHxE
    if not self.has_variable("cache", "cross_key"):
      # K/V depend on the source only: projected once, when the cache is created, and
      # stored as a kernel's `decode` reads them, so no step splits or transposes them.
      kv_BxSxHxKE = constrain(project_kv(memory_BxSxD), BLHK)
      k_BxSxHxK, v_BxSxHxE = jnp.split(kv_BxSxHxKE, [k], axis=-1)
      self.variable(
        "cache", "cross_key", lambda: constrain(jnp.transpose(k_BxSxHxK, (0, 2, 3, 1)), _BHKL)
      )
      self.variable(
        "cache", "cross_value", lambda: constrain(jnp.transpose(v_BxSxHxE, (0, 2, 1, 3)), _BHLK)
      )
      return None, None, None
    return (
      q_BxLxHxK,
      self.get_variable("cache", "cross_key"),
      self.get_variable("cache", "cross_value"),
    )

  def _attend_with_weights(
    self, kernel: Kernel, q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, mask: AttentionMask, deterministic
  ):
    """softmax(Q K^T / sqrt(d_k)) V by a form that hands over the f32 weights [B, H, L, S]:
    sown for attention maps, then attention dropout. A kernel without that form lends
    the default kernel's for attention maps (kernel_for refuses its attention dropout).
    """
    cfg = self.config

    def on_weights(weights_BxHxLxS):
      self.sow("intermediates", "attention_weights", weights_BxHxLxS)
      weights_BxHxLxS = weights_BxHxLxS.astype(v_BxSxHxE.dtype)
      if cfg.attention_dropout_rate > 0:
        with parts.scope(parts.DROPOUT):
          weights_BxHxLxS = Dropout(cfg.attention_dropout_rate, (BATCH, HEADS, LENGTH, None))(
            weights_BxHxLxS, deterministic=deterministic
          )
      return weights_BxHxLxS

    attend = kernel.attend_with_weights_or_default()
    return attend(q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, mask, on_weights)
