"""Generation: one entry point, `decode(model, params, prompts, search)`, for every search
and every kind of model.

  search.py       Prompts (the input), Generation (the output), the Search interface and
                  the loop of the searches that add one token per hypothesis per step,
                  on a cache that grows as it fills (cache_segments)
  beam.py         BeamSearch, GNMT's length penalty (the paper's decoding)
  sampling.py     Greedy, Sampling (temperature, top-k, top-p)
  speculative.py  Speculative: a draft model's proposals checked by the target
  offered.py      the searches the commands offer (--search): each decoding class above
                  declares its name and options, and registers itself

    prompts = decoding.translation_prompts(source_BxS, max_decode_extra_len, decoder_only)
    out = decoding.decode(model, params, prompts, decoding.BeamSearch(beam_size=4, alpha=0.6))
    out.tokens_BxO, out.scores_B

An encoder-decoder model continues BOS, reading its source; a decoder-only model
continues BOS + source, or any prompt (`continuation_prompts`). Either way the prompt
is read in one prefill, and every search then decodes over the cache, which grows as it
fills and keeps the cross-attention K/V once per sentence. The searches drive the model
through its incremental side (transformer/model/incremental.py: prefill, feed, the
decoder state's row operations) and never look inside its state. Sampling searches take
`rng`; `Speculative` owns the draft's parameters (its `draft_params`). Shape letters:
transformer/model/primitives.py.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from transformer.model import incremental
from transformer.model.decoding.beam import BeamSearch, length_penalty
from transformer.model.decoding.sampling import Greedy, Sampling, filter_logits
from transformer.model.decoding.search import (
  Generation,
  Prompts,
  Search,
  cache_segments,
  continuation_prompts,
  translation_prompts,
)
from transformer.model.decoding.speculative import Speculative, reads_target_encoding

__all__ = [
  "BeamSearch",
  "Generation",
  "Greedy",
  "Prompts",
  "Sampling",
  "Search",
  "Speculative",
  "cache_segments",
  "continuation_prompts",
  "decode",
  "filter_logits",
  "length_penalty",
  "compile_decode",
  "lower_decode",
  "reads_target_encoding",
  "translation_prompts",
]


def _split(search: Search) -> tuple[Any, list[Any]]:
  """(the search's settings, hashable: static for jit; the arrays it owns: inputs). A
  flax struct search's arrays are its pytree leaves (Speculative's draft_params); any
  other search object is all settings."""
  leaves, treedef = jax.tree.flatten(search)
  arrays = [x for x in leaves if isinstance(x, (jax.Array, np.ndarray))]
  settings = tuple(None if isinstance(x, (jax.Array, np.ndarray)) else x for x in leaves)
  return (treedef, settings), arrays


@functools.partial(jax.jit, static_argnames=("model", "settings"))
def _decode(model, params, prompts: Prompts, settings, arrays, rng) -> Generation:
  treedef, fixed = settings
  owned = iter(arrays)
  search = jax.tree.unflatten(treedef, [next(owned) if x is None else x for x in fixed])
  ready_model, ready_params = incremental.of(model).prepare(params)
  return search.run(ready_model, ready_params, prompts, rng)


def decode(
  model,
  params,
  prompts: Prompts,
  search: Search,
  rng: jax.Array | None = None,
) -> Generation:
  """Runs `search` on a batch of prompts, compiled once per model, search settings and
  shape: the arrays a search owns (a draft's parameters) are inputs of the program, not
  constants in it.

  `model` is a flax model (Transformer, ShallowDraft) or an incremental.IncrementalModel.
  """
  settings, arrays = _split(search)
  return _decode(model, params, prompts, settings, arrays, rng)


def lower_decode(model, params, prompts: Prompts, search: Search, rng: jax.Array | None = None):
  """`decode`'s program lowered for these arguments (jax.stages.Lowered: compile it, read
  its cost)."""
  settings, arrays = _split(search)
  return _decode.lower(model, params, prompts, settings, arrays, rng)


def compile_decode(model, params, prompts: Prompts, search: Search, rng: jax.Array | None = None):
  """`decode` compiled for these arguments' shapes, as a function of (params, prompts):
  for timing the program without its compile (tools/decoding_speed.py)."""
  settings, arrays = _split(search)
  compiled = _decode.lower(model, params, prompts, settings, arrays, rng).compile()
  return lambda params, prompts: compiled(params, prompts, arrays, rng)
