"""Shared by the sweep tests: the shipped sweep files, a tiny sweep over the test run,
the sweep command as a subprocess, and a row's workdir faked without training."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE3 = os.path.join(REPO, "configs/sweeps/table3.py")
TABLE3_SMALL = os.path.join(REPO, "configs/sweeps/table3_small.py")
PAPER_ROWS = [
  "base",
  "A1",
  "A2",
  "A3",
  "A4",
  "B1",
  "B2",
  "C1",
  "C2",
  "C3",
  "C4",
  "C5",
  "C6",
  "C7",
  "D1",
  "D2",
  "D3",
  "D4",
  "E",
  "big",
]


def write_sweep(tmp_path, corpus, rows: str, base_overrides: str = "{}") -> str:
  """A sweep over the tiny test run: its own config file plus a sweep file. The run
  validates at its last step, perplexity only (no beam search: it would dominate)."""
  path, vocab_dir = corpus
  config_file = tmp_path / "tiny_config.py"
  config_file.write_text(
    "from tests.helpers import tiny_run\n\n"
    "def get_config():\n"
    f"  return tiny_run.make_config(({path!r}, {vocab_dir!r}), eval_every_steps=6,\n"
    "                              eval_bleu_sentences=0)\n"
  )
  sweep_file = tmp_path / "tiny_sweep.py"
  sweep_file.write_text(
    "from transformer.sweeps import Row\n\n"
    f"BASE_CONFIG = {str(config_file)!r}\n"
    f"BASE_OVERRIDES = {base_overrides}\n\n"
    f"def get_sweep():\n  return {rows}\n"
  )
  return str(sweep_file)


def run_sweep_command(*args, timeout=120):
  return subprocess.run(
    [sys.executable, "-m", "transformer.sweeps", *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def fake_finished_row(workdir, name, steps, ppl, bleu, from_eval_py=True):
  """A row's workdir as a finished run leaves it: a checkpoint at `steps` and either
  eval.py's report or two validation records at `steps` in metrics.jsonl (the last wins)."""
  row_dir = os.path.join(workdir, name)
  os.makedirs(os.path.join(row_dir, "checkpoints", str(steps)))
  os.makedirs(os.path.join(row_dir, "eval"))
  if from_eval_py:
    with open(os.path.join(row_dir, "eval", f"validation-{steps}.json"), "w") as f:
      json.dump({"ppl": ppl, "bleu": bleu, "bleu_tok": bleu + 0.5, "num_sentences": 3000}, f)
  else:
    with open(os.path.join(row_dir, "metrics.jsonl"), "w") as f:
      f.write(json.dumps({"step": steps, "kind": "validation", "ppl": ppl + 1}) + "\n")
      f.write(json.dumps({"step": steps, "kind": "validation", "ppl": ppl, "bleu": bleu}) + "\n")
  return row_dir
