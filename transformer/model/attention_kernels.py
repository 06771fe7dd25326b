"""softmax(Q K^T / sqrt(d_k)) V: one interface, several kernels (`model.attention_kernel`).

Each kernel is one record, a `Kernel` in KERNELS: its functions and what it can do. Every
kernel has

    attend(q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, mask: AttentionMask) -> out_BxLxHxE

taking Q, K and V in the compute dtype and returning the heads' outputs in V's dtype.
Scores are accumulated and soft-maxed in f32 whatever the compute dtype (mixed precision
keeps the softmax statistics in f32), and the weights meet V in V's dtype. Where a query
has no key it may attend to (a padding query), its output is unspecified: no loss or
later layer reads it (a real query never attends to padding, segment id 0). A kernel
may also have

  attend_with_ones     the same from V with a column of ones appended, [B, S, H, E+1],
                       which MultiHeadAttention's projection writes itself
                       (`Projection.ones_column`): it saves a copy of V;
  attend_with_weights  the same, handing the f32 weights [B, H, L, S] to `on_weights`
                       and multiplying V by what it returns: attention maps and
                       attention dropout need them;
  decode               one decoding step's attention over the cache (`Decode`, below).

What a kernel lacks for attention maps and cached decoding it takes from the default
kernel (DEFAULT, einsum: `Kernel.attend_with_weights_or_default`, `decode_or_default`).
What cannot fall back is refused when the model is built (`kernel_for`): attention
dropout, d_k != d_v, a compute dtype the kernel does not take.

  einsum      written out in XLA ops: the f32 scores [B, H, L, S] are formed, soft-maxed
              and multiplied by V (`softmax_attention`, below, for training and
              scoring). The one kernel with every form: attention dropout and maps
              (`einsum_attention`), the ones column, and cached decoding
              (`cached_attention`).
  xla         jax.nn.dot_product_attention's XLA form, from the dense mask.
  cudnn       cuDNN's flash attention on GPU (jax.nn.dot_product_attention), same mask.
  tpu_flash   the Pallas FlashAttention kernel for TPU
              (jax.experimental.pallas.ops.tpu.flash_attention): tiles of Q against tiles
              of K and V in on-chip memory, the [L, S] scores never written to HBM
              (FlashAttention, Dao et al. 2022). It reads the mask as segment ids and
              causality, never as a dense [B, 1, L, S] array, and runs per device under
              shard_map (a custom call is opaque to XLA's partitioner). On CPU it runs
              only inside `jax.experimental.pallas.tpu.force_tpu_interpret_mode()`
              (its record's `cpu_interpreter`), as the tests do.

Adding a kernel is its functions, one entry in KERNELS, and its name among config/schema.py's
ATTENTION_KERNELS (the choices a config is checked against; config sits below the
model and cannot read KERNELS, and a test keeps the two equal). The tests over every
kernel (tests/test_model_attention_kernels.py) then hold it to the einsum path's
outputs, gradients and decoding wherever its record says it can run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from transformer.config import ConfigError
from transformer.model.primitives import (
  BATCH,
  HEADS,
  LENGTH,
  MASKED_LOGIT,
  Array,
  ModelConfig,
  attention_mask,
  constrain,
)


@struct.dataclass
class AttentionMask:
  """Who may attend to whom, as segment ids: a query may attend to a key of its own
  segment that is not padding (id 0), and with `causal` only to keys at or before it.
  Unpacked rows have segment ids `tokens != PAD_ID` (one segment and its padding).

  q_segment_ids_BxL: int32 [B, L]; kv_segment_ids_BxS: int32 [B, S].
  """

  q_segment_ids_BxL: Array
  kv_segment_ids_BxS: Array
  causal: bool = struct.field(pytree_node=False, default=False)

  def dense(self) -> Array:
    """bool [B, 1, L, S], broadcast over heads."""
    return attention_mask(self.q_segment_ids_BxL, self.kv_segment_ids_BxS, self.causal)


Attend = Callable[[Array, Array, Array, AttentionMask], Array]
AttendWithWeights = Callable[
  [Array, Array, Array, AttentionMask, Callable[[Array], Array] | None], Array
]
# decode(q_BxLxHxK, k_RxHxKxS, v_RxHxSxE, mask_Bx1xLxS) -> out_BxLxHxE: attention over
# the decoding cache, laid out as attention.py stores it (K [R, H, K, S], V [R, H, S, E],
# R = B / W rows each serving W adjacent query rows), with the slots each query sees as a
# dense bool mask (a row's position may differ from its neighbours').
Decode = Callable[[Array, Array, Array, Array], Array]


# ----------------------------------------------------------------------------------
# Written out.


def einsum_attention(
  q_BxLxHxK: Array,
  k_BxSxHxK: Array,
  v_BxSxHxE: Array,
  mask: AttentionMask,
  on_weights: Callable[[Array], Array] | None = None,
) -> Array:
  """Scores, mask, softmax and weights x V as separate ops, fused by XLA where it can.

  `on_weights` gets the f32 weights [B, H, L, S] and returns what meets V (the module
  sows them for attention maps and applies attention dropout); without it they are cast
  to V's dtype.
  """
  weights_BxHxLxS = jax.nn.softmax(_masked_scores(q_BxLxHxK, k_BxSxHxK, mask), axis=-1)
  # Weights in [0, 1] lose little in bf16 (relative rounding only), and weights x V is
  # a matmul as large as Q K^T: it runs at the compute dtype's speed.
  if on_weights is None:
    weights_BxHxLxS = weights_BxHxLxS.astype(v_BxSxHxE.dtype)
  else:
    weights_BxHxLxS = on_weights(weights_BxHxLxS)
  return jnp.einsum("bhls,bshe->blhe", weights_BxHxLxS, v_BxSxHxE)


def cached_attention(
  q_BxLxHxK: Array, k_RxHxKxS: Array, v_RxHxSxE: Array, mask_Bx1xLxS: Array
) -> Array:
  """The einsum kernel's `decode`: softmax(Q K^T / sqrt(d_k)) V over the cache, whose K
  [R, H, K, S] and V [R, H, S, E] are laid out as the two matmuls read them (batch
  dimensions first, the contracted one next): stored [B, S, H, K] instead, XLA:CPU
  copied every layer's K and V transposed at every decoding step, which took longer
  than the step's matmuls (docs/performance.md). Decoding has no dropout.

  The cache may have fewer rows than the queries, R = B / W: then each of its rows
  serves W adjacent query rows. Beam search keeps the cross-attention K/V once per
  sentence for its W hypotheses (rows b * W + w), so each sentence's W x L queries
  meet them in one matmul, M = W x L rows against the sentence's S slots; repeated
  per hypothesis, they were read W times over at every step.
  """
  batch, length, heads, d_k = q_BxLxHxK.shape
  rows, source_len = k_RxHxKxS.shape[0], k_RxHxKxS.shape[-1]
  group_rows = batch // rows * length  # M
  q_RxHxMxK = q_BxLxHxK.reshape(rows, group_rows, heads, -1).transpose(0, 2, 1, 3)
  logits_RxHxMxS = jnp.einsum(
    "rhmk,rhks->rhms", q_RxHxMxK, k_RxHxKxS, preferred_element_type=jnp.float32
  ) / math.sqrt(d_k)
  mask_Rx1xMxS = jnp.broadcast_to(mask_Bx1xLxS, (batch, 1, length, source_len)).reshape(
    rows, 1, group_rows, source_len
  )
  logits_RxHxMxS = jnp.where(mask_Rx1xMxS, logits_RxHxMxS, MASKED_LOGIT)
  weights_RxHxMxS = jax.nn.softmax(logits_RxHxMxS, axis=-1).astype(v_RxHxSxE.dtype)
  out_RxHxMxE = jnp.einsum("rhms,rhse->rhme", weights_RxHxMxS, v_RxHxSxE)
  return out_RxHxMxE.transpose(0, 2, 1, 3).reshape(batch, length, heads, -1)


# ----------------------------------------------------------------------------------
# Written out, with the softmax's statistics kept for the backward pass.


def softmax_attention(
  q_BxLxHxK: Array, k_BxSxHxK: Array, v_BxSxHxE: Array, mask: AttentionMask
) -> Array:
  """The einsum kernel: einsum_attention's result, computed as below."""
  ones_BxSxHx1 = jnp.ones(v_BxSxHxE.shape[:-1] + (1,), v_BxSxHxE.dtype)
  return softmax_attention_with_ones(
    q_BxLxHxK, k_BxSxHxK, jnp.concatenate([v_BxSxHxE, ones_BxSxHx1], axis=-1), mask
  )


@jax.custom_vjp
def softmax_attention_with_ones(
  q_BxLxHxK: Array, k_BxSxHxK: Array, v_and_ones_BxSxHxE1: Array, mask: AttentionMask
) -> Array:
  """softmax(Q K^T / sqrt(d_k)) V from V with a column of ones appended, [B, S, H, E+1].

  E = exp(scores - row max) multiplies [V | 1] in one matmul, whose last column is the
  softmax's denominator, sum_s E: the output is its first E columns divided by it. On
  TPU this is the cheap way to that sum: XLA's compiler otherwise reduces the f32
  [B, H, L, S] exponentials in a pass of their own, which its cost model puts at five
  times the P V matmul that the ones column rides along (docs/performance.md). The
  backward pass is FlashAttention's (Dao et al. 2022) in XLA ops: it keeps the row
  max and 1 / sum per query, not the weights, recomputes P from them and takes
  the softmax's correction from dO . O ([B, L, H]), not from the [B, H, L, S] dP * P.
  Returns [B, L, H, E] in V's dtype; the ones column gets no gradient.
  """
  return _softmax_attention_forward(q_BxLxHxK, k_BxSxHxK, v_and_ones_BxSxHxE1, mask)[0]


def _masked_scores(q_BxLxHxK, k_BxSxHxK, mask):
  """f32 [B, H, L, S]: Q K^T / sqrt(d_k), MASKED_LOGIT where the mask says no. Scaled
  in f32, where 1/sqrt(d_k) costs no rounding of q, and fused by XLA with the mask."""
  scores_BxHxLxS = constrain(
    attention_scores(q_BxLxHxK, k_BxSxHxK), (BATCH, HEADS, LENGTH, None)
  ) / math.sqrt(q_BxLxHxK.shape[-1])
  return jnp.where(mask.dense(), scores_BxHxLxS, MASKED_LOGIT)


def _softmax_attention_forward(q_BxLxHxK, k_BxSxHxK, v_and_ones_BxSxHxE1, mask):
  scores_BxHxLxS = _masked_scores(q_BxLxHxK, k_BxSxHxK, mask)
  max_BxHxLx1 = jnp.max(scores_BxHxLxS, axis=-1, keepdims=True)
  # In [0, 1], and 1 at the row's maximum, so the sum below is at least 1. They meet V
  # in V's dtype, as einsum_attention's weights do, and the sum is of the same values.
  exp_BxHxLxS = jnp.exp(scores_BxHxLxS - max_BxHxLx1).astype(v_and_ones_BxSxHxE1.dtype)
  out_and_sum_BxLxHxE1 = jnp.einsum(
    "bhls,bshe->blhe", exp_BxHxLxS, v_and_ones_BxSxHxE1, preferred_element_type=jnp.float32
  )
  inverse_sum_BxLxHx1 = 1.0 / out_and_sum_BxLxHxE1[..., -1:]
  out_BxLxHxE = out_and_sum_BxLxHxE1[..., :-1] * inverse_sum_BxLxHx1
  # The statistics as the max and 1 / sum, not as log-sum-exp: a query with no key to
  # attend to (padding) has max MASKED_LOGIT, and -1e9 + log(sum) rounds to -1e9 in
  # f32, which would make its recomputed weights 1 instead of einsum_attention's 1/S.
  statistics = (max_BxHxLx1, inverse_sum_BxLxHx1.transpose(0, 2, 1, 3))
  out_BxLxHxE = out_BxLxHxE.astype(v_and_ones_BxSxHxE1.dtype)
  return out_BxLxHxE, (q_BxLxHxK, k_BxSxHxK, v_and_ones_BxSxHxE1, mask, out_BxLxHxE, statistics)


def _softmax_attention_backward(residuals, grad_out_BxLxHxE):
  q_BxLxHxK, k_BxSxHxK, v_and_ones_BxSxHxE1, mask, out_BxLxHxE, statistics = residuals
  max_BxHxLx1, inverse_sum_BxHxLx1 = statistics
  v_BxSxHxE = v_and_ones_BxSxHxE1[..., :-1]
  scores_BxHxLxS = _masked_scores(q_BxLxHxK, k_BxSxHxK, mask)
  weights_BxHxLxS = jnp.exp(scores_BxHxLxS - max_BxHxLx1) * inverse_sum_BxHxLx1
  grad_out_BxLxHxE = grad_out_BxLxHxE.astype(v_BxSxHxE.dtype)
  grad_v_BxSxHxE = jnp.einsum(
    "bhls,blhe->bshe",
    weights_BxHxLxS.astype(v_BxSxHxE.dtype),
    grad_out_BxLxHxE,
    preferred_element_type=jnp.float32,
  )
  grad_weights_BxHxLxS = jnp.einsum(
    "blhe,bshe->bhls", grad_out_BxLxHxE, v_BxSxHxE, preferred_element_type=jnp.float32
  )
  # sum_s P dP = dO . O: the softmax's correction per query, from [B, L, H, E] arrays.
  correction_BxLxH = jnp.sum(
    grad_out_BxLxHxE.astype(jnp.float32) * out_BxLxHxE.astype(jnp.float32), axis=-1
  )
  grad_scores_BxHxLxS = (
    weights_BxHxLxS
    * (grad_weights_BxHxLxS - correction_BxLxH.transpose(0, 2, 1)[..., None])
    / math.sqrt(q_BxLxHxK.shape[-1])
  )
  # Masked scores are the constant MASKED_LOGIT: no gradient reaches Q or K through
  # them. (Their weights are 0 but for a query with no key to attend to, whose are 1/S.)
  grad_scores_BxHxLxS = jnp.where(mask.dense(), grad_scores_BxHxLxS, 0.0).astype(q_BxLxHxK.dtype)
  grad_q_BxLxHxK = jnp.einsum(
    "bhls,bshk->blhk", grad_scores_BxHxLxS, k_BxSxHxK, preferred_element_type=jnp.float32
  )
  grad_k_BxSxHxK = jnp.einsum(
    "bhls,blhk->bshk", grad_scores_BxHxLxS, q_BxLxHxK, preferred_element_type=jnp.float32
  )
  no_grad_for_ones = ((0, 0), (0, 0), (0, 0), (0, 1))
  return (
    grad_q_BxLxHxK.astype(q_BxLxHxK.dtype),
    grad_k_BxSxHxK.astype(k_BxSxHxK.dtype),
    jnp.pad(grad_v_BxSxHxE, no_grad_for_ones).astype(v_and_ones_BxSxHxE1.dtype),
    None,  # the mask's segment ids: integers
  )


softmax_attention_with_ones.defvjp(_softmax_attention_forward, _softmax_attention_backward)


@jax.custom_vjp
def attention_scores(q_BxLxHxK: Array, k_BxSxHxK: Array) -> Array:
  """Q K^T, unscaled, as f32 [B, H, L, S] whatever the dtype of q and k.

  Accumulated in f32 and never rounded to the compute dtype: scores of a few tens
  rounded to bf16 (8 significant bits) move by ~0.1, visibly reshaping the softmax.
  The backward pass is written out so its two matmuls stay in the compute dtype, the
  f32 cotangent cast down to it: left to autodiff, that f32 cotangent would turn them
  into f32 matmuls (q and k widened), twice the cost on accelerators.
  """
  return jnp.einsum("blhk,bshk->bhls", q_BxLxHxK, k_BxSxHxK, preferred_element_type=jnp.float32)


def _attention_scores_forward(q_BxLxHxK, k_BxSxHxK):
  return attention_scores(q_BxLxHxK, k_BxSxHxK), (q_BxLxHxK, k_BxSxHxK)


def _attention_scores_backward(residuals, grad_BxHxLxS):
  q_BxLxHxK, k_BxSxHxK = residuals
  grad_BxHxLxS = grad_BxHxLxS.astype(q_BxLxHxK.dtype)
  grad_q_BxLxHxK = jnp.einsum(
    "bhls,bshk->blhk", grad_BxHxLxS, k_BxSxHxK, preferred_element_type=jnp.float32
  )
  grad_k_BxSxHxK = jnp.einsum(
    "bhls,blhk->bshk", grad_BxHxLxS, q_BxLxHxK, preferred_element_type=jnp.float32
  )
  return grad_q_BxLxHxK.astype(q_BxLxHxK.dtype), grad_k_BxSxHxK.astype(k_BxSxHxK.dtype)


attention_scores.defvjp(_attention_scores_forward, _attention_scores_backward)


# ----------------------------------------------------------------------------------
# jax.nn.dot_product_attention: XLA's fused form, or cuDNN's flash attention on GPU.


def _dot_product_attention(implementation: str) -> Attend:
  def kernel(q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, mask):
    # No precision argument, and none is needed: the xla form takes bf16 Q K^T with
    # preferred_element_type=f32 (the BF16_BF16_F32 dot algorithm) and a f32 softmax,
    # cuDNN keeps the scores in f32 inside the kernel; both cast the weights to V's dtype.
    return jax.nn.dot_product_attention(
      q_BxLxHxK,
      k_BxSxHxK,
      v_BxSxHxE,
      mask=mask.dense(),
      scale=1.0 / math.sqrt(q_BxLxHxK.shape[-1]),
      implementation=implementation,
    )

  return kernel


# ----------------------------------------------------------------------------------
# Pallas FlashAttention on TPU.

# The kernel's tile along L and S. 128 fills the TPU's 128-lane vector registers and
# MXU rows, and the kernel needs key tiles of a multiple of it; a query sequence
# shorter than 128 is one tile, rounded up to the 8-row sublane.
_TPU_TILE = 128


def _tile_len(length: int, keys: bool) -> tuple[int, int]:
  """(tile, padded length): 128-row tiles, or for queries one tile of up to 128 rows."""
  if length <= _TPU_TILE and not keys:
    tile = -(-length // 8) * 8
    return tile, tile
  return _TPU_TILE, -(-length // _TPU_TILE) * _TPU_TILE


def tpu_flash_attention(q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, mask):
  return _per_device(tpu_flash_on_one_device)(
    q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, mask.q_segment_ids_BxL, mask.kv_segment_ids_BxS, mask.causal
  )


def tpu_flash_on_one_device(q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, q_ids_BxL, kv_ids_BxS, causal):
  """The Pallas kernel on one device's arrays: Q, K, V padded to whole tiles and laid
  out heads first, as the kernel reads them; returns [B, L, H, E] in V's dtype."""
  # Imported here: Pallas's TPU modules are needed only by this kernel.
  from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash

  length, source_len = q_BxLxHxK.shape[1], k_BxSxHxK.shape[1]
  q_tile, padded_len = _tile_len(length, keys=False)
  kv_tile, padded_source_len = _tile_len(source_len, keys=True)

  def heads_first(x_BxLxHxK, padded):
    # [B, H, L, K], the kernel's layout; padding rows get segment id 0, which no real
    # query attends to, and their own outputs are cut off below.
    x_BxLxHxK = jnp.pad(x_BxLxHxK, ((0, 0), (0, padded - x_BxLxHxK.shape[1]), (0, 0), (0, 0)))
    return x_BxLxHxK.transpose(0, 2, 1, 3)

  def padded_ids(ids_BxL, padded):
    return jnp.pad(ids_BxL.astype(jnp.int32), ((0, 0), (0, padded - ids_BxL.shape[1])))

  out_BxHxLxE = pallas_flash.flash_attention(
    heads_first(q_BxLxHxK, padded_len),
    heads_first(k_BxSxHxK, padded_source_len),
    heads_first(v_BxSxHxE, padded_source_len),
    segment_ids=pallas_flash.SegmentIds(
      q=padded_ids(q_ids_BxL, padded_len), kv=padded_ids(kv_ids_BxS, padded_source_len)
    ),
    causal=causal,
    sm_scale=1.0 / math.sqrt(q_BxLxHxK.shape[-1]),
    block_sizes=pallas_flash.BlockSizes(
      block_q=q_tile,
      block_k_major=kv_tile,
      block_k=kv_tile,
      block_b=1,
      block_q_major_dkv=q_tile,
      block_k_major_dkv=kv_tile,
      block_k_dkv=kv_tile,
      block_q_dkv=q_tile,
      block_k_major_dq=kv_tile,
      block_k_dq=kv_tile,
      block_q_dq=q_tile,
    ),
  )
  return out_BxHxLxE.transpose(0, 2, 1, 3)[:, :length].astype(v_BxSxHxE.dtype)


def _per_device(kernel):
  """`kernel(q, k, v, q_ids, kv_ids, causal)` run on each device's rows and heads.

  A Pallas call is a custom call that XLA's partitioner cannot split: left to it, a
  sharded Q, K and V would be gathered whole onto every device. Under the model's
  activation sharding (a mesh and axis rules in context), shard_map hands each device
  its own rows and heads, as the rules place them; lengths and d_k stay whole, which
  attention needs. Without a mesh (the model called directly) the kernel runs as is.
  """

  def run(q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, q_ids_BxL, kv_ids_BxS, causal):
    mesh = jax.sharding.get_abstract_mesh()
    rules = nn.get_logical_axis_rules()
    if mesh.empty or not rules:
      return kernel(q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, q_ids_BxL, kv_ids_BxS, causal)
    rows, heads = nn.logical_to_mesh_axes((BATCH, HEADS), rules)
    qkv_spec = jax.P(rows, None, heads, None)
    ids_spec = jax.P(rows, None)
    return jax.shard_map(
      lambda *arrays: kernel(*arrays, causal),
      mesh=mesh,
      in_specs=(qkv_spec, qkv_spec, qkv_spec, ids_spec, ids_spec),
      out_specs=qkv_spec,
      check_vma=False,
    )(q_BxLxHxK, k_BxSxHxK, v_BxSxHxE, q_ids_BxL, kv_ids_BxS)

  return run


# ----------------------------------------------------------------------------------
# The kernels and what each can do.


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One attention kernel: its functions (the module docstring's forms) and what it can
  do. A form it lacks is None: the `_or_default` methods lend the default kernel's
  where that may stand in (attention maps, decoding), and `kernel_for` refuses the model
  where it may not (attention dropout)."""

  name: str  # as model.attention_kernel names it
  attend: Attend
  platforms: tuple[str, ...]  # where it runs, as config.PLATFORMS names them
  attend_with_ones: Attend | None = None
  attend_with_weights: AttendWithWeights | None = None  # attention maps and dropout
  decode: Decode | None = None
  any_value_size: bool = False  # d_v may differ from d_k
  dtypes: tuple[str, ...] | None = None  # the compute dtypes it takes; None: any
  # Where it runs on a CPU only emulated: a context manager the call runs inside.
  cpu_interpreter: Callable[[], contextlib.AbstractContextManager] | None = None

  def decode_or_default(self) -> Decode:
    """`decode`, or the default kernel's (DEFAULT.decode) where this kernel has none."""
    return self.decode or cached_attention

  def attend_with_weights_or_default(self) -> AttendWithWeights:
    """`attend_with_weights`, or the default kernel's where this kernel has none."""
    return self.attend_with_weights or einsum_attention

  def unsupported(self, cfg: ModelConfig) -> str | None:
    """Why this kernel cannot serve a model of `cfg` (one line), or None if it can."""
    if cfg.d_k != cfg.d_v and not self.any_value_size:
      return f"{self.name} needs d_k == d_v, got {cfg.d_k} and {cfg.d_v}; use {DEFAULT.name}"
    if cfg.attention_dropout_rate > 0 and self.attend_with_weights is None:
      return (
        f"{self.name} has no attention dropout; use {DEFAULT.name} or set "
        "model.attention_dropout_rate=0"
      )
    if self.dtypes is not None and cfg.dtype.name not in self.dtypes:
      return f"{self.name} computes in {' or '.join(self.dtypes)} only, not {cfg.dtype.name}"
    return None


def _pallas_interpret_mode() -> contextlib.AbstractContextManager:
  # Imported here: Pallas's TPU modules are needed only by the tpu_flash kernel.
  from jax.experimental.pallas import tpu as pallas_tpu

  return pallas_tpu.force_tpu_interpret_mode()


_EVERYWHERE = ("cpu", "tpu", "cuda", "rocm")

DEFAULT = Kernel(
  "einsum",
  softmax_attention,
  _EVERYWHERE,
  attend_with_ones=softmax_attention_with_ones,
  attend_with_weights=einsum_attention,
  decode=cached_attention,
  any_value_size=True,
)

KERNELS: dict[str, Kernel] = {
  kernel.name: kernel
  for kernel in (
    DEFAULT,
    Kernel("xla", _dot_product_attention("xla"), _EVERYWHERE),
    # cuDNN's flash attention takes 16-bit inputs only (float16 is no model dtype).
    Kernel("cudnn", _dot_product_attention("cudnn"), ("cuda",), dtypes=("bfloat16",)),
    Kernel("tpu_flash", tpu_flash_attention, ("tpu",), cpu_interpreter=_pallas_interpret_mode),
  )
}


def kernel_for(cfg: ModelConfig) -> Kernel:
  """The kernel `cfg.attention_kernel` names; a ConfigError naming the key if there is
  none of that name or it cannot serve this model (Kernel.unsupported)."""
  if cfg.attention_kernel not in KERNELS:
    raise ConfigError(
      f"config.model.attention_kernel: {cfg.attention_kernel!r} is not one of {', '.join(KERNELS)}"
    )
  kernel = KERNELS[cfg.attention_kernel]
  problem = kernel.unsupported(cfg)
  if problem is not None:
    raise ConfigError(f"config.model.attention_kernel: {problem}")
  return kernel
