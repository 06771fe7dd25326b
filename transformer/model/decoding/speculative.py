"""Speculative decoding (Leviathan et al. 2023, Chen et al. 2023) over the cache.

A small draft model proposes J = draft_len tokens one at a time with its own cache; the
target then scores the last accepted token and the J proposals in ONE cached call of
J + 1 tokens. Each row keeps the longest prefix the target agrees with, plus one token
of the target's own (its correction at the first disagreement, or a bonus token when
all J agree), so every target call yields 1 .. J + 1 tokens. Rows accept different
amounts: each keeps its own cache position, and rolling a row back is setting its
position back (the model's set_positions, transformer/model/incremental.py); nothing is
recomputed.

The output is exactly the target's own decoding whatever the draft: `Greedy` token for
token (up to float rounding in near-ties: multi-token calls round differently from
one-token calls), and for `Sampling` its distribution (the accept / resample rule in
`Sampling.verify`). The search owns both halves: `propose` draws the draft's tokens as
it would choose, `verify` keeps what the target's own choice allows, so a search that
defines the two runs speculatively with no change here.

Two kinds of draft work. An independent model of the target's kind (same vocabulary)
encodes the source for itself. A draft whose `reads_target_encoding` attribute is True
has no encoder of its own: its decoder cross-attends to the target's encoder output
(same d_model), which the target's prefill computes once for both. Either kind is a
flax model with a `config` (vocab_size, d_model, decoder_only), driven through its
incremental side (transformer/model/incremental.py) as the target is.

After both prefills (search.Prompts: an encoder-decoder's prompt is BOS), with the
pending (generated, not yet fed) token `last` at position p and the token before it
`prev` at p - 1, a round is:

  draft:  feeds [prev, last] at p - 1, p (one call; rewriting p - 1 is harmless and
          covers the slot a round that accepted all J never fed), then each proposal
          d_1 .. d_{J-1} in turn: J calls proposing d_1 .. d_J.
  target: feeds [last, d_1 .. d_J] at p .. p + J: logits for d_1 .. d_J and the bonus.

Caches hold P + O + J slots, so a round never writes past the end (XLA would clamp the
write onto the wrong slots), even for rows already done, which keep computing in
lockstep and emit PAD. Shape letters: transformer/model/primitives.py; J1 = J + 1.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from transformer.config import EOS_ID, PAD_ID
from transformer.model import incremental
from transformer.model.decoding import search as search_lib
from transformer.model.decoding.sampling import Greedy
from transformer.model.incremental import IncrementalModel
from transformer.model.primitives import Array


def reads_target_encoding(draft_model) -> bool:
  """True for a draft without an encoder of its own, reading the target's encoder output;
  a model says so with a `reads_target_encoding = True` attribute."""
  return incremental.of(draft_model).reads_target_encoding


def tokens_per_round(acceptance: float, draft_len: int) -> float:
  """Tokens one sequence gets per round of k draft tokens and one check, on average:
  (1 - a^(k+1)) / (1 - a), and k + 1 when every proposal is accepted."""
  if acceptance >= 1:
    return draft_len + 1
  return (1 - acceptance ** (draft_len + 1)) / (1 - acceptance)


def expected_speedup(
  acceptance: float, draft_len: int, cost: float, check_cost: float = 1.0
) -> float:
  """Leviathan et al.'s expected speed-up of one sequence, (1 - a^(k+1)) / ((1 - a)(k c + 1)):
  tokens per round over the round's cost in target passes. check_cost is the (k + 1)-token
  check's cost in target passes: 1 in the formula (an accelerator's), measured on a CPU."""
  return tokens_per_round(acceptance, draft_len) / (draft_len * cost + check_cost)


class _Round(NamedTuple):
  generated_B: Array  # tokens emitted so far; the pending `last` is the latest of them
  last_B: Array  # generated, not yet fed to either model, at position p
  prev_B: Array  # the token before it, at p - 1
  finished_B: Array  # EOS emitted
  tokens_BxO: Array  # O + J + 1 slots: a round writes J + 1 behind generated_B
  logprob_B: Array  # log P(tokens) under the target
  target: Any  # the target's decoder state
  draft: Any  # the draft's
  calls: Array
  proposed: Array
  accepted: Array


@struct.dataclass
class Speculative:
  """The target's own `search` (one with `propose` and `verify`: Greedy() or a
  Sampling), reproduced exactly with draft_len tokens of `draft_model` checked per
  target pass. The search owns the draft's parameters (`draft_params`, arrays that
  `decode` takes as its inputs, not constants of the compiled program); no other search
  sees them."""

  draft_model: Any = struct.field(pytree_node=False)
  draft_len: int = struct.field(pytree_node=False, default=4)
  search: Greedy = struct.field(pytree_node=False, default=Greedy())
  draft_params: Any = None

  def check(self, model) -> None:
    """ValueError unless the draft can serve this target (a flax model or its
    incremental side)."""
    draft_config = self.draft_model.config
    if self.draft_len < 1:
      raise ValueError(f"draft_len must be >= 1, got {self.draft_len}")
    if draft_config.vocab_size != model.config.vocab_size:
      raise ValueError("the draft must share the target's vocabulary")
    if reads_target_encoding(self.draft_model):
      if model.config.decoder_only or draft_config.d_model != model.config.d_model:
        raise ValueError(
          "a draft reading the target's encoding needs an encoder-decoder target of its d_model"
        )
    elif draft_config.decoder_only != model.config.decoder_only:
      raise ValueError("the draft must be of the target's kind (decoder-only or not)")

  def run(
    self,
    model: IncrementalModel,
    params,
    prompts: search_lib.Prompts,
    rng: Array | None,
  ) -> search_lib.Generation:
    self.check(model)
    if self.draft_params is None:
      raise ValueError("Speculative needs the draft's parameters: Speculative(..., draft_params=)")
    draft_model, draft_params = incremental.of(self.draft_model).prepare(self.draft_params)
    init_rng, rounds_rng = jax.random.split(rng) if rng is not None else (None, None)
    s, prompt_len_B = self._start(model, params, draft_model, draft_params, prompts, init_rng)
    budget_B = prompts.budget_B
    active = lambda s: ~s.finished_B & (s.generated_B < budget_B)

    def body(s: _Round) -> _Round:
      round_rng = None if rounds_rng is None else jax.random.fold_in(rounds_rng, s.calls)
      draft_rng, verify_rng = (None, None) if round_rng is None else jax.random.split(round_rng)
      # `last` sits right behind the row's prompt and the tokens before it. Rows without
      # any budget never had a first token; p >= 1 keeps their draft call in bounds.
      position_B = prompt_len_B - 1 + jnp.maximum(s.generated_B, 1)
      draft, drafts_BxJ, logq_BxJxV = self._propose(
        draft_model, draft_params, s, position_B, draft_rng
      )
      fed_BxJ1 = jnp.concatenate([s.last_B[:, None], drafts_BxJ], axis=1)
      logits_BxJ1xV, target = model.feed(params, s.target, fed_BxJ1, position_B)
      n_B, next_B = self.search.verify(logits_BxJ1xV, drafts_BxJ, logq_BxJxV, verify_rng)
      s = s._replace(target=target, draft=draft)
      return _emit(s, active(s), budget_B, fed_BxJ1, n_B, next_B, jax.nn.log_softmax(logits_BxJ1xV))

    s = jax.lax.while_loop(lambda s: jnp.any(active(s)), body, s)
    return search_lib.Generation(
      s.tokens_BxO[:, : prompts.out_len],
      s.logprob_B,
      s.calls,
      s.proposed // self.draft_len,
      s.proposed,
      s.accepted,
    )

  def _start(
    self,
    model: IncrementalModel,
    params,
    draft_model: IncrementalModel,
    draft_params,
    prompts: search_lib.Prompts,
    rng: Array | None,
  ) -> tuple[_Round, Array]:
    """Both prefills and the first token, from the target's prefill logits."""
    prompt_BxP, j = prompts.prompt_BxP, self.draft_len
    batch, prompt_len = prompt_BxP.shape
    cache_len = prompt_len + prompts.out_len + j
    target = model.prefill(params, prompt_BxP, cache_len=cache_len, source_BxS=prompts.source_BxS)
    shared = target.encoded_BxSxD if draft_model.reads_target_encoding else None
    draft = draft_model.prefill(
      draft_params,
      prompt_BxP,
      cache_len=cache_len,
      source_BxS=prompts.source_BxS,
      encoded_BxSxD=shared,
    )
    first_B = self.search.choose(target.logits_BxV, jnp.array(0), rng)
    has_budget_B = prompts.budget_B >= 1
    first_B = jnp.where(has_budget_B, first_B, PAD_ID).astype(jnp.int32)
    logprob_B = jnp.where(
      has_budget_B,
      jnp.take_along_axis(jax.nn.log_softmax(target.logits_BxV), first_B[:, None], axis=1)[:, 0],
      0.0,
    )
    tokens_BxO = jnp.zeros((batch, prompts.out_len + j + 1), jnp.int32).at[:, 0].set(first_B)
    last_prompt_B = jnp.take_along_axis(prompt_BxP, (target.prompt_len_B - 1)[:, None], axis=1)[
      :, 0
    ]
    zero = jnp.array(0, jnp.int32)
    # Rows roll back by different amounts: a position per row from here on.
    s = _Round(
      has_budget_B.astype(jnp.int32),
      first_B,
      last_prompt_B,
      first_B == EOS_ID,
      tokens_BxO,
      logprob_B,
      model.set_positions(target.state, target.prompt_len_B),
      draft_model.set_positions(draft.state, target.prompt_len_B),
      zero,
      zero,
      zero,
    )
    return s, target.prompt_len_B

  def _propose(
    self, draft_model: IncrementalModel, draft_params, s: _Round, position_B: Array, rng
  ):
    """The draft's J tokens [B, J] (and, sampling, its log-probs [B, J, V])."""
    batch, j = s.last_B.shape[0], self.draft_len
    choose = lambda logits_BxV, index: self.search.propose(logits_BxV, index, rng)
    logits_Bx2xV, draft = draft_model.feed(
      draft_params, s.draft, jnp.stack([s.prev_B, s.last_B], axis=1), position_B - 1
    )
    token_B, logq_BxV = choose(logits_Bx2xV[:, 1], 0)
    drafts_BxJ = jnp.zeros((batch, j), jnp.int32).at[:, 0].set(token_B)
    logq_BxJxV = (
      None
      if logq_BxV is None
      else jnp.zeros((batch, j) + logq_BxV.shape[1:]).at[:, 0].set(logq_BxV)
    )

    def step(i, carry):
      draft, drafts_BxJ, logq_BxJxV = carry
      # The draft's own counter has advanced to proposal i - 1's slot.
      logits_Bx1xV, draft = draft_model.feed(draft_params, draft, drafts_BxJ[:, i - 1][:, None])
      token_B, logq_BxV = choose(logits_Bx1xV[:, 0], i)
      drafts_BxJ = drafts_BxJ.at[:, i].set(token_B)
      if logq_BxJxV is not None:
        logq_BxJxV = logq_BxJxV.at[:, i].set(logq_BxV)
      return draft, drafts_BxJ, logq_BxJxV

    if j > 1:  # J = 1 traces (and compiles) no second draft call
      draft, drafts_BxJ, logq_BxJxV = jax.lax.fori_loop(1, j, step, (draft, drafts_BxJ, logq_BxJxV))
    return draft, drafts_BxJ, logq_BxJxV


def _emit(
  s: _Round,
  active_B: Array,
  budget_B: Array,
  fed_BxJ1: Array,
  n_B: Array,
  next_B: Array,
  logp_BxJ1xV: Array,
) -> _Round:
  """Writes d_1 .. d_n and the target's token, up to the budget and the first EOS, and
  moves each active row's `prev` and `last` to the accepted prefix's end: both caches
  roll back there through the positions set next round (from generated_B)."""
  j1 = fed_BxJ1.shape[1]
  slot_J1 = jnp.arange(j1)
  emitted_BxJ1 = jnp.where(slot_J1 < n_B[:, None], jnp.roll(fed_BxJ1, -1, axis=1), next_B[:, None])
  is_eos_BxJ1 = emitted_BxJ1 == EOS_ID
  after_eos_BxJ1 = (jnp.cumsum(is_eos_BxJ1, axis=1) - is_eos_BxJ1) > 0
  valid_BxJ1 = (
    active_B[:, None]
    & (slot_J1 <= n_B[:, None])
    & ~after_eos_BxJ1
    & (s.generated_B[:, None] + slot_J1 < budget_B[:, None])
  )
  logp_BxJ1 = jnp.take_along_axis(logp_BxJ1xV, emitted_BxJ1[..., None], axis=-1)[..., 0]
  emitted_BxJ1 = jnp.where(valid_BxJ1, emitted_BxJ1, PAD_ID)
  # Slots from generated_B on hold PAD (done rows) or nothing yet, so writing all J + 1
  # there, PAD included, loses nothing.
  tokens_BxO = jax.vmap(
    lambda row_O, new_J1, at: jax.lax.dynamic_update_slice(row_O, new_J1, (at,))
  )(s.tokens_BxO, emitted_BxJ1, s.generated_B)
  n_active_B = jnp.where(active_B, n_B, 0)
  return s._replace(
    generated_B=s.generated_B + jnp.sum(valid_BxJ1, axis=1, dtype=jnp.int32),
    last_B=jnp.where(active_B, next_B, s.last_B),
    prev_B=jnp.where(active_B, jnp.take_along_axis(fed_BxJ1, n_B[:, None], axis=1)[:, 0], s.prev_B),
    finished_B=s.finished_B | jnp.any(valid_BxJ1 & is_eos_BxJ1, axis=1),
    tokens_BxO=tokens_BxO,
    logprob_B=s.logprob_B + jnp.sum(jnp.where(valid_BxJ1, logp_BxJ1, 0.0), axis=1),
    calls=s.calls + 1,
    proposed=s.proposed + (j1 - 1) * jnp.sum(active_B, dtype=jnp.int32),
    accepted=s.accepted + jnp.sum(n_active_B, dtype=jnp.int32),
  )
