"""Incremental decoding: the model's side of every search.

A search (transformer/model/decoding/) asks a model for a prefill, for a call that feeds
a few more tokens per row, and for the row operations on the state those calls carry.
`IncrementalModel` provides them for every model kind (encoder-decoder, decoder-only, a
draft reading its target's encoder output, layers looped or scanned) over the flax cache
of `decode(..., use_cache=True)` (transformer.py). It is the one place that knows the
cache's layout: its leaf names, which leaves hold slots, and the scanned stack's layer
axis. A search holds the state without looking inside it.

  model, params = incremental.of(flax_model).prepare(params)
  prefilled = model.prefill(params, prompt_BxP, cache_len=C, source_BxS=source_BxS)
  logits_NxLxV, state = model.feed(params, prefilled.state, tokens_NxL)

`prefill` creates the state and reads each row's whole prompt in one call. A decoder-only
model's prompt is BOS + source (or any text); an encoder-decoder's is just BOS, and its
source is encoded once, each decoder layer projecting its cross-attention K/V from the
encoder output when the cache is created. `feed` then takes L tokens per row and returns
their logits. Searches that keep several hypotheses per sentence `repeat_rows` the state
(the cross-attention K/V stay one per sentence), `reorder_rows` it by parent hypothesis,
and `grow` its slots as the hypotheses get longer (decoding.cache_segments).

Every row has its own position (an int32 [B] `position`, see Decoder in transformer.py)
once prompts differ in length; moving a row back (`set_positions`) rolls it back, its
later slots masked and overwritten by the next tokens it is fed. A prompt of one token
(BOS) keeps one position for the whole batch, the cheaper write of beam search.

`of` passes an IncrementalModel through as it is, so a search may run on a subclass that
decodes another way (transformer/tools/decoding_speed.py's recomputes the whole prefix
at every call, the reference the cache is checked and timed against). Shape
letters: transformer/model/primitives.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from transformer.config import PAD_ID
from transformer.model.primitives import Array, ModelConfig
from transformer.model.transformer import unstack_layer_params


class DecoderState(NamedTuple):
  """What a search carries for the model between calls.

  cache: the flax 'cache' collection; cache['decoder']['position'] is the next slot.
  source_NxS: each row's encoder input (for the cross-attention mask), None for a
    decoder-only model.
  """

  cache: Any
  source_NxS: Array | None


class Prefilled(NamedTuple):
  state: Any  # the model's decoder state (DecoderState here), opaque to a search
  logits_BxV: Array  # f32, for the token after each row's prompt
  prompt_len_B: Array  # int32, real (non-PAD) prompt tokens
  encoded_BxSxD: Array | None  # the encoder output (None: decoder-only)


def of(model) -> IncrementalModel:
  """The incremental side of a flax model (Transformer, ShallowDraft); an
  IncrementalModel (or a subclass that decodes another way) as it is."""
  return model if isinstance(model, IncrementalModel) else IncrementalModel(model)


# ----------------------------------------------------------------------------------
# Where the cache keeps what: the only code that names its leaves.


def _key(path) -> str | None:
  return getattr(path[-1], "key", None)


def _is_per_sentence(path) -> bool:
  """Cross-attention K/V depend on the source only: kept one per sentence (its
  hypotheses' queries meet them together, attention_kernels.cached_attention)."""
  return any(getattr(key, "key", None) in ("cross_key", "cross_value") for key in path)


def _batch_axis(path) -> int:
  """A cache leaf's row axis: 1 under scanned layers (stacked on a leading layer axis)."""
  return 1 if any(getattr(key, "key", None) == "layers" for key in path) else 0


def _slot_axis(path) -> int | None:
  """A leaf's slot (position) axis: self-attention K is stored [.., H, K, C] and V
  [.., H, C, E] (attention.py); None for every other leaf."""
  slot_axes: dict[str | None, int] = {"key": -1, "value": -2}
  return slot_axes.get(_key(path))


@dataclasses.dataclass(frozen=True)
class IncrementalModel:
  """A flax model (Transformer's `encode` and `decode`) as a search drives it."""

  model: Any

  @property
  def config(self) -> ModelConfig:
    return self.model.config

  @property
  def reads_target_encoding(self) -> bool:
    """True for a draft without an encoder of its own, reading the target's encoder
    output; a model says so with a `reads_target_encoding = True` attribute."""
    return bool(getattr(self.model, "reads_target_encoding", False))

  def prepare(self, params) -> tuple[IncrementalModel, Any]:
    """(self, params) with the layer stacks unrolled, for decoding.

    A scanned stack (`scan_layers`) carries every layer's K/V cache as one stacked array
    through nn.scan, which slices it apart and stacks it back together at every decoding
    step: a copy of the whole cache per token on top of the beam reordering. Decoding
    with the same weights as separate layers (`layer_0` ...) updates each layer's buffer
    in place, so scanned and unscanned runs decode at one speed (docs/performance.md).
    The split happens once per search, inside its jit.
    """
    if not getattr(self.config, "scan_layers", False):
      return self, params
    config = dataclasses.replace(self.config, scan_layers=False)
    unrolled = IncrementalModel(self.model.clone(config=config))
    return unrolled, unstack_layer_params(params, self.config.num_layers)

  def prefill(
    self,
    params,
    prompt_BxP: Array,
    *,
    cache_len: int,
    source_BxS: Array | None = None,
    encoded_BxSxD: Array | None = None,
  ) -> Prefilled:
    """Creates the state with cache_len slots and reads the whole padded prompt at once.

    Rows continue from their own prompt length: each row's position is set to it, so its
    padding slots are masked and the first generated token overwrites the first of them.
    Causal attention keeps the padding out of the real tokens' logits.

    Args:
      prompt_BxP: int32, each row's real tokens first (BOS, ...), then PAD.
      cache_len: slots, at least P plus whatever is fed later.
      source_BxS: an encoder-decoder model's encoder input.
      encoded_BxSxD: the encoder output to attend to, when it is not the model's own (a
        draft reading its target's encoding); by default the model encodes source_BxS.
    """
    model = self.model
    batch, prompt_len = prompt_BxP.shape
    if encoded_BxSxD is None and source_BxS is not None:
      encoded_BxSxD = model.apply({"params": params}, source_BxS, method=model.encode)
    _, variables = model.apply(
      {"params": params},
      encoded_BxSxD,
      source_BxS,
      jnp.zeros((batch, cache_len), jnp.int32),
      use_cache=True,
      mutable=["cache"],
      method=model.decode,
    )
    state = DecoderState(variables["cache"], source_BxS)
    logits_BxPxV, state = self.feed(params, state, prompt_BxP)
    if prompt_len == 1:
      return Prefilled(state, logits_BxPxV[:, 0], jnp.ones((batch,), jnp.int32), encoded_BxSxD)
    prompt_len_B = jnp.sum(prompt_BxP != PAD_ID, axis=1).astype(jnp.int32)
    logits_BxV = jnp.take_along_axis(logits_BxPxV, (prompt_len_B - 1)[:, None, None], axis=1)
    return Prefilled(
      self.set_positions(state, prompt_len_B), logits_BxV[:, 0], prompt_len_B, encoded_BxSxD
    )

  def feed(
    self, params, state: DecoderState, tokens_NxL: Array, position_N: Array | None = None
  ) -> tuple[Array, DecoderState]:
    """Feeds L tokens per row, at position_N .. + L - 1 if given, else where each row
    stands: (f32 logits [N, L, V], the state advanced by L)."""
    if position_N is not None:
      state = self.set_positions(state, position_N)
    model = self.model
    logits_NxLxV, variables = model.apply(
      {"params": params, "cache": state.cache},
      None,
      state.source_NxS,
      tokens_NxL,
      use_cache=True,
      mutable=["cache"],
      method=model.decode,
    )
    return logits_NxLxV, state._replace(cache=variables["cache"])

  def set_positions(self, state: DecoderState, position_N: Array) -> DecoderState:
    """The state with every row's next write (and position) at position_N [N].

    The counter is one leaf at Decoder level, cache['decoder']['position'], whether the
    layers are scanned or not.
    """
    cache = state.cache
    position = jnp.asarray(position_N, jnp.int32)
    return state._replace(cache={**cache, "decoder": {**cache["decoder"], "position": position}})

  def repeat_rows(self, state: DecoderState, copies: int) -> DecoderState:
    """Each row repeated `copies` times, adjacent (row b * copies + w); the counter and
    the cross-attention K/V stay as they are."""

    def repeat(path, x):
      if x.ndim == 0 or _is_per_sentence(path):
        return x
      return jnp.repeat(x, copies, axis=_batch_axis(path))

    source = state.source_NxS
    return state._replace(
      cache=jax.tree_util.tree_map_with_path(repeat, state.cache),
      source_NxS=None if source is None else jnp.repeat(source, copies, axis=0),
    )

  def reorder_rows(self, state: DecoderState, row_N: Array) -> DecoderState:
    """Row n becomes row row_N[n], which lies in the same sentence (hypotheses never
    move between sentences, so the per-sentence leaves and the source stay)."""

    def gather(path, x):
      if x.ndim == 0 or _is_per_sentence(path):
        return x
      # In bounds by construction: "clip" spares the out-of-bounds select of the default
      # mode, a second pass over every buffer.
      return jnp.take(x, row_N, axis=_batch_axis(path), mode="clip")

    return state._replace(cache=jax.tree_util.tree_map_with_path(gather, state.cache))

  def grow(self, state: DecoderState, cache_len: int) -> DecoderState:
    """The state with its slots (self-attention K/V) zero-padded to cache_len."""

    def pad(path, x):
      axis = _slot_axis(path)
      if axis is None:
        return x
      padding = [(0, 0)] * x.ndim
      padding[axis % x.ndim] = (0, cache_len - x.shape[axis])
      return jnp.pad(x, padding)

    return state._replace(cache=jax.tree_util.tree_map_with_path(pad, state.cache))
