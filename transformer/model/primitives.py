"""What every module of the model uses: its config, initializers, masks and positions.

Shape letters in names (`x_BxTxD` is x with shape [B, T, D]):
  B batch            S source length      T target length     L any length
  D d_model          H heads              K d_k (query/key)   E d_v (value)
  F d_ff             V vocabulary         C decoding cache length (slots)
Generation (transformer/model/decoding) adds:
  W beam width       N rows through the model (B * W)     P prompt length
  O output length    J draft tokens per speculative round   M candidates per row
  G chunks of a row  U entries per chunk (beam.top_k)
and the sums O1 = O + 1 (a BOS slot, then the outputs), J1 = J + 1. Letters written
together are a product (BL = B * L rows). The cached attention
(attention_kernels.cached_attention) adds R cache rows, and there M counts the query rows
that meet one cache row; the shallow draft (draft.py) adds Z, its shortlist's length.

Every parameter names logical axes (`vocab`, `embed`, `heads`, `kv`, `mlp`, `length`),
and the activations that matter are constrained to `activation_*` axes (`constrain`);
the training code maps both onto the device mesh, the model never sees it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import PartitionSpec

from transformer.config import AUTO, PAD_ID, position_table_size, resolve_auto

Array = jax.Array

# Masked attention logits get this instead of -inf, so an all-masked row (a padding
# query) gives a finite uniform softmax, not NaN; exp() of it underflows to exactly 0.
MASKED_LOGIT = -1e9

# Logical axes of activations. They are named apart from the parameters' axes because
# the two go to different mesh axes: a weight's `embed` dimension is split over fsdp,
# while a batch of activations already uses fsdp for its rows, and one array can use a
# mesh axis only once. config.logical_axis_rules says where each goes.
BATCH = "activation_batch"
LENGTH = "activation_length"
EMBED = "activation_embed"
HEADS = "activation_heads"
KV = "activation_kv"  # per-head d_k or d_v
MLP = "activation_mlp"
VOCAB = "activation_vocab"
BLD = (BATCH, LENGTH, EMBED)
BLHK = (BATCH, LENGTH, HEADS, KV)
BLF = (BATCH, LENGTH, MLP)
BLV = (BATCH, LENGTH, VOCAB)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Everything the modules read; built once from the run config (`from_config`).

  `dtype` is the compute dtype of activations and matmuls, `param_dtype` that of the
  parameters (and so of the optimizer state), as flax's layers name them.
  """

  vocab_size: int
  max_position: int  # rows of the learned position table (config.position_table_size)
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
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  layer_norm_epsilon: float = 1e-6
  scan_layers: bool = False
  remat: str = "none"
  attention_kernel: str = "einsum"
  # With scan_layers: each layer's parameter gradients leave the layer loop split over
  # the mesh's data axis (a reduce-scatter per layer, not an all-reduce), as
  # config.shard_optimizer_state keeps them (transformer.py: _split_layer_grads).
  split_layer_grads: bool = False

  def __post_init__(self):
    # Config files name dtypes as strings; modules want jnp dtypes. One conversion, here.
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))

  @classmethod
  def from_config(
    cls, config: ml_collections.ConfigDict, platform: str | None = None
  ) -> ModelConfig:
    """Reads `config.model`'s keys that are fields here, plus the vocabulary and lengths.

    An "auto" dtype or attention kernel is resolved for `platform` (config.PLATFORMS),
    by default the one this process runs on (`current_platform`): a tool that compiles
    for another, as compile_check does for TPUs, names it.
    """
    model = {
      f.name: config.model[f.name] for f in dataclasses.fields(cls) if f.name in config.model
    }
    if AUTO in (config.model.dtype, config.model.attention_kernel):
      model.update(resolve_auto(config.model, platform or current_platform()))
    return cls(
      vocab_size=config.vocab_size,
      max_position=position_table_size(config),
      split_layer_grads=config.shard_optimizer_state,
      **model,
    )


def current_platform() -> str:
  """This process's platform as config.resolve_auto names it: jax.default_backend(),
  with a GPU named by its maker ("cuda" for NVIDIA's, whose device kinds name it)."""
  backend = jax.default_backend()
  if backend != "gpu":
    return backend
  return "cuda" if "nvidia" in jax.devices()[0].device_kind.lower() else "rocm"


def split_spec(
  spec: PartitionSpec, shape: Sequence[int], mesh_shape: Mapping[str, int], axis: str
) -> PartitionSpec:
  """`spec` with one more split, over the mesh axis `axis`, of the dimension whose part on
  each device is longest among those it then still divides evenly (beside any axes
  already splitting it). Unchanged where the axis has size 1, the spec already uses it,
  or no dimension qualifies (a scalar, say). One rule for the optimizer's state
  (run/sharding.py: split_over) and the layers' gradients (transformer.py), so the two
  agree."""
  entries = list(spec) + [None] * (len(shape) - len(spec))
  axes = [() if e is None else e if isinstance(e, tuple) else (e,) for e in entries]
  per_device = [n // math.prod(mesh_shape[a] for a in names) for n, names in zip(shape, axes)]
  size = mesh_shape.get(axis, 1)
  fits = [i for i, n in enumerate(per_device) if n % size == 0]
  if size == 1 or any(axis in names for names in axes) or not fits:
    return spec
  i = max(fits, key=lambda i: per_device[i])
  entries[i] = axes[i] + (axis,) if axes[i] else axis
  return PartitionSpec(*entries)


def constrain(x: Array, axes: tuple[str | None, ...]) -> Array:
  """x, its sharding fixed by logical axis names, so meshes split it by design rather
  than by XLA's propagation. Applies only while flax's axis rules and a mesh are in
  context (transformer/inference/sharding.py: `activation_sharding`); without them, as
  when tests call the model directly, a no-op.
  """
  return nn.with_logical_constraint(x, axes)


# The residual stream (the input embedding sum, each residual sum and each LayerNorm's
# output) is float32 in every precision; sublayers cast it to the compute dtype for
# their matmuls. Kept in bf16, the sums of six layers and their gradients rounded at
# every layer, the default config trained 300 steps in bf16 ended 7-9% above float32's
# validation perplexity (docs/performance.md, "Mixed precision and accuracy").
RESIDUAL_DTYPE = jnp.float32


def layer_norm(cfg: ModelConfig, name: str) -> nn.LayerNorm:
  """LayerNorm over d_model, computed in and returning the residual stream's float32."""
  return nn.LayerNorm(
    epsilon=cfg.layer_norm_epsilon,
    dtype=RESIDUAL_DTYPE,
    param_dtype=cfg.param_dtype,
    name=name,
    scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
    bias_init=zeros_init(("embed",)),
  )


def dense_init(axes: tuple[str, ...]):
  return nn.with_logical_partitioning(nn.initializers.xavier_uniform(), axes)


def zeros_init(axes: tuple[str, ...]):
  return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


# ----------------------------------------------------------------------------------
# Masks and positions.


def attention_mask(q_segment_ids_BxL: Array, kv_segment_ids_BxS: Array, causal: bool) -> Array:
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
  return jnp.broadcast_to(jnp.arange(tokens_BxL.shape[1], dtype=jnp.int32), tokens_BxL.shape)


def sinusoidal_encoding(positions_BxL: Array, d_model: int) -> Array:
  """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(same), interleaved.

  The paper's layout (Tensor2Tensor concatenates sin and cos instead). Returns f32
  [B, L, D].
  """
  two_i = jnp.arange(0, d_model, 2, dtype=jnp.float32)
  angles_BxLxHalf = positions_BxL[..., None].astype(jnp.float32) / (10000.0 ** (two_i / d_model))
  interleaved = jnp.stack([jnp.sin(angles_BxLxHalf), jnp.cos(angles_BxLxHalf)], axis=-1)
  return interleaved.reshape(*positions_BxL.shape, d_model)


def apply_rope(x_BxLxHxK: Array, positions_BxL: Array) -> Array:
  """Rotary position embedding (Su et al. 2021), rotating the two halves of each head."""
  half = x_BxLxHxK.shape[-1] // 2
  inv_freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
  angles_BxLx1xHalf = (positions_BxL[..., None].astype(jnp.float32) * inv_freq)[:, :, None, :]
  sin, cos = jnp.sin(angles_BxLx1xHalf), jnp.cos(angles_BxLx1xHalf)
  x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x_BxLxHxK.dtype)


# ----------------------------------------------------------------------------------
# Dropout and the ReLU, as the layers use them.


def keep_mask(key: Array, keep_prob: float, shape: tuple[int, ...], axes) -> Array:
  """bool [*shape]: True with probability keep_prob (to 2^-32), for an activation whose
  logical axes are `axes`: uint32 random bits below round(keep_prob * 2^32), one compare
  per element where jax.random.bernoulli makes a float of the bits first.

  XLA's RngBitGenerator (keys of the "rbg" implementations) is not split by the
  partitioner: every device would draw the bits of the whole global array and keep its
  part (1.6 GB of bits per chip per step for base on a v5e-8). Under a mesh, each device
  here draws only its own part, from `key` folded with the part's index along the mesh
  axes that split the array, so those masks depend on the mesh as well as the seed.
  Threefry's bits JAX splits itself (jax_threefry_partitionable), the same on any mesh:
  they are drawn whole. The compare is left outside the per-device part, where XLA fuses
  it into the ops that apply the mask (on a v5e-8 the per-op profile put base's step
  about 0.1 ms slower with it inside).
  """
  threshold = jnp.uint32(min(round(keep_prob * 2.0**32), 2**32 - 1))
  return _random_bits(key, shape, axes) < threshold


def _random_bits(key: Array, shape: tuple[int, ...], axes) -> Array:
  """uint32 [*shape], each device's part drawn on its own for rbg keys (keep_mask)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or str(jax.random.key_impl(key)) not in ("rbg", "unsafe_rbg"):
    return jax.random.bits(key, shape, jnp.uint32)
  logical_spec = nn.logical_to_mesh_axes(axes)
  assert logical_spec is not None  # axes are given, so a spec is
  spec = [tuple(a for a in _named(entry) if mesh.shape[a] > 1) or None for entry in logical_spec]
  split = [a for entry in spec for a in _named(entry)]
  if not split:
    return jax.random.bits(key, shape, jnp.uint32)
  part_shape = tuple(
    n // math.prod(mesh.shape[a] for a in _named(entry)) for n, entry in zip(shape, spec)
  )

  def draw_part(key):
    index = 0
    for a in split:
      index = index * mesh.shape[a] + jax.lax.axis_index(a)
    return jax.random.bits(jax.random.fold_in(key, index), part_shape, jnp.uint32)

  # Manual over every axis of more than one device, not only those the activation is
  # split over: XLA cannot partition a device's index (axis_index, a PartitionId) over
  # an axis left automatic, such as the tensor axis for an activation it replicates.
  # Devices along such an axis draw the same bits (the index leaves it out).
  manual = {a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in mesh.manual_axes}
  return jax.shard_map(
    draw_part, in_specs=PartitionSpec(), out_specs=PartitionSpec(*spec), axis_names=manual
  )(key)


def _named(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry."""
  return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


class Dropout(nn.Module):
  """Inverted dropout, as flax's (kept elements scaled by 1 / (1 - rate), in f32, where a
  bf16 1 / 0.9 would be 1.109), with masks from `keep_mask`: an integer compare, and
  under a mesh each device's part only for rbg keys (`axes`, logical, say how the
  activation is split)."""

  rate: float
  axes: tuple[str | None, ...] = BLD

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    if deterministic or self.rate == 0.0:
      return x
    keep_prob = 1.0 - self.rate
    keep = keep_mask(self.make_rng("dropout"), keep_prob, x.shape, self.axes)
    scaled = (x.astype(jnp.float32) * (1.0 / keep_prob)).astype(x.dtype)
    return jax.lax.select(keep, scaled, jnp.zeros_like(x))


@jax.custom_jvp
def relu(x: Array) -> Array:
  """max(x, 0), with its derivative written through its output: sign(relu(x)) is 1 where
  x > 0 and 0 elsewhere, as jax.nn.relu's derivative. The backward pass then reads the
  activation the second matmul's weight gradient keeps anyway, rather than a mask of
  x > 0 of its own: on TPU the compiler packed that mask into bits in the forward matmul
  and unpacked it in the backward pass (docs/performance.md)."""
  return jnp.maximum(x, 0)


@relu.defjvp
def _relu_jvp(primals, tangents):
  (x,), (x_dot,) = primals, tangents
  y = relu(x)
  return y, x_dot * jnp.sign(y)
