"""Ablation sweeps: named rows of config overrides, run one after another or on a cluster.

  python -m transformer.sweep --sweep configs/sweeps/table3.py --dry_run [--json]
      Each row's parameters and training FLOPs per target token; trains nothing.
  python -m transformer.sweep --sweep configs/sweeps/table3_small.py --workdir W [--only A1,C3]
      Trains the rows here, one after another, each in W/<row>, then beam-searches its
      whole validation split (eval.py). Finished rows are skipped; interrupted ones resume.
  python -m transformer.sweep --sweep ... --workdir gs://BUCKET/t3 --launch slurm|tpu
      Writes one script per row (and one that starts them all) for a SLURM cluster or a
      TPU pod; the scripts run the same train.py and eval.py commands.
  python -m transformer.sweep --sweep ... --workdir W --collect [--output_dir DIR]
      Final validation perplexity and BLEU of every row beside the paper's numbers:
      DIR/<sweep>.md, .csv and .png (sweep_report.py).

A sweep file is plain Python (see configs/sweeps/table3.py): `BASE_CONFIG = "FILE[:ARG]"`,
optionally `BASE_OVERRIDES = {dotted key: value}` for every row, and `get_sweep()`
returning a list of `Row`s. Every row's config is built and validated before any row
trains, so a typo in the last row fails in one line before the first row starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any, Optional

import ml_collections

from transformer import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ROW_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # each row is a directory name


class SweepError(ValueError):
  """A sweep that cannot run as written; the message names the row or the file."""


@dataclasses.dataclass(frozen=True)
class Row:
  """One run of a sweep: config overrides (dotted keys) and the paper's numbers for it.

  paper_ppl and paper_bleu are the published dev perplexity and BLEU, paper_params_m the
  parameter count in millions; None where the paper gives none.
  """
  name: str
  overrides: dict
  paper_ppl: Optional[float] = None
  paper_bleu: Optional[float] = None
  paper_params_m: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class Sweep:
  name: str  # the sweep file's stem: names the collected table and plot
  base_config: str  # FILE[:ARG], as train.py's --config takes it
  base_overrides: dict
  rows: list


def load_module(path: str):
  """Imports a Python file by path (sweep files and config files are not packages)."""
  if not os.path.isfile(path):
    raise SweepError(f"{path}: no such file")
  name = "sweep_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_sweep(path: str) -> Sweep:
  """Reads a sweep file and checks its shape: base config, unique row names."""
  module = load_module(path)
  base_config = getattr(module, "BASE_CONFIG", None)
  if not isinstance(base_config, str) or not base_config:
    raise SweepError(f"{path}: BASE_CONFIG = 'FILE[:ARG]' is missing")
  if not hasattr(module, "get_sweep"):
    raise SweepError(f"{path}: get_sweep() returning a list of Row is missing")
  rows = list(module.get_sweep())
  if not rows:
    raise SweepError(f"{path}: get_sweep() returned no rows")
  seen = set()
  for row in rows:
    if not isinstance(row, Row):
      raise SweepError(f"{path}: get_sweep() must return Row objects, got {row!r}")
    if not _ROW_NAME.match(row.name):
      raise SweepError(f"{path}: row name {row.name!r} must be letters, digits, '_', '.', '-'")
    if row.name in seen:
      raise SweepError(f"{path}: row {row.name!r} appears twice")
    seen.add(row.name)
  name = os.path.splitext(os.path.basename(path))[0]
  return Sweep(name, base_config, dict(getattr(module, "BASE_OVERRIDES", {})), rows)


def select_rows(sweep: Sweep, only: str | None) -> list[Row]:
  """The rows named in a comma-separated list (all rows when empty), in sweep order."""
  if not only:
    return list(sweep.rows)
  wanted = [name.strip() for name in only.split(",") if name.strip()]
  known = {row.name for row in sweep.rows}
  for name in wanted:
    if name not in known:
      close = difflib.get_close_matches(name, known, n=1)
      hint = f" (did you mean {close[0]}?)" if close else ""
      raise SweepError(f"--only: no row {name!r} in sweep {sweep.name}{hint}")
  return [row for row in sweep.rows if row.name in wanted]


def resolve_config_path(spec: str) -> tuple[str, str | None]:
  """FILE[:ARG] -> (absolute FILE, ARG); FILE may be relative to the cwd or the repo."""
  path, _, arg = spec.partition(":")
  for candidate in (path, os.path.join(REPO, path)):
    if os.path.isfile(candidate):
      return os.path.abspath(candidate), (arg or None)
  raise SweepError(f"BASE_CONFIG {spec!r}: {path} is not a file")


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict, where: str) -> None:
  """Sets dotted keys in place; an unknown key or a wrong type is a one-line SweepError."""
  known = list(config_lib.flatten(config))
  for key, value in overrides.items():
    if key not in known:
      close = difflib.get_close_matches(key, known, n=1)
      hint = f" (did you mean config.{close[0]}?)" if close else ""
      raise SweepError(f"{where}: config.{key}: unknown key{hint}")
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
      node = node[part]
    try:
      node[leaf] = value
    except (TypeError, ValueError) as e:
      raise SweepError(f"{where}: config.{key}: {e}") from None


def row_config(sweep: Sweep, row: Row) -> ml_collections.ConfigDict:
  """The base config with the sweep's and the row's overrides applied, validated."""
  path, arg = resolve_config_path(sweep.base_config)
  module = load_module(path)
  config = module.get_config(arg) if arg is not None else module.get_config()
  apply_overrides(config, sweep.base_overrides, f"{sweep.name} BASE_OVERRIDES")
  apply_overrides(config, row.overrides, f"row {row.name}")
  try:
    config_lib.validate(config)
  except config_lib.ConfigError as e:
    raise SweepError(f"row {row.name}: {e}") from None
  return config


def flag_value(value: Any) -> str:
  """A value as ml_collections parses it back from --config.KEY=VALUE."""
  return value if isinstance(value, str) else repr(value)


def train_args(sweep: Sweep, row: Row, workdir: str, config_path: str) -> list[str]:
  """train.py's arguments for a row (without `python train.py`)."""
  overrides = {**sweep.base_overrides, **row.overrides}
  _, _, arg = sweep.base_config.partition(":")
  config = f"{config_path}:{arg}" if arg else config_path
  return (["--config", config, "--workdir", workdir] +
          [f"--config.{k}={flag_value(v)}" for k, v in overrides.items()])


def eval_args(workdir: str, num_train_steps: int) -> list[str]:
  """eval.py's arguments: the final checkpoint (no averaging, as Table 3) on validation."""
  return ["--workdir", workdir, "--split", "validation", "--step", str(num_train_steps)]


# --- What a row's workdir holds. Paths may be gs://... (etils.epath reads both).

def _path(p: str):
  from etils import epath
  return epath.Path(p)


def checkpoint_steps(workdir: str) -> list[int]:
  """Steps of the complete checkpoints (Orbax renames a checkpoint to its step when done)."""
  directory = _path(workdir) / "checkpoints"
  if not directory.exists():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def final_results(workdir: str, num_train_steps: int) -> dict | None:
  """Validation perplexity and BLEU at the final step, or None if not evaluated yet.

  Prefers eval.py's beam search of the whole split (eval/validation-<step>.json); falls
  back to the training run's own last validation record (BLEU of its first
  config.eval_bleu_sentences sentences, if any).
  """
  report = _path(workdir) / "eval" / f"validation-{num_train_steps}.json"
  if report.exists():
    found = json.loads(report.read_text())
    return {"ppl": found["ppl"], "bleu": found["bleu"], "bleu_tok": found.get("bleu_tok"),
            "bleu_sentences": found.get("num_sentences"), "source": "eval.py"}
  metrics = _path(workdir) / "metrics.jsonl"
  if not metrics.exists():
    return None
  last = None
  for line in metrics.read_text().splitlines():
    record = json.loads(line)
    if record.get("kind") == "validation" and record.get("step") == num_train_steps:
      last = record
  if last is None:
    return None
  return {"ppl": last["ppl"], "bleu": last.get("bleu"), "bleu_tok": None,
          "bleu_sentences": None, "source": "metrics.jsonl"}


def row_state(workdir: str, num_train_steps: int, final_eval: bool) -> str:
  """'finished', 'trained' (final eval missing), 'partial' (resumable) or 'new'."""
  steps = checkpoint_steps(workdir)
  if not steps:
    return "new"
  if steps[-1] < num_train_steps:
    return "partial"
  results = final_results(workdir, num_train_steps)
  if results is None or (final_eval and results["source"] != "eval.py"):
    return "trained"
  return "finished"


def _format_duration(seconds: float) -> str:
  minutes, secs = divmod(int(round(seconds)), 60)
  return f"{minutes}m{secs:02d}s"


def _run_child(command: list[str]) -> int:
  """Runs one row's command in the repo root; SIGTERM is passed on so the row saves.

  After a SIGTERM or Ctrl-C the sweep stops once the child has exited, rather than
  starting the next row.
  """
  print("+ " + " ".join(command), flush=True)
  child = subprocess.Popen(command, cwd=REPO)
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


def run_local(sweep: Sweep, rows: list[Row], configs: dict, workdir: str,
              final_eval: bool = True, python: str = sys.executable) -> list[dict]:
  """Trains and evaluates each row in turn under workdir/<row>; returns what was done."""
  os.makedirs(workdir, exist_ok=True)
  log_path = os.path.join(workdir, "sweep_log.jsonl")
  config_path, _ = resolve_config_path(sweep.base_config)
  done = []
  for row in rows:
    row_dir = os.path.abspath(os.path.join(workdir, row.name))
    steps = configs[row.name].num_train_steps
    state = row_state(row_dir, steps, final_eval)
    if state == "finished":
      print(f"[{row.name}] finished earlier: skipped", flush=True)
      done.append({"row": row.name, "phase": "skipped"})
      continue
    phases = []
    if state in ("new", "partial"):
      what = "resuming" if state == "partial" else "training"
      print(f"[{row.name}] {what} to step {steps} in {row_dir}", flush=True)
      phases.append(("train", [python, os.path.join(REPO, "train.py")] +
                     train_args(sweep, row, row_dir, config_path)))
    if final_eval:
      phases.append(("eval", [python, os.path.join(REPO, "eval.py")] +
                     eval_args(row_dir, steps)))
    if not phases:
      print(f"[{row.name}] trained, but there is no final validation to record: it needs "
            "config.eval_every_steps > 0 or --final_eval", flush=True)
    for phase, command in phases:
      started = time.time()
      returncode = _run_child(command)
      seconds = time.time() - started
      entry = {"row": row.name, "phase": phase, "seconds": round(seconds, 1),
               "returncode": returncode, "resumed": state == "partial" and phase == "train"}
      with open(log_path, "a") as f:
        f.write(json.dumps(entry) + "\n")
      done.append(entry)
      if returncode != 0:
        raise SweepError(f"row {row.name}: {phase} exited with code {returncode}; "
                         "rerun the same command to resume")
      if phase == "train" and (checkpoint_steps(row_dir) or [0])[-1] < steps:
        raise SweepError(f"row {row.name}: stopped before step {steps} (preempted?); "
                         "rerun the same command to resume")
      print(f"[{row.name}] {phase} took {_format_duration(seconds)}", flush=True)
  return done


# --- Command line.

def define_flags() -> None:
  from absl import flags
  flags.DEFINE_string("sweep", None, "Sweep file, e.g. configs/sweeps/table3.py.")
  flags.DEFINE_string("workdir", None, "Each row runs in WORKDIR/<row>.")
  flags.DEFINE_string("only", "", "Comma-separated row names to use (default: every row).")
  flags.DEFINE_bool("dry_run", False,
                    "Print each row's overrides, parameters and FLOPs per target token; "
                    "train nothing.")
  flags.DEFINE_bool("json", False, "With --dry_run: one JSON object per row instead of a table.")
  flags.DEFINE_enum("launch", None, ["slurm", "tpu"],
                    "Write scripts that run each row on a SLURM cluster or a TPU pod "
                    "instead of training here.")
  flags.DEFINE_bool("collect", False,
                    "Gather each row's final validation perplexity and BLEU into "
                    "<sweep>.md, .csv and .png.")
  flags.DEFINE_string("output_dir", None, "Where --collect writes (default: WORKDIR).")
  flags.DEFINE_bool("final_eval", True,
                    "After training a row, beam-search its whole validation split with "
                    "eval.py; --nofinal_eval keeps the training run's own last validation "
                    "metrics (perplexity; BLEU only if config.eval_bleu_sentences > 0).")
  from transformer import sweep_launch
  sweep_launch.define_flags()


def main(argv) -> None:
  from absl import flags
  from transformer import cli
  if len(argv) > 1:
    raise cli.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  FLAGS = flags.FLAGS
  try:
    if not FLAGS.sweep:
      raise SweepError("--sweep is required, e.g. --sweep configs/sweeps/table3.py")
    modes = [name for name in ("dry_run", "collect") if FLAGS[name].value]
    modes += ["launch"] if FLAGS.launch else []
    if len(modes) > 1:
      raise SweepError(f"choose one of --dry_run, --launch, --collect (got {', '.join(modes)})")
    if FLAGS.json and not FLAGS.dry_run:
      raise SweepError("--json goes with --dry_run")
    if not FLAGS.workdir and not FLAGS.dry_run:
      raise SweepError("--workdir is required (each row runs in WORKDIR/<row>)")
    sweep = load_sweep(FLAGS.sweep)
    rows = select_rows(sweep, FLAGS.only)
    # Every row is built and validated first: a bad override in the last row stops the
    # sweep here, before the first row spends hours training.
    configs = {row.name: row_config(sweep, row) for row in rows}

    if FLAGS.dry_run:
      from transformer import sweep_report
      summaries = sweep_report.describe_rows(rows, configs)
      if FLAGS.json:
        for entry in summaries:
          print(json.dumps(entry))
      else:
        print(sweep_report.dry_run_table(sweep, summaries))
    elif FLAGS.launch:
      from transformer import sweep_launch
      written = sweep_launch.write_scripts(FLAGS.launch, sweep, rows, configs, FLAGS.workdir,
                                           sweep_launch.options_from_flags())
      for path in written:
        print(path)
    elif FLAGS.collect:
      from transformer import sweep_report
      written = sweep_report.collect(sweep, rows, configs, FLAGS.workdir,
                                     FLAGS.output_dir or FLAGS.workdir)
      print(open(written[0], encoding="utf-8").read())
      for path in written:
        print(f"wrote {path}")
    else:
      run_local(sweep, rows, configs, FLAGS.workdir, final_eval=FLAGS.final_eval)
  except (SweepError, config_lib.ConfigError) as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  # Run the imported module, not __main__: sweep files import `Row` from transformer.sweep,
  # and isinstance checks need that one class.
  from absl import flags as absl_flags
  from transformer import cli, sweep_launch
  from transformer import sweep as sweep_module
  sweep_module.define_flags()
  for module in (sweep_module, sweep_launch):  # so that --help lists them
    absl_flags.adopt_module_key_flags(module)
  cli.run(sweep_module.main)
