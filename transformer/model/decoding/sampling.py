"""Greedy decoding and sampling: one hypothesis per row, one token per step.

`Greedy` takes the most likely token, `Sampling` draws from the distribution filtered
by temperature, top-k and top-p (`filter_logits`). Token t of a sample uses the key
fold_in(rng, t), so a seed gives the same output however the batch is split. Both run
in search.run_steps. Shape letters: transformer/model/primitives.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from transformer.config import EOS_ID, PAD_ID
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


@dataclasses.dataclass(frozen=True)
class Greedy:
  """The most likely token at every step."""

  width = 1

  def choose(self, logits_BxV: Array, step: Array, rng: Array | None) -> Array:
    return jnp.argmax(search_lib.forbid_special(logits_BxV), axis=-1).astype(jnp.int32)

  def run(
    self,
    model: IncrementalModel,
    params,
    prompts: search_lib.Prompts,
    rng: Array | None = None,
    draft_params: Any = None,
  ) -> search_lib.Generation:
    return search_lib.run_steps(_OneHypothesis(self, rng), model, params, prompts, rng)


@dataclasses.dataclass(frozen=True)
class Sampling(Greedy):
  """Ancestral sampling from the filtered distribution; top_k=1 is greedy decoding."""

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

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
