"""Greedy decoding and sampling: one hypothesis per row, one token per step.

`Greedy` takes the most likely token, `Sampling` draws from the distribution filtered
by temperature, top-k and top-p (`filter_logits`). Token t of a sample uses the key
fold_in(rng, t), so a seed gives the same output however the batch is split. Both run
in search.run_steps. Shape letters: transformer/model/primitives.py.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from transformer.config import EOS_ID, PAD_ID
from transformer.model.decoding import offered
from transformer.model.decoding import search as search_lib
from transformer.model.incremental import IncrementalModel
from transformer.model.primitives import Array


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


class _State(NamedTuple):
  step: Array  # tokens generated so far
  tokens_BxO: Array
  finished_B: Array  # EOS produced or budget used
  logprob_B: Array  # log P(tokens) under the model
  budget_B: Array


@offered.register
@struct.dataclass
class Greedy(offered.Offered):
  """The most likely token at every step."""

  name = "greedy"
  help = "the most likely token at every step"
  drafts = True
  width = 1

  @classmethod
  def from_options(cls, config, values) -> Greedy:
    return cls()

  def choose(self, logits_BxV: Array, step: Array, rng: Array | None) -> Array:
    return jnp.argmax(search_lib.forbid_special(logits_BxV), axis=-1).astype(jnp.int32)

  # Speculative decoding reproduces a search through these two: the draft proposes as
  # the search would choose, and the target verifies so that the output is the search's.

  def propose(self, logits_BxV: Array, index, rng: Array | None) -> tuple[Array, Array | None]:
    """The draft's token_B for proposal `index`, and the log-probs [B, V] it was drawn
    from (None: this search draws nothing)."""
    return self.choose(logits_BxV, index, None), None

  def verify(
    self, logits_BxJ1xV: Array, drafts_BxJ: Array, logq_BxJxV: Array | None, rng: Array | None
  ) -> tuple[Array, Array]:
    """(accepted count n_B in 0..J, the target's own next token_B): the proposals the
    target's argmax agrees with, up to the first that it does not."""
    choice_BxJ1 = jnp.argmax(search_lib.forbid_special(logits_BxJ1xV), axis=-1).astype(jnp.int32)
    agree_BxJ = drafts_BxJ == choice_BxJ1[:, :-1]
    n_B = jnp.sum(jnp.cumprod(agree_BxJ.astype(jnp.int32), axis=1), axis=1)
    return n_B, jnp.take_along_axis(choice_BxJ1, n_B[:, None], axis=1)[:, 0]

  def run(
    self,
    model: IncrementalModel,
    params,
    prompts: search_lib.Prompts,
    rng: Array | None = None,
  ) -> search_lib.Generation:
    return search_lib.run_steps(_OneHypothesis(self, rng), model, params, prompts, rng)


@offered.register
@struct.dataclass
class Sampling(Greedy):
  """Ancestral sampling from the filtered distribution; top_k=1 is greedy decoding."""

  name = "sample"
  help = "sampling from the filtered distribution"
  options = (
    offered.Option(
      "temperature", float, 1.0, "Sampling temperature (> 0).", lambda t: t > 0, "must be > 0"
    ),
    offered.Option(
      "top_k",
      int,
      0,
      "Sample from the K most likely tokens (0 = all).",
      lambda k: k >= 0,
      "must be >= 0 (0 = all)",
    ),
    offered.Option(
      "top_p",
      float,
      1.0,
      "Sample from the smallest set of tokens reaching this mass.",
      lambda p: 0 < p <= 1,
      "must be in (0, 1]",
    ),
  )

  temperature: float = struct.field(pytree_node=False, default=1.0)
  top_k: int = struct.field(pytree_node=False, default=0)
  top_p: float = struct.field(pytree_node=False, default=1.0)

  @classmethod
  def from_options(cls, config, values) -> Sampling:
    return cls(values["temperature"], values["top_k"], values["top_p"])

  @classmethod
  def record(cls, config, values) -> dict:
    return {name: values[name] for name in ("seed", "temperature", "top_k", "top_p")}

  def filtered_logprobs(self, logits_xV: Array) -> Array:
    """log of the distribution tokens are drawn from: specials forbidden, filtered."""
    shape = logits_xV.shape
    logits_NxV = search_lib.forbid_special(logits_xV.reshape(-1, shape[-1]))
    logits_NxV = filter_logits(
      logits_NxV, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p
    )
    return jax.nn.log_softmax(logits_NxV, axis=-1).reshape(shape)

  def choose(self, logits_BxV: Array, step: Array, rng: Array | None) -> Array:
    if rng is None:
      raise ValueError("Sampling draws at random: pass decode() an rng")
    return jax.random.categorical(
      jax.random.fold_in(rng, step), self.filtered_logprobs(logits_BxV), axis=-1
    ).astype(jnp.int32)

  def propose(self, logits_BxV: Array, index, rng: Array | None) -> tuple[Array, Array | None]:
    assert rng is not None  # Speculative splits decode()'s rng, which choose() demanded
    logq_BxV = self.filtered_logprobs(logits_BxV)
    token_B = jax.random.categorical(jax.random.fold_in(rng, index), logq_BxV, axis=-1)
    return token_B.astype(jnp.int32), logq_BxV

  def verify(
    self, logits_BxJ1xV: Array, drafts_BxJ: Array, logq_BxJxV: Array | None, rng: Array | None
  ) -> tuple[Array, Array]:
    """Accepts d_j with probability min(1, p(d_j) / q(d_j)): the output then follows p
    (Leviathan et al., Theorem 1) whatever q is. (n_B, the target's own next token_B)."""
    assert logq_BxJxV is not None and rng is not None  # proposed by propose() above
    batch, j = drafts_BxJ.shape
    uniform_key, residual_key = jax.random.split(rng)
    logp_BxJ1xV = self.filtered_logprobs(logits_BxJ1xV)
    pick_drafts = lambda x_BxJxV: jnp.take_along_axis(x_BxJxV, drafts_BxJ[..., None], axis=-1)[
      ..., 0
    ]
    logp_drafts_BxJ, logq_drafts_BxJ = pick_drafts(logp_BxJ1xV[:, :j]), pick_drafts(logq_BxJxV)
    uniform_BxJ = jax.random.uniform(uniform_key, (batch, j))
    accept_BxJ = uniform_BxJ < jnp.exp(logp_drafts_BxJ - logq_drafts_BxJ)
    n_B = jnp.sum(jnp.cumprod(accept_BxJ.astype(jnp.int32), axis=1), axis=1)
    # On rejection at n resample from normalise(max(0, p_n - q_{n+1})); with all J
    # accepted, sample the bonus from p_J: q padded with a zero distribution at J.
    pick = lambda x_BxJ1xV: jnp.take_along_axis(x_BxJ1xV, n_B[:, None, None], axis=1)[:, 0]
    p_BxV = jnp.exp(pick(logp_BxJ1xV))
    q_padded_BxJ1xV = jnp.concatenate([jnp.exp(logq_BxJxV), jnp.zeros_like(p_BxV)[:, None]], 1)
    residual_BxV = jnp.maximum(p_BxV - pick(q_padded_BxJ1xV), 0.0)
    # Rounding can reject where p <= q everywhere (p = q): then p itself is the answer.
    residual_BxV = jnp.where(jnp.sum(residual_BxV, axis=-1, keepdims=True) > 0, residual_BxV, p_BxV)
    token_B = jax.random.categorical(residual_key, jnp.log(residual_BxV), axis=-1)
    return n_B, token_B.astype(jnp.int32)


class _OneHypothesis:
  """Greedy or Sampling as a search.StepSearch of one hypothesis per row."""

  width = 1

  def __init__(self, chooser: Greedy, rng: Array | None):
    self.chooser, self.rng = chooser, rng

  def start(self, logits_BxV: Array, prompts: search_lib.Prompts, rng) -> _State:
    batch = logits_BxV.shape[0]
    budget_B = jnp.minimum(prompts.budget_B, prompts.out_len)
    state = _State(
      jnp.array(0, jnp.int32),
      jnp.zeros((batch, prompts.out_len), jnp.int32),
      budget_B < 1,
      jnp.zeros((batch,), jnp.float32),
      budget_B,
    )
    return self.step(state, logits_BxV)[0]

  def newest_N(self, s: _State) -> Array:
    return jax.lax.dynamic_index_in_dim(s.tokens_BxO, s.step - 1, axis=1, keepdims=False)

  def step(self, s: _State, logits_BxV: Array) -> tuple[_State, None]:
    token_B = jnp.where(s.finished_B, PAD_ID, self.chooser.choose(logits_BxV, s.step, self.rng))
    logprob_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BxV), token_B[:, None], axis=1)[:, 0]
    tokens_BxO = jax.lax.dynamic_update_slice_in_dim(s.tokens_BxO, token_B[:, None], s.step, axis=1)
    finished_B = s.finished_B | (token_B == EOS_ID) | (s.step + 1 >= s.budget_B)
    return _State(
      s.step + 1,
      tokens_BxO,
      finished_B,
      s.logprob_B + jnp.where(s.finished_B, 0.0, logprob_B),
      s.budget_B,
    ), None

  def done_B(self, s: _State) -> Array:
    return s.finished_B

  def finish(self, s: _State) -> tuple[Array, Array]:
    return s.tokens_BxO, s.logprob_B
