"""Seeds in a sweep: runs per seed, their records (records.py), and the aggregation over
seeds (aggregate.py): intervals, the paper's sign, the paired bootstrap, and a study
that resumes from its records alone."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil

import pytest

from tests.helpers import processes
from tests.helpers.sweep_helpers import write_sweep
from transformer.sweeps import aggregate, records, runner, spec

# ----------------------------------------------------------------------------------
# Statistics.


def test_interval_is_the_range_for_two_and_a_t_interval_for_three():
  assert aggregate.interval([1.0]) is None
  assert aggregate.interval([3.0, 1.0]) == (1.0, 3.0)
  low, high = aggregate.interval([1.0, 2.0, 3.0])
  # mean 2, sd 1: 2 -/+ t(0.975, 2 df) / sqrt(3), t = 4.302653
  half = 4.302653 / 3**0.5
  assert low == pytest.approx(2.0 - half) and high == pytest.approx(2.0 + half)


@pytest.mark.parametrize(
  "deltas, paper, spread, expected",
  [
    ([1.0, 1.2], 0.4, 0.1, "yes"),  # the paper's sign at every seed, beyond 2 spreads
    ([-1.0, -1.2], 0.4, 0.1, "no"),  # the opposite sign by the same test
    ([1.0, -0.1], 0.4, 0.1, "too small to tell"),  # the seeds disagree
    ([0.15, 0.18], 0.4, 0.1, "too small to tell"),  # the right sign, within 2 spreads
    ([0.1, -0.1], 0.0, 0.1, "yes"),  # the paper shows no change, nor do we
    ([1.0, 1.1], 0.0, 0.1, "no"),
    ([1.0, 1.1], None, 0.1, ""),  # no paper figure
    ([1.0, 1.1], 0.4, None, ""),  # base has one seed: no spread to judge by
  ],
)
def test_verdict(deltas, paper, spread, expected):
  assert aggregate.verdict(deltas, paper, spread) == expected


def test_paired_bootstrap_tells_a_real_difference_from_none():
  references = [f"the cat number {i} sat on the mat today" for i in range(60)]
  # Two systems as good as each other: each misses the last word of half the sentences.
  odd = [r if i % 2 else r.replace("today", "now") for i, r in enumerate(references)]
  even = [r if i % 2 == 0 else r.replace("today", "now") for i, r in enumerate(references)]
  same = aggregate.paired_bootstrap_p(odd, even, references)
  worse = [f"a dog {i} stood" for i in range(60)]
  different = aggregate.paired_bootstrap_p(worse, references, references)
  assert same > 0.2 and different < 0.01
  # sacreBLEU's seed is fixed: the same files give the same p.
  assert aggregate.paired_bootstrap_p(worse, references, references) == different


# ----------------------------------------------------------------------------------
# Sweep files with seeds.


def test_runs_have_a_directory_and_a_seed_each(tmp_path, small_corpus):
  sweep = spec.load_sweep(
    write_sweep(tmp_path, small_corpus, '[Row("base", {}, seeds=(0, 2)), Row("A", {})]')
  )
  runs = spec.runs(sweep.rows)
  # One pass over the rows per seed: a study stopped part way has every row once.
  assert [(r.name, r.directory("W")) for r in runs] == [
    ("base seed 0", "W/base/seed0"),
    ("A", "W/A"),
    ("base seed 2", "W/base/seed2"),
  ]
  args = spec.train_args(sweep, runs[2], "W/base/seed2", "c.py")
  assert "--config.seed=2" in args
  assert not any(
    a.startswith("--config.seed") for a in spec.train_args(sweep, runs[1], "W/A", "c.py")
  )


@pytest.mark.parametrize(
  "rows, extra, message",
  [
    ('[Row("b", {}, seeds=(1, 1))]', "", r"seeds \(1, 1\) must be distinct"),
    ('[Row("b", {}, seeds=())]', "", "must be distinct integers"),
    ('[Row("b", {})]', "AVERAGE_LAST = 0\n", "AVERAGE_LAST = 0 must be an integer >= 1"),
  ],
)
def test_bad_seeds_and_average_last_are_one_line_errors(
  tmp_path, small_corpus, rows, extra, message
):
  path = write_sweep(tmp_path, small_corpus, rows)
  with open(path, "a") as f:
    f.write(extra)
  with pytest.raises(spec.SweepError, match=message):
    spec.load_sweep(path)


def test_eval_args_average_the_last_checkpoints(tmp_path, small_corpus):
  sweep = spec.load_sweep(write_sweep(tmp_path, small_corpus, '[Row("b", {})]'))
  config = spec.row_config(sweep, sweep.rows[0])
  assert "--average_last" not in spec.eval_args("W", config)
  assert spec.eval_args("W", config, 3)[-2:] == ["--average_last", "3"]
  assert runner.final_eval_stem(6, 3) == "validation-6-avg3"
  assert runner.final_eval_stem(6) == "validation-6"


# ----------------------------------------------------------------------------------
# A real study: two rows of two seeds, recorded, resumed from its records, aggregated.


@pytest.mark.slow
def test_a_recorded_study_skips_what_it_holds_and_aggregates_its_seeds(
  tmp_path, small_corpus, monkeypatch
):
  # The runs' processes on one CPU device: a study's runs are single-device here.
  monkeypatch.setenv("XLA_FLAGS", processes.xla_flags(devices=1))
  sweep_file = write_sweep(
    tmp_path,
    small_corpus,
    '[Row("base", {}, paper_ppl=5.0, paper_bleu=25.0, seeds=(0, 1)),'
    ' Row("D1", {"model.dropout_rate": 0.0}, paper_ppl=5.5, paper_bleu=24.0, seeds=(0, 1))]',
    base_overrides='{"eval_every_steps": 2, "model.dropout_rate": 0.1, "max_decode_extra_len": 3}',
  )
  with open(sweep_file, "a") as f:
    f.write("AVERAGE_LAST = 2\n")
  sweep = spec.load_sweep(sweep_file)
  configs = {row.name: spec.row_config(sweep, row) for row in sweep.rows}
  workdir, path = str(tmp_path / "runs"), str(tmp_path / "results" / "study.jsonl")
  recording = runner.Recording(path, "python -m transformer.sweeps --sweep S", commit=False)
  runner.run_local(sweep, sweep.rows, configs, workdir, recording=recording)

  found = records.read_records(path)
  assert [(r["row"], r["seed"]) for r in found] == [("base", 0), ("D1", 0), ("base", 1), ("D1", 1)]
  for r in found:
    assert r["steps"] == 6 and r["average_last"] == 2 and r["record_version"] == 1
    assert [h["step"] for h in r["ppl_history"]] == [2, 4, 6]
    assert r["ppl"] > 1.0 and r["epochs"] > 0
    assert {"command", "commit", "machine", "date"} <= set(r)
  # Seeds differ: the same row at two seeds trains two different models.
  assert found[0]["ppl_history"] != found[2]["ppl_history"]
  # The final evaluation averaged the last two checkpoints, and its files sit beside
  # the records: hypotheses per run, the references once.
  with open(os.path.join(tmp_path, "results/study/base-seed1/final_eval.json")) as f:
    final = json.load(f)
  assert final["step"] == 6 and final["ppl"] == found[2]["ppl"]
  with gzip.open(tmp_path / "results/study/validation.ref.txt.gz", "rt") as f:
    assert len(f.read().splitlines()) == final["num_sentences"]

  # A new machine: the workdirs are gone, and the study trains only what is missing.
  shutil.rmtree(workdir)
  with open(path) as f:
    lines = f.readlines()
  with open(path, "w") as f:
    f.writelines(lines[:3])  # D1 seed 1 was in progress
  done = runner.run_local(sweep, sweep.rows, configs, workdir, recording=recording)
  assert [(d["row"], d["seed"], d["phase"]) for d in done] == [
    ("base", 0, "skipped"),
    ("D1", 0, "skipped"),
    ("base", 1, "skipped"),
    ("D1", 1, "train"),
    ("D1", 1, "eval"),
  ]
  again = records.read_records(path)
  # The retrained run is the same run: the same seed, the same data order.
  assert again[3]["ppl_history"] == found[3]["ppl_history"]

  written = aggregate.collect(sweep, path, str(tmp_path / "out"))
  with open(written[0]) as f:
    table = f.read()
  assert "| base | (base) | 0,1 |" in table and "| D1 | P_drop=0.0 | 0,1 |" in table
  summaries = aggregate.summarize(sweep, again, path)
  d1 = summaries[1]
  ppl = {(r["row"], r["seed"]): r["ppl"] for r in again}
  assert d1["ppl"].deltas == {s: ppl["D1", s] - ppl["base", s] for s in (0, 1)}
  assert d1["ppl"].paper_delta == pytest.approx(0.5)
  assert 0.0 <= d1["bleu"].p_value <= 1.0
  assert os.path.getsize(written[2]) > 1000  # the curves

  # A longer study, run for D1 seed 1 only: it resumes from its checkpoint at step 6 and
  # its record is replaced; the records file keeps one line per run, the others at 6.
  with open(sweep_file) as f:
    text = f.read().replace(
      '"eval_every_steps": 2,', '"eval_every_steps": 2, "num_train_steps": 8,', 1
    )
  with open(sweep_file, "w") as f:
    f.write(text)
  longer = spec.load_sweep(sweep_file)
  d1_seed1 = [dataclasses.replace(row, seeds=(1,)) for row in longer.rows if row.name == "D1"]
  longer_configs = {"D1": spec.row_config(longer, d1_seed1[0])}
  done = runner.run_local(longer, d1_seed1, longer_configs, workdir, recording=recording)
  assert [(d["seed"], d["phase"], d.get("resumed")) for d in done] == [
    (1, "train", True),
    (1, "eval", False),
  ]
  extended = records.read_records(path)
  assert [(r["row"], r["seed"], r["steps"]) for r in extended] == [
    ("base", 0, 6),
    ("D1", 0, 6),
    ("base", 1, 6),
    ("D1", 1, 8),
  ]
  # Resumed, not retrained: the first six steps' history is the shorter run's.
  assert extended[3]["ppl_history"][:3] == again[3]["ppl_history"]
  assert [h["step"] for h in extended[3]["ppl_history"]] == [2, 4, 6, 8]
