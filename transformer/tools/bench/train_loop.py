"""bench's train_loop: what train.py's training loop costs beside the bare step.

The loop (input pipeline, metrics, progress lines, final checkpoint; no validation) on
the config's own data against the bare step on the same batches, in one process,
bare-loop-bare: steps/s of each and the loop's share of the bare step's speed.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import sys
import tempfile
import time
from typing import Any

import jax

from transformer.inference import sharding
from transformer.training import flops, reporting, steps


def measure(config, num_steps: int, window: int) -> dict[str, Any]:
  """train.py's loop against the bare step, on the same batches of the config's own data.

  Three passes over the first `num_steps` batches, in one process: the bare step (the
  batches built and put on the devices beforehand, the step dispatched back to back and
  synchronized at the end of every `window` steps), then the training loop as train.py
  runs it (input pipeline on its thread, metrics, progress lines every `window` steps
  and the final checkpoint, in a temporary workdir; no validation), then the bare step
  again, so drift of the machine's speed during the loop shows in the bare figures on
  both sides. The first window of each pass (which compiles) is left out; medians of
  the rest. Steps per second compare like with like: the passes train on the same
  batches.
  """
  config = _loop_config(config, num_steps, window)
  loop_records, bare_seconds, host_batches = _three_passes(config, num_steps, window)
  loop_windows = [r["steps_per_sec"] for r in loop_records]
  bare_windows = [window / seconds for seconds in bare_seconds]
  loop_steps_per_sec = statistics.median(loop_windows)
  bare_steps_per_sec = statistics.median(bare_windows)
  loop_tokens_per_sec = statistics.median(r["tokens_per_sec"] for r in loop_records)
  target_tokens = sum(float(flops.count_tokens(b)["target_tokens"]) for b in host_batches)
  return {
    "name": "train_loop",
    "steps": num_steps,
    "window": window,
    "loop_steps_per_sec": loop_steps_per_sec,
    "bare_steps_per_sec": bare_steps_per_sec,
    "efficiency": loop_steps_per_sec / bare_steps_per_sec,
    "loop_window_steps_per_sec": loop_windows,
    "bare_window_steps_per_sec": bare_windows,
    "loop_tokens_per_sec": loop_tokens_per_sec,
    "tokens_per_sec": loop_tokens_per_sec,
    "real_target_tokens_per_step": target_tokens / num_steps,
    "step_time_s": 1.0 / bare_steps_per_sec,
    "mfu": (
      statistics.median(r["mfu"] for r in loop_records)
      if all("mfu" in r for r in loop_records)
      else None
    ),
  }


def _loop_config(config, num_steps: int, window: int):
  """The config with `num_steps` batches, a metrics line every `window`, no validation and
  no checkpoint but the final one."""
  config = config.copy_and_resolve_references()
  config.num_train_steps = num_steps // config.grad_accum_steps
  config.log_every_steps = window
  config.eval_every_steps = 0
  config.checkpoint_every_steps = 0
  config.checkpoint_every_minutes = 0.0
  return config


def _three_passes(config, num_steps: int, window: int) -> tuple[list[dict], list[float], list]:
  """(the loop's train metrics records but the first, the bare passes' window seconds
  before and after it, the host batches): measure's three passes, in a temporary workdir."""
  from transformer.training import loop

  with tempfile.TemporaryDirectory(prefix="bench_train_loop_") as workdir:
    with contextlib.redirect_stdout(sys.stderr):  # its progress lines; stdout is the report's
      run = loop.TrainingRun(config, workdir, validation=None)
      try:
        # The loop's own iterator, read ahead and rewound: the bare passes get its batches.
        start = run.train_iter.get_state()
        host_batches = list(itertools.islice(run.train_iter, num_steps))
        run.train_iter.set_state(start)
        batches = [sharding.global_batch(b, run.setup.mesh, run.setup.rules) for b in host_batches]
        bare_step = steps.jit_train_step(run.setup)
        bare_state = run.setup.init_state(jax.random.key(config.seed))
        bare_before, bare_state = _bare_windows(bare_step, bare_state, batches, window)
        run.train()
        bare_after, _ = _bare_windows(bare_step, bare_state, batches, window)
      finally:
        run.close()
    loop_records = reporting.read_metrics(workdir, kind="train")[1:]
  return loop_records, bare_before + bare_after, host_batches


def _bare_windows(step_fn, train_state, batches: list, window: int) -> tuple[list, Any]:
  """Seconds of each window of `window` steps after the first, over all batches."""
  times = []
  for start in range(0, len(batches) - window + 1, window):
    began = time.perf_counter()
    for batch in batches[start : start + window]:
      train_state, metrics = step_fn(train_state, batch)
    jax.block_until_ready((train_state, metrics))
    times.append(time.perf_counter() - began)
  return times[1:], train_state


def describe(result: dict[str, Any]) -> str:
  return (
    f"train_loop: {result['steps']} steps in windows of {result['window']}, "
    f"loop {result['loop_steps_per_sec']:.2f} steps/s "
    f"({result['loop_tokens_per_sec']:,.0f} real target tokens/s), bare step on the "
    f"same batches {result['bare_steps_per_sec']:.2f} steps/s: the loop runs at "
    f"{100 * result['efficiency']:.1f}% of the bare step"
  )
