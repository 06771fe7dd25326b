"""Beam search, greedy and sampled decoding for the encoder-decoder Transformer.

All three share one step function and one decoding cache. The encoder runs once per
sentence and each decoder layer projects its cross-attention K/V once from the encoder
output (when the cache is created); every step then feeds one token per hypothesis and
appends its self-attention K/V to the cache. `use_cache=False` instead reruns the whole
decoder over the padded prefix at every step, for measuring what the cache saves.

Lengths count generated tokens including the EOS that ends a hypothesis. A sentence may
produce at most (its own source length without padding) + `max_decode_extra_len` tokens,
so outputs are [B, C] with C = S + max_decode_extra_len, PAD after the end. Returned
tokens include the EOS (detokenizing stops there anyway).

PAD and BOS are never generated: the model never sees them as targets, and a PAD inside
a decoder input would be masked as padding by the teacher-forced forward pass.

Shape letters follow transformer/model/primitives.py; in addition N = B * beam (the flattened
hypotheses fed through the model), C1 = C + 1 (BOS followed by the C output slots)
and P the candidates taken from each beam.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from transformer.config import BOS_ID, EOS_ID, PAD_ID
from transformer.model.transformer import unstack_layer_params

Array = jax.Array

_NEVER_GENERATED = (PAD_ID, BOS_ID)


def length_penalty(length: Array, alpha: float) -> Array:
  """GNMT's ((5 + length) / 6) ** alpha; a hypothesis scores log P / this."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0)**alpha


def max_output_lengths(source_BxS: Array, max_decode_extra_len: int) -> Array:
  """Each sentence's budget: its own source length (non-pad tokens) + the extra."""
  return jnp.sum(source_BxS != PAD_ID, axis=1).astype(jnp.int32) + max_decode_extra_len


# ----------------------------------------------------------------------------------
# The step function shared by every search.


def unrolled(model, params) -> tuple[Any, Any]:
  """(model, params) with the layer stacks unrolled, for decoding.

  A scanned stack (`scan_layers`) carries every layer's K/V cache as one stacked array
  through nn.scan, which slices it apart and stacks it back together at every decoding
  step: a copy of the whole cache per token on top of the beam reordering. Decoding with
  the same weights as separate layers (`layer_0` ...) updates each layer's buffer in
  place, so scanned and unscanned runs decode at one speed (docs/performance.md). The
  split happens once per search, inside its jit.
  """
  if not model.config.scan_layers:
    return model, params
  config = dataclasses.replace(model.config, scan_layers=False)
  return (model.clone(config=config),
          unstack_layer_params(params, model.config.num_layers))


def _is_cross_attention(path) -> bool:
  return any(getattr(key, "key", None) in ("cross_key", "cross_value") for key in path)


def _batch_axis(path) -> int:
  """A cache leaf's batch axis: 1 under scanned layers (stacked on a leading layer axis)."""
  return 1 if any(getattr(key, "key", None) == "layers" for key in path) else 0


def _init_decoder_state(model, params, source_BxS: Array, copies: int, cache_len: int,
                        use_cache: bool) -> tuple[Any, Array]:
  """Encodes each sentence once and repeats what decoding needs `copies` times.

  Returns (decoder state, source_NxS): the cache, or for `use_cache=False` the encoder
  output, with each sentence's rows adjacent (row b * copies + k). The cache's
  cross-attention K/V keep one row per sentence (the attention serves each row to the
  sentence's `copies` queries); its self-attention K/V and counter are per hypothesis.
  """
  encoded_BxSxD = model.apply({"params": params}, source_BxS, method=model.encode)
  repeat = lambda x: jnp.repeat(x, copies, axis=0) if x.ndim > 0 else x
  source_NxS = repeat(source_BxS)
  if not use_cache:
    return {"encoded": repeat(encoded_BxSxD)}, source_NxS
  # Created at batch B, then repeated: cross K/V are projected once per sentence.
  batch = source_BxS.shape[0]
  _, variables = model.apply(
      {"params": params}, encoded_BxSxD, source_BxS, jnp.zeros((batch, cache_len), jnp.int32),
      use_cache=True, mutable=["cache"], method=model.decode)
  def repeat_leaf(path, x):
    # Cross-attention K/V stay one per sentence (MultiHeadAttention._attend_cached).
    if x.ndim == 0 or _is_cross_attention(path):
      return x
    return jnp.repeat(x, copies, axis=_batch_axis(path))
  return jax.tree_util.tree_map_with_path(repeat_leaf, variables["cache"]), source_NxS


def _next_token_logits(model, params, state: Any, source_NxS: Array, inputs_NxC: Array,
                       step: Array, use_cache: bool) -> tuple[Array, Any]:
  """Logits [N, V] for the token after decoder input `step` (BOS is input 0).

  With the cache only inputs_NxC[:, step] enters the model; without it the decoder
  reruns over all C inputs (causal masking keeps the later, unwritten ones out).
  """
  if use_cache:
    token_Nx1 = jax.lax.dynamic_slice_in_dim(inputs_NxC, step, 1, axis=1)
    logits_Nx1xV, variables = model.apply(
        {"params": params, "cache": state}, None, source_NxS, token_Nx1, use_cache=True,
        mutable=["cache"], method=model.decode)
    return logits_Nx1xV[:, 0], variables["cache"]
  logits_NxCxV = model.apply({"params": params}, state["encoded"], source_NxS, inputs_NxC,
                             method=model.decode)
  return jax.lax.dynamic_index_in_dim(logits_NxCxV, step, axis=1, keepdims=False), state


def _forbid_special(x_NxV: Array) -> Array:
  """Sets the logits (or log-probs) of tokens that are never generated to -inf."""
  return x_NxV.at[:, jnp.array(_NEVER_GENERATED)].set(-jnp.inf)


def _reorder_cache(cache: Any, flat_index_N: Array) -> Any:
  """Gathers every cache leaf along its batch axis.

  The scalar step counter has no batch axis; the cross-attention K/V are one per
  sentence (beams never move between sentences), so they stay as they are.
  """
  def gather(path, x):
    if x.ndim == 0 or _is_cross_attention(path):
      return x
    # In bounds by construction: "clip" spares the out-of-bounds select of the default
    # mode, a second pass over every buffer.
    return jnp.take(x, flat_index_N, axis=_batch_axis(path), mode="clip")
  return jax.tree_util.tree_map_with_path(gather, cache)


def _slot_axis(path) -> int | None:
  """A self-attention cache leaf's slot (position) axis: K is stored [.., H, K, C] and V
  [.., H, C, E] (transformer/model/attention.py); None for every other leaf."""
  return {"key": -1, "value": -2}.get(getattr(path[-1], "key", None))


def cache_segments(cache_len: int, first: int = 16) -> tuple[int, ...]:
  """Slot counts the search's cache grows through: doubling from `first`, then cache_len.

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


def _grow_cache(cache: Any, cache_len: int) -> Any:
  """The cache with its self-attention K/V zero-padded to cache_len slots."""
  def grow(path, x):
    axis = _slot_axis(path)
    if axis is None:
      return x
    padding = [(0, 0)] * x.ndim
    padding[axis % x.ndim] = (0, cache_len - x.shape[axis])
    return jnp.pad(x, padding)
  return jax.tree_util.tree_map_with_path(grow, cache)


# ----------------------------------------------------------------------------------
# Greedy and sampled decoding.


class _SampleState(NamedTuple):
  step: Array  # tokens generated so far
  inputs_BxC1: Array  # BOS, then the generated tokens
  finished_B: Array  # EOS produced
  decoder_state: Any


def _decode_one_at_a_time(model, params, source_BxS: Array, max_decode_extra_len: int,
                          use_cache: bool, choose_token: Callable[[Array, Array], Array]
                          ) -> Array:
  """Generates token after token with `choose_token(logits_BxV, step) -> ids_B`."""
  model, params = unrolled(model, params)
  batch, source_len = source_BxS.shape
  cache_len = source_len + max_decode_extra_len
  max_len_B = max_output_lengths(source_BxS, max_decode_extra_len)
  decoder_state, source_BxS = _init_decoder_state(model, params, source_BxS, 1, cache_len,
                                                  use_cache)
  inputs_BxC1 = jnp.zeros((batch, cache_len + 1), jnp.int32).at[:, 0].set(BOS_ID)
  done = lambda s: s.finished_B | (s.step >= max_len_B)

  def cond(s: _SampleState):
    return (s.step < cache_len) & ~jnp.all(done(s))

  def body(s: _SampleState):
    logits_BxV, decoder_state = _next_token_logits(
        model, params, s.decoder_state, source_BxS, s.inputs_BxC1[:, :-1], s.step, use_cache)
    token_B = choose_token(_forbid_special(logits_BxV), s.step)
    token_B = jnp.where(done(s), PAD_ID, token_B)
    inputs_BxC1 = jax.lax.dynamic_update_slice_in_dim(
        s.inputs_BxC1, token_B[:, None], s.step + 1, axis=1)
    return _SampleState(s.step + 1, inputs_BxC1, s.finished_B | (token_B == EOS_ID),
                        decoder_state)

  init = _SampleState(jnp.array(0, jnp.int32), inputs_BxC1, jnp.zeros((batch,), bool),
                      decoder_state)
  return jax.lax.while_loop(cond, body, init).inputs_BxC1[:, 1:]


@functools.partial(jax.jit, static_argnames=("model", "max_decode_extra_len", "use_cache"))
def greedy_decode(model, params, source_BxS: Array, *, max_decode_extra_len: int,
                  use_cache: bool = True) -> Array:
  """Most likely next token at every step. Returns int32 [B, S + extra], PAD after EOS."""
  return _decode_one_at_a_time(model, params, source_BxS, max_decode_extra_len, use_cache,
                               lambda logits_BxV, step: jnp.argmax(logits_BxV, axis=-1))


def filter_logits(logits_BxV: Array, *, temperature: float, top_k: int, top_p: float) -> Array:
  """Divides by the temperature, then keeps the top_k largest (0 = all) and the
  smallest set whose probability reaches top_p (1.0 = all); the rest become -inf.

  Ties with the last kept logit are kept too.
  """
  logits_BxV = logits_BxV / temperature
  sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
  probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
  mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
  rank_V = jnp.arange(logits_BxV.shape[-1])
  # The most likely token always survives (rank 0, mass before 0); top_p >= 1 keeps all
  # even where rounding pushes the cumulative mass past 1.
  kept_BxV = ((rank_V < top_k) | (top_k <= 0)) & ((mass_before_BxV < top_p) | (top_p >= 1.0))
  smallest_kept_Bx1 = jnp.min(jnp.where(kept_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits_BxV < smallest_kept_Bx1, -jnp.inf, logits_BxV)


@functools.partial(jax.jit, static_argnames=("model", "max_decode_extra_len", "use_cache"))
def sample_decode(model, params, source_BxS: Array, rng: Array, *, max_decode_extra_len: int,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  use_cache: bool = True) -> Array:
  """Ancestral sampling from the filtered distribution (see `filter_logits`).

  Returns int32 [B, S + extra], PAD after EOS; top_k=1 is greedy decoding.
  """
  def choose(logits_BxV, step):
    logits_BxV = filter_logits(logits_BxV, temperature=temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(jax.random.fold_in(rng, step), logits_BxV, axis=-1)
  return _decode_one_at_a_time(model, params, source_BxS, max_decode_extra_len, use_cache,
                               choose)


# ----------------------------------------------------------------------------------
# Beam search.


class BeamState(NamedTuple):
  step: Array  # tokens generated so far by every live hypothesis
  live_seqs_BxKxC1: Array  # BOS, then tokens; live hypotheses have no EOS yet
  live_logprobs_BxK: Array  # log P(tokens), sorted best first; -inf = empty slot
  finished_seqs_BxKxC1: Array  # ended by EOS or by the length budget, PAD after
  finished_scores_BxK: Array  # log P / length_penalty, best first; -inf = empty slot
  decoder_state: Any  # the cache, rows b * K + k


def _gather_beams(x_BxKx: Array, beam_index_BxJ: Array) -> Array:
  return jax.vmap(lambda x, i: x[i])(x_BxKx, beam_index_BxJ)


def _is_done(state: BeamState, max_len_B: Array, alpha: float, early_stop: bool) -> Array:
  """bool [B]: the sentence used its length budget, or no live beam can still win.

  A live hypothesis can only lose log-probability, and its penalty is largest at the
  maximum length, so log P(live) / penalty(max length) bounds any score it can reach;
  once K hypotheses finished and the worst of them beats that bound, the search of
  this sentence is over (the Tensor2Tensor / Flax WMT criterion).
  """
  done_B = state.step >= max_len_B
  if early_stop:
    best_possible_B = state.live_logprobs_BxK[:, 0] / length_penalty(max_len_B, alpha)
    done_B |= jnp.min(state.finished_scores_BxK, axis=1) > best_possible_B
  return done_B


def top_k(x_NxV: Array, k: int) -> tuple[Array, Array]:
  """`jax.lax.top_k(x_NxV, k)` over a long last axis, in two cheap passes.

  XLA:CPU's top_k over a vocabulary-sized row costs as much as ~15 max-reductions of it
  (3.5 ms against 0.2 ms at [64, 37000]). So the row is cut into chunks and only the k
  chunks with the largest maxima are searched: each chunk whose maximum reaches the k-th
  largest value holds a distinct entry at least that large, so there are at most k of
  them. The chosen chunks are searched in index order, so ties go to the lower index, as
  in lax.top_k.
  """
  n, v = x_NxV.shape
  chunk = _chunk_size(v, k)
  if chunk is None:
    return jax.lax.top_k(x_NxV, k)
  chunks_NxGxC = x_NxV.reshape(n, v // chunk, chunk)
  _, best_chunks_NxK = jax.lax.top_k(jnp.max(chunks_NxGxC, axis=-1), k)
  best_chunks_NxK = jnp.sort(best_chunks_NxK, axis=-1)
  candidates_NxKC = jnp.take_along_axis(chunks_NxGxC, best_chunks_NxK[:, :, None],
                                        axis=1).reshape(n, k * chunk)
  values_NxK, position_NxK = jax.lax.top_k(candidates_NxKC, k)
  chunk_NxK = jnp.take_along_axis(best_chunks_NxK, position_NxK // chunk, axis=1)
  return values_NxK, chunk_NxK * chunk + position_NxK % chunk


def _chunk_size(v: int, k: int) -> int | None:
  """The divisor of v nearest sqrt(v) that leaves more than 4k chunks, or None (then
  chunking saves nothing: a short or prime-length row)."""
  divisors = [c for c in range(2, int(v**0.5) * 2 + 1) if v % c == 0 and v // c > 4 * k]
  return min(divisors, key=lambda c: abs(c - v**0.5), default=None)


def best_tokens(logits_NxV: Array, count: int) -> tuple[Array, Array]:
  """The `count` most likely tokens of each row that may be generated (not PAD or BOS),
  with their log-probabilities under softmax(logits): (log P [N, count], ids [N, count]).

  The [N, V] log-softmax is never built: the top logits are ranked as they are (the
  normalizer is the same for a whole row) and only they have the log-sum-exp taken off.
  Taking len(_NEVER_GENERATED) more than asked leaves `count` after the forbidden ones
  are dropped.
  """
  vocab = logits_NxV.shape[-1]
  top_logits_NxM, top_tokens_NxM = top_k(logits_NxV, min(count + len(_NEVER_GENERATED), vocab))
  allowed_NxM = ~jnp.isin(top_tokens_NxM, jnp.array(_NEVER_GENERATED))
  best_logits_NxP, position_NxP = jax.lax.top_k(
      jnp.where(allowed_NxM, top_logits_NxM, -jnp.inf), count)
  log_normalizer_Nx1 = jax.nn.logsumexp(logits_NxV, axis=-1, keepdims=True)
  return (best_logits_NxP - log_normalizer_Nx1,
          jnp.take_along_axis(top_tokens_NxM, position_NxP, axis=1))


def _best_extensions(s: BeamState, logits_NxV: Array, k: int):
  """The 2K best one-token extensions of the live beams: (log P, parent beam, sequences).

  2K candidates leave K that do not end in EOS, whatever the K best are. They are among
  each beam's own 2K best, so selection runs in two stages: XLA on CPU otherwise sorts
  all K * V candidates, which costs more than the model's step.
  """
  batch, vocab = s.live_logprobs_BxK.shape[0], logits_NxV.shape[-1]
  per_beam = min(2 * k, vocab)
  beam_best_NxP, beam_token_NxP = best_tokens(logits_NxV, per_beam)
  candidates_BxKP = (s.live_logprobs_BxK[:, :, None]
                     + beam_best_NxP.reshape(batch, k, per_beam)).reshape(batch, k * per_beam)
  top_logprobs_Bx2K, top_index_Bx2K = jax.lax.top_k(candidates_BxKP, 2 * k)
  top_beam_Bx2K = top_index_Bx2K // per_beam
  top_token_Bx2K = jnp.take_along_axis(beam_token_NxP.reshape(batch, k * per_beam),
                                       top_index_Bx2K, axis=1)
  top_seqs_Bx2KxC1 = jax.lax.dynamic_update_slice_in_dim(
      _gather_beams(s.live_seqs_BxKxC1, top_beam_Bx2K), top_token_Bx2K[:, :, None], s.step + 1,
      axis=2)
  return top_logprobs_Bx2K, top_beam_Bx2K, top_seqs_Bx2KxC1, top_token_Bx2K == EOS_ID


def _beam_step(s: BeamState, logits_NxV: Array, max_len_B: Array, k: int, alpha: float,
               early_stop: bool) -> tuple[BeamState, Array]:
  """One search step from the next-token logits: (new state, parent beam [B, K]).

  The new state's decoder_state is still the old one; the caller reorders it by parent.
  """
  t = s.step
  top_logprobs_Bx2K, top_beam_Bx2K, top_seqs_Bx2KxC1, ends_Bx2K = _best_extensions(
      s, logits_NxV, k)
  live_logprobs_BxK, keep_BxK = jax.lax.top_k(
      jnp.where(ends_Bx2K, -jnp.inf, top_logprobs_Bx2K), k)
  live_seqs_BxKxC1 = _gather_beams(top_seqs_Bx2KxC1, keep_BxK)
  parent_beam_BxK = _gather_beams(top_beam_Bx2K, keep_BxK)

  # A hypothesis finishes when its EOS ranks among the K best candidates (as in fairseq,
  # so beam size 1 with alpha 0 is exactly greedy decoding), or when it reaches its
  # sentence's maximum length: then it competes as it stands, without EOS.
  penalty = length_penalty(t + 1, alpha)
  ended_scores_BxK = jnp.where(ends_Bx2K[:, :k], top_logprobs_Bx2K[:, :k] / penalty, -jnp.inf)
  capped_scores_BxK = jnp.where((t + 1 == max_len_B)[:, None], live_logprobs_BxK / penalty,
                                -jnp.inf)
  finished_scores_BxK, keep_BxK = jax.lax.top_k(jnp.concatenate(
      [s.finished_scores_BxK, ended_scores_BxK, capped_scores_BxK], axis=1), k)
  finished_seqs_BxKxC1 = _gather_beams(jnp.concatenate(
      [s.finished_seqs_BxKxC1, top_seqs_Bx2KxC1[:, :k], live_seqs_BxKxC1], axis=1), keep_BxK)

  # Sentences already done keep their beams (and cache rows) as they were.
  active_B = ~_is_done(s, max_len_B, alpha, early_stop)
  keep = lambda new, old: jnp.where(active_B.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
  parent_beam_BxK = keep(parent_beam_BxK, jnp.broadcast_to(jnp.arange(k), parent_beam_BxK.shape))
  new_state = BeamState(t + 1, keep(live_seqs_BxKxC1, s.live_seqs_BxKxC1),
                        keep(live_logprobs_BxK, s.live_logprobs_BxK),
                        keep(finished_seqs_BxKxC1, s.finished_seqs_BxKxC1),
                        keep(finished_scores_BxK, s.finished_scores_BxK), s.decoder_state)
  return new_state, parent_beam_BxK


@functools.partial(jax.jit, static_argnames=("model", "beam_size", "max_decode_extra_len",
                                             "use_cache", "early_stop"))
def beam_search_state(model, params, source_BxS: Array, *, beam_size: int, alpha: float,
                      max_decode_extra_len: int, use_cache: bool = True,
                      early_stop: bool = True) -> BeamState:
  """Runs the search and returns its final state (see `beam_search`)."""
  model, params = unrolled(model, params)
  batch, source_len = source_BxS.shape
  k = beam_size
  cache_len = source_len + max_decode_extra_len
  max_len_B = max_output_lengths(source_BxS, max_decode_extra_len)
  segments = cache_segments(cache_len) if use_cache else (cache_len,)
  decoder_state, source_NxS = _init_decoder_state(model, params, source_BxS, k, segments[0],
                                                  use_cache)

  def cond(s: BeamState):
    return (s.step < cache_len) & ~jnp.all(_is_done(s, max_len_B, alpha, early_stop))

  def body(s: BeamState):
    logits_NxV, decoder_state = _next_token_logits(
        model, params, s.decoder_state, source_NxS,
        s.live_seqs_BxKxC1.reshape(batch * k, cache_len + 1)[:, :-1], s.step, use_cache)
    s, parent_beam_BxK = _beam_step(s, logits_NxV, max_len_B, k, alpha, early_stop)
    if use_cache:
      flat_index_N = (jnp.arange(batch)[:, None] * k + parent_beam_BxK).reshape(-1)
      decoder_state = _reorder_cache(decoder_state, flat_index_N)
    return s._replace(decoder_state=decoder_state)

  seqs_BxKxC1 = jnp.zeros((batch, k, cache_len + 1), jnp.int32).at[:, :, 0].set(BOS_ID)
  # One live beam to start with: K copies of BOS would fill the beam with duplicates.
  live_logprobs_BxK = jnp.full((batch, k), -jnp.inf).at[:, 0].set(0.0)
  s = BeamState(jnp.array(0, jnp.int32), seqs_BxKxC1, live_logprobs_BxK, seqs_BxKxC1,
                jnp.full((batch, k), -jnp.inf), decoder_state)
  for i, slots in enumerate(segments):
    if i:
      s = s._replace(decoder_state=_grow_cache(s.decoder_state, slots))
    s = jax.lax.while_loop(lambda s, slots=slots: cond(s) & (s.step < slots), body, s)
  return s


def beam_search(model, params, source_BxS: Array, *, beam_size: int, alpha: float,
                max_decode_extra_len: int, use_cache: bool = True,
                early_stop: bool = True) -> tuple[Array, Array]:
  """Beam search with GNMT's length penalty, the paper's decoding.

  The search itself is compiled (`beam_search_state`); this picks each sentence's best
  hypothesis from its final state, and may itself be called under `jax.jit`.

  Args:
    model: the `Transformer` (encoder-decoder).
    source_BxS: int32 source ids, PAD-padded, each sentence ending in EOS.
    beam_size: hypotheses kept per sentence (K).
    alpha: length penalty exponent; 0 ranks by log-probability alone.
    max_decode_extra_len: a sentence may produce its source length + this many tokens.
    use_cache: False reruns the decoder over the whole prefix each step (slow).
    early_stop: False runs every sentence to its maximum length (for timing).

  Returns:
    tokens_BxC: int32 [B, S + extra], each sentence's best-scoring hypothesis among
      those that ended with EOS (included) and those that reached the sentence's
      maximum length without one; PAD after it.
    scores_B: f32 log P(tokens) / length_penalty(number of tokens, EOS included).
  """
  s = beam_search_state(model, params, source_BxS, beam_size=beam_size, alpha=alpha,
                        max_decode_extra_len=max_decode_extra_len, use_cache=use_cache,
                        early_stop=early_stop)
  # Every sentence ends with finished hypotheses: it either stopped early, which needs
  # K of them, or reached its maximum length, which finishes every live one.
  return s.finished_seqs_BxKxC1[:, 0, 1:], s.finished_scores_BxK[:, 0]


# ----------------------------------------------------------------------------------
# Beam search continuing a prompt (decoder-only).


# ----------------------------------------------------------------------------------
# Prompts: one cached pass over each row's prompt, rows at their own positions.


def translation_prompt(source_BxS: Array) -> Array:
  """[BOS] + source ids: what a decoder-only model trained on source + target continues."""
  return jnp.concatenate([jnp.full((source_BxS.shape[0], 1), BOS_ID, jnp.int32),
                          source_BxS.astype(jnp.int32)], axis=1)


def set_positions(cache: Any, position_B: Array) -> Any:
  """The cache with every row's next write (and position) at position_B [B].

  The counter is one leaf at Decoder level, cache['decoder']['position'], whether the
  layers are scanned or not. Moving a row back rolls it back: its later slots are
  masked from then on and overwritten by the next tokens it is fed.
  """
  return {**cache, "decoder": {**cache["decoder"],
                               "position": jnp.asarray(position_B, jnp.int32)}}


def _create_cache(model, params, source_BxS: Optional[Array], batch: int,
                  cache_len: int) -> Any:
  """An empty cache of cache_len slots; encoder-decoder: encodes and projects cross K/V."""
  encoded_BxSxD = None
  if not model.config.decoder_only:
    encoded_BxSxD = model.apply({"params": params}, source_BxS, method=model.encode)
  _, variables = model.apply(
      {"params": params}, encoded_BxSxD, source_BxS, jnp.zeros((batch, cache_len), jnp.int32),
      use_cache=True, mutable=["cache"], method=model.decode)
  return variables["cache"]


def _cached_call(model, params, cache: Any, source_BxS: Optional[Array], tokens_BxL: Array,
                 position_B: Optional[Array] = None) -> tuple[Array, Any]:
  """Feeds L tokens per row (at position_B .. + L - 1 if given): (f32 [B, L, V], cache)."""
  if position_B is not None:
    cache = set_positions(cache, position_B)
  logits_BxLxV, variables = model.apply(
      {"params": params, "cache": cache}, None, source_BxS, tokens_BxL, use_cache=True,
      mutable=["cache"], method=model.decode)
  return logits_BxLxV, variables["cache"]


def prefill(model, params, prompt_BxP: Array, *, cache_len: int,
            source_BxS: Optional[Array] = None) -> tuple[Any, Array, Array]:
  """Creates a cache of cache_len slots and reads the whole padded prompt in one call.

  Rows continue from their own prompt length: each row's position is set to it, so its
  padding slots are masked and the first generated token overwrites the first of them.
  Causal attention keeps the padding out of the real tokens' logits.

  Args:
    prompt_BxP: int32, each row's real tokens first (BOS, ...), then PAD.
    cache_len: slots, at least P plus whatever is fed later.
    source_BxS: the encoder input of an encoder-decoder model (whose prompt is BOS).

  Returns:
    (cache with int32 [B] positions, logits_BxV at each row's last prompt token,
    prompt_len_B).
  """
  batch = prompt_BxP.shape[0]
  prompt_len_B = jnp.sum(prompt_BxP != PAD_ID, axis=1).astype(jnp.int32)
  cache = _create_cache(model, params, source_BxS, batch, cache_len)
  logits_BxPxV, cache = _cached_call(model, params, cache, source_BxS, prompt_BxP)
  logits_BxV = jnp.take_along_axis(logits_BxPxV, (prompt_len_B - 1)[:, None, None],
                                   axis=1)[:, 0]
  return set_positions(cache, prompt_len_B), logits_BxV, prompt_len_B


@functools.partial(jax.jit, static_argnames=("model", "beam_size", "max_new_tokens",
                                             "early_stop"))
def prompt_beam_search(model, params, prompt_BxP: Array, *, beam_size: int, alpha: float,
                       max_new_tokens: int, max_len_B: Array | None = None,
                       early_stop: bool = True) -> tuple[Array, Array]:
  """`beam_search` for a decoder-only model: continues each prompt, which differ in length.

  Each prompt is read in one cached call at batch B (`prefill`: every row's
  cache position is its own prompt length, its padding masked), and the cache and first
  logits are then repeated for the K beams; from there the search is `beam_search`'s,
  one token per hypothesis per step at each row's own position.

  Args:
    prompt_BxP: int32, BOS + source ids (ending in EOS), right-padded with PAD (see
      `translation_prompt`).
    max_new_tokens: output slots O; the most any row may generate.
    max_len_B: each row's budget (<= O), the encoder-decoder's source length + extra
      (`max_output_lengths`); default O for every row.

  Returns:
    (tokens_BxO, the continuation only, EOS included, PAD after it; scores_B), as
    `beam_search`. Beam size 1 is `speculative.prompt_greedy_decode`.
  """
  if not model.config.decoder_only:
    raise ValueError("prompt_beam_search is for decoder-only models; see beam_search")
  model, params = unrolled(model, params)
  batch, prompt_len = prompt_BxP.shape
  k, out_len = beam_size, max_new_tokens
  if max_len_B is None:
    max_len_B = jnp.full((batch,), out_len, jnp.int32)
  max_len_B = jnp.minimum(max_len_B, out_len).astype(jnp.int32)
  cache, logits_BxV, _ = prefill(model, params, prompt_BxP, cache_len=prompt_len + out_len)
  repeat_leaf = lambda path, x: (jnp.repeat(x, k, axis=_batch_axis(path)) if x.ndim > 0
                                 else x)
  cache = jax.tree_util.tree_map_with_path(repeat_leaf, cache)  # rows b * K + k
  logits_NxV = jnp.repeat(logits_BxV, k, axis=0)

  def cond(carry):
    s, _ = carry
    return (s.step < out_len) & ~jnp.all(_is_done(s, max_len_B, alpha, early_stop))

  def body(carry):
    s, logits_NxV = carry
    s, parent_beam_BxK = _beam_step(s, logits_NxV, max_len_B, k, alpha, early_stop)
    flat_index_N = (jnp.arange(batch)[:, None] * k + parent_beam_BxK).reshape(-1)
    cache = _reorder_cache(s.decoder_state, flat_index_N)
    # Feed each hypothesis' newest token (slot step, behind the leading dummy) at its
    # row's own position; the cache counter advances every row by one.
    token_Nx1 = jax.lax.dynamic_slice_in_dim(
        s.live_seqs_BxKxC1.reshape(batch * k, out_len + 1), s.step, 1, axis=1)
    logits_Nx1xV, variables = model.apply(
        {"params": params, "cache": cache}, None, None, token_Nx1, use_cache=True,
        mutable=["cache"], method=model.decode)
    return s._replace(decoder_state=variables["cache"]), logits_Nx1xV[:, 0]

  # Slot 0 stands where beam_search keeps BOS (the prompt is in the cache already).
  seqs_BxKxC1 = jnp.zeros((batch, k, out_len + 1), jnp.int32).at[:, :, 0].set(BOS_ID)
  live_logprobs_BxK = jnp.full((batch, k), -jnp.inf).at[:, 0].set(0.0)
  init = BeamState(jnp.array(0, jnp.int32), seqs_BxKxC1, live_logprobs_BxK, seqs_BxKxC1,
                   jnp.full((batch, k), -jnp.inf), cache)
  s, _ = jax.lax.while_loop(cond, body, (init, logits_NxV))
  return s.finished_seqs_BxKxC1[:, 0, 1:], s.finished_scores_BxK[:, 0]
