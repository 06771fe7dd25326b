"""Running a sweep's rows here, one after another, and reading what each row's workdir holds.

Each row trains in WORKDIR/<row> (a row with seeds: each seed in WORKDIR/<row>/seed<k>)
with `train.py`, then beam-searches its whole validation split with `eval.py`, each as a
child process. A run whose final evaluation exists is skipped; one with checkpoints short
of its last step resumes. With --records FILE, each finished run is recorded there
(records.py), and a run FILE holds at the sweep's step count is skipped even without its
workdir; one it holds at fewer steps is resumed to the new count and its record replaced.
The sweep's workdir may be gs://...: rows, their files and the sweep's log all go through
`transformer.storage`.
"""

from __future__ import annotations

import dataclasses
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
from transformer.sweeps import records
from transformer.sweeps.spec import (
  Row,
  Sweep,
  SweepError,
  config_file,
  eval_args,
  runs,
  train_args,
)
from transformer.training import reporting


def final_results(workdir: str, final_step: int, average_last: int = 1) -> dict | None:
  """Validation perplexity and BLEU at the final step (config_lib.final_step), or None if
  not evaluated yet.

  Prefers eval.py's beam search of the whole split (eval/validation-<step>[-avg<k>].json,
  k the sweep's AVERAGE_LAST); falls back to the training run's own last validation
  record (BLEU of its first config.eval_bleu_sentences sentences, if any).
  """
  report = storage.join(workdir, "eval", final_eval_stem(final_step, average_last) + ".json")
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


def final_eval_stem(final_step: int, average_last: int = 1) -> str:
  """The name eval.py gives the final evaluation's files (evaluation/score.py)."""
  return f"validation-{final_step}" + (f"-avg{average_last}" if average_last > 1 else "")


def row_state(workdir: str, final_step: int, final_eval: bool, average_last: int = 1) -> str:
  """'finished', 'trained' (final eval missing), 'partial' (resumable) or 'new', for a run
  whose last step is `final_step` (config_lib.final_step)."""
  steps = steps_on_disk(workdir)
  if not steps:
    return "new"
  if steps[-1] < final_step:
    return "partial"
  results = final_results(workdir, final_step, average_last)
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


@dataclasses.dataclass(frozen=True)
class Recording:
  """Where finished runs are recorded (records.py), and whether each is committed."""

  path: str  # the records file, e.g. docs/results/table3_converged.jsonl
  command: str  # the sweep's command line, for the records
  commit: bool = False


def run_local(
  sweep: Sweep,
  rows: list[Row],
  configs: dict,
  workdir: str,
  final_eval: bool = True,
  python: str = sys.executable,
  recording: Recording | None = None,
) -> list[dict]:
  """Trains and evaluates each run of each row in turn (Run.directory under workdir);
  with `recording`, records each as it finishes and skips those already recorded.
  Returns what was done."""
  storage.makedirs(workdir)
  log = storage.AppendLog(storage.join(workdir, "sweep_log.jsonl"))
  done: list[dict[str, Any]] = []
  for run in runs(rows):
    steps = config_lib.final_step(configs[run.row.name])
    if recording is not None and records.recorded(recording.path, run, steps):
      print(f"[{run.name}] recorded in {recording.path}: skipped", flush=True)
      done.append({"row": run.row.name, "seed": run.seed, "phase": "skipped"})
      continue
    done += _run_one(sweep, run, configs[run.row.name], workdir, final_eval, python, log, recording)
  return done


def _run_one(sweep, run, config, workdir, final_eval, python, log, recording) -> list[dict]:
  """Trains and evaluates one run (each phase its child process), then records it."""
  run_dir = run.directory(storage.join(workdir))  # absolute: children run in the repo root
  steps = config_lib.final_step(config)
  state = row_state(run_dir, steps, final_eval, sweep.average_last)
  if state == "finished" and recording is None:
    print(f"[{run.name}] finished earlier: skipped", flush=True)
    return [{"row": run.row.name, "seed": run.seed, "phase": "skipped"}]
  phases = []
  if state in ("new", "partial"):
    what = "resuming" if state == "partial" else "training"
    print(f"[{run.name}] {what} to step {steps} in {run_dir}", flush=True)
    script = os.path.join(config_lib.REPO_ROOT, "train.py")
    phases.append(("train", [python, script] + train_args(sweep, run, run_dir, config_file(sweep))))
  if final_eval and state != "finished":
    script = os.path.join(config_lib.REPO_ROOT, "eval.py")
    phases.append(("eval", [python, script] + eval_args(run_dir, config, sweep.average_last)))
  if not phases and state != "finished":
    print(
      f"[{run.name}] trained, but there is no final validation to record: it needs "
      "config.eval_every_steps > 0 or --final_eval",
      flush=True,
    )
  done, seconds = [], {}
  for phase, command in phases:
    started = time.time()
    returncode = _run_child(command)
    seconds[phase] = round(time.time() - started, 1)
    entry = {
      "row": run.row.name,
      "seed": run.seed,
      "phase": phase,
      "seconds": seconds[phase],
      "returncode": returncode,
      "resumed": state == "partial" and phase == "train",
      "versions": versions.library_versions(),
    }
    log.write_line(json.dumps(entry))
    log.flush()
    done.append(entry)
    if returncode != 0:
      raise SweepError(
        f"row {run.name}: {phase} exited with code {returncode}; rerun the same command to resume"
      )
    if phase == "train" and (steps_on_disk(run_dir) or [0])[-1] < steps:
      raise SweepError(
        f"row {run.name}: stopped before step {steps} (preempted?); "
        "rerun the same command to resume"
      )
    print(f"[{run.name}] {phase} took {format_duration(seconds[phase])}", flush=True)
  if recording is not None:
    _record(sweep, run, config, run_dir, seconds, recording, final_eval)
  return done


def _record(sweep, run, config, run_dir, seconds, recording: Recording, final_eval) -> None:
  """Appends the finished run's record (and its small files) to recording.path."""
  steps = config_lib.final_step(config)
  if not final_eval:
    raise SweepError("--records needs the final evaluation (drop --nofinal_eval)")
  stem = storage.join(run_dir, "eval", final_eval_stem(steps, sweep.average_last))
  final = storage.read_json(stem + ".json")
  from transformer.data.pipeline import load_raw_pairs  # TensorFlow: only when recording

  train_pairs = len(load_raw_pairs(config, "train"))
  record = records.make_record(
    sweep, run, config, run_dir, final, train_pairs, seconds, recording.command
  )
  written = records.save(recording.path, record, run, run_dir, stem)
  print(
    f"[{run.name}] recorded in {recording.path}: ppl {record['ppl']:.2f}, "
    f"BLEU {record['bleu']:.2f}, {record['epochs']:.2f} epochs",
    flush=True,
  )
  if recording.commit:
    records.git_commit(written, f"{sweep.name}: {run.name} recorded")
