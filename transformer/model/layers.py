"""The layers: embedding and the output projection (tied or not), feed-forward, residual
sublayers, and the encoder and decoder layers built from them.

Paper defaults: post-LN sublayers `LayerNorm(x + Dropout(F(x)))`, ReLU feed-forward,
embeddings scaled by sqrt(d_model), one embedding matrix for the source, the target and
the output projection. Shape letters: transformer/model/primitives.py.

What leaves each layer is constrained to [activation_batch, activation_length,
activation_embed] (`constrain`), the feed-forward hidden layer to activation_mlp and the
logits to activation_vocab, so every residual stream is split the same way on any mesh.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype

from transformer.model.attention import MultiHeadAttention
from transformer.model.primitives import (
  BLD,
  BLF,
  RESIDUAL_DTYPE,
  Array,
  Dropout,
  ModelConfig,
  constrain,
  dense_init,
  layer_norm,
  relu,
  sinusoidal_encoding,
  zeros_init,
)


class Embed(nn.Module):
  """Token embedding; `attend` is the tied pre-softmax projection x @ E^T."""

  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.embedding = self.param(
      "embedding",
      nn.with_logical_partitioning(
        nn.initializers.normal(stddev=cfg.d_model**-0.5), ("vocab", "embed")
      ),
      (cfg.vocab_size, cfg.d_model),
      cfg.param_dtype,
    )

  def __call__(self, ids_BxL: Array) -> Array:
    # The lookup reads the table as the matmuls read their weights: embed gathered whole
    # (FSDP), vocab still split over tensor. From the stored layout (embed over fsdp) the
    # rows picked would come out split along d_model, and the partitioner could reach
    # the batch-split activations, and their gradient the table, only by gathering whole
    # tensors on every device ("[SPMD] Involuntary full rematerialization", 8 of them
    # on a 2x2x2 mesh). Same values: the constraint moves data, not arithmetic.
    # The rows are picked from the parameter and then cast to the compute dtype: cast
    # first, a bf16 step converted the whole table for the lookup (0.4 ms of base's step
    # on a v5e-8, by the per-op profile) and summed its gradient's rows in bf16.
    table_VxD = constrain(self.embedding, ("activation_vocab", "activation_embed"))
    return jnp.take(table_VxD, ids_BxL, axis=0).astype(self.config.dtype)

  def output_table(self) -> Array:
    """The table [V, D] in the compute dtype, as the tied pre-softmax projection reads it."""
    return jnp.asarray(self.embedding, self.config.dtype)

  def attend(self, x_BxLxD: Array) -> Array:
    table_VxD = self.output_table()
    batch, length, d_model = x_BxLxD.shape
    x_NxD = x_BxLxD.reshape(batch * length, d_model).astype(self.config.dtype)
    logits_NxV = tied_projection(x_NxD, table_VxD)
    return logits_NxV.reshape(batch, length, -1)


class OutputProjection(nn.Module):
  """The untied pre-softmax projection x W, logits in f32.

  The parameter is nn.DenseGeneral's without bias ('kernel', [D, V], the same initial
  values), so checkpoints are unchanged; the matmul is `untied_projection`'s.
  """

  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.kernel = self.param(
      "kernel", dense_init(("embed", "vocab")), (cfg.d_model, cfg.vocab_size), cfg.param_dtype
    )

  def weight(self) -> Array:
    """The kernel [D, V] in the compute dtype."""
    return jnp.asarray(self.kernel, self.config.dtype)

  def __call__(self, x_BxLxD: Array) -> Array:
    x_BxLxD, kernel_DxV = promote_dtype(x_BxLxD, self.kernel, dtype=self.config.dtype)
    batch, length, d_model = x_BxLxD.shape
    logits_NxV = untied_projection(x_BxLxD.reshape(batch * length, d_model), kernel_DxV)
    return logits_NxV.reshape(batch, length, -1)


def tied_projection(x_NxD: Array, table_VxD: Array) -> Array:
  """Logits x E^T in f32, for the tied pre-softmax projection (see `_logits`)."""
  return _logits(x_NxD, table_VxD, True)


def untied_projection(x_NxD: Array, kernel_DxV: Array) -> Array:
  """Logits x W in f32, for the untied pre-softmax projection (see `_logits`)."""
  return _logits(x_NxD, kernel_DxV, False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _logits(x_NxD: Array, weight: Array, weight_is_VxD: bool) -> Array:
  """Logits [N, V] of x and the output weight ([V, D] if `weight_is_VxD`, else [D, V]),
  accumulated in f32 and never rounded to the compute dtype.

  The backward pass is written out for two reasons. Left to autodiff, the f32 logit
  gradient would turn both backward matmuls into f32 ones; here they run in the compute
  dtype with f32 sums. And the weight gradient is computed as x^T g, [D, V]: the [N, V]
  logit gradient (the largest array of a step) is never transposed, only the smaller
  result. Left to itself XLA:CPU copies g transposed first, which took as long as a
  vocabulary matmul (docs/performance.md).
  """
  spec = "nd,vd->nv" if weight_is_VxD else "nd,dv->nv"
  return jnp.einsum(spec, x_NxD, weight, preferred_element_type=jnp.float32)


def _logits_forward(x_NxD, weight, weight_is_VxD):
  return _logits(x_NxD, weight, weight_is_VxD), (x_NxD, weight)


def _logits_backward(weight_is_VxD, residuals, grad_NxV):
  x_NxD, weight = residuals
  grad_NxV = grad_NxV.astype(x_NxD.dtype)  # bf16 matmuls in mixed precision, f32 sums
  spec = "nv,vd->nd" if weight_is_VxD else "nv,dv->nd"
  grad_x_NxD = jnp.einsum(spec, grad_NxV, weight, preferred_element_type=jnp.float32)
  grad_weight_DxV = jnp.einsum("nd,nv->dv", x_NxD, grad_NxV, preferred_element_type=jnp.float32)
  grad_weight = grad_weight_DxV.T if weight_is_VxD else grad_weight_DxV
  return grad_x_NxD.astype(x_NxD.dtype), grad_weight.astype(weight.dtype)


_logits.defvjp(_logits_forward, _logits_backward)


class InputEmbedding(nn.Module):
  """ids -> embedding * sqrt(D) + positions, then dropout (the paper's input sum), in
  the residual stream's float32 (primitives.RESIDUAL_DTYPE)."""

  config: ModelConfig
  embed: Embed

  @nn.compact
  def __call__(self, ids_BxL, positions_BxL, deterministic):
    cfg = self.config
    x_BxLxD = self.embed(ids_BxL).astype(RESIDUAL_DTYPE) * math.sqrt(cfg.d_model)
    if cfg.positional == "sinusoidal":
      x_BxLxD = x_BxLxD + sinusoidal_encoding(positions_BxL, cfg.d_model).astype(x_BxLxD.dtype)
    elif cfg.positional == "learned":
      table_PxD = self.param(
        "position_embedding",
        nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02), ("length", "embed")),
        (cfg.max_position, cfg.d_model),
        cfg.param_dtype,
      )
      x_BxLxD = x_BxLxD + jnp.take(table_PxD, positions_BxL, axis=0).astype(x_BxLxD.dtype)
    # rope: positions enter inside attention, nothing is added here.
    # Fixed here because the gather from the table (vocab over tensor, embed over fsdp)
    # would otherwise hand its own layout to the whole stack.
    x_BxLxD = constrain(x_BxLxD, BLD)
    return Dropout(cfg.dropout_rate)(x_BxLxD, deterministic=deterministic)


class FeedForward(nn.Module):
  """max(0, x W1 + b1) W2 + b2 (paper), or with GELU, or SwiGLU (gated, no biases)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxLxD: Array) -> Array:
    cfg = self.config
    dense = lambda features, axes, name, use_bias=True: nn.Dense(
      features,
      use_bias=use_bias,
      name=name,
      kernel_init=dense_init(axes),
      bias_init=zeros_init(axes[-1:]),
      dtype=cfg.dtype,
      param_dtype=cfg.param_dtype,
    )
    gated = cfg.activation == "swiglu"
    if gated:
      gate_BxLxF = dense(cfg.d_ff, ("embed", "mlp"), "wi_gate", use_bias=False)(x_BxLxD)
      up_BxLxF = dense(cfg.d_ff, ("embed", "mlp"), "wi_up", use_bias=False)(x_BxLxD)
      hidden_BxLxF = nn.silu(gate_BxLxF) * up_BxLxF
    else:
      activations: dict[str, Callable[[Array], Array]] = {"relu": relu, "gelu": nn.gelu}
      activation = activations[cfg.activation]
      hidden_BxLxF = activation(dense(cfg.d_ff, ("embed", "mlp"), "wi")(x_BxLxD))
    hidden_BxLxF = constrain(hidden_BxLxF, BLF)
    out_BxLxD = dense(cfg.d_model, ("mlp", "embed"), "wo", use_bias=not gated)(hidden_BxLxF)
    return constrain(out_BxLxD, BLD)


class Sublayer(nn.Module):
  """Residual wrapper: post-LN `LN(x + Dropout(F(x)))` or pre-LN `x + Dropout(F(LN(x)))`."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxLxD: Array, sublayer, deterministic: bool) -> Array:
    cfg = self.config
    norm = layer_norm(cfg, "norm")
    dropout = Dropout(cfg.dropout_rate)
    if cfg.norm == "pre":
      y_BxLxD = x_BxLxD + dropout(sublayer(norm(x_BxLxD)), deterministic=deterministic)
    else:
      y_BxLxD = norm(x_BxLxD + dropout(sublayer(x_BxLxD), deterministic=deterministic))
    return constrain(y_BxLxD, BLD)


# The layers take their Python flags (deterministic, use_cache) as module attributes, not
# call arguments: under jax.checkpoint (remat) and nn.scan every call argument is traced,
# and attributes stay static without positional bookkeeping.


class EncoderLayer(nn.Module):
  """Self-attention, then feed-forward, each in a residual sublayer."""

  config: ModelConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x_BxSxD, mask, positions_BxS):
    cfg, deterministic = self.config, self.deterministic
    attention = MultiHeadAttention(cfg, self_attention=True, name="self_attention")
    x_BxSxD = Sublayer(cfg, name="attention_block")(
      x_BxSxD,
      lambda y: attention(y, mask, positions_BxL=positions_BxS, deterministic=deterministic),
      deterministic,
    )
    return Sublayer(cfg, name="ffn_block")(x_BxSxD, FeedForward(cfg, name="ffn"), deterministic)


class DecoderLayer(nn.Module):
  """Causal self-attention, cross-attention to the final encoder output, feed-forward."""

  config: ModelConfig
  deterministic: bool = True
  use_cache: bool = False

  @nn.compact
  def __call__(
    self,
    y_BxTxD,
    self_mask,
    positions_BxT,
    memory_BxSxD,
    cross_mask,
    cache_position: Array | None = None,
  ):
    cfg, deterministic = self.config, self.deterministic
    self_attention = MultiHeadAttention(cfg, self_attention=True, name="self_attention")
    y_BxTxD = Sublayer(cfg, name="self_attention_block")(
      y_BxTxD,
      lambda z: self_attention(
        z,
        self_mask,
        positions_BxL=positions_BxT,
        deterministic=deterministic,
        use_cache=self.use_cache,
        cache_position=cache_position,
      ),
      deterministic,
    )
    if not cfg.decoder_only:
      # Queries come from the decoder state after its self-attention sublayer; keys and
      # values are this layer's own projections of the final encoder output.
      cross_attention = MultiHeadAttention(cfg, self_attention=False, name="cross_attention")
      y_BxTxD = Sublayer(cfg, name="cross_attention_block")(
        y_BxTxD,
        lambda z: cross_attention(
          z,
          cross_mask,
          memory_BxSxD=memory_BxSxD,
          deterministic=deterministic,
          use_cache=self.use_cache,
        ),
        deterministic,
      )
    return Sublayer(cfg, name="ffn_block")(y_BxTxD, FeedForward(cfg, name="ffn"), deterministic)
