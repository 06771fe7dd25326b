"""What every search takes and returns, and the loop of the searches that add one token
per hypothesis per step.

Every search (beam.py, sampling.py, speculative.py) is a small frozen dataclass (a flax
struct: a pytree whose settings are static) with one method,
`run(model, params, prompts, rng) -> Generation`, and `decode`
(decoding/__init__.py) is the one compiled entry point that calls it. The model it gets
is the model's incremental side (transformer/model/incremental.py): a prefill, a feed
and the row operations on a decoder state the search never looks inside. The input
is always `Prompts`: what each row continues (BOS for an encoder-decoder, BOS + source or
text for a decoder-only model), its budget and, encoder-decoder, its source. The output
is always `Generation`.

A `StepSearch` (beam search, greedy, sampling) only says how to choose tokens from
logits; `run_steps` does the rest: the prefill, the first choice from its logits at
batch B, then per step feeding each hypothesis' newest token, choosing, and reordering
the decoder state by parent hypothesis, on a cache that grows as it fills
(`cache_segments`). Shape letters: transformer/model/primitives.py.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from transformer.config import BOS_ID, PAD_ID
from transformer.model.incremental import IncrementalModel
from transformer.model.primitives import Array

# The model never sees them as targets, and a PAD inside a decoder input would be masked
# as padding: never generated.
NEVER_GENERATED = (PAD_ID, BOS_ID)


def forbid_special(x_NxV: Array) -> Array:
  """Sets the logits (or log-probs) of tokens that are never generated to -inf."""
  return x_NxV.at[..., jnp.array(NEVER_GENERATED)].set(-jnp.inf)


@struct.dataclass
class Prompts:
  """One batch of generation requests.

  prompt_BxP: int32, each row's real tokens first (BOS, ...), then PAD.
  budget_B: int32, the most tokens each row may generate (EOS included), <= out_len.
  source_BxS: an encoder-decoder model's source ids; None for a decoder-only model.
  out_len: O, the output's width (static).
  """

  prompt_BxP: Array
  budget_B: Array
  source_BxS: Array | None = None
  out_len: int = struct.field(pytree_node=False, default=0)


def translation_prompts(
  source_BxS: Array | np.ndarray, max_decode_extra_len: int, decoder_only: bool
) -> Prompts:
  """Translating padded source ids (each ending in EOS): a sentence may produce its own
  source length + max_decode_extra_len tokens, outputs are O = S + extra wide.

  An encoder-decoder model reads the source and continues BOS; a decoder-only model,
  trained on source + EOS + target + EOS (data/pipeline.py `make_example`), continues
  BOS + source.
  """
  source_BxS = jnp.asarray(source_BxS, jnp.int32)
  batch, source_len = source_BxS.shape
  budget_B = jnp.sum(source_BxS != PAD_ID, axis=1).astype(jnp.int32) + max_decode_extra_len
  bos_Bx1 = jnp.full((batch, 1), BOS_ID, jnp.int32)
  out_len = source_len + max_decode_extra_len
  if decoder_only:
    return Prompts(jnp.concatenate([bos_Bx1, source_BxS], axis=1), budget_B, None, out_len)
  return Prompts(bos_Bx1, budget_B, source_BxS, out_len)


def continuation_prompts(prompt_BxP: Array | np.ndarray, max_new_tokens: int) -> Prompts:
  """A decoder-only model continuing each prompt (BOS + ids, right-padded) by up to
  max_new_tokens tokens."""
  batch = prompt_BxP.shape[0]
  return Prompts(
    jnp.asarray(prompt_BxP, jnp.int32),
    jnp.full((batch,), max_new_tokens, jnp.int32),
    None,
    max_new_tokens,
  )


class Generation(NamedTuple):
  """What every search returns.

  tokens_BxO: int32, EOS included, PAD after it and beyond each row's budget.
  scores_B: f32, log P(tokens) under the model / length_penalty (beam search's alpha;
    the other searches rank nothing and report log P itself).
  calls: int32, the model's passes after the prefill (which yields the first token).
  row_calls: int32, rows still generating summed over those passes.
  proposed, accepted: int32, draft tokens offered and taken (speculative; else 0).
  """

  tokens_BxO: Array
  scores_B: Array
  calls: Array
  row_calls: Array
  proposed: Array
  accepted: Array


class Search(Protocol):
  """One way of generating: `decode(model, params, prompts, search, rng)` calls run with
  the model's incremental side, its layers ready for decoding (IncrementalModel.prepare).
  A search is a pytree (flax.struct.dataclass): its settings are static fields, and
  whatever arrays it owns (Speculative's draft parameters) are its leaves."""

  def run(
    self, model: IncrementalModel, params, prompts: Prompts, rng: Array | None
  ) -> Generation: ...


class StepSearch(Protocol):
  """A search of `width` hypotheses per row that adds one token to each per step.

  Its state is any pytree with a `step` field (tokens generated so far); `start` makes
  it from the prefill's logits at batch B, `step` takes the logits of every hypothesis'
  newest token [N, V] and returns the new state and each new hypothesis' parent row
  [N] (None: rows never move).
  """

  @property
  def width(self) -> int: ...

  def start(self, logits_BxV: Array, prompts: Prompts, rng: Array | None) -> Any: ...

  def newest_N(self, state: Any) -> Array: ...

  def step(self, state: Any, logits_NxV: Array) -> tuple[Any, Array | None]: ...

  def done_B(self, state: Any) -> Array: ...

  def finish(self, state: Any) -> tuple[Array, Array]:
    """(tokens_BxO, scores_B)."""
    ...


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


class _Loop(NamedTuple):
  search: Any
  decoder: Any  # the model's decoder state
  row_calls: Array


def run_steps(
  search: StepSearch, model: IncrementalModel, params, prompts: Prompts, rng: Array | None
) -> Generation:
  """Prefill, then one token per hypothesis per step until every row is done."""
  prompt_len = prompts.prompt_BxP.shape[1]
  # Output t is fed at slot (prompt length + t); the last output is never fed.
  cache_len = prompt_len + prompts.out_len - 1
  segments = tuple(s for s in cache_segments(cache_len) if s > prompt_len)
  segments = segments or (cache_len,)
  prefilled = model.prefill(
    params, prompts.prompt_BxP, cache_len=segments[0], source_BxS=prompts.source_BxS
  )
  state = search.start(prefilled.logits_BxV, prompts, rng)
  decoder = prefilled.state
  if search.width > 1:
    decoder = model.repeat_rows(decoder, search.width)

  def body(loop: _Loop) -> _Loop:
    row_calls = loop.row_calls + jnp.sum(~search.done_B(loop.search), dtype=jnp.int32)
    token_Nx1 = search.newest_N(loop.search)[:, None]
    logits_Nx1xV, decoder = model.feed(params, loop.decoder, token_Nx1)
    state, parent_N = search.step(loop.search, logits_Nx1xV[:, 0])
    if parent_N is not None:
      decoder = model.reorder_rows(decoder, parent_N)
    return _Loop(state, decoder, row_calls)

  def going(loop: _Loop, slots: int) -> Array:
    step = loop.search.step
    return (
      (prompt_len + step - 1 < slots)
      & (step < prompts.out_len)
      & ~jnp.all(search.done_B(loop.search))
    )

  loop = _Loop(state, decoder, jnp.array(0, jnp.int32))
  for i, slots in enumerate(segments):
    if i:
      loop = loop._replace(decoder=model.grow(loop.decoder, slots))
    loop = jax.lax.while_loop(functools.partial(going, slots=slots), body, loop)
  tokens_BxO, scores_B = search.finish(loop.search)
  zero = jnp.array(0, jnp.int32)
  return Generation(
    tokens_BxO, scores_B, jnp.maximum(loop.search.step - 1, 0), loop.row_calls, zero, zero
  )
