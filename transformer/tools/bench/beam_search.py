"""bench's beam_search: sentences/s and tokens/s of the config's beam search.

Beam search (cache on, early stopping off) of `sentences` random sentences of
`source_len` tokens for `steps` output tokens (at least one more than the source), the
median of `repeats` runs after an untimed one that compiles (decoding_speed.py).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from transformer.config import EOS_ID
from transformer.tools import decoding_speed


def measure(
  config, model, params, *, sentences: int, steps: int, source_len: int, repeats: int
) -> dict[str, Any]:
  rng = np.random.default_rng(1)
  source_len = min(source_len, config.max_len)
  source = rng.integers(4, config.vocab_size, (sentences, source_len), dtype=np.int32)
  source[:, -1] = EOS_ID
  steps = max(steps, source_len + 1)
  r = decoding_speed.time_beam_search(
    model,
    params,
    jnp.asarray(source),
    beam_size=config.beam_size,
    steps=steps,
    use_cache=True,
    repeats=repeats,
  )
  return {
    "name": "beam_search",
    "beam_size": config.beam_size,
    "sentences": sentences,
    "steps": steps,
    "repeats": repeats,
    "compile_s": r["compile_s"],
    "step_time_s": r["run_s"] / steps,
    "sentences_per_sec": r["sentences_per_s"],
    "tokens_per_sec": r["tokens_per_s"],
    "mfu": None,
  }


def describe(result: dict[str, Any]) -> str:
  return (
    f"beam_search: beam {result['beam_size']}, {result['sentences']} sentences x "
    f"{result['steps']} steps, compile {result['compile_s']:.1f} s, "
    f"{result['sentences_per_sec']:,.2f} sentences/s, "
    f"{result['tokens_per_sec']:,.0f} tokens/s"
  )
