"""Sweeps: expansion and validation, dry-run sizes, the local runner, cluster scripts, collect."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests import tiny_run
from transformer.sweeps import launch, report, runner, spec
from transformer.training import loop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE3 = os.path.join(REPO, "configs/sweeps/table3.py")
TABLE3_SMALL = os.path.join(REPO, "configs/sweeps/table3_small.py")
PAPER_ROWS = ["base", "A1", "A2", "A3", "A4", "B1", "B2", "C1", "C2", "C3", "C4", "C5", "C6",
              "C7", "D1", "D2", "D3", "D4", "E", "big"]


def _write_sweep(tmp_path, corpus, rows: str, base_overrides: str = "{}") -> str:
  """A sweep over the tiny test run: its own config file plus a sweep file."""
  path, vocab_dir = corpus
  config_file = tmp_path / "tiny_config.py"
  config_file.write_text(
      "from tests import tiny_run\n\n"
      "def get_config():\n"
      f"  return tiny_run.make_config(({path!r}, {vocab_dir!r}), eval_every_steps=6)\n")
  sweep_file = tmp_path / "tiny_sweep.py"
  sweep_file.write_text(
      "from transformer.sweeps import Row\n\n"
      f"BASE_CONFIG = {str(config_file)!r}\n"
      f"BASE_OVERRIDES = {base_overrides}\n\n"
      f"def get_sweep():\n  return {rows}\n")
  return str(sweep_file)


def _run_sweep_command(*args, timeout=120):
  return subprocess.run([sys.executable, "-m", "transformer.sweeps", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)


def test_table3_has_every_row_once_with_the_papers_changes():
  sweep = spec.load_sweep(TABLE3)
  assert [row.name for row in sweep.rows] == PAPER_ROWS
  assert sweep.base_config == "configs/wmt14.py:base"
  configs = {row.name: spec.row_config(sweep, row) for row in sweep.rows}
  a1, base = configs["A1"].model, configs["base"].model
  assert (a1.num_heads, a1.d_k, a1.d_v) == (1, 512, 512)
  assert (a1.num_layers, a1.d_model, a1.d_ff, a1.dropout_rate) == (6, 512, 2048, 0.1)
  assert configs["C4"].model.num_heads == base.num_heads == 8  # "In C4 and C5 h stays 8"
  assert configs["D3"].label_smoothing == 0.0 and configs["base"].label_smoothing == 0.1
  assert configs["E"].model.positional == "learned" and base.positional == "sinusoidal"
  assert configs["big"].num_train_steps == 300_000 and configs["A1"].num_train_steps == 100_000
  assert configs["big"].model.dropout_rate == 0.3
  # Rows are independent: overriding A1 did not leak into the rows built after it.
  assert configs["A2"].model.num_heads == 4 and configs["D1"].model.num_heads == 8


def test_table3_small_scales_every_row_and_keeps_the_papers_numbers():
  small, paper = spec.load_sweep(TABLE3_SMALL), spec.load_sweep(TABLE3)
  assert [row.name for row in small.rows] == PAPER_ROWS
  for small_row, paper_row in zip(small.rows, paper.rows):
    assert (small_row.paper_ppl, small_row.paper_bleu) == (paper_row.paper_ppl,
                                                           paper_row.paper_bleu)
    config = spec.row_config(small, small_row)
    assert config.dataset == "tatoeba_en_es"
    # (A) keeps h * d_k = d_model, as in the paper.
    if small_row.name.startswith("A"):
      assert config.model.num_heads * config.model.d_k == config.model.d_model
  base = spec.row_config(small, small.rows[0])
  assert base.model.d_model == 256 and base.model.dropout_rate == 0.1
  assert spec.row_config(small, small.rows[PAPER_ROWS.index("D1")]).model.dropout_rate == 0


def test_row_names_must_be_unique(tmp_path, small_corpus):
  path = _write_sweep(tmp_path, small_corpus, '[Row("a", {}), Row("a", {"seed": 1})]')
  with pytest.raises(spec.SweepError, match="row 'a' appears twice"):
    spec.load_sweep(path)


@pytest.mark.parametrize("overrides,message", [
    ({"model.d_fff": 1}, r"row r: config\.model\.d_fff: unknown key \(did you mean "
                         r"config\.model\.d_ff\?\)"),
    ({"model.num_heads": "eight"}, r"row r: config\.model\.num_heads"),
    ({"model.dropout_rate": 1.5}, r"row r: config\.model\.dropout_rate: must be in \[0, 1\)"),
])
def test_bad_override_is_a_one_line_error(overrides, message):
  sweep = spec.Sweep("s", "configs/default.py", {}, [])
  with pytest.raises(spec.SweepError, match=message):
    spec.row_config(sweep, spec.Row("r", overrides))


def test_invalid_last_row_stops_the_sweep_before_the_first_row_trains(tmp_path):
  sweep_file = tmp_path / "typo.py"
  sweep_file.write_text(
      "from transformer.sweeps import Row\n"
      "BASE_CONFIG = 'configs/default.py'\n"
      "def get_sweep():\n"
      "  return [Row('first', {}), Row('last', {'model.positional': 'sinusoids'})]\n")
  workdir = tmp_path / "runs"
  result = _run_sweep_command("--sweep", str(sweep_file), "--workdir", str(workdir), timeout=60)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1].startswith(
      "error: row last: config.model.positional: 'sinusoids' is not one of")
  assert not (workdir / "first").exists()


def test_only_picks_rows_and_rejects_unknown_names():
  sweep = spec.load_sweep(TABLE3)
  assert [r.name for r in spec.select_rows(sweep, "C3, A1")] == ["A1", "C3"]
  with pytest.raises(spec.SweepError,
                     match=r"no row 'bse' in sweep table3 \(did you mean base\?\)"):
    spec.select_rows(sweep, "A1,bse")


def test_dry_run_params_within_7_percent_of_table3():
  sweep = spec.load_sweep(TABLE3)
  with_params = [row for row in sweep.rows if row.paper_params_m]
  assert len(with_params) == 11
  rows = with_params + spec.select_rows(sweep, "A4")
  configs = {row.name: spec.row_config(sweep, row) for row in rows}
  described = {d["name"]: d for d in report.describe_rows(rows, configs)}
  for row in with_params:
    ratio = described[row.name]["num_params"] / (row.paper_params_m * 1e6)
    assert abs(ratio - 1) < 0.07, (row.name, ratio)
  # Rows that only reshape heads keep the parameters and the FLOPs of base.
  assert described["A4"]["num_params"] == described["base"]["num_params"]
  assert described["C3"]["flops_per_token"] > described["base"]["flops_per_token"]
  table = report.dry_run_table(sweep, list(described.values()))
  assert "C1    N=2" in table and "-6.5%" in table


def test_dry_run_json_prints_one_object_per_row():
  result = _run_sweep_command("--sweep", TABLE3, "--dry_run", "--json", "--only", "C1,big")
  assert result.returncode == 0, result.stderr[-2000:]
  rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
  assert [r["name"] for r in rows] == ["C1", "big"]
  assert abs(rows[1]["num_params"] / 213e6 - 1) < 0.07
  assert rows[0]["flops_per_token"] < rows[1]["flops_per_token"]


def test_local_runner_resumes_an_interrupted_row_and_skips_a_finished_one(
    tmp_path, small_corpus):
  sweep = spec.load_sweep(_write_sweep(tmp_path, small_corpus, '[Row("r", {})]'))
  configs = {"r": spec.row_config(sweep, sweep.rows[0])}
  workdir = str(tmp_path / "runs")
  row_dir = os.path.join(workdir, "r")
  assert runner.row_state(row_dir, 6, final_eval=False) == "new"

  # The row's run, trained here to save a process start; then an interruption after
  # step 4: the step-6 checkpoint never got written.
  loop.train_and_evaluate(configs["r"], row_dir)
  assert checkpoints.steps_on_disk(row_dir) == [2, 4, 6]
  assert runner.row_state(row_dir, 6, final_eval=False) == "finished"
  shutil.rmtree(os.path.join(row_dir, "checkpoints", "6"))
  assert runner.row_state(row_dir, 6, final_eval=False) == "partial"

  done = runner.run_local(sweep, sweep.rows, configs, workdir, final_eval=False)
  assert [(d["phase"], d["resumed"], d["returncode"]) for d in done] == [("train", True, 0)]
  steps = [r["step"] for r in tiny_run.read_metrics(row_dir)]
  assert steps == [1, 2, 3, 4, 5, 6, 5, 6]  # resumed at 5, not restarted at 1
  assert checkpoints.steps_on_disk(row_dir)[-1] == 6

  done = runner.run_local(sweep, sweep.rows, configs, workdir, final_eval=False)
  assert done == [{"row": "r", "phase": "skipped"}]
  assert len(tiny_run.read_metrics(row_dir)) == 8
  # Asking for the full-split evaluation would now run only eval.py, not training.
  assert runner.row_state(row_dir, 6, final_eval=True) == "trained"


def _fake_finished_row(workdir, name, steps, ppl, bleu, from_eval_py=True):
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


def test_collect_writes_table_csv_and_plot(tmp_path):
  sweep = spec.load_sweep(TABLE3)
  rows = spec.select_rows(sweep, "base,A1,C1,E")
  configs = {row.name: spec.row_config(sweep, row) for row in rows}
  workdir = str(tmp_path / "runs")
  _fake_finished_row(workdir, "base", 100_000, ppl=5.0, bleu=25.0)
  _fake_finished_row(workdir, "A1", 100_000, ppl=5.5, bleu=24.0)
  _fake_finished_row(workdir, "C1", 100_000, ppl=6.25, bleu=20.0, from_eval_py=False)
  # E never ran: its cells stay blank rather than failing the collection.
  out = str(tmp_path / "out")
  written = report.collect(sweep, rows, configs, workdir, out)
  assert [os.path.basename(p) for p in written] == ["table3.md", "table3.csv", "table3.png"]

  markdown = open(written[0]).read()
  assert ("| row | changed values | params (M) | ppl | BLEU | tok BLEU | paper ppl | paper BLEU "
          "| paper params (M) |") in markdown
  assert "| A1 | h=1 d_k=512 d_v=512 | 63.0 | 5.50 | 24.00 | 24.50 | 5.29 | 24.9 |  |" in markdown
  assert "| C1 | N=2 | 33.6 | 6.25 | 20.00 |  | 6.11 | 23.7 | 36 |" in markdown
  assert "Not finished yet (blank): E." in markdown
  assert ("BLEU of base, A1 is computed on the whole validation split (3000 sentences, "
          "eval.py). BLEU of C1 is computed on the first 500 validation sentences (the "
          "training run's last evaluation).") in markdown
  with open(written[1]) as f:
    table = list(csv.DictReader(f))
  assert [r["row"] for r in table] == ["base", "A1", "C1", "E"]
  assert float(table[0]["ppl"]) == 5.0 and float(table[0]["paper params (M)"]) == 65
  assert table[3]["ppl"] == "" and table[2]["tok BLEU"] == "" and float(table[2]["BLEU"]) == 20
  with open(written[2], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.path.getsize(written[2]) > 10_000


def test_relative_change_is_against_the_base_row():
  assert report._relative_to_base([5.0, 5.5, None], 5.0) == [0.0, pytest.approx(10.0),
                                                                   None]
  assert report._relative_to_base([1.0], None) == [None]


def test_launch_scripts_run_train_and_eval_for_each_row(tmp_path):
  sweep = spec.load_sweep(TABLE3)
  rows = spec.select_rows(sweep, "E,big")
  configs = {row.name: spec.row_config(sweep, row) for row in rows}
  options = launch.LaunchOptions(script_dir=str(tmp_path), tpu_name="pod", tpu_zone="z")
  slurm = launch.write_scripts("slurm", sweep, rows, configs, "gs://b/t3", options)
  tpu = launch.write_scripts("tpu", sweep, rows, configs, "gs://b/t3", options)
  assert [os.path.basename(p) for p in slurm] == ["E.sbatch", "big.sbatch", "slurm_all.sh"]
  script = open(slurm[1]).read()
  assert ("srun python train.py --config configs/wmt14.py:base --workdir gs://b/t3/big "
          "--config.model.d_model=1024 --config.model.d_ff=4096 --config.model.num_heads=16 "
          "--config.model.dropout_rate=0.3 --config.num_train_steps=300000\n") in script
  assert ("srun --nodes=1 --ntasks=1 python eval.py --workdir gs://b/t3/big --split validation "
          "--step 300000\n") in script
  assert "#SBATCH --signal=TERM@120 --requeue" in script
  assert open(slurm[2]).read().splitlines()[2:] == [f"sbatch {slurm[0]}", f"sbatch {slurm[1]}"]
  tpu_script = open(tpu[0]).read()
  assert ("gcloud compute tpus tpu-vm ssh pod --zone z --worker=all --command='cd "
          "$HOME/transformer && python train.py --config configs/wmt14.py:base --workdir "
          "gs://b/t3/E --config.model.positional=learned'") in tpu_script
