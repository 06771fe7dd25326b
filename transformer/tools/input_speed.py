"""Throughput of the input pipeline alone (no model): examples/s and tokens/s.

    python -m transformer.tools.input_speed --config configs/default.py
    python -m transformer.tools.input_speed --config configs/default.py --mock_wmt
    python -m transformer.tools.input_speed --config configs/default.py --json

--json prints the figures as one JSON object (the padding records of docs/data.md).
--mock_wmt reads wmt14_translate/de-en through tfds.testing.mock_data (random text, no
download) at the paper's base settings: max_len 256, 25,000 tokens per batch.
"""

from __future__ import annotations

import collections
import contextlib
import json
import sys
import time

import numpy as np
import tensorflow_datasets as tfds
from absl import flags
from ml_collections import config_flags

from transformer import cli, versions
from transformer import config as config_lib
from transformer.data import pipeline, sources
from transformer.data import tokenizer as tokenizer_lib

# Its docs/results records' version: bump when what it computes changes, not on a reformat.
RECORD_VERSION = 1


def count(batch: dict[str, np.ndarray]) -> dict[str, int]:
  """Sentence pairs, and real (non-pad) tokens and slots per side, of a batch."""
  pairs = (
    int(batch["target_segment_ids"].max(axis=1).sum())
    if ("target_segment_ids" in batch)
    else int((batch["decoder_input"] != 0).any(axis=1).sum())
  )
  # decoder_input holds every token of the decoder side (a decoder-only target is
  # zero where the loss is masked).
  counts = {"pairs": pairs}
  for side, key in (("source", "source"), ("target", "decoder_input")):
    if key in batch:
      counts[f"{side}_tokens"] = int((batch[key] != 0).sum())
      counts[f"{side}_slots"] = int(batch[key].size)
  return counts


def measure(config, num_batches: int, source=None) -> dict[str, float]:
  """Times `num_batches` training batches after one warm-up batch; also what share of
  the batches' slots are real tokens and how many shapes (compiles) they come in."""
  source = source or sources.make_source(config)
  tokenizer = tokenizer_lib.load_or_train_tokenizer(config, source=source)
  iterator = pipeline.make_train_iterator(config, tokenizer, source=source)
  totals: collections.Counter[str] = collections.Counter()
  shapes: set[tuple[int, ...]] = set()
  try:
    next(iterator)  # warm-up: tf.data start-up, first shuffle buffer fill
    start = time.perf_counter()
    for _ in range(num_batches):
      batch = next(iterator)
      totals.update(count(batch))
      shapes.add(batch["decoder_input"].shape)
    seconds = time.perf_counter() - start
  finally:
    iterator.close()
  tokens = totals["source_tokens"] + totals["target_tokens"]
  result = {
    "batches": num_batches,
    "seconds": seconds,
    "examples_per_sec": totals["pairs"] / seconds,
    "tokens_per_sec": tokens / seconds,
    "shapes": len(shapes),
    "planned_shapes": len(iterator.rows_by_length),
  }
  for side in ("source", "target"):
    if totals[f"{side}_slots"]:
      result[f"{side}_tokens_per_batch"] = totals[f"{side}_tokens"] / num_batches
      result[f"{side}_padding_efficiency"] = totals[f"{side}_tokens"] / totals[f"{side}_slots"]
  return result


def describe(config, r: dict[str, float]) -> str:
  sides = [
    f"{side} {r[f'{side}_tokens_per_batch']:,.0f} real tokens per batch "
    f"({100 * r[f'{side}_padding_efficiency']:.1f}% of slots)"
    for side in ("source", "target")
    if f"{side}_tokens_per_batch" in r
  ]
  return (
    f"{config.dataset} ({config.direction}, {config.batching}, max_len {config.max_len}, "
    f"tokens_per_batch {config.tokens_per_batch}): {r['batches']} batches in "
    f"{r['seconds']:.1f}s: {r['examples_per_sec']:,.0f} examples/s, "
    f"{r['tokens_per_sec']:,.0f} tokens/s; {', '.join(sides)}; {r['shapes']} batch "
    f"shapes seen of {r['planned_shapes']} planned"
  )


_FLAG_VALUES = cli.program_flags(__name__)  # absl's only when run as a program
_CONFIG = config_flags.DEFINE_config_file(
  "config", config_lib.DEFAULT_CONFIG, "Config file.", flag_values=_FLAG_VALUES
)
_MOCK_WMT = flags.DEFINE_bool(
  "mock_wmt", False, "Mock wmt14_translate/de-en, base sizes.", flag_values=_FLAG_VALUES
)
_NUM_BATCHES = flags.DEFINE_integer(
  "num_batches", 200, "Batches to time (after one warm-up).", flag_values=_FLAG_VALUES
)
_JSON = flags.DEFINE_bool(
  "json", False, "Print the figures as one JSON object.", flag_values=_FLAG_VALUES
)
_MOCK_EXAMPLES = flags.DEFINE_integer(
  "mock_examples", 100_000, "Examples per mock split.", flag_values=_FLAG_VALUES
)


def main(argv):
  del argv  # the --config.* overrides are read from sys.argv for the record
  config = _CONFIG.value
  mock = contextlib.nullcontext()
  if _MOCK_WMT.value:
    config.dataset, config.direction = "wmt14_translate/de-en", "en-de"
    config.max_len, config.tokens_per_batch = 256, 25_000
    mock = tfds.testing.mock_data(num_examples=_MOCK_EXAMPLES.value)
  with mock:
    r = measure(config, _NUM_BATCHES.value)
  if _JSON.value:
    print(
      json.dumps(
        record(config, r, overrides=[a for a in sys.argv[1:] if a.startswith("--config.")])
      )
    )
    return
  print(describe(config, r))


def record(config, r: dict[str, float], overrides: list[str]) -> dict:
  """The figures as docs/results/input_pipeline.jsonl keeps them, by the flags that made
  the config differ from its file."""
  return {
    "name": "input_padding",
    "flags": " ".join(overrides),
    "batching": config.batching,
    "max_len": config.max_len,
    "tokens_per_batch": config.tokens_per_batch,
    **{k: r[k] for k in r if k.startswith(("source_", "target_"))},
    "shapes_seen": r["shapes"],
    "shapes_planned": r["planned_shapes"],
    "num_batches": r["batches"],
    "examples_per_sec": r["examples_per_sec"],
    "tokens_per_sec": r["tokens_per_sec"],
    "versions": versions.library_versions(),
  }


if __name__ == "__main__":
  cli.run(main)
