"""The benchmark, `python -m transformer.tools.bench` (its options: __main__.py): one module
per measurement, each with measure(), which makes the measurement's record, and
describe(record), which says it in one line.
"""

from typing import Any

from transformer.tools.bench import (
  beam_search,
  input_pipeline,
  peak,
  speculative,
  train_loop,
  train_step,
)

# Each measurement's module, by the name its records carry, in the order a run makes them.
MEASUREMENTS = {
  "peak": peak,
  "train_step": train_step,
  "beam_search": beam_search,
  "input_pipeline": input_pipeline,
  "train_loop": train_loop,
  "speculative": speculative,
}


def describe(record: dict[str, Any]) -> str:
  """A record in one line, as bench prints it without --json."""
  if record.get("skipped"):
    return f"{record['name']}: skipped, {record['skipped']}"
  return MEASUREMENTS[record["name"]].describe(record)
