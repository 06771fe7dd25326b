"""bench's input_pipeline: tokens/s of the config's dataset, read as training reads it.

`batches` batches, tokenized and batched exactly as training reads them
(input_speed.py); skipped, saying so, when the dataset is not prepared on disk.
"""

from __future__ import annotations

from typing import Any


def measure(config, batches: int) -> dict[str, Any]:
  # Imported here: TensorFlow is only needed for this measurement.
  from transformer.data import sources
  from transformer.tools import input_speed

  source = sources.make_source(config)
  if isinstance(source, sources.TfdsSource) and not (
    source.builder.is_prepared() or source.name == "tatoeba_en_es"
  ):
    return {
      "name": "input_pipeline",
      "skipped": f"{source.name} is not prepared on disk",
      "tokens_per_sec": None,
      "mfu": None,
      "step_time_s": None,
    }
  r = input_speed.measure(config, batches, source=source)
  return {
    "name": "input_pipeline",
    "batches": r["batches"],
    "step_time_s": r["seconds"] / r["batches"],
    "examples_per_sec": r["examples_per_sec"],
    "tokens_per_sec": r["tokens_per_sec"],
    "mfu": None,
  }


def describe(result: dict[str, Any]) -> str:
  return (
    f"input_pipeline: {result['batches']} batches, "
    f"{result['examples_per_sec']:,.0f} examples/s, "
    f"{result['tokens_per_sec']:,.0f} tokens/s"
  )
