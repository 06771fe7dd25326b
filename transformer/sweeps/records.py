"""A finished run's record: one JSON line per (row, seed), and the small files behind it.

`python -m transformer.sweeps ... --records FILE` appends each run's record to FILE as the
run finishes (its final evaluation written), and copies beside it, to FILE's stem
/<row>-seed<k>/, what the record's figures can be checked against without the run's
workdir: the validation history (metrics.jsonl's validation lines), the final
evaluation's scores (.json) and hypotheses (.hyp.txt.gz; the references are written once,
as FILE's stem/validation.ref.txt.gz). Checkpoints never go there. A run already in FILE
at the sweep's step count is skipped, so a study restarted on a new machine, its workdirs
lost, trains only what FILE lacks. A run recorded at fewer steps than the sweep now asks
for is extended: resumed from its last checkpoint (the learning rate depends only on the
step) and its record replaced.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import time

from transformer import config as config_lib
from transformer import storage, versions
from transformer.sweeps.spec import Run, Sweep

# Bump when what a record's figures mean changes (how a run is evaluated, which steps
# its history holds), not when this code is reformatted.
RECORD_VERSION = 1


def artefact_dir(records_path: str, run: Run) -> str:
  """FILE's stem/<row>-seed<k> (or /<row>): a run's small files beside its record."""
  stem = os.path.splitext(records_path)[0]
  label = run.row.name if run.seed is None else f"{run.row.name}-seed{run.seed}"
  return os.path.join(stem, label)


def read_records(records_path: str) -> list[dict]:
  """The records of FILE in order; [] if it does not exist yet."""
  if not os.path.exists(records_path):
    return []
  with open(records_path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def is_of(record: dict, run: Run) -> bool:
  """Whether `record` is of this run (its row and seed), at any step count."""
  return record.get("row") == run.row.name and record.get("seed") == run.seed


def recorded(records_path: str, run: Run, steps: int) -> bool:
  """Whether FILE already holds this run's record at `steps` steps (a record of fewer
  steps is of a shorter study, and the run is extended)."""
  return any(is_of(r, run) and r.get("steps") == steps for r in read_records(records_path))


def validation_history(workdir: str) -> list[dict]:
  """[{"step", "ppl"}] of every validation evaluation of the run, in step order; a
  step evaluated twice (a resumed run) keeps its last evaluation."""
  by_step: dict[int, dict] = {}
  path = storage.join(workdir, "metrics.jsonl")
  for line in storage.read_text(path).splitlines() if storage.exists(path) else []:
    entry = json.loads(line)
    if entry.get("kind") == "validation":
      by_step[entry["step"]] = entry
  return [by_step[s] for s in sorted(by_step)]


def epochs_trained(workdir: str, step: int, train_pairs: int) -> float:
  """Epochs of the training split that `step` steps read, from the data iterator's state
  saved with checkpoint `step` (whole epochs done, and the pairs of the current one)."""
  from transformer.inference.checkpoints import CheckpointReader

  reader = CheckpointReader(workdir, timeout_s=600.0)
  state = reader.saved_iterator_state(step)
  return int(state["epoch"]) + int(state["pairs_read"]) / train_pairs


def make_record(
  sweep: Sweep,
  run: Run,
  config,
  workdir: str,
  final: dict,
  train_pairs: int,
  seconds: dict,
  command: str,
) -> dict:
  """The record of a finished run: its figures, and how, where and when they were made.

  `final` is eval.py's report of the final evaluation; `seconds` the time its phases
  took here ({"train": s, "eval": s}; a resumed run counts only its last part);
  `command` the sweep's command line."""
  step = config_lib.final_step(config)
  history = validation_history(workdir)
  return {
    "sweep": sweep.name,
    "row": run.row.name,
    "seed": run.seed,
    "overrides": run.row.overrides,
    "steps": step,
    "epochs": round(epochs_trained(workdir, step, train_pairs), 3),
    "ppl": final["ppl"],
    "ppl_history": [{"step": h["step"], "ppl": h["ppl"]} for h in history],
    "bleu": final["bleu"],
    "bleu_tok": final.get("bleu_tok"),
    "chrf": final.get("chrf"),
    "bleu_signature": final.get("bleu_signature"),
    "num_sentences": final.get("num_sentences"),
    "average_last": sweep.average_last,
    "seconds": seconds,
    **versions.provenance(command),
    "versions": versions.library_versions(),
    "record_version": RECORD_VERSION,
  }


def save(records_path: str, record: dict, run: Run, workdir: str, eval_stem: str) -> list[str]:
  """Writes the record to FILE, in place of an earlier record of the same run (a shorter
  study's), and copies the run's small files beside it; returns the paths written (for a
  commit)."""
  out = artefact_dir(records_path, run)
  os.makedirs(out, exist_ok=True)
  history = os.path.join(out, "validation_metrics.jsonl")
  with open(history, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(h) + "\n" for h in validation_history(workdir))
  scores = os.path.join(out, "final_eval.json")
  storage.write_text(scores, storage.read_text(eval_stem + ".json"))
  hypotheses = os.path.join(out, "validation.hyp.txt.gz")
  with gzip.open(hypotheses, "wt", encoding="utf-8") as f:
    f.write(storage.read_text(eval_stem + ".hyp.txt"))
  references = os.path.join(os.path.splitext(records_path)[0], "validation.ref.txt.gz")
  written = [records_path, history, scores, hypotheses]
  if not os.path.exists(references):
    with gzip.open(references, "wt", encoding="utf-8") as f:
      f.write(storage.read_text(eval_stem + ".ref.txt"))
    written.append(references)
  # FILE is local (docs/results/ in the repository, committed by git), so plain open().
  found = read_records(records_path)
  lines = [record if is_of(r, run) else r for r in found]
  if record not in lines:  # the run's first record
    lines.append(record)
  with open(records_path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in lines)
  return written


def read_lines_gz(path: str) -> list[str]:
  with gzip.open(path, "rt", encoding="utf-8") as f:
    return f.read().splitlines()


def git_commit(paths: list[str], message: str) -> None:
  """Commits exactly these paths (others' staged changes are left as they are), so each
  finished run is kept even if the machine is lost before the study ends."""
  repo = config_lib.REPO_ROOT
  for attempt in range(5):  # another git command may hold the index for a moment
    try:
      subprocess.run(["git", "add", "--", *paths], cwd=repo, check=True)
      subprocess.run(["git", "commit", "-q", "-m", message, "--", *paths], cwd=repo, check=True)
      return
    except subprocess.CalledProcessError:
      if attempt == 4:
        raise
      time.sleep(2.0 * (attempt + 1))
