"""The Transformer of "Attention Is All You Need" in Flax Linen.

Shape letters in names (`x_BxTxD` is x with shape [B, T, D]):
  B batch            S source length      T target length     L any length
  D d_model          H heads              K d_k (query/key)   E d_v (value)
  F d_ff             V vocabulary         C decoding cache length

Paper defaults: post-LN sublayers `LayerNorm(x + Dropout(F(x)))`, ReLU feed-forward,
interleaved sinusoidal positions, embeddings scaled by sqrt(d_model), one embedding
matrix shared by the source, the target and the output projection. Every parameter
names logical axes (`vocab`, `embed`, `heads`, `kv`, `mlp`, `length`); the trainer maps
them onto the device mesh, the model never sees it.

Decoding (`decode=True`) keeps a 'cache' collection. The first call in that mode
creates it: the self-attention K/V buffers, sized by that call's target length C, and
each layer's cross-attention K/V, projected once from the final encoder output. Later
calls feed one token per sentence ([B, 1]) and append to the buffers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from transformer.config import PAD_ID

Array = jax.Array

# Masked attention logits get this instead of -inf, so an all-masked row (a padding
# query) gives a finite uniform softmax, not NaN; exp() of it underflows to exactly 0.
_MASKED_LOGIT = -1e9


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Everything the modules read; built once from the run config."""
  vocab_size: int
  max_position: int  # rows of the learned position table (max_len + decoding slack)
  num_layers: int = 6
  d_model: int = 512
  d_ff: int = 2048
  num_heads: int = 8
  d_k: int = 64
  d_v: int = 64
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  positional: str = "sinusoidal"
  norm: str = "post"
  activation: str = "relu"
  tie_embeddings: bool = True
  decoder_only: bool = False
  dtype: str = "float32"
  param_dtype: str = "float32"
  layer_norm_epsilon: float = 1e-6
  scan_layers: bool = False
  remat: str = "none"
  attention_kernel: str = "einsum"

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> "ModelConfig":
    fields = {f.name for f in dataclasses.fields(cls)}
    model = {k: v for k, v in config.model.to_dict().items() if k in fields}
    return cls(vocab_size=config.vocab_size,
               max_position=config.max_len + config.max_decode_extra_len + 1,
               **model)

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self):
    return jnp.dtype(self.param_dtype)


def _layer_norm(cfg: ModelConfig, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.compute_dtype,
                      param_dtype=cfg.weight_dtype, name=name,
                      scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                      bias_init=_zeros_init(("embed",)))


def _dense_init(axes):
  return nn.with_logical_partitioning(nn.initializers.xavier_uniform(), axes)


def _zeros_init(axes):
  return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


# ----------------------------------------------------------------------------------
# Masks and positions.


def attention_mask(q_segment_ids_BxL: Array, kv_segment_ids_BxS: Array,
                   causal: bool) -> Array:
  """The one mask for every attention: padding, packed segments and causality.

  A query may attend to a key when both lie in the same segment and the key is not
  padding (segment id 0); with `causal`, also only to keys at or before it. Unpacked
  data passes `ids != PAD_ID` as segment ids.

  Returns: bool [B, 1, L, S], broadcast over heads.
  """
  same_segment = q_segment_ids_BxL[:, :, None] == kv_segment_ids_BxS[:, None, :]
  mask_BxLxS = same_segment & (kv_segment_ids_BxS != 0)[:, None, :]
  if causal:
    q_len, kv_len = q_segment_ids_BxL.shape[1], kv_segment_ids_BxS.shape[1]
    mask_BxLxS &= jnp.tril(jnp.ones((q_len, kv_len), bool))[None]
  return mask_BxLxS[:, None]


def segment_ids_from_tokens(tokens_BxL: Array) -> Array:
  return (tokens_BxL != PAD_ID).astype(jnp.int32)


def default_positions(tokens_BxL: Array) -> Array:
  return jnp.broadcast_to(jnp.arange(tokens_BxL.shape[1], dtype=jnp.int32),
                          tokens_BxL.shape)


def sinusoidal_encoding(positions_BxL: Array, d_model: int) -> Array:
  """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(same), interleaved.

  The paper's layout (Tensor2Tensor concatenates sin and cos instead). Returns f32
  [B, L, D].
  """
  two_i = jnp.arange(0, d_model, 2, dtype=jnp.float32)
  angles_BxLxHalf = positions_BxL[..., None].astype(jnp.float32) / (10000.0**(two_i / d_model))
  interleaved = jnp.stack([jnp.sin(angles_BxLxHalf), jnp.cos(angles_BxLxHalf)], axis=-1)
  return interleaved.reshape(*positions_BxL.shape, d_model)


def apply_rope(x_BxLxHxK: Array, positions_BxL: Array) -> Array:
  """Rotary position embedding (Su et al. 2021), rotating the two halves of each head."""
  half = x_BxLxHxK.shape[-1] // 2
  inv_freq = 1.0 / (10000.0**(jnp.arange(half, dtype=jnp.float32) / half))
  angles_BxLx1xHalf = (positions_BxL[..., None].astype(jnp.float32) * inv_freq)[:, :, None, :]
  sin, cos = jnp.sin(angles_BxLx1xHalf), jnp.cos(angles_BxLx1xHalf)
  x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x_BxLxHxK.dtype)


# ----------------------------------------------------------------------------------
# Layers.


class Embed(nn.Module):
  """Token embedding; `attend` is the tied pre-softmax projection x @ E^T."""
  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.embedding = self.param(
        "embedding",
        nn.with_logical_partitioning(nn.initializers.normal(stddev=cfg.d_model**-0.5),
                                     ("vocab", "embed")),
        (cfg.vocab_size, cfg.d_model), cfg.weight_dtype)

  def __call__(self, ids_BxL: Array) -> Array:
    table_VxD = jnp.asarray(self.embedding, self.config.compute_dtype)
    return jnp.take(table_VxD, ids_BxL, axis=0)

  def attend(self, x_BxLxD: Array) -> Array:
    table_VxD = jnp.asarray(self.embedding, self.config.compute_dtype)
    batch, length, d_model = x_BxLxD.shape
    logits_NxV = tied_projection(x_BxLxD.reshape(batch * length, d_model), table_VxD)
    return logits_NxV.reshape(batch, length, -1)


@jax.custom_vjp
def tied_projection(x_NxD: Array, table_VxD: Array) -> Array:
  """Logits x E^T in f32, for the tied pre-softmax projection.

  The backward pass is written out so the weight gradient is (x^T g)^T: the [N, V]
  logit gradient (the largest array of a step) is never transposed, only the smaller
  [D, V] result. Left to itself XLA:CPU copies g transposed first, which took as long
  as a vocabulary matmul (docs/performance.md).
  """
  return jnp.einsum("nd,vd->nv", x_NxD, table_VxD, preferred_element_type=jnp.float32)


def _tied_projection_forward(x_NxD, table_VxD):
  return tied_projection(x_NxD, table_VxD), (x_NxD, table_VxD)


def _tied_projection_backward(residuals, grad_NxV):
  x_NxD, table_VxD = residuals
  grad_NxV = grad_NxV.astype(x_NxD.dtype)  # bf16 matmuls in mixed precision, f32 sums
  grad_x_NxD = jnp.einsum("nv,vd->nd", grad_NxV, table_VxD,
                          preferred_element_type=jnp.float32).astype(x_NxD.dtype)
  grad_table_DxV = jnp.einsum("nd,nv->dv", x_NxD, grad_NxV, preferred_element_type=jnp.float32)
  return grad_x_NxD, grad_table_DxV.T.astype(table_VxD.dtype)


tied_projection.defvjp(_tied_projection_forward, _tied_projection_backward)


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
               deterministic: bool = True, decode: bool = False,
               decode_position: Optional[Array] = None) -> Array:
    cfg = self.config
    h, k, e = cfg.num_heads, cfg.d_k, cfg.d_v
    dense = lambda features, axes, name: nn.DenseGeneral(
        features, axis=-1, use_bias=False, kernel_init=_dense_init(axes), name=name,
        dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype)

    if self.self_attention:
      qkv_BxLxHx2KE = dense((h, 2 * k + e), ("embed", "heads", "kv"), "qkv")(x_BxLxD)
      q_BxLxHxK, k_BxSxHxK, v_BxSxHxE = jnp.split(qkv_BxLxHx2KE, [k, 2 * k], axis=-1)
      if cfg.positional == "rope":
        q_BxLxHxK = apply_rope(q_BxLxHxK, positions_BxL)
        k_BxSxHxK = apply_rope(k_BxSxHxK, positions_BxL)
      if decode:
        is_created = self.has_variable("cache", "key")
        key_cache = self.variable("cache", "key", jnp.zeros, k_BxSxHxK.shape, k_BxSxHxK.dtype)
        value_cache = self.variable("cache", "value", jnp.zeros, v_BxSxHxE.shape,
                                    v_BxSxHxE.dtype)
        if not is_created:  # the creating call only sizes the buffers
          return jnp.zeros_like(x_BxLxD)
        # One new token per sentence: write its K/V at the current position and attend
        # over the buffer, masking the slots not yet written.
        start = (0, decode_position, 0, 0)
        key_cache.value = jax.lax.dynamic_update_slice(key_cache.value, k_BxSxHxK, start)
        value_cache.value = jax.lax.dynamic_update_slice(value_cache.value, v_BxSxHxE, start)
        k_BxSxHxK, v_BxSxHxE = key_cache.value, value_cache.value
        batch, cache_len = k_BxSxHxK.shape[:2]
        written_BxC = jnp.broadcast_to(jnp.arange(cache_len) <= decode_position,
                                       (batch, cache_len)).astype(jnp.int32)
        mask_Bx1xLxS = attention_mask(jnp.ones((batch, 1), jnp.int32), written_BxC,
                                      causal=False)
    else:
      q_BxLxHxK = dense((h, k), ("embed", "heads", "kv"), "query")(x_BxLxD)
      project_kv = dense((h, k + e), ("embed", "heads", "kv"), "kv")
      if decode:
        # Cross-attention K/V depend on the source only: project the final encoder
        # output once, when the cache is created, and reuse it at every step.
        if not self.has_variable("cache", "cross_kv"):
          kv_BxSxHxKE = project_kv(memory_BxSxD)
          self.variable("cache", "cross_kv", lambda: kv_BxSxHxKE)
          return jnp.zeros_like(x_BxLxD)
        kv_BxSxHxKE = self.get_variable("cache", "cross_kv")
      else:
        kv_BxSxHxKE = project_kv(memory_BxSxD)
      k_BxSxHxK, v_BxSxHxE = jnp.split(kv_BxSxHxKE, [k], axis=-1)

    if cfg.attention_kernel != "einsum" and not self.is_mutable_collection("intermediates"):
      # jax.nn.dot_product_attention: XLA's fused form, or cuDNN flash attention on GPU.
      # The attention weights never materialize, so maps (intermediates) use einsum.
      out_BxLxHxE = jax.nn.dot_product_attention(
          q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, mask=mask_Bx1xLxS, scale=1.0 / math.sqrt(k),
          implementation=cfg.attention_kernel)
    else:
      out_BxLxHxE = self._einsum_attention(q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, mask_Bx1xLxS,
                                           deterministic)
    return nn.DenseGeneral(
        cfg.d_model, axis=(-2, -1), use_bias=False, name="out",
        kernel_init=_dense_init(("heads", "kv", "embed")),
        dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype)(out_BxLxHxE)


  def _einsum_attention(self, q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, mask_Bx1xLxS, deterministic):
    """softmax(Q K^T / sqrt(d_k)) V with explicit weights: sown, and dropout-able."""
    cfg = self.config
    q_BxLxHxK = q_BxLxHxK / jnp.sqrt(cfg.d_k).astype(q_BxLxHxK.dtype)
    logits_BxHxLxS = jnp.einsum("blhk,bshk->bhls", q_BxLxHxK, k_BxSxHxK)
    logits_BxHxLxS = jnp.where(mask_Bx1xLxS, logits_BxHxLxS.astype(jnp.float32), _MASKED_LOGIT)
    weights_BxHxLxS = jax.nn.softmax(logits_BxHxLxS, axis=-1)
    self.sow("intermediates", "attention_weights", weights_BxHxLxS)
    weights_BxHxLxS = weights_BxHxLxS.astype(cfg.compute_dtype)
    if cfg.attention_dropout_rate > 0:
      weights_BxHxLxS = nn.Dropout(cfg.attention_dropout_rate)(
          weights_BxHxLxS, deterministic=deterministic)
    return jnp.einsum("bhls,bshe->blhe", weights_BxHxLxS, v_BxSxHxE)


class FeedForward(nn.Module):
  """max(0, x W1 + b1) W2 + b2 (paper), or with GELU, or SwiGLU (gated, no biases)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxLxD: Array) -> Array:
    cfg = self.config
    dense = lambda features, axes, name, use_bias=True: nn.Dense(
        features, use_bias=use_bias, name=name, kernel_init=_dense_init(axes),
        bias_init=_zeros_init(axes[-1:]), dtype=cfg.compute_dtype,
        param_dtype=cfg.weight_dtype)
    if cfg.activation == "swiglu":
      gate_BxLxF = dense(cfg.d_ff, ("embed", "mlp"), "wi_gate", use_bias=False)(x_BxLxD)
      up_BxLxF = dense(cfg.d_ff, ("embed", "mlp"), "wi_up", use_bias=False)(x_BxLxD)
      hidden_BxLxF = nn.silu(gate_BxLxF) * up_BxLxF
      return dense(cfg.d_model, ("mlp", "embed"), "wo", use_bias=False)(hidden_BxLxF)
    activation = {"relu": nn.relu, "gelu": nn.gelu}[cfg.activation]
    hidden_BxLxF = activation(dense(cfg.d_ff, ("embed", "mlp"), "wi")(x_BxLxD))
    return dense(cfg.d_model, ("mlp", "embed"), "wo")(hidden_BxLxF)


class Sublayer(nn.Module):
  """Residual wrapper: post-LN `LN(x + Dropout(F(x)))` or pre-LN `x + Dropout(F(LN(x)))`."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxLxD: Array, sublayer, deterministic: bool) -> Array:
    cfg = self.config
    norm = _layer_norm(cfg, "norm")
    dropout = nn.Dropout(cfg.dropout_rate)
    if cfg.norm == "pre":
      return x_BxLxD + dropout(sublayer(norm(x_BxLxD)), deterministic=deterministic)
    return norm(x_BxLxD + dropout(sublayer(x_BxLxD), deterministic=deterministic))


class EncoderLayer(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxSxD, mask_Bx1xSxS, positions_BxS, deterministic):
    cfg = self.config
    attention = MultiHeadAttention(cfg, self_attention=True, name="self_attention")
    x_BxSxD = Sublayer(cfg, name="attention_block")(
        x_BxSxD, lambda y: attention(y, mask_Bx1xSxS, positions_BxL=positions_BxS,
                                     deterministic=deterministic), deterministic)
    return Sublayer(cfg, name="ffn_block")(x_BxSxD, FeedForward(cfg, name="ffn"), deterministic)


class DecoderLayer(nn.Module):
  """Causal self-attention, cross-attention to the final encoder output, feed-forward."""
  config: ModelConfig

  @nn.compact
  def __call__(self, y_BxTxD, self_mask_Bx1xTxT, positions_BxT, memory_BxSxD,
               cross_mask_Bx1xTxS, deterministic, decode=False, decode_position=None):
    cfg = self.config
    self_attention = MultiHeadAttention(cfg, self_attention=True, name="self_attention")
    y_BxTxD = Sublayer(cfg, name="self_attention_block")(
        y_BxTxD, lambda z: self_attention(
            z, self_mask_Bx1xTxT, positions_BxL=positions_BxT, deterministic=deterministic,
            decode=decode, decode_position=decode_position), deterministic)
    if not cfg.decoder_only:
      # Queries come from the decoder state after its self-attention sublayer; keys and
      # values are this layer's own projections of the final encoder output.
      cross_attention = MultiHeadAttention(cfg, self_attention=False, name="cross_attention")
      y_BxTxD = Sublayer(cfg, name="cross_attention_block")(
          y_BxTxD, lambda z: cross_attention(
              z, cross_mask_Bx1xTxS, memory_BxSxD=memory_BxSxD, deterministic=deterministic,
              decode=decode), deterministic)
    return Sublayer(cfg, name="ffn_block")(y_BxTxD, FeedForward(cfg, name="ffn"), deterministic)


# ----------------------------------------------------------------------------------
# Layer stacks: a Python loop (layer_0 ... layer_{N-1}), or one scanned layer whose
# parameters carry a leading `layers` axis, so the stack compiles once whatever N is.

_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute every activation in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def _rematted(layer_class, cfg: ModelConfig, static_argnums: tuple[int, ...]):
  """The layer under jax.checkpoint with cfg.remat's policy ('none': unchanged).

  static_argnums count `self` as 0 and name the Python bools (deterministic, decode).
  """
  if cfg.remat == "none":
    return layer_class
  return nn.remat(layer_class, policy=_REMAT_POLICIES[cfg.remat], static_argnums=static_argnums,
                  prevent_cse=not cfg.scan_layers)


def _Carried(layer_class):
  """Wraps a layer as nn.scan wants it: (carry, *broadcast) -> (carry, None)."""

  class Carried(layer_class):

    def __call__(self, x, *args):
      return super().__call__(x, *args), None

  Carried.__name__ = layer_class.__name__
  return Carried


def _scan(carried_class, cfg: ModelConfig, num_broadcast_args: int,
          static_argnums: tuple[int, ...]):
  """N copies of a layer as one nn.scan over stacked parameters (and caches).

  Masks, positions, the encoder output and the flags are the same for every layer
  (broadcast); dropout draws fresh masks per layer (split_rngs).
  """
  return nn.scan(
      _rematted(carried_class, cfg, static_argnums),
      variable_axes={"params": 0, "cache": 0, "intermediates": 0},
      split_rngs={"params": True, "dropout": True},
      in_axes=(nn.broadcast,) * num_broadcast_args,
      length=cfg.num_layers,
      metadata_params={nn.PARTITION_NAME: "layers"})


class InputEmbedding(nn.Module):
  """ids -> embedding * sqrt(D) + positions, then dropout (the paper's input sum)."""
  config: ModelConfig
  embed: Embed

  @nn.compact
  def __call__(self, ids_BxL, positions_BxL, deterministic):
    cfg = self.config
    x_BxLxD = self.embed(ids_BxL) * jnp.asarray(math.sqrt(cfg.d_model), cfg.compute_dtype)
    if cfg.positional == "sinusoidal":
      x_BxLxD = x_BxLxD + sinusoidal_encoding(positions_BxL, cfg.d_model).astype(x_BxLxD.dtype)
    elif cfg.positional == "learned":
      table_PxD = self.param(
          "position_embedding",
          nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02), ("length", "embed")),
          (cfg.max_position, cfg.d_model), cfg.weight_dtype)
      x_BxLxD = x_BxLxD + jnp.take(table_PxD, positions_BxL, axis=0).astype(x_BxLxD.dtype)
    # rope: positions enter inside attention, nothing is added here.
    return nn.Dropout(cfg.dropout_rate)(x_BxLxD, deterministic=deterministic)


class Encoder(nn.Module):
  config: ModelConfig
  embed: Embed

  @nn.compact
  def __call__(self, source_BxS, source_segment_ids_BxS, source_positions_BxS,
               deterministic=True):
    cfg = self.config
    x_BxSxD = InputEmbedding(cfg, self.embed, name="input")(
        source_BxS, source_positions_BxS, deterministic)
    mask_Bx1xSxS = attention_mask(source_segment_ids_BxS, source_segment_ids_BxS, causal=False)
    if cfg.scan_layers:
      x_BxSxD, _ = _scan(_Carried(EncoderLayer), cfg, num_broadcast_args=3,
                         static_argnums=(4,))(cfg, name="layers")(x_BxSxD, mask_Bx1xSxS, source_positions_BxS, deterministic)
    else:
      layer_class = _rematted(EncoderLayer, cfg, static_argnums=(4,))
      for i in range(cfg.num_layers):
        x_BxSxD = layer_class(cfg, name=f"layer_{i}")(
            x_BxSxD, mask_Bx1xSxS, source_positions_BxS, deterministic)
    if cfg.norm == "pre":
      x_BxSxD = _layer_norm(cfg, "final_norm")(x_BxSxD)
    return x_BxSxD


class Decoder(nn.Module):
  """Target (or, decoder-only, the whole sequence) -> logits over the vocabulary."""
  config: ModelConfig
  embed: Embed

  @nn.compact
  def __call__(self, decoder_input_BxT, target_segment_ids_BxT, target_positions_BxT,
               memory_BxSxD=None, source_segment_ids_BxS=None, deterministic=True,
               decode=False):
    cfg = self.config
    decode_position = None
    if decode:
      # One counter for the whole stack: where the next token goes in every layer's
      # K/V buffer, and that token's position for the position encoding.
      is_created = self.has_variable("cache", "position")
      position = self.variable("cache", "position", lambda: jnp.zeros((), jnp.int32))
      decode_position = position.value
      if is_created:
        target_positions_BxT = jnp.full_like(decoder_input_BxT, decode_position)
        position.value = decode_position + decoder_input_BxT.shape[1]
    y_BxTxD = InputEmbedding(cfg, self.embed, name="input")(
        decoder_input_BxT, target_positions_BxT, deterministic)
    self_mask = attention_mask(target_segment_ids_BxT, target_segment_ids_BxT, causal=True)
    cross_mask = None
    if not cfg.decoder_only:
      cross_mask = attention_mask(target_segment_ids_BxT, source_segment_ids_BxS, causal=False)
    layer_args = (self_mask, target_positions_BxT, memory_BxSxD, cross_mask, deterministic,
                  decode, decode_position)
    if cfg.scan_layers:
      y_BxTxD, _ = _scan(_Carried(DecoderLayer), cfg, num_broadcast_args=len(layer_args),
                         static_argnums=(6, 7))(cfg, name="layers")(y_BxTxD, *layer_args)
    else:
      layer_class = _rematted(DecoderLayer, cfg, static_argnums=(6, 7))
      for i in range(cfg.num_layers):
        y_BxTxD = layer_class(cfg, name=f"layer_{i}")(y_BxTxD, *layer_args)
    if cfg.norm == "pre":
      y_BxTxD = _layer_norm(cfg, "final_norm")(y_BxTxD)
    if cfg.tie_embeddings:
      logits_BxTxV = self.embed.attend(y_BxTxD)
    else:
      logits_BxTxV = nn.DenseGeneral(
          cfg.vocab_size, use_bias=False, name="output_projection",
          kernel_init=_dense_init(("embed", "vocab")), dtype=cfg.compute_dtype,
          param_dtype=cfg.weight_dtype)(y_BxTxD)
    return logits_BxTxV.astype(jnp.float32)


class Transformer(nn.Module):
  """Encoder-decoder (the paper) or, with `decoder_only`, a GPT-style language model.

  Batches are dicts of int32 arrays (see transformer/data): `source` [B, S],
  `decoder_input` [B, T] (the target shifted right behind BOS), `target` [B, T], and
  for packed batches `{source,target}_{segment_ids,positions}`.
  """
  config: ModelConfig

  def setup(self):
    cfg = self.config
    if cfg.tie_embeddings:
      # One matrix for source, target and the pre-softmax projection (shared vocabulary).
      self.shared_embedding = Embed(cfg)
      source_embed = target_embed = self.shared_embedding
    else:
      source_embed = Embed(cfg, name="source_embedding")
      target_embed = Embed(cfg, name="target_embedding")
    if not cfg.decoder_only:
      self.encoder = Encoder(cfg, source_embed)
    self.decoder = Decoder(cfg, target_embed)

  def encode(self, source_BxS: Array, source_segment_ids: Optional[Array] = None,
             source_positions: Optional[Array] = None, deterministic: bool = True) -> Array:
    """Source tokens -> final encoder output [B, S, D]."""
    if source_segment_ids is None:
      source_segment_ids = segment_ids_from_tokens(source_BxS)
    if source_positions is None:
      source_positions = default_positions(source_BxS)
    return self.encoder(source_BxS, source_segment_ids, source_positions, deterministic)

  def decode(self, encoded_BxSxD: Optional[Array], source_BxS: Optional[Array],
             decoder_input_BxT: Array, source_segment_ids: Optional[Array] = None,
             target_segment_ids: Optional[Array] = None,
             target_positions: Optional[Array] = None, deterministic: bool = True,
             decode: bool = False) -> Array:
    """Decoder inputs (+ encoder output) -> f32 logits [B, T, V].

    With `decode=True` and `mutable=['cache']`: the first call creates the cache (its
    logits are meaningless), later calls take [B, 1] and return [B, 1, V].
    """
    if source_segment_ids is None and source_BxS is not None:
      source_segment_ids = segment_ids_from_tokens(source_BxS)
    if target_segment_ids is None:
      # Decoder inputs start with BOS, never PAD, so ids != PAD marks real positions.
      target_segment_ids = segment_ids_from_tokens(decoder_input_BxT)
      if decode:
        target_segment_ids = jnp.ones_like(decoder_input_BxT)
    if target_positions is None:
      target_positions = default_positions(decoder_input_BxT)
    return self.decoder(decoder_input_BxT, target_segment_ids, target_positions,
                        encoded_BxSxD, source_segment_ids, deterministic, decode)

  def __call__(self, source: Optional[Array], decoder_input: Array, *,
               source_segment_ids: Optional[Array] = None,
               source_positions: Optional[Array] = None,
               target_segment_ids: Optional[Array] = None,
               target_positions: Optional[Array] = None,
               deterministic: bool = True) -> Array:
    """Teacher-forced forward pass -> f32 logits [B, T, V]."""
    encoded = None
    if not self.config.decoder_only:
      encoded = self.encode(source, source_segment_ids, source_positions, deterministic)
    return self.decode(encoded, source, decoder_input, source_segment_ids,
                       target_segment_ids, target_positions, deterministic)


def stack_layer_params(params: dict[str, Any], num_layers: int) -> dict[str, Any]:
  """Unscanned parameters (layer_0 ... layer_{N-1}) -> the `scan_layers` tree.

  Each stack's layers become one `layers` entry whose leaves gain a leading axis of N,
  e.g. to continue an unscanned run's weights in a scanned model.
  """
  stacked = dict(params)
  for stack in ("encoder", "decoder"):
    if stack in stacked:
      layers = dict(stacked[stack])
      per_layer = [layers.pop(f"layer_{i}") for i in range(num_layers)]
      layers["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
      stacked[stack] = layers
  return stacked


_MODEL_INPUT_KEYS = ("source", "decoder_input", "source_segment_ids", "source_positions",
                     "target_segment_ids", "target_positions")


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
  """The keyword arguments of `Transformer.__call__` found in a batch."""
  inputs = {k: batch[k] for k in _MODEL_INPUT_KEYS if k in batch}
  inputs.setdefault("source", None)
  return inputs
