"""Speculative decoding (Leviathan et al. 2023, Chen et al. 2023) over the KV cache, and
plain prompt continuation for decoder-only models.

A small draft model proposes `draft_len` (k) tokens one at a time with its own cache;
the target then scores the last accepted token and the k proposals in ONE cached call
of k + 1 tokens. Each row keeps the longest prefix the target agrees with, plus one
token of the target's own (its correction at the first disagreement, or a bonus token
when all k agree), so every target call yields 1 .. k + 1 tokens. Rows accept different
amounts: every cache keeps one position per row (an int32 [B] `cache/position`, see
Decoder in transformer.py), and rolling a row back is setting its position back; the
stale slots after it are masked and overwritten later, nothing is recomputed.

The output is exactly the target's own decoding whatever the draft: greedy decoding
token for token (`decoding.greedy_decode`, up to float rounding in near-ties: the
target's multi-token calls round differently from one-token calls), and for sampling
the distribution of `decoding.sample_decode` (the accept / resample rule below).

Both kinds of model work. Encoder-decoder: the input is a source batch and generation
starts behind BOS, with `decoding.max_output_lengths` budgets and [B, S + extra] outputs
as in decoding.py. Decoder-only: the input is a prompt batch, each row BOS followed by
the source ids (ending in EOS, as in training, see data/pipeline.py `make_example`),
right-padded with PAD; `prefill` reads it in one cached call and each row continues
from its own length. Outputs are the continuation only, [B, max_new_tokens].

Every generation here begins with a prefill: the cache is created, the prompt (for an
encoder-decoder model, just BOS) is fed in one call, and its logits at each row's last
prompt token give the first token. In a round, with the pending (generated, not yet
fed) token `last` at position p and the token before it `prev` at p - 1:

  draft:  feeds [prev, last] at p - 1, p (one call; rewriting p - 1 is harmless and
          covers the slot a round that accepted all k never fed), then each proposal
          d_1 .. d_{k-1} in turn: k calls proposing d_1 .. d_k.
  target: feeds [last, d_1 .. d_k] at p .. p + k: logits for d_1 .. d_k and the bonus.

Caches hold (prompt length) + (output length) + k slots, so a round never writes past
the end (XLA would clamp the write onto the wrong slots), even for rows already done,
which keep computing in lockstep and emit PAD. A learned position table must cover
that many positions too.

Shape letters follow transformer/model/primitives.py; in addition P is the padded
prompt length, O the output length, K here the number of draft tokens k (not d_k) and
K1 = k + 1.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from transformer.config import BOS_ID, EOS_ID, PAD_ID
from transformer.model import draft as draft_lib
from transformer.model.decoding import (_cached_call, _create_cache, _forbid_special,
                                        filter_logits, max_output_lengths, prefill,
                                        set_positions, translation_prompt)

Array = jax.Array


class SpeculativeOutput(NamedTuple):
  """Tokens and what the draft saved.

  target_calls counts the target's passes after the prefill (the cache creation and
  the prompt pass, which also yields the first token, are not counted; one-token
  decoding spends one pass per further token). proposed counts the draft tokens offered
  to rows still generating, accepted those the target agreed with; row_calls counts the
  rows still generating summed over the target's passes (each such row's share of one).
  """
  tokens_BxC: Array  # int32, PAD after EOS
  target_calls: Array  # int32 scalar
  proposed: Array  # int32 scalar
  accepted: Array  # int32 scalar
  row_calls: Array  # int32 scalar

  @property
  def acceptance_rate(self) -> Array:
    return self.accepted / jnp.maximum(self.proposed, 1)

  @property
  def tokens_per_target_call(self) -> Array:
    """Generated tokens (EOS included) per sentence per counted target pass: at most
    k + 1, plus the share of the first tokens, which the uncounted prefill yields.
    Plain decoding with the cache makes 1."""
    generated = jnp.sum(self.tokens_BxC != PAD_ID)
    return generated / jnp.maximum(self.row_calls, 1)


# ----------------------------------------------------------------------------------
# The cache: creation, prefill and per-row cached calls.


def _inputs(model, source_or_prompt_BxS: Array, max_decode_extra_len: int,
            max_new_tokens: int) -> tuple[Optional[Array], Array, int, Array]:
  """(source or None, prompt_BxP, output length O, budget max_len_B) for either kind."""
  batch = source_or_prompt_BxS.shape[0]
  if model.config.decoder_only:
    if max_new_tokens <= 0:
      raise ValueError("decoder-only models need max_new_tokens > 0")
    return (None, source_or_prompt_BxS, max_new_tokens,
            jnp.full((batch,), max_new_tokens, jnp.int32))
  out_len = source_or_prompt_BxS.shape[1] + max_decode_extra_len
  return (source_or_prompt_BxS, jnp.full((batch, 1), BOS_ID, jnp.int32), out_len,
          max_output_lengths(source_or_prompt_BxS, max_decode_extra_len))


def _filtered_logprobs(logits_xV: Array, temperature: float, top_k: int,
                       top_p: float) -> Array:
  """log of sample_decode's distribution: special tokens forbidden, then filtered."""
  shape = logits_xV.shape
  logits_NxV = _forbid_special(logits_xV.reshape(-1, shape[-1]))
  logits_NxV = filter_logits(logits_NxV, temperature=temperature, top_k=top_k, top_p=top_p)
  return jax.nn.log_softmax(logits_NxV, axis=-1).reshape(shape)


# ----------------------------------------------------------------------------------
# Plain prompt continuation (decoder-only), one token per call after the prefill.


class _PromptState(NamedTuple):
  step: Array  # tokens generated so far
  tokens_BxO: Array
  finished_B: Array  # EOS produced
  logits_BxV: Array  # for the next token
  cache: Any


def _prompt_decode(model, params, prompt_BxP: Array, max_new_tokens: int,
                   choose_token: Callable[[Array, Array], Array]) -> Array:
  """Prefill, then `choose_token(filtered-ready logits_BxV, step) -> ids_B` per step."""
  if not model.config.decoder_only:
    raise ValueError("prompt decoding is for decoder-only models; see decoding.py")
  batch, prompt_len = prompt_BxP.shape
  cache, logits_BxV, _ = prefill(model, params, prompt_BxP,
                                 cache_len=prompt_len + max_new_tokens)

  def cond(s: _PromptState):
    return (s.step < max_new_tokens) & ~jnp.all(s.finished_B)

  def body(s: _PromptState):
    token_B = choose_token(_forbid_special(s.logits_BxV), s.step)
    token_B = jnp.where(s.finished_B, PAD_ID, token_B)
    tokens_BxO = jax.lax.dynamic_update_slice_in_dim(s.tokens_BxO, token_B[:, None], s.step,
                                                     axis=1)
    # Each row's position counter advances by one from its own prompt length.
    logits_Bx1xV, cache = _cached_call(model, params, s.cache, None, token_B[:, None])
    return _PromptState(s.step + 1, tokens_BxO, s.finished_B | (token_B == EOS_ID),
                        logits_Bx1xV[:, 0], cache)

  init = _PromptState(jnp.array(0, jnp.int32), jnp.zeros((batch, max_new_tokens), jnp.int32),
                      jnp.zeros((batch,), bool), logits_BxV, cache)
  return jax.lax.while_loop(cond, body, init).tokens_BxO


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens"))
def prompt_greedy_decode(model, params, prompt_BxP: Array, *, max_new_tokens: int) -> Array:
  """Greedy continuation of each prompt (decoder-only): int32 [B, max_new_tokens], PAD
  after EOS. prompt_BxP: BOS + source ids (see `translation_prompt`), right-padded."""
  return _prompt_decode(model, params, prompt_BxP, max_new_tokens,
                        lambda logits_BxV, step: jnp.argmax(logits_BxV, axis=-1))


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens"))
def prompt_sample_decode(model, params, prompt_BxP: Array, rng: Array, *,
                         max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                         top_p: float = 1.0) -> Array:
  """Sampled continuation of each prompt, as `decoding.sample_decode` samples."""
  def choose(logits_BxV, step):
    logits_BxV = filter_logits(logits_BxV, temperature=temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(jax.random.fold_in(rng, step), logits_BxV, axis=-1)
  return _prompt_decode(model, params, prompt_BxP, max_new_tokens, choose)


# ----------------------------------------------------------------------------------
# A draft that reads the target's encoder output (model/draft.py: ShallowDraft).


def _draft_prefill(target_model, target_params, draft_model, draft_params,
                   source_BxS: Optional[Array], prompt_BxP: Array, cache_len: int) -> Any:
  """The draft's cache after the prompt. A draft with `reads_target_encoder` has no
  encoder pass of its own: it is handed the target's encoder output (the target's
  prefill encodes the same source with the same parameters, and XLA computes the two
  identical encodings once)."""
  if not getattr(draft_model, "reads_target_encoder", False):
    return prefill(draft_model, draft_params, prompt_BxP, cache_len=cache_len,
                   source_BxS=source_BxS)[0]
  encoded_BxSxD = target_model.apply({"params": target_params}, source_BxS,
                                     method=target_model.encode)
  return draft_lib.prefill_from_encoded(draft_model, draft_params, encoded_BxSxD, source_BxS,
                                        prompt_BxP, cache_len)


# ----------------------------------------------------------------------------------
# Speculative decoding.


class _RoundState(NamedTuple):
  generated_B: Array  # tokens emitted so far; the pending `last` is the latest of them
  last_B: Array  # generated, not yet fed to either model, at position p
  prev_B: Array  # the token before it, at p - 1
  finished_B: Array  # EOS emitted
  tokens_BxO: Array  # O + k + 1 slots: a round writes k + 1 behind generated_B
  target_cache: Any
  draft_cache: Any
  target_calls: Array
  proposed: Array
  accepted: Array


def _speculative_decode(target_model, target_params, draft_model, draft_params,
                        source_or_prompt_BxS: Array, draft_len: int,
                        max_decode_extra_len: int, max_new_tokens: int,
                        sampling: Optional[dict], rng: Optional[Array]) -> SpeculativeOutput:
  """The shared loop; `sampling` None is greedy, else filter_logits' keyword arguments."""
  if target_model.config.decoder_only != draft_model.config.decoder_only:
    raise ValueError("the draft must be of the target's kind (decoder-only or not)")
  if target_model.config.vocab_size != draft_model.config.vocab_size:
    raise ValueError("the draft must share the target's vocabulary")
  if draft_len < 1:
    raise ValueError(f"draft_len must be >= 1, got {draft_len}")
  k = draft_len
  source_BxS, prompt_BxP, out_len, max_len_B = _inputs(
      target_model, source_or_prompt_BxS, max_decode_extra_len, max_new_tokens)
  batch, prompt_len = prompt_BxP.shape
  cache_len = prompt_len + out_len + k
  init_rng, rounds_rng = jax.random.split(rng) if sampling is not None else (None, None)

  target_cache, logits_BxV, prompt_len_B = prefill(
      target_model, target_params, prompt_BxP, cache_len=cache_len, source_BxS=source_BxS)
  draft_cache = _draft_prefill(target_model, target_params, draft_model, draft_params,
                               source_BxS, prompt_BxP, cache_len)
  if sampling is None:
    first_B = jnp.argmax(_forbid_special(logits_BxV), axis=-1)
  else:
    first_B = jax.random.categorical(
        init_rng, _filtered_logprobs(logits_BxV, **sampling), axis=-1)
  has_budget_B = max_len_B >= 1
  first_B = jnp.where(has_budget_B, first_B, PAD_ID).astype(jnp.int32)
  tokens_BxO = jnp.zeros((batch, out_len + k + 1), jnp.int32).at[:, 0].set(first_B)
  last_prompt_B = jnp.take_along_axis(prompt_BxP, (prompt_len_B - 1)[:, None], axis=1)[:, 0]
  zero = jnp.array(0, jnp.int32)
  init = _RoundState(has_budget_B.astype(jnp.int32), first_B, last_prompt_B,
                     first_B == EOS_ID, tokens_BxO, target_cache, draft_cache, zero, zero,
                     zero)
  active = lambda s: ~s.finished_B & (s.generated_B < max_len_B)

  def propose(s: _RoundState, position_B: Array, round_rng):
    """The draft's k tokens [B, K] and, when sampling, its log-probs [B, K, V]."""
    def choose(logits_BxV, j):
      if sampling is None:
        return jnp.argmax(_forbid_special(logits_BxV), axis=-1).astype(jnp.int32), None
      logq_BxV = _filtered_logprobs(logits_BxV, **sampling)
      key = jax.random.fold_in(round_rng, j)
      return jax.random.categorical(key, logq_BxV, axis=-1).astype(jnp.int32), logq_BxV

    logits_Bx2xV, cache = _cached_call(draft_model, draft_params, s.draft_cache, source_BxS,
                                       jnp.stack([s.prev_B, s.last_B], axis=1),
                                       position_B - 1)
    token_B, logq_BxV = choose(logits_Bx2xV[:, 1], 0)
    drafts_BxK = jnp.zeros((batch, k), jnp.int32).at[:, 0].set(token_B)
    logq_BxKxV = None
    if sampling is not None:
      logq_BxKxV = jnp.zeros((batch, k) + logq_BxV.shape[1:]).at[:, 0].set(logq_BxV)

    def step(j, carry):
      cache, drafts_BxK, logq_BxKxV = carry
      # The draft's own counter has advanced to proposal j - 1's slot.
      logits_Bx1xV, cache = _cached_call(draft_model, draft_params, cache, source_BxS,
                                         drafts_BxK[:, j - 1][:, None])
      token_B, logq_BxV = choose(logits_Bx1xV[:, 0], j)
      drafts_BxK = drafts_BxK.at[:, j].set(token_B)
      if logq_BxKxV is not None:
        logq_BxKxV = logq_BxKxV.at[:, j].set(logq_BxV)
      return cache, drafts_BxK, logq_BxKxV

    if k > 1:  # k = 1 traces (and compiles) no second draft call
      cache, drafts_BxK, logq_BxKxV = jax.lax.fori_loop(1, k, step,
                                                         (cache, drafts_BxK, logq_BxKxV))
    return cache, drafts_BxK, logq_BxKxV

  def verify(logits_BxK1xV: Array, drafts_BxK: Array, logq_BxKxV: Optional[Array],
             round_rng) -> tuple[Array, Array]:
    """(accepted count n_B in 0..k, the target's own next token_B)."""
    if sampling is None:
      vocab = logits_BxK1xV.shape[-1]
      choice_BxK1 = jnp.argmax(_forbid_special(logits_BxK1xV.reshape(-1, vocab)),
                               axis=-1).reshape(batch, k + 1).astype(jnp.int32)
      agree_BxK = drafts_BxK == choice_BxK1[:, :k]
      n_B = jnp.sum(jnp.cumprod(agree_BxK.astype(jnp.int32), axis=1), axis=1)
      return n_B, jnp.take_along_axis(choice_BxK1, n_B[:, None], axis=1)[:, 0]
    # Accept d_j with probability min(1, p(d_j) / q(d_j)): the output then follows p
    # (Leviathan et al., Theorem 1) whatever q is.
    uniform_key, residual_key = jax.random.split(round_rng)
    logp_BxK1xV = _filtered_logprobs(logits_BxK1xV, **sampling)
    logp_drafts_BxK = jnp.take_along_axis(logp_BxK1xV[:, :k], drafts_BxK[..., None],
                                          axis=-1)[..., 0]
    logq_drafts_BxK = jnp.take_along_axis(logq_BxKxV, drafts_BxK[..., None], axis=-1)[..., 0]
    uniform_BxK = jax.random.uniform(uniform_key, (batch, k))
    accept_BxK = uniform_BxK < jnp.exp(logp_drafts_BxK - logq_drafts_BxK)
    n_B = jnp.sum(jnp.cumprod(accept_BxK.astype(jnp.int32), axis=1), axis=1)
    # On rejection at n resample from normalise(max(0, p_n - q_{n+1})); with all k
    # accepted, sample the bonus from p_k: q padded with a zero distribution at k.
    pick = lambda x_BxJxV: jnp.take_along_axis(x_BxJxV, n_B[:, None, None], axis=1)[:, 0]
    p_BxV = jnp.exp(pick(logp_BxK1xV))
    q_padded_BxK1xV = jnp.concatenate([jnp.exp(logq_BxKxV), jnp.zeros_like(p_BxV)[:, None]],
                                      axis=1)
    residual_BxV = jnp.maximum(p_BxV - pick(q_padded_BxK1xV), 0.0)
    # Rounding can reject where p <= q everywhere (p = q): then p itself is the answer.
    residual_BxV = jnp.where(jnp.sum(residual_BxV, axis=-1, keepdims=True) > 0, residual_BxV,
                             p_BxV)
    token_B = jax.random.categorical(residual_key, jnp.log(residual_BxV), axis=-1)
    return n_B, token_B.astype(jnp.int32)

  def body(s: _RoundState) -> _RoundState:
    active_B = active(s)
    round_rng = (None if sampling is None
                 else jax.random.fold_in(rounds_rng, s.target_calls))
    draft_rng, verify_rng = (None, None) if round_rng is None else jax.random.split(round_rng)
    # `last` sits right behind the row's prompt and the tokens before it. Rows without
    # any budget never had a first token; p >= 1 keeps their draft call in bounds.
    position_B = prompt_len_B - 1 + jnp.maximum(s.generated_B, 1)
    draft_cache, drafts_BxK, logq_BxKxV = propose(s, position_B, draft_rng)
    fed_BxK1 = jnp.concatenate([s.last_B[:, None], drafts_BxK], axis=1)
    logits_BxK1xV, target_cache = _cached_call(target_model, target_params, s.target_cache,
                                               source_BxS, fed_BxK1, position_B)
    n_B, next_B = verify(logits_BxK1xV, drafts_BxK, logq_BxKxV, verify_rng)

    # Emit d_1 .. d_n and the target's token, up to the budget and the first EOS.
    slot_K1 = jnp.arange(k + 1)
    emitted_BxK1 = jnp.where(slot_K1 < n_B[:, None], jnp.roll(fed_BxK1, -1, axis=1),
                             next_B[:, None])
    is_eos_BxK1 = emitted_BxK1 == EOS_ID
    after_eos_BxK1 = (jnp.cumsum(is_eos_BxK1, axis=1) - is_eos_BxK1) > 0
    valid_BxK1 = (active_B[:, None] & (slot_K1 <= n_B[:, None]) & ~after_eos_BxK1
                  & (s.generated_B[:, None] + slot_K1 < max_len_B[:, None]))
    emitted_BxK1 = jnp.where(valid_BxK1, emitted_BxK1, PAD_ID)
    # Slots from generated_B on hold PAD (done rows) or nothing yet, so writing all
    # k + 1 there, PAD included, loses nothing.
    tokens_BxO = jax.vmap(lambda row_O, new_K1, at: jax.lax.dynamic_update_slice(
        row_O, new_K1, (at,)))(s.tokens_BxO, emitted_BxK1, s.generated_B)

    # Both caches roll back to the accepted prefix through the positions set next
    # round (from generated_B); `prev` and `last` are the tokens around that point.
    n_active_B = jnp.where(active_B, n_B, 0)
    return _RoundState(
        generated_B=s.generated_B + jnp.sum(valid_BxK1, axis=1, dtype=jnp.int32),
        last_B=jnp.where(active_B, next_B, s.last_B),
        prev_B=jnp.where(active_B, jnp.take_along_axis(fed_BxK1, n_B[:, None], axis=1)[:, 0],
                         s.prev_B),
        finished_B=s.finished_B | jnp.any(valid_BxK1 & is_eos_BxK1, axis=1),
        tokens_BxO=tokens_BxO, target_cache=target_cache, draft_cache=draft_cache,
        target_calls=s.target_calls + 1,
        proposed=s.proposed + k * jnp.sum(active_B, dtype=jnp.int32),
        accepted=s.accepted + jnp.sum(n_active_B, dtype=jnp.int32))

  s = jax.lax.while_loop(lambda s: jnp.any(active(s)), body, init)
  return SpeculativeOutput(s.tokens_BxO[:, :out_len], s.target_calls, s.proposed,
                           s.accepted, s.proposed // k)


_STATIC = ("target_model", "draft_model", "draft_len", "max_decode_extra_len",
           "max_new_tokens")


@functools.partial(jax.jit, static_argnames=_STATIC)
def speculative_greedy_decode(target_model, target_params, draft_model, draft_params,
                              source_BxS: Array, *, draft_len: int,
                              max_decode_extra_len: int = 0,
                              max_new_tokens: int = 0) -> SpeculativeOutput:
  """The target's greedy decoding, k = draft_len draft tokens checked per target pass.

  Encoder-decoder models: source_BxS is the source and the tokens [B, S + extra] equal
  `decoding.greedy_decode(target_model, target_params, source_BxS,
  max_decode_extra_len=...)`. Decoder-only: source_BxS is the prompt (see
  `translation_prompt`), tokens are [B, max_new_tokens] and equal
  `prompt_greedy_decode`. Any draft gives the same tokens; a better one, fewer passes.
  """
  return _speculative_decode(target_model, target_params, draft_model, draft_params,
                             source_BxS, draft_len, max_decode_extra_len, max_new_tokens,
                             None, None)


@functools.partial(jax.jit, static_argnames=_STATIC)
def speculative_sample_decode(target_model, target_params, draft_model, draft_params,
                              source_BxS: Array, rng: Array, *, draft_len: int,
                              max_decode_extra_len: int = 0, max_new_tokens: int = 0,
                              temperature: float = 1.0, top_k: int = 0,
                              top_p: float = 1.0) -> SpeculativeOutput:
  """Samples from the target's filtered distribution, as `decoding.sample_decode` (or,
  decoder-only, `prompt_sample_decode`) does, with draft proposals checked by rejection.

  The draft samples from its own distribution filtered the same way; any draft leaves
  the output distribution exactly the target's (not the same samples for one rng).
  """
  sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
  return _speculative_decode(target_model, target_params, draft_model, draft_params,
                             source_BxS, draft_len, max_decode_extra_len, max_new_tokens,
                             sampling, rng)
