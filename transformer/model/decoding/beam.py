"""Beam search with GNMT's length penalty, the paper's decoding.

W hypotheses per sentence. Each step extends every live hypothesis by each token,
keeps the W best that do not end in EOS as the live beam and moves those that end in
EOS (or reach the sentence's budget) to the finished set; a sentence stops when no live
hypothesis can still beat its W finished ones (`is_done`). The model's side, the prefill
and the cache, is search.run_steps'. Shape letters: transformer/model/primitives.py;
O1 = O + 1 (a BOS slot before the O output slots).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from transformer.config import BOS_ID, EOS_ID
from transformer.model.decoding import offered
from transformer.model.decoding import search as search_lib
from transformer.model.incremental import IncrementalModel
from transformer.model.primitives import Array


def length_penalty(length: Array, alpha: float) -> Array:
  """GNMT's ((5 + length) / 6) ** alpha; a hypothesis scores log P / this."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


class BeamState(NamedTuple):
  step: Array  # tokens generated so far by every live hypothesis
  live_seqs_BxWxO1: Array  # BOS, then tokens; live hypotheses have no EOS yet
  live_logprobs_BxW: Array  # log P(tokens), sorted best first; -inf = empty slot
  finished_seqs_BxWxO1: Array  # ended by EOS or by the length budget, PAD after
  finished_scores_BxW: Array  # log P / length_penalty, best first; -inf = empty slot
  budget_B: Array  # the most tokens each sentence may generate


def _gather_beams(x_BxWx: Array, beam_BxM: Array) -> Array:
  return jax.vmap(lambda x, i: x[i])(x_BxWx, beam_BxM)


def is_done(state: BeamState, alpha: float, early_stop: bool) -> Array:
  """bool [B]: the sentence used its length budget, or no live beam can still win.

  A live hypothesis can only lose log-probability, and its penalty is largest at the
  maximum length, so log P(live) / penalty(max length) bounds any score it can reach;
  once W hypotheses finished and the worst of them beats that bound, the search of
  this sentence is over (the Tensor2Tensor / Flax WMT criterion).
  """
  done_B = state.step >= state.budget_B
  if early_stop:
    best_possible_B = state.live_logprobs_BxW[:, 0] / length_penalty(state.budget_B, alpha)
    done_B |= jnp.min(state.finished_scores_BxW, axis=1) > best_possible_B
  return done_B


def top_k(x_NxV: Array, count: int) -> tuple[Array, Array]:
  """`jax.lax.top_k(x_NxV, count)` over a long last axis, in two cheap passes.

  XLA:CPU's top_k over a vocabulary-sized row costs as much as many max-reductions of it
  (docs/notes/performance-log.md). So the row is cut into G chunks of U entries
  and only the `count` chunks with the largest maxima are searched: each chunk whose
  maximum reaches the count-th largest value holds a distinct entry at least that large,
  so there are at most `count` of them. The chosen chunks are searched in index order,
  so ties go to the lower index, as in lax.top_k.
  """
  n, v = x_NxV.shape
  width = _chunk_width(v, count)
  if width is None:
    return jax.lax.top_k(x_NxV, count)
  chunks_NxGxU = x_NxV.reshape(n, v // width, width)
  _, best_chunks_NxM = jax.lax.top_k(jnp.max(chunks_NxGxU, axis=-1), count)
  best_chunks_NxM = jnp.sort(best_chunks_NxM, axis=-1)
  candidates_NxMU = jnp.take_along_axis(chunks_NxGxU, best_chunks_NxM[:, :, None], axis=1).reshape(
    n, count * width
  )
  values_NxM, position_NxM = jax.lax.top_k(candidates_NxMU, count)
  chunk_NxM = jnp.take_along_axis(best_chunks_NxM, position_NxM // width, axis=1)
  return values_NxM, chunk_NxM * width + position_NxM % width


def _chunk_width(v: int, count: int) -> int | None:
  """The divisor of v nearest sqrt(v) that leaves more than 4 * count chunks, or None
  (then chunking saves nothing: a short or prime-length row)."""
  divisors = [u for u in range(2, int(v**0.5) * 2 + 1) if v % u == 0 and v // u > 4 * count]
  return min(divisors, key=lambda u: abs(u - v**0.5), default=None)


def best_tokens(logits_NxV: Array, count: int) -> tuple[Array, Array]:
  """The `count` most likely tokens of each row that may be generated (not PAD or BOS),
  with their log-probabilities under softmax(logits): (log P [N, M], ids [N, M]).

  The [N, V] log-softmax is never built: the top logits are ranked as they are (the
  normalizer is the same for a whole row) and only they have the log-sum-exp taken off.
  Taking len(NEVER_GENERATED) more than asked leaves `count` after the forbidden ones
  are dropped.
  """
  never = search_lib.NEVER_GENERATED
  vocab = logits_NxV.shape[-1]
  top_logits_NxM, top_tokens_NxM = top_k(logits_NxV, min(count + len(never), vocab))
  allowed_NxM = ~jnp.isin(top_tokens_NxM, jnp.array(never))
  best_logits_NxM, position_NxM = jax.lax.top_k(
    jnp.where(allowed_NxM, top_logits_NxM, -jnp.inf), count
  )
  log_normalizer_Nx1 = jax.nn.logsumexp(logits_NxV, axis=-1, keepdims=True)
  return (
    best_logits_NxM - log_normalizer_Nx1,
    jnp.take_along_axis(top_tokens_NxM, position_NxM, axis=1),
  )


def _best_extensions(s: BeamState, logits_NxV: Array, beams: int):
  """The 2W best one-token extensions of the live beams: (log P, parent beam,
  sequences, ends in EOS), each [B, 2W, ...].

  2W candidates leave W that do not end in EOS, whatever the W best are. They are among
  each beam's own 2W best (M per beam), so selection runs in two stages: XLA on CPU
  otherwise sorts all W * V candidates, which costs more than the model's step.
  """
  batch, vocab = s.live_logprobs_BxW.shape[0], logits_NxV.shape[-1]
  per_beam = min(2 * beams, vocab)
  beam_best_NxM, beam_token_NxM = best_tokens(logits_NxV, per_beam)
  candidates_BxWM = (
    s.live_logprobs_BxW[:, :, None] + beam_best_NxM.reshape(batch, beams, per_beam)
  ).reshape(batch, -1)
  top_logprobs_Bx2W, top_index_Bx2W = jax.lax.top_k(candidates_BxWM, 2 * beams)
  top_beam_Bx2W = top_index_Bx2W // per_beam
  top_token_Bx2W = jnp.take_along_axis(beam_token_NxM.reshape(batch, -1), top_index_Bx2W, axis=1)
  top_seqs_Bx2WxO1 = jax.lax.dynamic_update_slice_in_dim(
    _gather_beams(s.live_seqs_BxWxO1, top_beam_Bx2W), top_token_Bx2W[:, :, None], s.step + 1, axis=2
  )
  return top_logprobs_Bx2W, top_beam_Bx2W, top_seqs_Bx2WxO1, top_token_Bx2W == EOS_ID


def beam_step(
  s: BeamState, logits_NxV: Array, beams: int, alpha: float, early_stop: bool
) -> tuple[BeamState, Array]:
  """One search step from the next-token logits: (new state, parent beam [B, W])."""
  t = s.step
  top_logprobs_Bx2W, top_beam_Bx2W, top_seqs_Bx2WxO1, ends_Bx2W = _best_extensions(
    s, logits_NxV, beams
  )
  live_logprobs_BxW, keep_BxW = jax.lax.top_k(
    jnp.where(ends_Bx2W, -jnp.inf, top_logprobs_Bx2W), beams
  )
  live_seqs_BxWxO1 = _gather_beams(top_seqs_Bx2WxO1, keep_BxW)
  parent_beam_BxW = _gather_beams(top_beam_Bx2W, keep_BxW)

  # A hypothesis finishes when its EOS ranks among the W best candidates (as in fairseq,
  # so beam size 1 with alpha 0 is exactly greedy decoding), or when it reaches its
  # sentence's maximum length: then it competes as it stands, without EOS.
  penalty = length_penalty(t + 1, alpha)
  ended_scores_BxW = jnp.where(
    ends_Bx2W[:, :beams], top_logprobs_Bx2W[:, :beams] / penalty, -jnp.inf
  )
  capped_scores_BxW = jnp.where(
    (t + 1 == s.budget_B)[:, None], live_logprobs_BxW / penalty, -jnp.inf
  )
  finished_scores_BxW, keep_BxW = jax.lax.top_k(
    jnp.concatenate([s.finished_scores_BxW, ended_scores_BxW, capped_scores_BxW], axis=1), beams
  )
  finished_seqs_BxWxO1 = _gather_beams(
    jnp.concatenate(
      [s.finished_seqs_BxWxO1, top_seqs_Bx2WxO1[:, :beams], live_seqs_BxWxO1], axis=1
    ),
    keep_BxW,
  )

  # Sentences already done keep their beams (and cache rows) as they were.
  active_B = ~is_done(s, alpha, early_stop)
  keep = lambda new, old: jnp.where(active_B.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
  parent_beam_BxW = keep(
    parent_beam_BxW, jnp.broadcast_to(jnp.arange(beams), parent_beam_BxW.shape)
  )
  new_state = BeamState(
    t + 1,
    keep(live_seqs_BxWxO1, s.live_seqs_BxWxO1),
    keep(live_logprobs_BxW, s.live_logprobs_BxW),
    keep(finished_seqs_BxWxO1, s.finished_seqs_BxWxO1),
    keep(finished_scores_BxW, s.finished_scores_BxW),
    s.budget_B,
  )
  return new_state, parent_beam_BxW


@offered.register
@struct.dataclass
class BeamSearch(offered.Offered):
  """W = beam_size hypotheses per sentence; alpha: the length penalty's exponent (0
  ranks by log-probability alone); early_stop=False runs every sentence to its budget
  (for timing). Returns each sentence's best-scoring hypothesis among those that ended
  with EOS (included) and those that reached the budget without one."""

  name = "beam"
  help = "beam search (the paper's)"
  continues_text = False
  options = (
    offered.Option(
      "beam_size", int, None, "Beam size (default: the config's).", lambda n: n >= 1, "must be >= 1"
    ),
    offered.Option("alpha", float, None, "Length penalty alpha (default: the config's)."),
  )

  beam_size: int = struct.field(pytree_node=False, default=4)
  alpha: float = struct.field(pytree_node=False, default=0.6)
  early_stop: bool = struct.field(pytree_node=False, default=True)

  @classmethod
  def from_options(cls, config, values) -> BeamSearch:
    """--beam_size and --alpha, each the config's where not given."""
    size, alpha = values.get("beam_size"), values.get("alpha")
    return cls(
      config.beam_size if size is None else size,
      config.length_penalty_alpha if alpha is None else alpha,
    )

  @classmethod
  def record(cls, config, values) -> dict:
    search = cls.from_options(config, values)
    return {"beam_size": search.beam_size, "alpha": search.alpha}

  @property
  def width(self) -> int:
    return self.beam_size

  def run(
    self,
    model: IncrementalModel,
    params,
    prompts: search_lib.Prompts,
    rng: Array | None = None,
  ) -> search_lib.Generation:
    return search_lib.run_steps(self, model, params, prompts, rng)

  def start(self, logits_BxV: Array, prompts: search_lib.Prompts, rng) -> BeamState:
    """The first step, from the prefill's logits: every beam starts as BOS, and only
    the first is live (W copies of BOS would fill the beam with duplicates)."""
    batch, beams = logits_BxV.shape[0], self.beam_size
    seqs_BxWxO1 = jnp.zeros((batch, beams, prompts.out_len + 1), jnp.int32).at[:, :, 0].set(BOS_ID)
    live_logprobs_BxW = jnp.full((batch, beams), -jnp.inf).at[:, 0].set(0.0)
    s = BeamState(
      jnp.array(0, jnp.int32),
      seqs_BxWxO1,
      live_logprobs_BxW,
      seqs_BxWxO1,
      jnp.full((batch, beams), -jnp.inf),
      jnp.minimum(prompts.budget_B, prompts.out_len).astype(jnp.int32),
    )
    # Every row of a sentence holds the same state: no reordering needed after this.
    return self.step(s, jnp.repeat(logits_BxV, beams, axis=0))[0]

  def newest_N(self, s: BeamState) -> Array:
    return jax.lax.dynamic_index_in_dim(s.live_seqs_BxWxO1, s.step, axis=2, keepdims=False).reshape(
      -1
    )

  def step(self, s: BeamState, logits_NxV: Array) -> tuple[BeamState, Array]:
    s, parent_beam_BxW = beam_step(s, logits_NxV, self.beam_size, self.alpha, self.early_stop)
    batch = parent_beam_BxW.shape[0]
    return s, (jnp.arange(batch)[:, None] * self.beam_size + parent_beam_BxW).reshape(-1)

  def done_B(self, s: BeamState) -> Array:
    return is_done(s, self.alpha, self.early_stop)

  def finish(self, s: BeamState) -> tuple[Array, Array]:
    # Every sentence ends with finished hypotheses: it either stopped early, which needs
    # W of them, or reached its maximum length, which finishes every live one.
    return s.finished_seqs_BxWxO1[:, 0, 1:], s.finished_scores_BxW[:, 0]
