"""A sweep's numbers (report.py): sizes before training (--dry_run) and the collected
table, CSV and plot after it (--collect)."""

from __future__ import annotations

import csv
import os
import pathlib

import pytest

from tests.helpers.sweep_helpers import TABLE3, fake_finished_row
from transformer.sweeps import report, spec


def _collected(name, **values):
  """One collect_rows dict, None except for `values` (COLUMNS keys, "_" for " ")."""
  row = {column: None for column in report.COLUMNS}
  row.update({"row": name, "changed values": "(base)"})
  for key, value in values.items():
    assert key.replace("_", " ") in row, key
    row[key.replace("_", " ")] = value
  return row


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


def test_dry_run_table_layout():
  """A title line, aligned columns, the paper's size and the difference only where the
  paper gives a size."""
  sweep = spec.Sweep("s", "configs/x.py:base", {}, [])
  described = [
    {
      "name": "base",
      "overrides": {},
      "num_params": 50_500_000,
      "flops_per_token": 3.0e8,
      "paper_params_m": 50,
    },
    {
      "name": "wide",
      "overrides": {"model.d_ff": 4096, "seed": 2},
      "num_params": 2_000_000,
      "flops_per_token": 1.23456e7,
      "paper_params_m": None,
    },
  ]
  assert report.dry_run_table(sweep, described).splitlines() == [
    "sweep s on configs/x.py:base",
    "row   overrides         params  FLOPs/token  paper params  diff",
    "base  (base)            50.5M   3e+08        50M           +1.0%",
    "wide  d_ff=4096 seed=2  2.0M    1.23e+07",
  ]


def test_changed_values_use_table3_names():
  """Overrides read as Table 3's column names, in the row's order; other keys as they are."""
  assert report.changed_values(spec.Row("b", {})) == "(base)"
  row = spec.Row(
    "x",
    {
      "model.num_heads": 1,
      "model.d_k": 512,
      "model.dropout_rate": 0.0,
      "label_smoothing": 0.2,
      "model.positional": "learned",
      "num_train_steps": 300_000,
      "model.num_layers": 2,
      "seed": 3,
      "model.norm": "pre",
    },
  )
  assert report.changed_values(row) == (
    "h=1 d_k=512 P_drop=0.0 eps_ls=0.2 positional=learned steps=300000 N=2 seed=3 model.norm=pre"
  )


def test_markdown_table_formats_numbers_and_leaves_missing_cells_blank():
  """Header and separator have one cell per column; params 1 decimal, ppl and BLEU 2,
  the paper's BLEU 1, its params as written; None is an empty cell."""
  table = report.markdown_table(
    [
      _collected("base", ppl=4.9349, BLEU=25.456, tok_BLEU=26.0, paper_ppl=4.92, paper_BLEU=25.8),
      _collected("big", **{"params (M)": 213.04, "paper params (M)": 213}),
    ]
  )
  lines = table.splitlines()
  assert table.endswith("\n") and len(lines) == 4
  assert lines[0] == (
    "| row | changed values | params (M) | ppl | BLEU | tok BLEU | paper ppl "
    "| paper BLEU | paper params (M) |"
  )
  assert lines[1] == "|" + "---|" * 9
  assert lines[2] == "| base | (base) |  | 4.93 | 25.46 | 26.00 | 4.92 | 25.8 |  |"
  assert lines[3] == "| big | (base) | 213.0 |  |  |  |  |  | 213 |"


def test_markdown_table_keeps_the_papers_fractional_params():
  row = _collected("r", **{"paper params (M)": 65.5})
  assert report.markdown_table([row]).splitlines()[2] == "| r | (base) |  |  |  |  |  |  | 65.5 |"


def test_relative_change_is_against_the_base_row():
  assert report.relative_to_base([5.0, 5.5, None], 5.0) == [0.0, pytest.approx(10.0), None]
  assert report.relative_to_base([1.0], None) == [None]
  assert report.relative_to_base([1.0, 0.0], 0.0) == [None, None]  # no change from 0


def test_collect_with_a_base_row_of_bleu_0_and_a_row_without_scores_writes_the_plot(tmp_path):
  """A smoke run's BLEU is 0; a row never run has no scores: both still give a plot."""
  sweep = spec.load_sweep(TABLE3)
  rows = spec.select_rows(sweep, "base,A1")
  configs = {row.name: spec.row_config(sweep, row) for row in rows}
  workdir = str(tmp_path)
  fake_finished_row(workdir, "base", 100_000, ppl=900.0, bleu=0.0)
  written = report.collect(sweep, rows, configs, workdir, workdir)
  with open(written[2], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_collect_writes_table_csv_and_plot(tmp_path):
  sweep = spec.load_sweep(TABLE3)
  rows = spec.select_rows(sweep, "base,A1,C1,E")
  configs = {row.name: spec.row_config(sweep, row) for row in rows}
  workdir = str(tmp_path / "runs")
  fake_finished_row(workdir, "base", 100_000, ppl=5.0, bleu=25.0)
  fake_finished_row(workdir, "A1", 100_000, ppl=5.5, bleu=24.0)
  fake_finished_row(workdir, "C1", 100_000, ppl=6.25, bleu=20.0, from_eval_py=False)
  # E never ran: its cells stay blank rather than failing the collection.
  out = str(tmp_path / "out")
  written = report.collect(sweep, rows, configs, workdir, out)
  assert [os.path.basename(p) for p in written] == ["table3.md", "table3.csv", "table3.png"]

  markdown = pathlib.Path(written[0]).read_text()
  assert (
    "| row | changed values | params (M) | ppl | BLEU | tok BLEU | paper ppl | paper BLEU "
    "| paper params (M) |"
  ) in markdown
  assert "| A1 | h=1 d_k=512 d_v=512 | 63.0 | 5.50 | 24.00 | 24.50 | 5.29 | 24.9 |  |" in markdown
  assert "| C1 | N=2 | 33.6 | 6.25 | 20.00 |  | 6.11 | 23.7 | 36 |" in markdown
  assert "Not finished yet (blank): E." in markdown
  assert (
    "BLEU of base, A1 is computed on the whole validation split (3000 sentences, "
    "eval.py). BLEU of C1 is computed on the first 500 validation sentences (the "
    "training run's last evaluation)."
  ) in markdown
  with open(written[1]) as f:
    table = list(csv.DictReader(f))
  assert [r["row"] for r in table] == ["base", "A1", "C1", "E"]
  assert float(table[0]["ppl"]) == 5.0 and float(table[0]["paper params (M)"]) == 65
  assert table[3]["ppl"] == "" and table[2]["tok BLEU"] == "" and float(table[2]["BLEU"]) == 20
  with open(written[2], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.path.getsize(written[2]) > 10_000


def test_collect_rows_group_rows_by_where_bleu_came_from(tmp_path):
  """bleu_sources maps each BLEU provenance to its rows; rows without BLEU under None.
  A workdir given with a trailing slash finds the same rows."""
  sweep = spec.load_sweep(TABLE3)
  rows = spec.select_rows(sweep, "base,A1,E")
  configs = {row.name: spec.row_config(sweep, row) for row in rows}
  workdir = str(tmp_path / "runs")
  fake_finished_row(workdir, "base", 100_000, ppl=5.0, bleu=25.0)
  fake_finished_row(workdir, "A1", 100_000, ppl=5.5, bleu=24.0)
  sources = {}
  collected = report.collect_rows(sweep, rows, configs, workdir + "/", sources)
  assert sources == {
    "the whole validation split (3000 sentences, eval.py)": ["base", "A1"],
    None: ["E"],
  }
  assert [(r["row"], r["ppl"], r["BLEU"], r["tok BLEU"]) for r in collected] == [
    ("base", 5.0, 25.0, 25.5),
    ("A1", 5.5, 24.0, 24.5),
    ("E", None, None, None),
  ]
  assert collected[0]["params (M)"] == pytest.approx(63.1, abs=0.1)
  assert (collected[0]["paper ppl"], collected[0]["paper BLEU"]) == (4.92, 25.8)


def test_collect_with_one_bleu_source_and_every_row_finished(tmp_path):
  """One provenance is stated once for all rows; no "not finished" note when none is
  missing; the output directory is created."""
  sweep = spec.load_sweep(TABLE3)
  rows = spec.select_rows(sweep, "base,C1")
  configs = {row.name: spec.row_config(sweep, row) for row in rows}
  workdir = str(tmp_path / "runs")
  fake_finished_row(workdir, "base", 100_000, ppl=5.0, bleu=25.0)
  fake_finished_row(workdir, "C1", 100_000, ppl=6.0, bleu=21.0)
  written = report.collect(sweep, rows, configs, workdir, str(tmp_path / "a" / "b"))
  markdown = pathlib.Path(written[0]).read_text()
  assert " BLEU is computed on the whole validation split (3000 sentences, eval.py).\n" in markdown
  assert "BLEU of base" not in markdown and "Not finished" not in markdown
  assert markdown.endswith("| C1 | N=2 | 33.6 | 6.00 | 21.00 | 21.50 | 6.11 | 23.7 | 36 |\n")
