r"""Ablation sweeps: named rows of config overrides, run one after another or on a cluster.

  python -m transformer.sweeps --sweep configs/sweeps/table3.py --dry_run [--json]
      Each row's parameters and training FLOPs per target token; trains nothing.
  python -m transformer.sweeps --sweep configs/sweeps/table3_small.py --workdir W [--only A1,C3]
      Trains the rows here, one after another, each in W/<row>, then beam-searches its
      whole validation split (eval.py). Finished rows are skipped; interrupted ones resume.
  python -m transformer.sweeps --sweep ... --workdir gs://BUCKET/t3 --launch slurm|tpu
      Writes one script per row (and one that starts them all) for a SLURM cluster or a
      TPU pod; the scripts run the same train.py and eval.py commands.
  python -m transformer.sweeps --sweep configs/sweeps/table3.py --compile_check v5e-32
      Compiles every row's train step for that TPU slice on this machine and prints, per
      row, bytes per chip, whether it fits, and the predicted step time, MFU and time to
      its step count (transformer/tools/compile_check.py); --json: each row's report.
      --launch tpu does this first and writes no script for a row that does not fit
      (--compile_check none: skip it).
  python -m transformer.sweeps --sweep ... --workdir W --collect [--output_dir DIR]
      Final validation perplexity and BLEU of every row beside the paper's numbers:
      DIR/<sweep>.md, .csv and .png (report.py).
  python -m transformer.sweeps --sweep configs/sweeps/table3_converged.py --workdir W \
      --records docs/results/table3_converged.jsonl [--commit_records]
      Also records each finished (row, seed) in the records file, with its small files
      beside it (records.py), and commits them with --commit_records. The runs go one
      pass over the rows per seed; a run the file holds at this step count is skipped, so
      a study restarted anywhere trains only what is missing, and one the file holds at
      fewer steps resumes to the new count (raise the sweep's steps to extend a study).
  python -m transformer.sweeps --sweep ... --records FILE --collect --output_dir DIR
      Each row over its seeds, from the records alone: mean, spread, change against
      base at the same seed with an interval, a paired bootstrap of BLEU, and whether it
      agrees with the paper; the validation curves in DIR/<sweep>.png (aggregate.py).

`--config.KEY=VALUE` changes every row, over the row's own values, in every mode: e.g.
`--config.num_train_steps=20` for a smoke run of the whole sweep.

The sweep file format is in spec.py.
"""

import dataclasses
import functools
import json
import subprocess
import sys

from absl import flags

from transformer import cli, storage, versions
from transformer import config as config_lib
from transformer.sweeps import aggregate, launch, report, runner, spec

FLAGS = flags.FLAGS

flags.DEFINE_string("sweep", None, "Sweep file, e.g. configs/sweeps/table3.py.")
flags.DEFINE_string("workdir", None, "Each row runs in WORKDIR/<row>.")
flags.DEFINE_string("only", "", "Comma-separated row names to use (default: every row).")
flags.DEFINE_bool(
  "dry_run",
  False,
  "Print each row's overrides, parameters and FLOPs per target token; train nothing.",
)
flags.DEFINE_bool(
  "json",
  False,
  "With --dry_run or --compile_check alone: one JSON object per row instead of a table.",
)
flags.DEFINE_enum(
  "launch",
  None,
  ["slurm", "tpu"],
  "Write scripts that run each row on a SLURM cluster or a TPU pod instead of training here.",
)
flags.DEFINE_bool(
  "collect",
  False,
  "Gather each row's final validation perplexity and BLEU into <sweep>.md, .csv and .png.",
)
flags.DEFINE_string("output_dir", None, "Where --collect writes (default: WORKDIR).")
flags.DEFINE_string(
  "records",
  None,
  "A JSON-lines file: training records each finished (row, seed) there and skips those "
  "it holds; --collect aggregates the seeds from it.",
)
flags.DEFINE_bool(
  "commit_records", False, "With --records, training commits each new record to git."
)
flags.DEFINE_string(
  "compile_check",
  None,
  "A TPU slice (v5e-32, v4-128, ...): compile each row's train step for it and print "
  "whether it fits and its predicted step time; with --launch tpu, the slice the scripts "
  "run on (rows that do not fit get no script), or none to launch without checking.",
)
flags.DEFINE_bool(
  "final_eval",
  True,
  "After training a row, beam-search its whole validation split with "
  "eval.py; --nofinal_eval keeps the training run's own last validation "
  "metrics (perplexity; BLEU only if config.eval_bleu_sentences > 0).",
)


def main(argv, overrides: dict[str, str]) -> None:
  if len(argv) > 1:
    raise cli.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    mode = _mode()
    sweep = dataclasses.replace(spec.load_sweep(FLAGS.sweep), command_line_overrides=overrides)
    rows = spec.select_rows(sweep, FLAGS.only)
    # Every row is built and validated first: a bad override in the last row stops the
    # sweep here, before the first row spends hours training.
    configs = {row.name: spec.row_config(sweep, row) for row in rows}
    if mode == "dry_run":
      summaries = report.describe_rows(rows, configs)
      if FLAGS.json:
        for entry in summaries:
          print(json.dumps({**entry, "versions": versions.library_versions()}))
      else:
        print(report.dry_run_table(sweep, summaries))
    elif mode == "compile_check" and FLAGS.json:
      checks, _ = _check_rows(sweep, rows, configs)
      for row in rows:  # each row's compile_check report, with the row and its overrides
        record = {"row": row.name, "overrides": row.overrides, **checks[row.name]}
        print(json.dumps(record, default=str))
    elif mode == "compile_check":
      print(_check_rows(sweep, rows, configs)[1])
    elif mode == "launch":
      _launch(sweep, rows, configs)
    elif mode in ("collect", "collect_records"):
      if mode == "collect_records":
        written = aggregate.collect(sweep, FLAGS.records, FLAGS.output_dir)
      else:
        output_dir = FLAGS.output_dir or FLAGS.workdir
        written = report.collect(sweep, rows, configs, FLAGS.workdir, output_dir)
      print(storage.read_text(written[0]))
      for path in written:
        print(f"wrote {path}")
    else:
      recording = None
      if FLAGS.records:
        typed = sys.argv[1:] + [f"--config.{k}={v}" for k, v in overrides.items()]
        command = "python -m transformer.sweeps " + " ".join(typed)
        recording = runner.Recording(FLAGS.records, command, FLAGS.commit_records)
      runner.run_local(
        sweep, rows, configs, FLAGS.workdir, final_eval=FLAGS.final_eval, recording=recording
      )
  except (spec.SweepError, config_lib.ConfigError) as e:
    sys.exit(f"error: {e}")


def _mode() -> str:
  """What the flags ask for: dry_run, compile_check, launch, collect, collect_records or
  train; a SweepError names a combination that does not go together."""
  if not FLAGS.sweep:
    raise spec.SweepError("--sweep is required, e.g. --sweep configs/sweeps/table3.py")
  modes = [name for name in ("dry_run", "collect") if FLAGS[name].value]
  modes += ["launch"] if FLAGS.launch else []
  if len(modes) > 1:
    raise spec.SweepError(f"choose one of --dry_run, --launch, --collect (got {', '.join(modes)})")
  if FLAGS.compile_check and modes and FLAGS.launch != "tpu":
    raise spec.SweepError("--compile_check goes alone or with --launch tpu")
  if FLAGS.compile_check and not FLAGS.launch:
    modes.append("compile_check")
  if FLAGS.json and modes not in (["dry_run"], ["compile_check"]):
    raise spec.SweepError("--json goes with --dry_run or --compile_check alone")
  if FLAGS.launch == "tpu" and not FLAGS.compile_check:
    raise spec.SweepError(
      "--launch tpu checks each row on the slice first: name it, e.g. --compile_check "
      "v5e-32 (or --compile_check none to launch without checking)"
    )
  if FLAGS.commit_records and not FLAGS.records:
    raise spec.SweepError("--commit_records needs --records FILE")
  if FLAGS.records and modes and modes != ["collect"]:
    raise spec.SweepError("--records goes with training or --collect")
  mode = modes[0] if modes else "train"
  if mode == "collect" and FLAGS.records:
    if not FLAGS.output_dir:
      raise spec.SweepError("--collect --records needs --output_dir")
    return "collect_records"
  if not FLAGS.workdir and mode not in ("dry_run", "compile_check"):
    raise spec.SweepError("--workdir is required (each row runs in WORKDIR/<row>)")
  return mode


def _launch(sweep, rows, configs) -> None:
  """Writes --launch's scripts; for a TPU slice, only for the rows that fit it."""
  if FLAGS.launch == "tpu" and FLAGS.compile_check != "none":
    checks, table = _check_rows(sweep, rows, configs)
    print(table, file=sys.stderr)
    for row in [r for r in rows if not checks[r.name]["fits"]]:
      why = report.why_not(checks[row.name])
      print(f"{row.name}: no script, it does not fit {FLAGS.compile_check}: {why}", file=sys.stderr)
    rows = [r for r in rows if checks[r.name]["fits"]]
  written = launch.write_scripts(
    FLAGS.launch, sweep, rows, configs, FLAGS.workdir, launch.options_from_flags()
  )
  for path in written:
    print(path)


def _check_rows(sweep, rows, configs) -> tuple[dict[str, dict], str]:
  """Every row's train step compiled for --compile_check's slice, each by
  `python -m transformer.tools.compile_check --json` in a process of its own (libtpu
  stays out of this one): (reports by row name, the table to print)."""
  checks = {}
  for row in rows:
    overrides = {**sweep.base_overrides, **row.overrides}
    command = [
      sys.executable,
      "-m",
      "transformer.tools.compile_check",
      "--json",
      "--topology",
      FLAGS.compile_check,
      "--config",
      sweep.base_config,
    ]
    command += [f"--config.{k}={spec.flag_value(v)}" for k, v in overrides.items()]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
      last = (result.stderr.strip().splitlines() or ["no output"])[-1]
      raise spec.SweepError(f"row {row.name}: compile_check failed: {last}")
    checks[row.name] = json.loads(result.stdout.strip().splitlines()[-1])
    checks[row.name]["num_train_steps"] = int(configs[row.name].num_train_steps)
  described = report.describe_rows(rows, configs)
  return checks, report.compile_check_table(FLAGS.compile_check, rows, described, checks)


if __name__ == "__main__":
  launch.define_flags()
  flags.adopt_module_key_flags(launch)  # so that --help lists them
  try:  # absl knows no --config here: the sweep applies them to every row itself
    sys.argv, command_line_overrides = spec.split_config_overrides(sys.argv)
  except spec.SweepError as e:
    sys.exit(f"error: {e}")
  cli.run(functools.partial(main, overrides=command_line_overrides))
