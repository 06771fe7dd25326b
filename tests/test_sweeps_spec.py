"""Sweep files (spec.py): loading and checking them, choosing rows, each row's validated
config, and the train.py / eval.py arguments that reproduce it."""

from __future__ import annotations

import os
import types

import pytest
from absl import flags
from ml_collections import config_flags

from tests.helpers.sweep_helpers import PAPER_ROWS, REPO, TABLE3, TABLE3_SMALL, write_sweep
from transformer import config as config_lib
from transformer.sweeps import spec


def _sweep_file(tmp_path, body: str, name: str = "s.py") -> str:
  path = tmp_path / name
  path.write_text("from transformer.sweeps import Row\n" + body)
  return str(path)


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
    assert (small_row.paper_ppl, small_row.paper_bleu) == (
      paper_row.paper_ppl,
      paper_row.paper_bleu,
    )
    config = spec.row_config(small, small_row)
    assert config.dataset == "tatoeba_en_es"
    # (A) keeps h * d_k = d_model, as in the paper.
    if small_row.name.startswith("A"):
      assert config.model.num_heads * config.model.d_k == config.model.d_model
  base = spec.row_config(small, small.rows[0])
  assert base.model.d_model == 256 and base.model.dropout_rate == 0.1
  assert spec.row_config(small, small.rows[PAPER_ROWS.index("D1")]).model.dropout_rate == 0


def test_row_names_must_be_unique(tmp_path, small_corpus):
  path = write_sweep(tmp_path, small_corpus, '[Row("a", {}), Row("a", {"seed": 1})]')
  with pytest.raises(spec.SweepError, match="row 'a' appears twice"):
    spec.load_sweep(path)


def test_load_sweep_names_the_sweep_by_its_file_and_defaults_base_overrides(tmp_path):
  """The sweep's name is the file's stem; BASE_OVERRIDES may be left out."""
  path = _sweep_file(
    tmp_path,
    "BASE_CONFIG = 'configs/default.py'\ndef get_sweep():\n  return [Row('x', {'seed': 1})]\n",
    name="my_sweep.py",
  )
  sweep = spec.load_sweep(path)
  assert (sweep.name, sweep.base_config, sweep.base_overrides) == (
    "my_sweep",
    "configs/default.py",
    {},
  )
  assert sweep.rows == [spec.Row("x", {"seed": 1})]


@pytest.mark.parametrize(
  "body,message",
  [
    ("def get_sweep():\n  return [Row('a', {})]\n", r"BASE_CONFIG = 'FILE\[:ARG\]' is missing"),
    (
      "BASE_CONFIG = ''\ndef get_sweep():\n  return [Row('a', {})]\n",
      r"BASE_CONFIG = 'FILE\[:ARG\]' is missing",
    ),
    ("BASE_CONFIG = 'configs/default.py'\n", r"get_sweep\(\) returning a list of Row is missing"),
    (
      "BASE_CONFIG = 'configs/default.py'\ndef get_sweep():\n  return []\n",
      r"get_sweep\(\) returned no rows",
    ),
    (
      "BASE_CONFIG = 'configs/default.py'\ndef get_sweep():\n  return [('a', {})]\n",
      r"get_sweep\(\) must return Row objects, got \('a', \{\}\)",
    ),
  ],
)
def test_malformed_sweep_file_is_a_one_line_error_naming_the_file(tmp_path, body, message):
  """Each way a sweep file can be malformed fails naming the file and what is wrong."""
  path = _sweep_file(tmp_path, body)
  with pytest.raises(spec.SweepError, match=message) as error:
    spec.load_sweep(path)
  assert str(error.value).startswith(f"{path}: ") and "\n" not in str(error.value)


def test_missing_sweep_file_is_an_error(tmp_path):
  """A sweep path that is not a file fails before any import."""
  missing = str(tmp_path / "nope.py")
  with pytest.raises(spec.SweepError, match=f"^{missing}: no such file$"):
    spec.load_sweep(missing)


def test_shipped_sweep_files_load_from_any_directory(tmp_path, monkeypatch):
  """`--sweep configs/sweeps/table3.py` works outside the repository, as --config does."""
  monkeypatch.chdir(tmp_path)
  sweep = spec.load_sweep("configs/sweeps/table3.py")
  assert sweep.name == "table3" and sweep.rows[0].name == "base"
  assert spec.row_config(sweep, sweep.rows[0]).model.d_model == 512


@pytest.mark.parametrize(
  "name,ok",
  [
    ("A1", True),
    ("big.v2", True),
    ("x_y-z", True),
    ("", False),
    (".hidden", False),
    ("-x", False),
    ("a/b", False),
    ("a b", False),
    ("..", False),
  ],
)
def test_row_names_must_be_directory_names(tmp_path, name, ok):
  """A row name is its workdir's directory name: no separators, no leading dot or dash."""
  path = _sweep_file(
    tmp_path,
    f"BASE_CONFIG = 'configs/default.py'\ndef get_sweep():\n  return [Row({name!r}, {{}})]\n",
  )
  if ok:
    assert [row.name for row in spec.load_sweep(path).rows] == [name]
  else:
    with pytest.raises(spec.SweepError, match="must be letters, digits"):
      spec.load_sweep(path)


@pytest.mark.parametrize(
  "overrides,message",
  [
    (
      {"model.d_fff": 1},
      r"row r: config\.model\.d_fff: unknown key \(did you mean "
      r"config\.model\.d_ff\?\)",
    ),
    ({"model.num_heads": "eight"}, r"row r: config\.model\.num_heads"),
    ({"model.dropout_rate": 1.5}, r"row r: config\.model\.dropout_rate: must be in \[0, 1\)"),
  ],
)
def test_bad_override_is_a_one_line_error(overrides, message):
  sweep = spec.Sweep("s", "configs/default.py", {}, [])
  with pytest.raises(spec.SweepError, match=message):
    spec.row_config(sweep, spec.Row("r", overrides))


def test_bad_base_override_names_the_sweeps_base_overrides():
  """A typo in BASE_OVERRIDES is blamed on BASE_OVERRIDES, not on the row it surfaced in."""
  sweep = spec.Sweep("s", "configs/default.py", {"label_smoothin": 0.2}, [])
  with pytest.raises(
    spec.SweepError,
    match=r"^s BASE_OVERRIDES: config\.label_smoothin: unknown key "
    r"\(did you mean config\.label_smoothing\?\)$",
  ):
    spec.row_config(sweep, spec.Row("r", {}))


def test_row_overrides_apply_after_base_overrides_and_arg_is_passed():
  """BASE_OVERRIDES reach every row, a row's own value wins, FILE:ARG picks the variant."""
  sweep = spec.Sweep("s", "configs/wmt14.py:big", {"label_smoothing": 0.2, "seed": 7}, [])
  plain = spec.row_config(sweep, spec.Row("plain", {}))
  own = spec.row_config(sweep, spec.Row("own", {"label_smoothing": 0.0}))
  assert plain.model.d_model == own.model.d_model == 1024  # :big
  assert (plain.label_smoothing, plain.seed) == (0.2, 7)
  assert (own.label_smoothing, own.seed) == (0.0, 7)


def test_only_picks_rows_and_rejects_unknown_names():
  sweep = spec.load_sweep(TABLE3)
  assert [r.name for r in spec.select_rows(sweep, "C3, A1")] == ["A1", "C3"]
  with pytest.raises(
    spec.SweepError, match=r"no row 'bse' in sweep table3 \(did you mean base\?\)"
  ):
    spec.select_rows(sweep, "A1,bse")


def test_only_empty_means_every_row_and_blank_names_are_ignored():
  """No --only (None or "") is every row; stray commas and spaces are not row names."""
  sweep = spec.load_sweep(TABLE3)
  assert spec.select_rows(sweep, None) == spec.select_rows(sweep, "") == sweep.rows
  assert [r.name for r in spec.select_rows(sweep, " E, ,big,")] == ["E", "big"]


def test_only_gives_no_hint_when_nothing_is_close():
  """The "did you mean" hint appears only for a near miss."""
  sweep = spec.load_sweep(TABLE3)
  with pytest.raises(spec.SweepError) as error:
    spec.select_rows(sweep, "zzzzzz")
  assert str(error.value) == "--only: no row 'zzzzzz' in sweep table3"


def test_config_file_is_found_from_any_directory(tmp_path, monkeypatch):
  """BASE_CONFIG relative to the repo works from elsewhere; one relative to the working
  directory is preferred when it exists; the :ARG part is not part of the path."""
  monkeypatch.chdir(tmp_path)
  sweep = spec.Sweep("s", "configs/wmt14.py:base", {}, [])
  assert spec.config_file(sweep) == os.path.join(REPO, "configs", "wmt14.py")
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "wmt14.py").write_text("")
  assert spec.config_file(sweep) == str(tmp_path / "configs" / "wmt14.py")


def test_missing_base_config_is_a_one_line_sweep_error(tmp_path, monkeypatch):
  """A BASE_CONFIG that names no file is a SweepError quoting it, for the row configs too."""
  monkeypatch.chdir(tmp_path)
  sweep = spec.Sweep("s", "configs/nowhere.py:big", {}, [])
  expected = "BASE_CONFIG 'configs/nowhere.py:big' is not a file"
  with pytest.raises(spec.SweepError) as error:
    spec.config_file(sweep)
  assert str(error.value) == expected
  with pytest.raises(spec.SweepError) as error:
    spec.row_config(sweep, spec.Row("r", {}))
  assert str(error.value) == expected


def test_flag_value_writes_strings_bare_and_other_values_as_repr():
  assert spec.flag_value("learned") == "learned"
  assert [spec.flag_value(v) for v in (0.3, 0.0, 300_000, True, None)] == [
    "0.3",
    "0.0",
    "300000",
    "True",
    "None",
  ]


def test_train_and_eval_args():
  """train.py gets the config FILE:ARG, the workdir and every override (a row's value
  replacing the sweep's); eval.py the final step on validation."""
  sweep = spec.Sweep("s", "configs/wmt14.py:base", {"seed": 1, "label_smoothing": 0.0}, [])
  row = spec.Row("r", {"label_smoothing": 0.2, "model.positional": "learned"})
  assert spec.train_args(sweep, spec.Run(row), "W/r", "/abs/wmt14.py") == [
    "--config",
    "/abs/wmt14.py:base",
    "--workdir",
    "W/r",
    "--config.seed=1",
    "--config.label_smoothing=0.2",
    "--config.model.positional=learned",
  ]
  no_arg = spec.Sweep("s", "configs/default.py", {}, [])
  assert spec.train_args(no_arg, spec.Run(spec.Row("r", {})), "W/r", "/abs/default.py") == [
    "--config",
    "/abs/default.py",
    "--workdir",
    "W/r",
  ]
  config = types.SimpleNamespace(num_train_steps=6, grad_accum_steps=1)
  assert spec.eval_args("W/r", config) == [
    "--workdir", "W/r", "--split", "validation", "--step", "6"
  ]  # fmt: skip
  # With gradient accumulation the final checkpoint is the last batch's step.
  config.grad_accum_steps = 2
  assert spec.eval_args("W/r", config)[-2:] == ["--step", "12"]


def test_train_args_parse_back_to_the_row_config():
  """train.py's --config flags, parsed as train.py parses them, give the validated row
  config: every override's value survives the trip through the command line."""
  sweep = spec.load_sweep(TABLE3)
  for row in spec.select_rows(sweep, "base,A1,C4,D3,E,big"):
    argv = ["train.py"] + spec.train_args(sweep, spec.Run(row), "W", spec.config_file(sweep))
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=flag_values, sys_argv=argv)
    flags.DEFINE_string("workdir", None, "", flag_values=flag_values)
    flag_values(argv)
    parsed = config_lib.flatten(flag_values.config)
    assert parsed == config_lib.flatten(spec.row_config(sweep, row)), row.name


def test_command_line_overrides_change_every_row_over_its_own_values():
  """`--config.num_train_steps=20` shortens every row of a sweep, the one that sets its
  own steps too, and its train.py command carries it last (so it wins there as well)."""
  argv, overrides = spec.split_config_overrides(
    [
      "sweeps",
      "--sweep",
      "s.py",
      "--config.num_train_steps=20",
      "--config.model.scan_layers=false",
      "--config.data_dir=gs://b/tfds",
    ]
  )
  assert argv == ["sweeps", "--sweep", "s.py"]
  sweep = spec.load_sweep(TABLE3)
  sweep = spec.Sweep(sweep.name, sweep.base_config, sweep.base_overrides, sweep.rows, overrides)
  for row in spec.select_rows(sweep, "base,big"):
    config = spec.row_config(sweep, row)
    assert (config.num_train_steps, config.model.scan_layers, config.data_dir) == (
      20,
      False,
      "gs://b/tfds",
    )
    assert spec.train_args(sweep, spec.Run(row), "W", "c.py")[-3:] == [
      "--config.num_train_steps=20",
      "--config.model.scan_layers=false",
      "--config.data_dir=gs://b/tfds",
    ]
  with pytest.raises(spec.SweepError, match="^--config.seed: write --config.KEY=VALUE"):
    spec.split_config_overrides(["--config.seed", "3"])
  bad = spec.Sweep(sweep.name, sweep.base_config, {}, sweep.rows, {"num_train_step": "2"})
  with pytest.raises(spec.SweepError, match="^command line: config.num_train_step: unknown"):
    spec.row_config(bad, sweep.rows[0])
