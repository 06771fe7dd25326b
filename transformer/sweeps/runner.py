"""Running a sweep's rows here, one after another, and reading what each row's workdir holds.

Each row trains in WORKDIR/<row> with `train.py`, then beam-searches its whole validation
split with `eval.py`, each as a child process. A row whose final evaluation exists is
skipped; one with checkpoints short of its last step resumes. The sweep's workdir may be
gs://...: rows, their files and the sweep's log all go through `transformer.storage`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from transformer import config as config_lib
from transformer import storage, versions
from transformer.inference.checkpoints import steps_on_disk
from transformer.messages import format_duration
from transformer.sweeps.spec import Row, Sweep, SweepError, config_file, eval_args, train_args
from transformer.training import reporting


def final_results(workdir: str, final_step: int) -> dict | None:
  """Validation perplexity and BLEU at the final step (config_lib.final_step), or None if
  not evaluated yet.

  Prefers eval.py's beam search of the whole split (eval/validation-<step>.json); falls
  back to the training run's own last validation record (BLEU of its first
  config.eval_bleu_sentences sentences, if any).
  """
  report = storage.join(workdir, "eval", f"validation-{final_step}.json")
  if storage.exists(report):
    found = storage.read_json(report)
    return {
      "ppl": found["ppl"],
      "bleu": found["bleu"],
      "bleu_tok": found.get("bleu_tok"),
      "bleu_sentences": found.get("num_sentences"),
      "source": "eval.py",
    }
  last = None
  for record in reporting.read_metrics(workdir, kind="validation"):
    if record.get("step") == final_step:
      last = record
  if last is None:
    return None
  return {
    "ppl": last["ppl"],
    "bleu": last.get("bleu"),
    "bleu_tok": None,
    "bleu_sentences": None,
    "source": "metrics.jsonl",
  }


def row_state(workdir: str, final_step: int, final_eval: bool) -> str:
  """'finished', 'trained' (final eval missing), 'partial' (resumable) or 'new', for a row
  whose last step is `final_step` (config_lib.final_step)."""
  steps = steps_on_disk(workdir)
  if not steps:
    return "new"
  if steps[-1] < final_step:
    return "partial"
  results = final_results(workdir, final_step)
  if results is None or (final_eval and results["source"] != "eval.py"):
    return "trained"
  return "finished"


def _run_child(command: list[str]) -> int:
  """Runs one row's command in the repo root; SIGTERM is passed on so the row saves.

  After a SIGTERM or Ctrl-C the sweep stops once the child has exited, rather than
  starting the next row.
  """
  print("+ " + " ".join(command), flush=True)
  child = subprocess.Popen(command, cwd=config_lib.REPO_ROOT)
  terminated = []

  def forward(signum, frame):
    terminated.append(signum)
    child.send_signal(signum)

  previous = signal.signal(signal.SIGTERM, forward)
  try:
    try:
      returncode = child.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the child too: let it checkpoint
      child.wait()
      raise SweepError("interrupted; rerun the same command to resume") from None
  finally:
    signal.signal(signal.SIGTERM, previous)
  if terminated:
    raise SweepError("stopped by SIGTERM; rerun the same command to resume")
  return returncode


def run_local(
  sweep: Sweep,
  rows: list[Row],
  configs: dict,
  workdir: str,
  final_eval: bool = True,
  python: str = sys.executable,
) -> list[dict]:
  """Trains and evaluates each row in turn under workdir/<row>; returns what was done."""
  storage.makedirs(workdir)
  log = storage.AppendLog(storage.join(workdir, "sweep_log.jsonl"))
  config_path = config_file(sweep)
  done: list[dict[str, Any]] = []
  for row in rows:
    row_dir = storage.join(workdir, row.name)
    steps = config_lib.final_step(configs[row.name])
    state = row_state(row_dir, steps, final_eval)
    if state == "finished":
      print(f"[{row.name}] finished earlier: skipped", flush=True)
      done.append({"row": row.name, "phase": "skipped"})
      continue
    phases = []
    if state in ("new", "partial"):
      what = "resuming" if state == "partial" else "training"
      print(f"[{row.name}] {what} to step {steps} in {row_dir}", flush=True)
      phases.append(
        (
          "train",
          [python, os.path.join(config_lib.REPO_ROOT, "train.py")]
          + train_args(sweep, row, row_dir, config_path),
        )
      )
    if final_eval:
      phases.append(
        (
          "eval",
          [python, os.path.join(config_lib.REPO_ROOT, "eval.py")]
          + eval_args(row_dir, configs[row.name]),
        )
      )
    if not phases:
      print(
        f"[{row.name}] trained, but there is no final validation to record: it needs "
        "config.eval_every_steps > 0 or --final_eval",
        flush=True,
      )
    for phase, command in phases:
      started = time.time()
      returncode = _run_child(command)
      seconds = time.time() - started
      entry = {
        "row": row.name,
        "phase": phase,
        "seconds": round(seconds, 1),
        "returncode": returncode,
        "resumed": state == "partial" and phase == "train",
        "versions": versions.library_versions(),
      }
      log.write_line(json.dumps(entry))
      log.flush()
      done.append(entry)
      if returncode != 0:
        raise SweepError(
          f"row {row.name}: {phase} exited with code {returncode}; rerun the same command to resume"
        )
      if phase == "train" and (steps_on_disk(row_dir) or [0])[-1] < steps:
        raise SweepError(
          f"row {row.name}: stopped before step {steps} (preempted?); "
          "rerun the same command to resume"
        )
      print(f"[{row.name}] {phase} took {format_duration(seconds)}", flush=True)
  return done
