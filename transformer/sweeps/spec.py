"""The sweep file format: named rows of config overrides on one base config.

A sweep file is plain Python (see configs/sweeps/table3.py): `BASE_CONFIG =
"FILE[:ARG]"`, optionally `BASE_OVERRIDES = {dotted key: value}` for every row and
`AVERAGE_LAST = K` (the final evaluation averages the last K checkpoints, as the paper
does; default 1, the last checkpoint alone), and `get_sweep()` returning a list of `Row`s
(`from transformer.sweeps import Row`); a Row may name its seeds, one run for each.
Every row's config is built and validated before any row trains, so a typo in the last
row fails in one line before the first row starts.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from typing import Any

import ml_collections

from transformer import config as config_lib
from transformer.messages import did_you_mean

_ROW_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # each row is a directory name


class SweepError(ValueError):
  """A sweep that cannot run as written; the message names the row or the file."""


@dataclasses.dataclass(frozen=True)
class Row:
  """One run of a sweep: config overrides (dotted keys) and the paper's numbers for it.

  paper_ppl and paper_bleu are the published dev perplexity and BLEU, paper_params_m the
  parameter count in millions; None where the paper gives none. seeds: the config.seed
  of each run of the row; a row with seeds runs each in WORKDIR/<row>/seed<k>, one
  without runs once, with the config's seed, in WORKDIR/<row>.
  """

  name: str
  overrides: dict
  paper_ppl: float | None = None
  paper_bleu: float | None = None
  paper_params_m: float | None = None
  seeds: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Sweep:
  name: str  # the sweep file's stem: names the collected table and plot
  base_config: str  # FILE[:ARG], as train.py's --config takes it
  base_overrides: dict
  rows: list
  # `--config.KEY=VALUE` of the sweep's command line, as typed: over every row's own.
  command_line_overrides: dict = dataclasses.field(default_factory=dict)
  average_last: int = 1  # checkpoints the final evaluation averages


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run of a row: the row at one seed (None: the config's own seed)."""

  row: Row
  seed: int | None = None

  @property
  def name(self) -> str:
    return self.row.name if self.seed is None else f"{self.row.name} seed {self.seed}"

  def directory(self, workdir: str) -> str:
    """WORKDIR/<row> for a row without seeds, WORKDIR/<row>/seed<k> for one with."""
    row_dir = f"{workdir.rstrip('/')}/{self.row.name}"
    return row_dir if self.seed is None else f"{row_dir}/seed{self.seed}"


def runs(rows: list[Row]) -> list[Run]:
  """Every run of the rows, a pass over the rows per seed: each row's first seed (or its
  one run), then each row's second, and so on. A study stopped part way then holds the
  whole table at fewer seeds, not some rows at every seed and the rest at none."""
  seeded = [[Run(row, seed) for seed in (row.seeds or (None,))] for row in rows]
  passes = max((len(r) for r in seeded), default=0)
  return [r[k] for k in range(passes) for r in seeded if k < len(r)]


def split_config_overrides(argv: list[str]) -> tuple[list[str], dict[str, str]]:
  """Takes `--config.KEY=VALUE` arguments out of a command line: (the others, {KEY: VALUE})."""
  rest, overrides = [], {}
  for arg in argv:
    if not arg.startswith("--config."):
      rest.append(arg)
    elif "=" not in arg:
      raise SweepError(f"{arg}: write --config.KEY=VALUE, with '='")
    else:
      key, _, value = arg[len("--config.") :].partition("=")
      overrides[key] = value
  return rest, overrides


def _typed(key: str, value: str, current: Any) -> Any:
  """A command line's VALUE as the type of the key's current value, as train.py reads it."""
  if isinstance(current, bool):
    if value.lower() not in ("true", "false"):
      raise config_lib.ConfigError(f"config.{key}: {value!r} is not true or false")
    return value.lower() == "true"
  if isinstance(current, str):
    return value
  try:
    return ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return value  # left for the config's own type check to name


def load_sweep(path: str) -> Sweep:
  """Reads a sweep file and checks its shape: base config, unique row names."""
  try:  # relative to the working directory, else to the repository
    resolved = config_lib.resolve_config_file(path)
  except config_lib.ConfigError:
    raise SweepError(f"{path}: no such file") from None
  module = config_lib.import_file(resolved, prefix="sweep")
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
    seeds = row.seeds
    if seeds is not None and (
      not seeds
      or len(set(seeds)) != len(seeds)
      or not all(isinstance(s, int) and s >= 0 for s in seeds)
    ):
      raise SweepError(f"{path}: row {row.name}: seeds {seeds!r} must be distinct integers >= 0")
  average_last = getattr(module, "AVERAGE_LAST", 1)
  if not isinstance(average_last, int) or average_last < 1:
    raise SweepError(f"{path}: AVERAGE_LAST = {average_last!r} must be an integer >= 1")
  name = os.path.splitext(os.path.basename(path))[0]
  return Sweep(
    name,
    base_config,
    dict(getattr(module, "BASE_OVERRIDES", {})),
    rows,
    average_last=average_last,
  )


def select_rows(sweep: Sweep, only: str | None) -> list[Row]:
  """The rows named in a comma-separated list (all rows when empty), in sweep order."""
  if not only:
    return list(sweep.rows)
  wanted = [name.strip() for name in only.split(",") if name.strip()]
  known = {row.name for row in sweep.rows}
  for name in wanted:
    if name not in known:
      raise SweepError(f"--only: no row {name!r} in sweep {sweep.name}{did_you_mean(name, known)}")
  return [row for row in sweep.rows if row.name in wanted]


def config_file(sweep: Sweep) -> str:
  """The absolute path of the sweep's base config file (relative to the cwd or the repo)."""
  try:
    return config_lib.resolve_config_file(sweep.base_config.partition(":")[0])
  except config_lib.ConfigError:
    raise SweepError(f"BASE_CONFIG {sweep.base_config!r} is not a file") from None


def row_config(sweep: Sweep, row: Row) -> ml_collections.ConfigDict:
  """The base config with the sweep's and the row's overrides applied, validated."""
  path, arg = config_file(sweep), sweep.base_config.partition(":")[2]
  config = config_lib.load_config(f"{path}:{arg}" if arg else path)
  for where, overrides in (
    (f"{sweep.name} BASE_OVERRIDES", sweep.base_overrides),
    (f"row {row.name}", row.overrides),
    ("command line", sweep.command_line_overrides),
  ):
    try:
      if overrides is sweep.command_line_overrides:
        current = config_lib.flatten(config)
        overrides = {k: _typed(k, v, current.get(k)) for k, v in overrides.items()}
      config_lib.apply_overrides(config, overrides)
    except config_lib.ConfigError as e:
      raise SweepError(f"{where}: {e}") from None
  try:
    config_lib.validate(config)
  except config_lib.ConfigError as e:
    raise SweepError(f"row {row.name}: {e}") from None
  return config


def flag_value(value: Any) -> str:
  """A value as ml_collections parses it back from --config.KEY=VALUE."""
  return value if isinstance(value, str) else repr(value)


def train_args(sweep: Sweep, run: Run, workdir: str, config_path: str) -> list[str]:
  """train.py's arguments for a run of a row (without `python train.py`)."""
  overrides = {**sweep.base_overrides, **run.row.overrides}
  if run.seed is not None:
    overrides["seed"] = run.seed
  _, _, arg = sweep.base_config.partition(":")
  config = f"{config_path}:{arg}" if arg else config_path
  return (
    ["--config", config, "--workdir", workdir]
    + [f"--config.{k}={flag_value(v)}" for k, v in overrides.items()]
    + [f"--config.{k}={v}" for k, v in sweep.command_line_overrides.items()]
  )


def eval_args(workdir: str, config: ml_collections.ConfigDict, average_last: int = 1) -> list[str]:
  """eval.py's arguments: the whole validation split at the final checkpoint, averaged
  with the checkpoints before it when average_last > 1 (the sweep's AVERAGE_LAST)."""
  step = config_lib.final_step(config)
  args = ["--workdir", workdir, "--split", "validation", "--step", str(step)]
  return args + (["--average_last", str(average_last)] if average_last > 1 else [])
