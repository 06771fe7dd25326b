"""The decoder's state while generating: one prefill for every kind of model, then a few
tokens per row per call.

`prefill` creates the state and reads each row's whole prompt in one call. A decoder-only
model's prompt is BOS + source (or any text); an encoder-decoder's is just BOS, and its
source is encoded once, each decoder layer projecting its cross-attention K/V from the
encoder output when the cache is created. `feed` then takes L tokens per row and returns
their logits. Searches that keep several hypotheses per sentence `repeat_rows` the state
(the cross-attention K/V stay one per sentence), `reorder_rows` it by parent hypothesis,
and `grow` its slots as the hypotheses get longer (`cache_segments`).

Every row has its own position (an int32 [B] `position`, see Decoder in
transformer/model/transformer.py) once prompts differ in length; moving a row back
(`set_positions`) rolls it back, its later slots masked and overwritten by the next
tokens it is fed. A prompt of one token (BOS) keeps one position for the whole batch,
the cheaper write of beam search.

`use_cache=False` keeps no K/V at all: the state holds the tokens fed so far and every
call reruns the whole decoder over them, the reference the cache is checked and timed
against. Shape letters: transformer/model/primitives.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from transformer.config import PAD_ID
from transformer.model.primitives import Array
from transformer.model.transformer import unstack_layer_params


class DecoderState(NamedTuple):
  """What a search carries for the model between calls.

  cache: the flax 'cache' collection, or with use_cache=False {'decoder': {'position',
    'tokens' [N, C]}}; either way cache['decoder']['position'] is the next slot.
  source_NxS: each row's encoder input (for the cross-attention mask), None for a
    decoder-only model.
  encoded_BxSxD: use_cache=False only: the encoder output, one per sentence.
  """

  cache: Any
  source_NxS: Array | None
  encoded_BxSxD: Array | None = None


class Prefilled(NamedTuple):
  state: DecoderState
  logits_BxV: Array  # f32, for the token after each row's prompt
  prompt_len_B: Array  # int32, real (non-PAD) prompt tokens
  encoded_BxSxD: Array | None  # the encoder output (None: decoder-only)


def unrolled(model, params) -> tuple[Any, Any]:
  """(model, params) with the layer stacks unrolled, for decoding.

  A scanned stack (`scan_layers`) carries every layer's K/V cache as one stacked array
  through nn.scan, which slices it apart and stacks it back together at every decoding
  step: a copy of the whole cache per token on top of the beam reordering. Decoding with
  the same weights as separate layers (`layer_0` ...) updates each layer's buffer in
  place, so scanned and unscanned runs decode at one speed (docs/performance.md). The
  split happens once per search, inside its jit.
  """
  if not getattr(model.config, "scan_layers", False):
    return model, params
  config = dataclasses.replace(model.config, scan_layers=False)
  return (model.clone(config=config), unstack_layer_params(params, model.config.num_layers))


def prefill(
  model,
  params,
  prompt_BxP: Array,
  *,
  cache_len: int,
  source_BxS: Array | None = None,
  encoded_BxSxD: Array | None = None,
  use_cache: bool = True,
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
  batch, prompt_len = prompt_BxP.shape
  if encoded_BxSxD is None and source_BxS is not None:
    encoded_BxSxD = model.apply({"params": params}, source_BxS, method=model.encode)
  if use_cache:
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
  else:
    recompute = {
      "decoder": {
        "position": jnp.zeros((), jnp.int32),
        "tokens": jnp.zeros((batch, cache_len), jnp.int32),
      }
    }
    state = DecoderState(recompute, source_BxS, encoded_BxSxD)
  logits_BxPxV, state = feed(model, params, state, prompt_BxP)
  if prompt_len == 1:
    return Prefilled(state, logits_BxPxV[:, 0], jnp.ones((batch,), jnp.int32), encoded_BxSxD)
  prompt_len_B = jnp.sum(prompt_BxP != PAD_ID, axis=1).astype(jnp.int32)
  logits_BxV = jnp.take_along_axis(logits_BxPxV, (prompt_len_B - 1)[:, None, None], axis=1)[:, 0]
  return Prefilled(set_positions(state, prompt_len_B), logits_BxV, prompt_len_B, encoded_BxSxD)


def feed(
  model, params, state: DecoderState, tokens_NxL: Array, position_N: Array | None = None
) -> tuple[Array, DecoderState]:
  """Feeds L tokens per row, at position_N .. + L - 1 if given, else where each row
  stands: (f32 logits [N, L, V], the state advanced by L)."""
  if position_N is not None:
    state = set_positions(state, position_N)
  if "tokens" in state.cache["decoder"]:
    return _recompute(model, params, state, tokens_NxL)
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


def _recompute(model, params, state: DecoderState, tokens_NxL: Array) -> tuple[Array, DecoderState]:
  """`feed` without K/V: writes the tokens into the state's buffer and reruns the
  decoder over all C of its slots (causal masking keeps the later ones out)."""
  position = state.cache["decoder"]["position"]
  rows, length = tokens_NxL.shape
  position_N = jnp.broadcast_to(position, (rows,))
  tokens_NxC = jax.vmap(lambda row_C, new_L, at: jax.lax.dynamic_update_slice(row_C, new_L, (at,)))(
    state.cache["decoder"]["tokens"], tokens_NxL, position_N
  )
  encoded = state.encoded_BxSxD
  if encoded is not None:  # one per sentence: repeated for its rows
    encoded = jnp.repeat(encoded, rows // encoded.shape[0], axis=0)
  logits_NxCxV = model.apply(
    {"params": params}, encoded, state.source_NxS, tokens_NxC, method=model.decode
  )
  at_NxL = position_N[:, None] + jnp.arange(length)
  logits_NxLxV = jnp.take_along_axis(logits_NxCxV, at_NxL[:, :, None], axis=1)
  cache = {"decoder": {"position": position + length, "tokens": tokens_NxC}}
  return logits_NxLxV, state._replace(cache=cache)


def set_positions(state: DecoderState, position_N: Array) -> DecoderState:
  """The state with every row's next write (and position) at position_N [N].

  The counter is one leaf at Decoder level, cache['decoder']['position'], whether the
  layers are scanned or not.
  """
  cache = state.cache
  return state._replace(
    cache={**cache, "decoder": {**cache["decoder"], "position": jnp.asarray(position_N, jnp.int32)}}
  )


# ----------------------------------------------------------------------------------
# Several hypotheses per sentence: repeating, reordering and growing the rows.


def _key(path) -> str | None:
  return getattr(path[-1], "key", None)


def _is_per_sentence(path) -> bool:
  """Cross-attention K/V depend on the source only: kept one per sentence (its
  hypotheses' queries meet them together, MultiHeadAttention._attend_cached)."""
  return any(getattr(key, "key", None) in ("cross_key", "cross_value") for key in path)


def _batch_axis(path) -> int:
  """A cache leaf's row axis: 1 under scanned layers (stacked on a leading layer axis)."""
  return 1 if any(getattr(key, "key", None) == "layers" for key in path) else 0


def _slot_axis(path) -> int | None:
  """A leaf's slot (position) axis: self-attention K is stored [.., H, K, C] and V
  [.., H, C, E] (transformer/model/attention.py), recomputation's tokens [N, C]; None
  for every other leaf."""
  slot_axes: dict[str | None, int] = {"key": -1, "value": -2, "tokens": -1}
  return slot_axes.get(_key(path))


def repeat_rows(state: DecoderState, copies: int) -> DecoderState:
  """Each row repeated `copies` times, adjacent (row b * copies + w); the counter, the
  cross-attention K/V and the encoder output stay as they are."""

  def repeat(path, x):
    if x.ndim == 0 or _is_per_sentence(path):
      return x
    return jnp.repeat(x, copies, axis=_batch_axis(path))

  source = state.source_NxS
  return state._replace(
    cache=jax.tree_util.tree_map_with_path(repeat, state.cache),
    source_NxS=None if source is None else jnp.repeat(source, copies, axis=0),
  )


def reorder_rows(state: DecoderState, row_N: Array) -> DecoderState:
  """Row n becomes row row_N[n], which lies in the same sentence (hypotheses never
  move between sentences, so the per-sentence leaves and the source stay)."""

  def gather(path, x):
    if x.ndim == 0 or _is_per_sentence(path):
      return x
    # In bounds by construction: "clip" spares the out-of-bounds select of the default
    # mode, a second pass over every buffer.
    return jnp.take(x, row_N, axis=_batch_axis(path), mode="clip")

  return state._replace(cache=jax.tree_util.tree_map_with_path(gather, state.cache))


def cache_segments(cache_len: int, first: int = 16) -> tuple[int, ...]:
  """Slot counts a search's cache grows through: doubling from `first`, then cache_len.

  Step t writes slot t, so until step 16 a cache of 16 slots holds everything written.
  Every step reorders its whole cache by parent beam and attends over all its slots, so
  running steps [0, 16) on 16 slots, [16, 32) on 32 and so on moves about a third fewer
  bytes than running them all on cache_len slots when a search runs to its end, and
  far fewer when it stops early, as translation does well before source length + extra.
  """
  lengths, length = [], first
  while length < cache_len:
    lengths.append(length)
    length *= 2
  return tuple(lengths) + (cache_len,)


def grow(state: DecoderState, cache_len: int) -> DecoderState:
  """The state with its slots (self-attention K/V, or the token buffer) zero-padded to
  cache_len."""

  def pad(path, x):
    axis = _slot_axis(path)
    if axis is None:
      return x
    padding = [(0, 0)] * x.ndim
    padding[axis % x.ndim] = (0, cache_len - x.shape[axis])
    return jnp.pad(x, padding)

  return state._replace(cache=jax.tree_util.tree_map_with_path(pad, state.cache))
