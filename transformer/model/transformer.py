"""The Transformer of "Attention Is All You Need": the encoder and decoder stacks.

`Transformer` is the encoder-decoder of the paper, or with `decoder_only` a GPT-style
language model. Each stack runs its N layers as a Python loop (`layer_0` ...
`layer_{N-1}`) or, with `scan_layers`, as one nn.scan over stacked parameters, so the
stack compiles once whatever N is. Shape letters: transformer/model/primitives.py.

Incremental decoding (`use_cache=True` with `mutable=['cache']`): the first call creates
the cache, sized by that call's target length C (see attention.py); later calls feed L
tokens per row ([B, L]: one per step when decoding, a whole prompt when prefilling, the
k + 1 tokens a speculative round checks) and write them at the cache's position. The
position is a scalar shared by the batch, or an int32 [B] vector, one per row, that a
caller may set back to roll a row back (speculative.py).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from transformer.model.attention_kernels import AttentionMask
from transformer.model.layers import (
  DecoderLayer,
  Embed,
  EncoderLayer,
  InputEmbedding,
  OutputProjection,
)
from transformer.model.primitives import (
  BLD,
  BLV,
  Array,
  ModelConfig,
  constrain,
  default_positions,
  layer_norm,
  segment_ids_from_tokens,
  split_spec,
)

_REMAT_POLICIES = {
  "full": None,  # save nothing: recompute every activation in the backward pass
  "dots": jax.checkpoint_policies.checkpoint_dots,
  "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def _rematted(layer_class, cfg: ModelConfig):
  """The layer under jax.checkpoint with cfg.remat's policy ('none': unchanged)."""
  if cfg.remat == "none":
    return layer_class
  return nn.remat(layer_class, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)


def _carried(layer_class):
  """Wraps a layer as nn.scan wants it: (carry, *broadcast) -> (carry, None)."""

  class Carried(layer_class):
    def __call__(self, x, *args):
      return super().__call__(x, *args), None

  Carried.__name__ = layer_class.__name__
  return Carried


def _split_layer_grads(params: Any, num_layers: int) -> Any:
  """One layer's parameters, unchanged, whose gradients the backward pass splits over the
  mesh's data axis as they leave the layer: summed whole first, then split, which XLA
  turns into one reduce-scatter per layer inside the layer loop. Summed whole and split
  only after the loop, as the optimizer's split state alone would have them, they are
  all-reduced at every layer and the loop's stacked gradient buffers are whole: on a
  v5e-8 the per-op profile put base's step at 27.5 ms that way and 25.9 ms this way.
  Constrained straight to the split, the partitioner would split the backward pass's
  matmuls too.

  Only on a mesh that is all data parallel (fsdp and tensor of size 1), where a layer's
  parameters are whole on every device: inside the step the parameters are bare arrays
  whose logical axes are not at hand, and there "whole" needs none. Elsewhere, and
  outside a mesh and axis rules (run/sharding.py: activation_sharding, as when tests
  call the model), the parameters pass through untouched."""
  mesh = jax.sharding.get_abstract_mesh()
  if not nn.get_logical_axis_rules() or mesh.empty:
    return params
  sizes = dict(mesh.shape)
  if sizes.get("data", 1) == 1 or sizes.get("fsdp", 1) != 1 or sizes.get("tensor", 1) != 1:
    return params

  def split(leaf: Any) -> Any:
    boxed = isinstance(leaf, nn.LogicallyPartitioned)  # at init; bare arrays in a step
    value = leaf.unbox() if boxed else leaf
    # The rule the optimizer's state is split by, applied to the stacked parameter (N
    # layers first), so that each layer's slice of the stacked gradient is placed as
    # the slice of the optimizer's state it meets. Where that rule splits the layer
    # axis itself, a layer's gradient cannot be: it leaves the loop whole.
    stacked = list(split_spec(PartitionSpec(), (num_layers, *value.shape), sizes, "data"))
    if not stacked or stacked[0] is not None:
      return leaf
    split_value = _constrain_gradient(value, PartitionSpec(*stacked[1:]))
    return leaf.replace_boxed(split_value) if boxed else split_value

  return jax.tree.map(split, params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _constrain_gradient(x: Array, split: PartitionSpec) -> Array:
  """x; its gradient placed whole, then by `split`."""
  return x


def _constrain_gradient_forward(x, split):
  return x, None


def _constrain_gradient_backward(split, _, grad):
  grad = jax.lax.with_sharding_constraint(grad, PartitionSpec())
  return (jax.lax.with_sharding_constraint(grad, split),)


_constrain_gradient.defvjp(_constrain_gradient_forward, _constrain_gradient_backward)


def layer_stack(layer_class, cfg: ModelConfig, x_BxLxD: Array, *args, **attributes) -> Array:
  """Runs N layers of `layer_class(cfg, **attributes)` over x, each with `*args`.

  Unscanned: modules `layer_0` ... `layer_{N-1}`. Scanned: one module `layers` whose
  parameters (and caches) carry a leading axis of N; masks, positions and the encoder
  output are the same for every layer (broadcast), and dropout draws fresh masks per
  layer (split_rngs).
  """
  # Unscanned, every layer's gradient is its own array, which the train step splits
  # (config.shard_optimizer_state): there is no loop to split it inside.
  split_grads = cfg.split_layer_grads and cfg.scan_layers
  if not cfg.scan_layers:
    layer = _rematted(layer_class, cfg)
    for i in range(cfg.num_layers):
      x_BxLxD = layer(cfg, name=f"layer_{i}", **attributes)(x_BxLxD, *args)
    return x_BxLxD
  body = _rematted(_carried(layer_class), cfg)
  if split_grads:
    body = nn.map_variables(
      body,
      "params",
      trans_in_fn=functools.partial(_split_layer_grads, num_layers=cfg.num_layers),
      init=True,
      mutable=True,
    )
  scanned = nn.scan(
    body,
    variable_axes={"params": 0, "cache": 0, "intermediates": 0},
    split_rngs={"params": True, "dropout": True},
    in_axes=(nn.broadcast,) * len(args),
    length=cfg.num_layers,
    metadata_params={nn.PARTITION_NAME: "layers"},
  )
  x_BxLxD, _ = scanned(cfg, name="layers", **attributes)(x_BxLxD, *args)
  return x_BxLxD


class Encoder(nn.Module):
  """Source tokens -> the final encoder output [B, S, D] (the decoder's memory)."""

  config: ModelConfig
  embed: Embed

  @nn.compact
  def __call__(self, source_BxS, source_segment_ids_BxS, source_positions_BxS, deterministic=True):
    cfg = self.config
    x_BxSxD = InputEmbedding(cfg, self.embed, name="input")(
      source_BxS, source_positions_BxS, deterministic
    )
    mask = AttentionMask(source_segment_ids_BxS, source_segment_ids_BxS, causal=False)
    x_BxSxD = layer_stack(
      EncoderLayer, cfg, x_BxSxD, mask, source_positions_BxS, deterministic=deterministic
    )
    if cfg.norm == "pre":
      x_BxSxD = constrain(layer_norm(cfg, "final_norm")(x_BxSxD), BLD)
    return x_BxSxD


class Decoder(nn.Module):
  """Target (or, decoder-only, the whole sequence) -> logits over the vocabulary."""

  config: ModelConfig
  embed: Embed

  @nn.compact
  def __call__(
    self,
    decoder_input_BxT,
    target_segment_ids_BxT,
    target_positions_BxT,
    memory_BxSxD=None,
    source_segment_ids_BxS=None,
    deterministic=True,
    use_cache=False,
    features_only=False,
  ):
    cfg = self.config
    cache_position = None
    if use_cache:
      cache_position, target_positions_BxT = self._advance_cache(
        decoder_input_BxT, target_positions_BxT
      )
    y_BxTxD = InputEmbedding(cfg, self.embed, name="input")(
      decoder_input_BxT, target_positions_BxT, deterministic
    )
    self_mask = AttentionMask(target_segment_ids_BxT, target_segment_ids_BxT, causal=True)
    cross_mask = None
    if not cfg.decoder_only:
      cross_mask = AttentionMask(target_segment_ids_BxT, source_segment_ids_BxS, causal=False)
    y_BxTxD = layer_stack(
      DecoderLayer,
      cfg,
      y_BxTxD,
      self_mask,
      target_positions_BxT,
      memory_BxSxD,
      cross_mask,
      cache_position,
      deterministic=deterministic,
      use_cache=use_cache,
    )
    if cfg.norm == "pre":
      y_BxTxD = constrain(layer_norm(cfg, "final_norm")(y_BxTxD), BLD)
    return self._output(y_BxTxD, features_only)

  def _advance_cache(self, decoder_input_BxL, positions_BxL):
    """(where this call's tokens go in every layer's K/V buffer, their positions [B, L])
    with the cache; moves the cache's position on by L. The call that creates the cache
    keeps the given positions."""
    # One counter for the whole stack: where the next token goes in every layer's K/V
    # buffer, and that token's position for the position encoding. A scalar (created
    # so) serves the whole batch; a caller may replace it by an int32 [B] vector, one
    # per row, and set it back to roll a row back (speculative.py).
    is_created = self.has_variable("cache", "position")
    position = self.variable("cache", "position", lambda: jnp.zeros((), jnp.int32))
    cache_position = position.value
    if not is_created:
      return cache_position, positions_BxL
    length = decoder_input_BxL.shape[1]
    if cache_position.ndim == 0 and length == 1:
      positions_BxL = jnp.full_like(decoder_input_BxL, cache_position)
    else:
      # L tokens per row: token i of row b sits at position_b + i.
      positions_BxL = jnp.broadcast_to(
        jnp.reshape(cache_position, (-1, 1)) + jnp.arange(length, dtype=jnp.int32),
        decoder_input_BxL.shape,
      )
      if self.config.positional == "learned":
        # A speculative round may score draft tokens past the table, tokens it never
        # emits; an out-of-range lookup would put NaN in their K/V slots, and a NaN V
        # poisons later queries even where its attention weight is 0.
        positions_BxL = jnp.minimum(positions_BxL, self.config.max_position - 1)
    position.value = cache_position + length
    return cache_position, positions_BxL

  def _output(self, y_BxTxD, features_only):
    """f32 logits [B, T, V] of the final decoder states; with `features_only`, (the
    states, the pre-softmax weight, whether it is [V, D])."""
    cfg = self.config
    if features_only:
      # The final hidden states and the pre-softmax weight, both in the compute dtype
      # (the matmul's inputs), for a loss that fuses the projection
      # (transformer/inference/scoring.py: fused_cross_entropy_sums).
      y_BxTxD = y_BxTxD.astype(cfg.dtype)
      if cfg.tie_embeddings:
        return y_BxTxD, self.embed.output_table(), True
      return y_BxTxD, OutputProjection(cfg, name="output_projection").weight(), False
    if cfg.tie_embeddings:
      logits_BxTxV = self.embed.attend(y_BxTxD)
    else:
      logits_BxTxV = OutputProjection(cfg, name="output_projection")(y_BxTxD)
    # The largest activation of a step: split over the tensor axis along the vocabulary.
    return constrain(logits_BxTxV.astype(jnp.float32), BLV)


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

  def encode(
    self,
    source_BxS: Array,
    source_segment_ids: Array | None = None,
    source_positions: Array | None = None,
    deterministic: bool = True,
  ) -> Array:
    """Source tokens -> final encoder output [B, S, D]."""
    if source_segment_ids is None:
      source_segment_ids = segment_ids_from_tokens(source_BxS)
    if source_positions is None:
      source_positions = default_positions(source_BxS)
    return self.encoder(source_BxS, source_segment_ids, source_positions, deterministic)

  def decode(
    self,
    encoded_BxSxD: Array | None,
    source_BxS: Array | None,
    decoder_input_BxT: Array,
    source_segment_ids: Array | None = None,
    target_segment_ids: Array | None = None,
    target_positions: Array | None = None,
    deterministic: bool = True,
    use_cache: bool = False,
    features_only: bool = False,
  ) -> Array:
    """Decoder inputs (+ encoder output) -> f32 logits [B, T, V]; with `features_only`,
    (the final hidden states [B, T, D], the pre-softmax weight, whether it is [V, D]).

    With `use_cache=True` and `mutable=['cache']`: the first call creates the cache (its
    logits are meaningless); later calls take [B, L] and return [B, L, V], token i of
    row b at position p_b + i, where the cache's position p is a scalar for the whole
    batch or a per-row int32 [B] vector (IncrementalModel.set_positions, incremental.py).
    """
    if source_segment_ids is None and source_BxS is not None:
      source_segment_ids = segment_ids_from_tokens(source_BxS)
    if target_segment_ids is None:
      # Decoder inputs start with BOS, never PAD, so ids != PAD marks real positions.
      target_segment_ids = segment_ids_from_tokens(decoder_input_BxT)
      if use_cache:
        target_segment_ids = jnp.ones_like(decoder_input_BxT)
    if target_positions is None:
      target_positions = default_positions(decoder_input_BxT)
    return self.decoder(
      decoder_input_BxT,
      target_segment_ids,
      target_positions,
      encoded_BxSxD,
      source_segment_ids,
      deterministic,
      use_cache,
      features_only,
    )

  def __call__(
    self,
    source: Array | None,
    decoder_input: Array,
    *,
    source_segment_ids: Array | None = None,
    source_positions: Array | None = None,
    target_segment_ids: Array | None = None,
    target_positions: Array | None = None,
    deterministic: bool = True,
    features_only: bool = False,
  ) -> Array:
    """Teacher-forced forward pass -> f32 logits [B, T, V] (with `features_only`, what
    `decode` returns with it: the final hidden states and the pre-softmax weight)."""
    encoded = None
    if not self.config.decoder_only:
      if source is None:
        raise ValueError("an encoder-decoder model needs a source")
      encoded = self.encode(source, source_segment_ids, source_positions, deterministic)
    return self.decode(
      encoded,
      source,
      decoder_input,
      source_segment_ids,
      target_segment_ids,
      target_positions,
      deterministic,
      features_only=features_only,
    )


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


def unstack_layer_params(params: dict[str, Any], num_layers: int) -> dict[str, Any]:
  """The `scan_layers` tree -> unscanned parameters (`layer_0` ... `layer_{N-1}`), the
  inverse of `stack_layer_params`: each `layers` leaf is split along its layer axis."""
  unstacked = dict(params)
  for stack in ("encoder", "decoder"):
    if stack in unstacked and "layers" in unstacked[stack]:
      layers = dict(unstacked[stack])
      stacked = layers.pop("layers")
      for i in range(num_layers):
        layers[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
      unstacked[stack] = layers
  return unstacked


_MODEL_INPUT_KEYS = (
  "source",
  "decoder_input",
  "source_segment_ids",
  "source_positions",
  "target_segment_ids",
  "target_positions",
)


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
  """The keyword arguments of `Transformer.__call__` found in a batch."""
  inputs = {k: batch[k] for k in _MODEL_INPUT_KEYS if k in batch}
  inputs.setdefault("source", None)
  return inputs
