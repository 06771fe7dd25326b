"""Throughput of the input pipeline alone (no model): examples/s and tokens/s.

    python -m transformer.tools.input_speed --config configs/default.py
    python -m transformer.tools.input_speed --config configs/default.py --mock_wmt

--mock_wmt reads wmt14_translate/de-en through tfds.testing.mock_data (random text, no
download) at the paper's base settings: max_len 256, 25,000 tokens per batch.
"""

from __future__ import annotations

import contextlib
import time

from absl import flags
from ml_collections import config_flags
import numpy as np
import tensorflow_datasets as tfds

from transformer import cli
from transformer import config as config_lib
from transformer.data import pipeline
from transformer.data import sources
from transformer.data import tokenizer as tokenizer_lib



def count(batch: dict[str, np.ndarray]) -> tuple[int, int]:
  """(sentence pairs, non-pad source + target tokens) in a batch."""
  pairs = int(batch["target_segment_ids"].max(axis=1).sum()) if (
      "target_segment_ids" in batch) else int((batch["target"] != 0).any(axis=1).sum())
  tokens = sum(int((batch[k] != 0).sum()) for k in ("source", "target") if k in batch)
  return pairs, tokens


def measure(config, num_batches: int, source=None) -> dict[str, float]:
  """Times `num_batches` training batches after one warm-up batch."""
  source = source or sources.make_source(config)
  tokenizer = tokenizer_lib.load_or_train_tokenizer(config, source=source)
  iterator = pipeline.make_train_iterator(config, tokenizer, source=source)
  try:
    next(iterator)  # warm-up: tf.data start-up, first shuffle buffer fill
    pairs = tokens = 0
    start = time.perf_counter()
    for _ in range(num_batches):
      batch_pairs, batch_tokens = count(next(iterator))
      pairs, tokens = pairs + batch_pairs, tokens + batch_tokens
    seconds = time.perf_counter() - start
  finally:
    iterator.close()
  return {"batches": num_batches, "seconds": seconds, "examples_per_sec": pairs / seconds,
          "tokens_per_sec": tokens / seconds}


def _define_flags():
  """Command-line flags, defined only when run as a program (`measure` is imported too)."""
  global _CONFIG, _MOCK_WMT, _NUM_BATCHES, _MOCK_EXAMPLES
  _CONFIG = config_flags.DEFINE_config_file("config", config_lib.DEFAULT_CONFIG, "Config file.")
  _MOCK_WMT = flags.DEFINE_bool("mock_wmt", False, "Mock wmt14_translate/de-en, base sizes.")
  _NUM_BATCHES = flags.DEFINE_integer("num_batches", 200,
                                      "Batches to time (after one warm-up).")
  _MOCK_EXAMPLES = flags.DEFINE_integer("mock_examples", 100_000, "Examples per mock split.")


def main(argv):
  del argv
  config = _CONFIG.value
  mock = contextlib.nullcontext()
  if _MOCK_WMT.value:
    config.dataset, config.direction = "wmt14_translate/de-en", "en-de"
    config.max_len, config.tokens_per_batch = 256, 25_000
    mock = tfds.testing.mock_data(num_examples=_MOCK_EXAMPLES.value)
  with mock:
    r = measure(config, _NUM_BATCHES.value)
  print(f"{config.dataset} ({config.direction}, {config.batching}, max_len {config.max_len}, "
        f"tokens_per_batch {config.tokens_per_batch}): {r['batches']} batches in "
        f"{r['seconds']:.1f}s: {r['examples_per_sec']:,.0f} examples/s, "
        f"{r['tokens_per_sec']:,.0f} tokens/s")


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
