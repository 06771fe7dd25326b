"""Where a workdir's wall time went, summed over every start of its run (goodput).

In the manner of MaxText's goodput measurement: the share of wall time spent on training
steps that count (goodput), and what took the rest (badput). Each start of the run keeps
its own seconds by category (`Clock`); the loop writes them as a `goodput` record of
metrics.jsonl at every checkpoint save and at the end, and `summed` adds up the last
record of every start. The categories, disjoint, cover a start's time from
`train_and_evaluate` to its end:

  startup      building the run: mesh, config, vocabulary, input pipeline, model init
  restore      reading the checkpoint it resumes from (data state and arrays)
  compile      the first training step's call, which traces and compiles it (a later
               batch shape's compile, under length bucketing, counts as its step's)
  steps        training steps (goodput), including the host's own work between them
  input        waiting for the next global batch (the prefetch queue was empty)
  checkpoints  the loop's blocking part of saves, and waits for them to be written
  eval         validation every eval_every_steps
  recomputed   steps trained again after a kill or a preemption: a global step (not a
               step since restart) at or below the highest one an earlier start logged

A start killed without warning (kill -9, a lost host) loses the time after its last
checkpoint's record: no record says it. The steps it trained then are trained again by
the next start, whose `recomputed` counts those up to the highest step the killed start
logged (every log_every_steps, and at every save); the steps after that log line and
before the kill left no trace, so the next start counts them as `steps`, overstating
goodput by up to log_every_steps - 1 steps per kill. A preemption notice loses none:
the run saves and logs at the step it stops. Python's imports before
`train_and_evaluate` (a few seconds) are not counted.
"""

from __future__ import annotations

import contextlib
import json
import time

from transformer import storage
from transformer.messages import format_duration

CATEGORIES = (
  "startup",
  "restore",
  "compile",
  "steps",
  "input",
  "checkpoints",
  "eval",
  "recomputed",
)
KIND = "goodput"  # the records' kind in metrics.jsonl (reporting.read_metrics keeps them apart)


class Clock:
  """One start's seconds by category. `time.monotonic` throughout: a wall-clock jump
  (NTP) must not make a category negative."""

  def __init__(self):
    self.start = time.time()  # wall clock: which start a record belongs to
    self._origin = time.monotonic()
    self.seconds = dict.fromkeys(CATEGORIES, 0.0)
    self._mark = self._origin  # the end of the time already given a category
    # What the time between the timed blocks is: "startup" until the loop, then
    # "steps" or "recomputed" for each step (the loop sets it).
    self.current = "startup"

  def charge(self, category: str | None = None) -> None:
    """Gives the time since the last charge to `category` (default: `current`)."""
    now = time.monotonic()
    self.seconds[category or self.current] += now - self._mark
    self._mark = now

  @contextlib.contextmanager
  def timing(self, category: str):
    """The time until the block starts goes to `current`, the block's to `category`."""
    self.charge()
    try:
      yield
    finally:
      self.charge(category)

  def record(self) -> dict:
    """This start's seconds up to the last charge: a goodput record's fields. (Inside a
    timed block, the block's time so far is its category's, not yet given to it.)"""
    return {
      "start_time": self.start,
      "wall_s": self._mark - self._origin,
      **{f"{category}_s": seconds for category, seconds in self.seconds.items()},
    }


def read_earlier(workdir: str) -> tuple[dict[float, dict], int]:
  """({start_time: its last goodput record}, the highest global step any start logged) of
  the workdir so far: every line of metrics.jsonl, those of runs resumed past included."""
  last_records: dict[float, dict] = {}
  highest = 0
  for line in storage.read_log_lines(storage.join(workdir, "metrics.jsonl")):
    try:
      record = json.loads(line)
    except ValueError:
      continue  # a torn line (reporting.read_metrics warns of it)
    if record.get("kind") == KIND:
      last_records[record["start_time"]] = record
    elif record.get("kind") == "train":
      highest = max(highest, int(record.get("step", 0)))
  return last_records, highest


def summed(records: list[dict]) -> dict:
  """{category: seconds, "wall_s": seconds, "starts": count} over starts' last records."""
  total = {category: sum(r[f"{category}_s"] for r in records) for category in CATEGORIES}
  return {**total, "wall_s": sum(r["wall_s"] for r in records), "starts": len(records)}


def summary_line(total: dict) -> str:
  """e.g. `goodput 91.2%: compile 3.1%, input 0.4%, checkpoints 1.0%, eval 2.9%,
  recomputed 1.4% (startup 0.5%, restore 0.1%; 2 starts, 1h05m of wall time)`."""
  wall = max(total["wall_s"], 1e-9)
  share = {category: 100 * total[category] / wall for category in CATEGORIES}
  badput = ", ".join(
    f"{category} {share[category]:.1f}%"
    for category in ("compile", "input", "checkpoints", "eval", "recomputed")
  )
  return (
    f"goodput {share['steps']:.1f}%: {badput} (startup {share['startup']:.1f}%, "
    f"restore {share['restore']:.1f}%; {total['starts']} start"
    f"{'s' if total['starts'] != 1 else ''}, {format_duration(total['wall_s'])} of wall time)"
  )
