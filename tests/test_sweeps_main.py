"""`python -m transformer.sweeps` as a command: its modes, and one-line errors that stop
a sweep before any row trains."""

from __future__ import annotations

import json

import pytest

from tests.helpers.sweep_helpers import TABLE3, fake_finished_row, run_sweep_command
from transformer import versions


def _last_stderr_line(result) -> str:
  return result.stderr.strip().splitlines()[-1]


def test_invalid_last_row_stops_the_sweep_before_the_first_row_trains(tmp_path):
  sweep_file = tmp_path / "typo.py"
  sweep_file.write_text(
    "from transformer.sweeps import Row\n"
    "BASE_CONFIG = 'configs/default.py'\n"
    "def get_sweep():\n"
    "  return [Row('first', {}), Row('last', {'model.positional': 'sinusoids'})]\n"
  )
  workdir = tmp_path / "runs"
  result = run_sweep_command("--sweep", str(sweep_file), "--workdir", str(workdir), timeout=60)
  assert result.returncode == 1
  assert (
    result.stderr.strip()
    .splitlines()[-1]
    .startswith("error: row last: config.model.positional: 'sinusoids' is not one of")
  )
  assert not (workdir / "first").exists()


def test_dry_run_json_prints_one_object_per_row():
  result = run_sweep_command("--sweep", TABLE3, "--dry_run", "--json", "--only", "C1,big")
  assert result.returncode == 0, result.stderr[-2000:]
  rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
  assert [r["name"] for r in rows] == ["C1", "big"]
  assert abs(rows[1]["num_params"] / 213e6 - 1) < 0.07
  assert rows[0]["flops_per_token"] < rows[1]["flops_per_token"]
  assert rows[0]["versions"] == versions.library_versions()


@pytest.mark.parametrize(
  "args,message",
  [
    ([], "error: --sweep is required, e.g. --sweep configs/sweeps/table3.py"),
    (
      ["--sweep", TABLE3, "--dry_run", "--collect", "--workdir", "W"],
      "error: choose one of --dry_run, --launch, --collect (got dry_run, collect)",
    ),
    (
      ["--sweep", TABLE3, "--collect", "--launch", "tpu", "--workdir", "W"],
      "error: choose one of --dry_run, --launch, --collect (got collect, launch)",
    ),
    (
      ["--sweep", TABLE3, "--json", "--workdir", "W"],
      "error: --json goes with --dry_run or --compile_check alone",
    ),
    (["--sweep", TABLE3], "error: --workdir is required (each row runs in WORKDIR/<row>)"),
    (
      ["--sweep", TABLE3, "--workdir", "W", "--commit_records"],
      "error: --commit_records needs --records FILE",
    ),
    (
      ["--sweep", TABLE3, "--dry_run", "--records", "r.jsonl"],
      "error: --records goes with training or --collect",
    ),
    (
      ["--sweep", TABLE3, "--collect", "--records", "r.jsonl"],
      "error: --collect --records needs --output_dir",
    ),
    (
      ["--sweep", TABLE3, "--dry_run", "--only", "A1,bse"],
      "error: --only: no row 'bse' in sweep table3 (did you mean base?)",
    ),
    (
      ["--sweep", "configs/sweeps/nope.py", "--dry_run"],
      "error: configs/sweeps/nope.py: no such file",
    ),
  ],
)
def test_usage_errors_are_one_line(args, message):
  """Each misuse exits 1 with one line that says what to change."""
  result = run_sweep_command(*args, timeout=60)
  assert result.returncode == 1, result.stdout[-2000:]
  assert _last_stderr_line(result) == message


def test_dry_run_table_is_printed(tmp_path):
  """Without --json, --dry_run prints the table, and needs no --workdir."""
  result = run_sweep_command("--sweep", TABLE3, "--dry_run", "--only", "base,C1")
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.splitlines()
  assert lines[0] == "sweep table3 on configs/wmt14.py:base"
  assert lines[1].split() == [
    "row",
    "overrides",
    "params",
    "FLOPs/token",
    "paper",
    "params",
    "diff",
  ]
  assert [line.split()[0] for line in lines[2:]] == ["base", "C1"]


def test_collect_prints_the_table_and_writes_into_the_workdir(tmp_path):
  """--collect without --output_dir writes next to the rows and prints the markdown."""
  workdir = tmp_path / "runs"
  fake_finished_row(str(workdir), "E", 100_000, ppl=5.0, bleu=25.0)
  result = run_sweep_command(
    "--sweep", TABLE3, "--workdir", str(workdir), "--collect", "--only", "E", timeout=90
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert "| E | positional=learned | " in result.stdout
  assert result.stdout.splitlines()[-3:] == [
    f"wrote {workdir}/table3.{ext}" for ext in ("md", "csv", "png")
  ]
  assert (workdir / "table3.png").exists()
