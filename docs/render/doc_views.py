"""The result records of docs/results/, and the views `make docs` renders from them.

A view is a function decorated with @view, named in a region of README, docs/ or a
config's docstring (`<!-- results:NAME -->`, see render_docs.py). It reads its records,
keeps the newest record of each fact, and ends with where the figures came from
(`source`): the record file, the machine, the date, the commit and the command. The
prose around a table lives in the page, outside the region; a view renders figures.
"""

from __future__ import annotations

import json
import os
import statistics
import textwrap
from collections.abc import Callable, Iterable, Sequence
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_DIR = os.path.join(REPO_ROOT, "docs", "results")
PROVENANCE_KEYS = ("machine", "date", "commit", "command")

Record = dict[str, Any]
_VIEWS: dict[str, Callable[[], str]] = {}


class RecordError(ValueError):
  """A record file, record or region that cannot be rendered; the message names it."""


def view(function: Callable[[], str]) -> Callable[[], str]:
  """Makes a function a view, rendered in the regions that name it."""
  _VIEWS[function.__name__] = function
  return function


def views() -> dict[str, Callable[[], str]]:
  """Every view, by the name regions use."""
  return dict(_VIEWS)


def read_records(name: str, results_dir: str | None = None) -> list[Record]:
  """The records of docs/results/NAME.jsonl, in file order, each checked for provenance."""
  path = os.path.join(results_dir or RESULTS_DIR, f"{name}.jsonl")
  if not os.path.exists(path):
    raise RecordError(f"no record file {os.path.relpath(path, REPO_ROOT)}")
  records = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{os.path.relpath(path, REPO_ROOT)}:{number}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise RecordError(f"{where}: not JSON ({e})") from None
      missing = [key for key in PROVENANCE_KEYS if not record.get(key)]
      if missing:
        raise RecordError(f"{where}: the record has no {', '.join(missing)}")
      records.append(record)
  return records


def latest(records: Iterable[Record], key: Callable[[Record], Any]) -> list[Record]:
  """The newest record of each fact (records with equal key(record)), in the order the
  facts first appear."""
  return list({key(r): r for r in records}.values())  # a dict keeps a key's first position


def one_sitting(records: list[Record]) -> list[Record]:
  """The runs made at the newest record's commit, in file order (older ones are history).
  `abc1234-dirty` counts as abc1234: a run of one sitting finds the records file its
  earlier runs appended to uncommitted."""
  commit = lambda r: r["commit"].removesuffix("-dirty")
  return [r for r in records if commit(r) == commit(records[-1])]


# (record file, record, shown as dated history) per record the view that shown() renders
# names; None outside shown().
_shown: list[tuple[str, Record, bool]] | None = None


def shown(view: Callable[[], str]) -> list[tuple[str, Record, bool]]:
  """What a view shows: (record file, record, as dated history) per record it names."""
  global _shown
  _shown = []
  try:
    view()
    return _shown
  finally:
    _shown = None


def cite(name: str, records: Sequence[Record], history: bool = False) -> None:
  """Names the records a view shows (source does it too): as current figures, which must
  be of their producer's RECORD_VERSION (record_sources.py), or as dated history, each
  labelled with its commit where it is shown."""
  if _shown is not None:
    _shown.extend((name, r, history) for r in records)


def source(name: str, records: Sequence[Record], history: bool = False) -> str:
  """One line: the record file, and each distinct machine, date, commit and command."""
  cite(name, records, history)
  distinct = lambda key: list(dict.fromkeys(str(r[key]) for r in records))
  commands = distinct("command")
  parts = [f"`docs/results/{name}.jsonl`", "; ".join(distinct("machine"))]
  parts += [", ".join(distinct("date")), "commit " + ", ".join(distinct("commit"))]
  parts.append(f"`{commands[0]}`" if len(commands) == 1 else "each row's command is in its record")
  quoted: dict[str, list[str]] = {}  # a page -> its commits ("PAGE at COMMIT (...)")
  for r in (r for r in records if "source" in r):
    where, _, commit = r["source"].split(" (")[0].partition(" at ")
    quoted.setdefault(where, [])
    quoted[where] += [] if commit in quoted[where] else [commit]
  if quoted:
    pages = "; ".join(f"{where} at {', '.join(commits)}" for where, commits in quoted.items())
    parts.append("figures first quoted in " + pages)
  if history:
    parts.append("dated: each figure as of its own commit")
  return "<sub>Records: " + "; ".join(parts) + ".</sub>"


# Formatting.


def table(headers: str | Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
  """A Markdown table; headers as a sequence or one string, "a|b|c"."""
  headers = headers.split("|") if isinstance(headers, str) else headers
  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def columns(records: Iterable[Any], cells: dict[str, Callable[[Any], Any]]) -> str:
  """A Markdown table of one row per record: {header: the record's cell}."""
  return table(list(cells), [[cell(r) for cell in cells.values()] for r in records])


def _thousands(value: float, digits: int = 0) -> str:
  return f"{value:,.{digits}f}"


def _percent(value: float) -> str:
  return f"{100 * value:.1f}%"


def _ms(seconds: float, digits: int = 1) -> str:
  return f"{seconds * 1e3:,.{digits}f} ms"


def _minutes(seconds: float) -> str:
  return f"{int(seconds // 60)}m{int(round(seconds % 60)):02d}s"


def _runs(values: Sequence[float], fmt: Callable[[float], str] | str, unit: str = "") -> str:
  """'median (run, run, run) unit'; fmt a function or a format spec ('.2f')."""
  fmt = fmt if callable(fmt) else (lambda v, spec=fmt: format(v, spec))
  runs = ", ".join(fmt(v) for v in values)
  return f"{fmt(statistics.median(values))} ({runs}){' ' + unit if unit else ''}"


def _scientific(value: float) -> str:
  """4.06e8, as the paper writes FLOPs."""
  mantissa, exponent = f"{value:.2e}".split("e")
  return f"{mantissa}e{int(exponent)}"


def _optional(value: float | None, fmt: Callable[[float], str] | str) -> str:
  return "" if value is None else fmt(value) if callable(fmt) else format(value, fmt)


def _median(records: Iterable[Record], key: str) -> float:
  return statistics.median(r[key] for r in records)


# README and configs/default.py: what `make train` and `make test` reach.


@view
def make_train() -> str:
  r = read_records("make_train")[-1]
  low, high = r["tokens_per_sec_windows"]
  per_step = _thousands(round(r["tokens_per_sec"] / r["steps_per_sec"], -2))
  split = f"{r['split']} split"
  rows = [
    (
      "time (install done, vocabulary cached)",
      f"{_minutes(r['wall_time_s'])}, of which training {_minutes(r['train_time_s'])} "
      f"({r['num_train_steps']:,} steps of about {per_step} real target tokens)",
    ),
    (
      "training throughput (median logged window)",
      f"{_thousands(r['tokens_per_sec'])} target tokens/s ({_thousands(low)} to "
      f"{_thousands(high)}), MFU {_percent(r['mfu'])}, HFU {_percent(r['hfu'])}",
    ),
    (
      f"{split} ({r['num_sentences']:,} sentences), beam {r['beam_size']}, alpha {r['alpha']}",
      f"**sacreBLEU {r['bleu']:.2f}**, tokenized BLEU {r['bleu_tok']:.2f}, chrF {r['chrf']:.2f}",
    ),
    (f"{split} perplexity (unsmoothed)", f"{r['ppl']:.2f}"),
  ]
  if "validation_ppl" in r:  # the run's last validation, in records made by --from_workdir
    rows.append(("validation perplexity, last step (unsmoothed)", f"{r['validation_ppl']:.2f}"))
  rows.append(
    ("test decoding speed (compiles included)", f"{r['sentences_per_sec']:.1f} sentences/s")
  )
  return (
    table("`make train`|result", rows)
    + f"\n\nIts last line: `sacreBLEU {r['bleu']:.2f}  {r['bleu_signature']}`\n\n"
    + source("make_train", [r])
  )


@view
def make_train_expected() -> str:
  r = read_records("make_train")[-1]
  cite("make_train", [r])
  return textwrap.fill(
    f"sacreBLEU {r['bleu']:.2f} (tokenized BLEU {r['bleu_tok']:.2f}) on the "
    f"{r['num_sentences']:,}-sentence {r['split']} split, perplexity {r['ppl']:.2f} there; "
    f"{r['num_train_steps']:,} steps in {_minutes(r['train_time_s'])} on a {r['machine']} "
    f"({r['date']}, commit {r['commit']}; docs/results/make_train.jsonl).",
    width=88,
  )


@view
def make_test() -> str:
  """The suite's size and time, as of the commit it names (dated: it has no producer)."""
  r = read_records("make_test")[-1]
  cite("make_test", [r], history=True)
  low, high = r["wall_time_min_range"]
  minutes = f"{low} minutes" if low == high else f"{low} to {high} minutes"
  install = "install included" if r["install_included"] else "with the install already done"
  return (
    f"`make test` runs the full suite, as CI does: {r['tests']} tests in {minutes}, "
    f"{install}, on a {r['machine']} ({r['date']}, commit {r['commit']}; "
    "`docs/results/make_test.jsonl`)."
  )


# docs/performance.md: bench on this CPU.


def _by_label(name: str, kind: str) -> dict[str, Record]:
  """The newest record of each label; one that lacks the run-wide figures gets them from
  its run's peak record (the same label, just before it in the file)."""
  records, peaks = [], {}
  for r in read_records(name):
    if r["name"] == "peak":
      peaks[r.get("label")] = r
    elif r["name"] == kind:
      peak = peaks.get(r.get("label"), {})
      run_wide = ("peak_flops_per_sec", "host_memory_retained")
      records.append({**{k: peak[k] for k in run_wide if k in peak}, **r})
  return {r["label"]: r for r in latest(records, key=lambda r: r["label"])}


# bench/cpu.sh's labels: what each row is (records of other labels are not shown).
_CPU_STEP_ROWS = {
  "base": "wmt14 base (`configs/wmt14.py`, scanned layers)",
  "base-glibc_default": "... with `TRANSFORMER_RETAIN_FREED_MEMORY=0`",
  "base-unscanned": "wmt14 base, `model.scan_layers=false`",
  "base-unsafe_rbg": "wmt14 base, `dropout_rng_impl=unsafe_rbg`",
  "base-attention_xla": "wmt14 base, `model.attention_kernel=xla`",
  "base-remat_full": "wmt14 base, `model.remat=full`",
  "big": "wmt14 big, 4 x 64 tokens",
  "default": "default (Tatoeba), 16 x 64 tokens",
  "default-train-shape": "default, 17 x 64 tokens: the step `make train` runs",
}


def _median_of(record: Record, key: str) -> float | None:
  """A record's figure, or the median of its runs (`KEY_runs`), or None."""
  runs = record.get(key + "_runs")
  return record[key] if record.get(key) is not None else statistics.median(runs) if runs else None


@view
def cpu_train_step() -> str:
  by_label = _by_label("cpu", "train_step")
  shown = [by_label[label] for label in _CPU_STEP_ROWS if label in by_label]
  cells = {
    "run": lambda r: _CPU_STEP_ROWS[r["label"]],
    "measured": lambda r: f"{r['date']}, {r['commit']}",
    "compile": lambda r: _optional(r.get("compile_s"), lambda v: f"{v:.1f} s"),
    "step (median)": lambda r: _optional(_median_of(r, "step_time_s"), lambda v: _ms(v, 0)),
    "target tokens/s": lambda r: _optional(_median_of(r, "tokens_per_sec"), _thousands),
    "MFU": lambda r: _optional(r.get("mfu"), _percent),
    "peak in that run": lambda r: _optional(
      r.get("peak_flops_per_sec"), lambda v: f"{v / 1e9:.1f} GFLOP/s"
    ),
    "freed host memory": lambda r: "kept" if r["host_memory_retained"] else "returned",
  }
  return columns(shown, cells) + "\n\n" + source("cpu", shown)


def _beam_search(b: Record, on: str, ms_digits: int, per_sec: str, note: str = "") -> str:
  """A bench beam_search record in one sentence; per_sec formats its sentences/s."""
  return (
    f"Beam search on {on} (beam {b['beam_size']}, {b['sentences']} sentences, {b['steps']} "
    f"output tokens each, with the cache{note}"
    f"): {_ms(b['step_time_s'], ms_digits)} per step, {_thousands(b['tokens_per_sec'])} "
    f"output tokens/s, {format(b['sentences_per_sec'], per_sec)} sentences/s."
  )


@view
def cpu_default_beam_search() -> str:
  beam = _by_label("cpu", "beam_search")["default"]
  return _beam_search(beam, "the default model", 0, ".1f") + "\n\n" + source("cpu", [beam])


@view
def compile_depth() -> str:
  by_label = _by_label("cpu", "train_step")
  runs = {n: [by_label[f"compile-N{n}-scan_{s}"] for s in ("false", "true")] for n in (2, 12)}
  rows = [(f"N = {n}", *(f"{r['compile_s']:.1f} s" for r in pair)) for n, pair in runs.items()]
  unrolled, scanned = runs[12]
  return (
    table("layers per stack|compile, unrolled layers|compile, `scan_layers=true`", rows)
    + f"\n\nAt N = 12 the scanned step also ran faster: {_ms(scanned['step_time_s'], 0)} "
    f"against {_ms(unrolled['step_time_s'], 0)}.\n\n"
    + source("cpu", [r for pair in runs.values() for r in pair])
  )


_KEPT = "kept (the default on CPU)"
_RETURNED = "returned (`TRANSFORMER_RETAIN_FREED_MEMORY=0`)"


@view
def host_memory() -> str:
  """The base step with freed memory kept and returned: every run of each label at the
  newest commit it was measured at (one sitting)."""
  steps = [r for r in read_records("cpu") if r["name"] == "train_step"]
  kept, returned = (
    one_sitting([r for r in steps if r["label"] == label])
    for label in ("base", "base-glibc_default")
  )

  def row(what: str, chosen: list[Record]) -> tuple:
    kernel_s = sorted((f"{r['host_kernel_s_per_step']:.2f}" for r in chosen), key=float)
    return (
      what,
      _runs([r["step_time_s"] for r in chosen], lambda s: _thousands(1e3 * s), "ms"),
      _runs([r["tokens_per_sec"] for r in chosen], _thousands),
      _thousands(_median(chosen, "host_page_faults_per_step")),
      f"{kernel_s[0]} s" if kernel_s[0] == kernel_s[-1] else f"{kernel_s[0]} to {kernel_s[-1]} s",
      f"{_median(chosen, 'peak_rss_bytes') / 1e9:.2f} GB",
    )

  gain = 1 - _median(kept, "step_time_s") / _median(returned, "step_time_s")
  memory = _median(kept, "peak_rss_bytes") / _median(returned, "peak_rss_bytes")
  headers = (
    "freed memory|step: median (each run)|target tokens/s|host page faults per step (median)"
    "|kernel time per step|peak resident memory (median)"
  )
  return (
    table(headers, [row(_KEPT, kept), row(_RETURNED, returned)])
    + f"\n\nKept, the step takes {100 * gain:.0f}% less time, for "
    f"{100 * (memory - 1):.0f}% more peak resident memory.\n\n" + source("cpu", kept + returned)
  )


@view
def host_memory_input_pipeline() -> str:
  pipelines = _by_label("host_memory", "input_pipeline")
  kept, returned = pipelines["default-retain_freed_memory"], pipelines["default-glibc_default"]
  less = 1 - statistics.median(kept["tokens_per_sec_runs"]) / statistics.median(
    returned["tokens_per_sec_runs"]
  )
  return (
    f"The default's input pipeline delivered {_runs(kept['tokens_per_sec_runs'], _thousands)}"
    f" tokens/s with the options and {_runs(returned['tokens_per_sec_runs'], _thousands)} "
    f"without: {100 * less:.0f}% less with the single arena.\n\n"
    + source("host_memory", [kept, returned])
  )


@view
def train_loop() -> str:
  records = one_sitting([r for r in read_records("host_memory") if r["name"] == "train_loop"])
  rows = []
  for label, what in (
    ("default-train_loop", _KEPT),
    ("default-train_loop-glibc_default", _RETURNED),
  ):
    runs = [r for r in records if r["label"] == label]
    ratios = sorted(r["efficiency"] for r in runs)
    loop, bare = _median(runs, "loop_steps_per_sec"), _median(runs, "bare_steps_per_sec")
    ratio = f"{_median(runs, 'efficiency'):.0%} ({ratios[0]:.0%} to {ratios[-1]:.0%})"
    rows.append((what, len(runs), f"{loop:.2f}", f"{bare:.2f}", ratio))
  headers = (
    "freed host memory|runs|loop, steps/s (median)|bare step, steps/s (median)"
    "|loop / bare: median (range)"
  )
  return table(headers, rows) + "\n\n" + source("host_memory", records)


@view
def restore_memory() -> str:
  """tools.restore_memory: host memory and time of restoring averaged parameters, the
  parameters alone against whole train states, the newest sitting's processes."""
  sitting = one_sitting(read_records("restore_memory"))
  records = [r for r in sitting if r["num_params"] == sitting[-1]["num_params"]]
  ways = {
    "params_only": "parameters only, part by part, into one running sum (today)",
    "full_state": "whole train states, moments thrown away (before)",
  }
  rows = []
  for way in dict.fromkeys(r["way"] for r in records):
    runs = [r for r in records if r["way"] == way]
    gib = lambda key, runs=runs: _runs([r[key] / 2**30 for r in runs], ".2f", "GiB")
    rows.append(
      (
        ways[way],
        gib("held_by_restore_bytes"),
        gib("peak_rss_bytes"),
        _runs([r["restore_s"] for r in runs], ".1f", "s"),
      )
    )
  r = records[0]
  return (
    f"The mean of {r['average_last']} checkpoints of a {r['num_params'] / 1e6:,.1f}M-"
    f"parameter model (parameters {r['params_bytes'] / 2**30:.2f} GiB, train state "
    f"{r['state_bytes'] / 2**30:.2f} GiB, float32), each way in a fresh process:\n\n"
    + table("restore|held by the restore at its peak|peak resident|time", rows)
    + "\n\n"
    + source("restore_memory", records)
  )


@view
def checkpoint_saves() -> str:
  """tools.restore_memory's saves: a whole train state written, per model of the newest
  sitting (what a preemption notice's margin must hold, docs/clusters.md)."""
  models: dict[int, Record] = {}
  for r in one_sitting(read_records("restore_memory")):
    models.setdefault(r["num_params"], r)  # the same checkpoints for both ways
  cells = {
    "parameters": lambda r: f"{r['num_params'] / 1e6:,.1f}M",
    "train state (GiB)": lambda r: f"{r['state_bytes'] / 2**30:.2f}",
    "one save: median (each)": lambda r: _runs(r["save_s"], ".1f", "s"),
    "MB/s": lambda r: f"{r['state_bytes'] / statistics.median(r['save_s']) / 1e6:,.0f}",
  }
  return columns(models.values(), cells) + "\n\n" + source("restore_memory", list(models.values()))


@view
def memory_per_mesh() -> str:
  records = latest(read_records("memory"), key=lambda r: (r["data"], r["fsdp"], r["tensor"]))
  kinds = ("state", "argument", "output", "temp", "temp_propagated")
  rows = [
    (r["data"], r["fsdp"], r["tensor"], *(f"{r[k] / 2**20:,.1f}" for k in kinds)) for r in records
  ]
  return (
    f"{records[0]['rows']} x {records[0]['seq_len']} source and target tokens per step; MiB "
    "per device:\n\n"
    + table("data|fsdp|tensor|state|argument|output|temp|temp, propagation only", rows)
    + "\n\n"
    + source("memory", records)
  )


def _side_by_side(kind: str) -> str:
  records = [r for r in read_records("flax_side_by_side") if r["kind"] == kind]
  chosen = [r for r in records if r["sitting"] == max(r["sitting"] for r in records)]
  fmt = _thousands if kind == "train_step" else ".2f"
  rows = []
  for r in chosen:
    ours = statistics.median(r["project_runs"])
    row = [r["layers"], _runs(r["project_runs"], fmt), _runs(r["flax_runs"], fmt)]
    row.append(f"**{ours / statistics.median(r['flax_runs']):.2f}x**")
    if "flax_same_glibc_runs" in r:
      same = statistics.median(r["flax_same_glibc_runs"])
      row += [_runs(r["flax_same_glibc_runs"], fmt), f"{ours / same:.2f}x"]
    rows.append(row)
  headers = ["layers", f"this project, {chosen[0]['unit']}", "Flax example", "ratio"]
  headers += ["Flax example, same glibc options", "ratio"] if len(rows[0]) > 4 else []
  return table(headers, rows) + "\n\n" + source("flax_side_by_side", chosen)


@view
def flax_train_step() -> str:
  return _side_by_side("train_step")


@view
def flax_beam_search() -> str:
  return _side_by_side("beam_search")


# bench/gpu.sh's labels: what each row changes from the WMT config as it is.
_GPU_ROWS = {
  "base": "base, the config (`auto`)",
  "big": "big, the config (`auto`)",
  "base-f32": "base, `model.dtype=float32`",
  "big-f32": "big, `model.dtype=float32`",
  "base-bf16-einsum": "base, bf16, `model.attention_kernel=einsum`",
  "big-bf16-einsum": "big, bf16, `model.attention_kernel=einsum`",
  "big-noremat": "big, the config, `model.remat=none`",
}


@view
def gpu_train_step() -> str:
  """bench/gpu.sh's newest sitting: the WMT steps on one GPU at the paper's batch, with
  the TPU prediction for the same configs beside them."""
  sitting = one_sitting(read_records("gpu"))
  steps = [r for r in sitting if r["name"] == "train_step"]
  beams = [r for r in sitting if r["name"] == "beam_search"]
  peak = {r["label"]: r for r in sitting if r["name"] == "peak"}[steps[0]["label"]]
  cells = {
    "run": lambda r: _GPU_ROWS.get(r["label"], r["label"]),
    "dtype, attention": lambda r: f"{r['dtype']}, {r['attention_kernel']}",
    "step (median)": lambda r: _ms(r["step_time_s"]),
    "target tokens/s": lambda r: _thousands(r["tokens_per_sec"]),
    "MFU": lambda r: _percent(r["mfu"]),
    "peak GPU memory": lambda r: f"{r['peak_memory_bytes'] / 2**30:.1f} GiB",
    "compile": lambda r: f"{r['compile_s']:.0f} s",
  }
  beam_lines = "".join(
    _beam_search(b, b["label"], 1, ".0f", ", untrained parameters") + "\n\n" for b in beams
  )
  profiles = _v5e8_profiles()
  predicted = "; ".join(
    f"{_model(p)} {_thousands(p['rows'] * p['seq_len'] / p['profile']['step_s'] / p['chips'])}"
    f" target tokens/s per chip ({p['profile']['mfu']:.0%} MFU)"
    for p in profiles
  )
  versions = steps[0]["versions"]
  return (
    f"One {peak['device']}, the paper's batch (96 x 256 target tokens a step), "
    f"jax {versions['jax']} and flax {versions['flax']}; MFU against the datasheet's dense "
    f"bf16 peak, {peak['peak_flops_per_sec'] / 1e12:.0f} TFLOP/s; measured:\n\n"
    + columns(steps, cells)
    + "\n\n"
    + beam_lines
    + "Beside them, predicted for a TPU by the per-op profile (v5e-8, float32, the "
    f"config's mesh; not measured): {predicted}.\n\n"
    + source("gpu", steps + beams)  # a peak record's "source" names its peak's, not a page
    + "\n"
    + source("compile_check", profiles)
  )


# docs/reproduce.md: the paper's tables, and the sweeps at CPU scale.


def _training_flops(record: Record, tokens_per_step: float = 25_000) -> float:
  steps = record["overrides"].get("num_train_steps", 100_000)
  return record["flops_per_token"] * tokens_per_step * steps


def _paper_rows(sweep: str) -> dict[str, Any]:
  from transformer.sweeps.spec import load_sweep

  return {row.name: row for row in load_sweep(f"configs/sweeps/{sweep}.py").rows}


_PPL = {"validation ppl": lambda r: f"{r['ppl']:.2f}"}


def _bleu(records: list[Record]) -> dict[str, Callable[[Record], str]]:
  """A sweep's BLEU column, over the first validation sentences its records name."""
  header = f"BLEU (first {records[0]['bleu_sentences']} validation sentences)"
  return {header: lambda r: f"{r['bleu']:.2f}"}


@view
def table3() -> str:
  paper = _paper_rows("table3")
  records = latest(read_records("table3_dry_run"), key=lambda r: r["name"])
  overrides = lambda r: " ".join(f"{k}={v}" for k, v in r["overrides"].items()) or "(none)"
  cells = {
    "row": lambda r: r["name"],
    "train.py overrides of `configs/wmt14.py:base`": lambda r: f"`{overrides(r)}`",
    "paper PPL": lambda r: _optional(paper[r["name"]].paper_ppl, ".2f"),
    "paper BLEU": lambda r: _optional(paper[r["name"]].paper_bleu, ".1f"),
    "paper params": lambda r: _optional(r["paper_params_m"], lambda v: f"{v}M"),
    "our params": lambda r: f"{r['num_params'] / 1e6:.1f}M",
    "FLOPs / target token": lambda r: _scientific(r["flops_per_token"]),
  }
  return columns(records, cells) + "\n\n" + source("table3_dry_run", records)


@view
def table3_cost() -> str:
  """Parameter counts against the paper's, and training FLOPs, from the dry run."""
  from transformer import config as config_lib

  records = latest(read_records("table3_dry_run"), key=lambda r: r["name"])
  by_name = {r["name"]: r for r in records}
  compared = [
    (r["num_params"] / (r["paper_params_m"] * 1e6) - 1, r["name"])
    for r in records
    if r["paper_params_m"]
  ]
  furthest, furthest_name = max(compared, key=lambda c: abs(c[0]))
  hundred_k = [r for r in records if "num_train_steps" not in r["overrides"]]
  cheapest, dearest = min(hundred_k, key=_training_flops), max(hundred_k, key=_training_flops)
  flops = lambda r: _scientific(_training_flops(r))
  # The WMT configs' steps on one GPU, as bench/gpu.sh measured them, priced at each
  # config's num_train_steps.
  gpu = {r["label"]: r for r in one_sitting(read_records("gpu")) if r["name"] == "train_step"}
  hours = {
    m: config_lib.load_config(f"configs/wmt14.py:{m}").num_train_steps
    * gpu[m]["step_time_s"]
    / 3600
    for m in ("base", "big")
  }
  device = read_records("gpu")[-1]["machine"].split(" (")[0].removeprefix("one ")
  return (
    f"Every row's parameter count is within {100 * abs(furthest):.0f}% of the paper's "
    f"({furthest_name} is the furthest, {100 * furthest:+.1f}%). By our FLOP count a "
    f"100K-step row at 25,000 target tokens per step is about {flops(by_name['base'])} "
    f"FLOPs (base; from {flops(cheapest)} for {cheapest['name']} to {flops(dearest)} for "
    f"{dearest['name']}), big about {flops(by_name['big'])}, and the whole table about "
    f"{_scientific(sum(_training_flops(r) for r in records))}. On one {device}, at the "
    "steps bench/gpu.sh measured there (96 x 256 target tokens, the configs' bf16 and "
    'cuDNN attention; docs/performance.md, "GPU"), base\'s 100K steps take about '
    f"{hours['base']:.1f} hours and big's 300K about {hours['big']:.1f}: the "
    "measured step times the steps, with no input pipeline, evaluation or checkpoints.\n\n"
    + source("table3_dry_run", records)
    + "\n"
    + source("gpu", [gpu["base"], gpu["big"]])
  )


@view
def table3_small() -> str:
  paper = _paper_rows("table3_small")
  records = latest(read_records("table3_small"), key=lambda r: r["row"])
  base = next(r for r in records if r["row"] == "base")
  change = lambda v, ref: "" if v is None or ref is None else f"{100 * (v / ref - 1):+.0f}%"
  cells = {
    "row": lambda r: r["row"],
    "changed values": lambda r: r["changed"],
    "params (M)": lambda r: f"{r['num_params'] / 1e6:.1f}",
    **_PPL,
    "ppl vs base": lambda r: change(r["ppl"], base["ppl"]),
    **_bleu(records),
    "paper ppl": lambda r: _optional(paper[r["row"]].paper_ppl, ".2f"),
    "paper ppl vs base": lambda r: change(paper[r["row"]].paper_ppl, paper["base"].paper_ppl),
    "paper BLEU": lambda r: _optional(paper[r["row"]].paper_bleu, ".1f"),
  }
  return columns(records, cells) + "\n\n" + source("table3_small", records)


@view
def table3_converged() -> str:
  """Each row of the converged study over its seeds (transformer/sweeps/aggregate.py, as
  `--collect --records` writes it): mean and spread, the change against base at the same
  seed with its interval, the paired bootstrap of BLEU, and whether it agrees with the
  paper; the runs not recorded yet named below."""
  from transformer.sweeps import aggregate, spec

  sweep = spec.load_sweep(os.path.join(REPO_ROOT, "configs/sweeps/table3_converged.py"))
  records = [r for r in read_records("table3_converged") if r["sweep"] == sweep.name]
  missing = aggregate.missing_runs(sweep, records)
  if not records:
    return f"No run recorded yet: {len(missing)} runs to go."
  path = os.path.join(RESULTS_DIR, "table3_converged.jsonl")
  summaries = aggregate.summarize(sweep, records, path)
  note = f"Not recorded yet: {', '.join(missing)}.\n\n" if missing else ""
  return aggregate.markdown_table(summaries) + "\n" + note + source("table3_converged", records)


@view
def decoder_only_vs_encoder_decoder() -> str:
  records = latest(read_records("decoder_only_vs_encoder_decoder"), key=lambda r: r["row"])
  cells = {"row": lambda r: r["row"], "parameters": lambda r: _thousands(r["num_params"])}
  cells |= {**_PPL, **_bleu(records)}
  return columns(records, cells) + "\n\n" + source("decoder_only_vs_encoder_decoder", records)


@view
def mixed_precision() -> str:
  """Each run's validation perplexity and BLEU, the perplexity set against float32's at
  the same seed (the sweep's criterion: within 2%), each row at its own commit."""
  every = read_records("mixed_precision")
  records = latest(every, key=lambda r: r["row"])

  def against_float32(record: Record) -> str:
    """Against float32's perplexity at the record's seed, from a run of the same commit
    where there is one (the older rows were measured against their own), else the newest."""
    if record["row"].startswith("float32"):
      return ""
    name = "float32_seed1" if "seed1" in record["row"] else "float32"
    float32 = [r for r in every if r["row"] == name]
    same = [r for r in float32 if r["commit"] == record["commit"]] or float32
    return f"{100 * (record['ppl'] / same[-1]['ppl'] - 1):+.1f}%"

  cells = {"run": lambda r: r["row"], "changed values": lambda r: f"`{r['changed']}`", **_PPL}
  cells |= {"ppl vs float32, same seed": against_float32, **_bleu(records)}
  cells["commit"] = lambda r: r["commit"]
  return columns(records, cells) + "\n\n" + source("mixed_precision", records)


def _sweep_expected(name: str, keep: Callable[[Record], bool] = lambda r: True) -> str:
  records = [r for r in latest(read_records(name), key=lambda r: r["row"]) if keep(r)]
  cite(name, records)
  rows = "; ".join(f"{r['row']} {r['ppl']:.2f} and {r['bleu']:.2f}" for r in records)
  first = records[0]
  return textwrap.fill(
    f"Expected, as validation perplexity and BLEU (first {first['bleu_sentences']} "
    f"validation sentences) at the last step: {rows} ({first['date']}, commit "
    f"{first['commit']}; docs/results/{name}.jsonl).",
    width=88,
  )


@view
def mixed_precision_expected() -> str:
  # The sweep's own rows: not the earlier runs with the residual stream in bf16.
  return _sweep_expected("mixed_precision", keep=lambda r: "residual" not in r["row"])


@view
def table3_small_expected() -> str:
  return _sweep_expected("table3_small")


@view
def decoder_only_vs_encoder_decoder_expected() -> str:
  return _sweep_expected("decoder_only_vs_encoder_decoder")


# docs/data.md.


@view
def input_padding() -> str:
  records = latest(read_records("input_pipeline"), key=lambda r: r["flags"])
  both = lambda r, fmt, key: f"{fmt(r[f'source_{key}'])} / {fmt(r[f'target_{key}'])}"
  cells = {
    "flags": lambda r: f"`{r['flags']}`" if r["flags"] else "(none)",
    "batching": lambda r: r["batching"],
    "max_len / tokens_per_batch": lambda r: f"{r['max_len']} / {_thousands(r['tokens_per_batch'])}",
    "real tokens per batch (source / target)": lambda r: both(r, _thousands, "tokens_per_batch"),
    "real share of slots (source / target)": lambda r: both(r, _percent, "padding_efficiency"),
    "shapes seen / planned": lambda r: f"{r['shapes_seen']} / {r['shapes_planned']}",
  }
  return columns(records, cells) + "\n\n" + source("input_pipeline", records)


# docs/decoding.md.


def acceptance_for(tokens_per_round: float, k: int) -> float:
  """The acceptance rate a at which a round gives `tokens_per_round` tokens
  (speculative_lib.tokens_per_round, which grows with a: bisected)."""
  from transformer.model.decoding import speculative as speculative_lib  # imports JAX

  low, high = 0.0, 1.0
  for _ in range(60):
    a = (low + high) / 2
    low, high = (a, high) if speculative_lib.tokens_per_round(a, k) < tokens_per_round else (low, a)
  return (low + high) / 2


@view
def speculative() -> str:
  """Speculative against plain greedy decoding, one row per batch size, with a, c, the
  check's cost and what Leviathan et al.'s formula predicts."""
  from transformer.model.decoding import speculative as speculative_lib  # imports JAX

  # bench also prints its peak record (name "peak") before the speculative ones.
  records = [r for r in read_records("speculative") if r["name"] == "speculative"]
  records = latest(records, key=lambda r: r["batch_size"])
  with_check = lambda r: speculative_lib.expected_speedup(
    r["acceptance_rate"], r["draft_len"], r["draft_cost_ratio"], check_cost=r["check_cost_ratio"]
  )
  cells = {
    "batch": lambda r: r["batch_size"],
    "greedy ms/sentence": lambda r: f"{r['greedy_ms_per_sentence']:.1f}",
    "speculative ms/sentence": lambda r: f"{r['speculative_ms_per_sentence']:.1f}",
    "measured speed-up": lambda r: f"{r['speedup']:.2f}x",
    "a": lambda r: f"{r['acceptance_rate']:.3f}",
    "c": lambda r: f"{r['draft_cost_ratio']:.3f}",
    "(k + 1)-token check / target pass": lambda r: f"{r['check_cost_ratio']:.2f}",
    "predicted (1 - a^(k+1)) / ((1 - a)(k c + 1))": lambda r: f"{r['expected_speedup']:.2f}x",
    "predicted with the check's cost": lambda r: f"{with_check(r):.2f}x",
    "target passes, greedy → speculative": lambda r: (
      f"{r['target_passes_greedy']:,} → {r['target_passes_speculative']:,}"
    ),
  }
  first, k = records[0], records[0]["draft_len"]
  needed = 1.5 * (k * first["draft_cost_ratio"] + first["check_cost_ratio"])
  return (
    columns(records, cells)
    + f"\n\n{first['sentences']} test sentences, k = {k}; the target trained "
    f"{first['target_steps']:,} steps (validation ppl {first['target_validation_ppl']:.2f}), "
    f"the draft {first['draft_steps']:,} (ppl {first['draft_validation_ppl']:.2f}, scored over "
    f"the whole vocabulary). At these costs 1.5x one sentence at a time needs "
    f"{needed:.2f} tokens per round, of the k + 1 = {k + 1} a round gives at most: "
    + (
      f"an acceptance rate of {acceptance_for(needed, k):.2f}."
      if needed < k + 1
      else "no acceptance rate reaches it; only a cheaper draft or check would."
    )
    + "\n\n"
    + source("speculative", records)
  )


_SYSTEMS = {"ours": "ours (JAX)", "float32": "CTranslate2 float32", "int8": "CTranslate2 int8"}


@view
def ctranslate2_quality() -> str:
  """The exported model's outputs and BLEU beside the run's own (compare_ctranslate2)."""
  r = read_records("ctranslate2")[-1]
  gaps = [d["logprob_gap"] for d in r["greedy_differing"]]
  differing = (
    f"The {len(gaps)} that differ part where our two candidates' log-probabilities are "
    f"at most {max(gaps):.1e} apart (near-ties: float32 sums in another order decide them)."
    if gaps
    else "None differs."
  )
  beam = f"beam {r['beam_size']}, alpha {r['length_penalty_alpha']}"
  rows = [
    (search, *(f"{r['bleu'][f'{system}_{key}']:.2f}" for system in _SYSTEMS))
    for search, key in (("greedy", "greedy"), (beam, "beam"))
  ]
  return (
    f"Greedy: {r['greedy_identical']:,} of {r['num_sentences']:,} {r['split']} sentences "
    f"({r['greedy_identical_share']:.1%}) identical to ours token for token. {differing}\n\n"
    + table(["sacreBLEU", "ours", *list(_SYSTEMS.values())[1:]], rows)
    + f"\n\nStep {r['step']:,} of `{r['workdir']}`, CTranslate2 {r['ctranslate2']}.\n\n"
    + source("ctranslate2", [r])
  )


@view
def ctranslate2_speed() -> str:
  """Sentences/s of the run's own decoding and of the exported model, one interleaved run."""
  r = read_records("ctranslate2")[-1]
  rates = {(x["system"], x["search"], x["batch"]): x["sentences_per_sec"] for x in r["speed"]}
  batches = sorted({x["batch"] for x in r["speed"]})
  rows = [
    (name, search, *(f"{rates[(system, search, b)]:.1f}" for b in batches))
    for system, name in _SYSTEMS.items()
    for search in ("greedy", "beam")
  ]
  return (
    table(("", "search", *(f"batch {b} (sentences/s)" for b in batches)), rows)
    + f"\n\nBatch 1: the first {r['batch1_sentences']:,} {r['split']} sentences; batch "
    f"{r['batch_size']}: all {r['num_sentences']:,}, in the split's order. Each figure is "
    f"the fastest of {r['rounds']} turns, the systems taking turns; ours compiled first. "
    f"CTranslate2 {r['ctranslate2']} with {r['ctranslate2_threads']}.\n\n"
    + source("ctranslate2", [r])
  )


# docs/performance.md and reproduce.md: compile_check's predictions for TPU slices.


def _flag(command: str, flag: str) -> str | None:
  """'configs/wmt14.py:big' from '... --config configs/wmt14.py:big ...' (flag 'config')."""
  words = command.replace("=", " ").split()
  return words[words.index(f"--{flag}") + 1] if f"--{flag}" in words else None


def _model(record: Record) -> str:
  return (_flag(record["command"], "config") or "").rsplit(":", 1)[-1]


def _overrides(command: str) -> tuple[str, ...]:
  """A command's config overrides, "--config.model.dtype=bfloat16" as "model.dtype=bfloat16":
  a compile_check record with any is an experiment on the step, not the config's figure."""
  return tuple(w.removeprefix("--config.") for w in command.split() if w.startswith("--config."))


def _launch_key(record: Record) -> tuple:
  """What a compile_check record is about: model, slice, slices, mesh asked, batch asked."""
  command = record["command"]
  mesh = "search" if "--search_mesh" in command.split() else _flag(command, "mesh")
  return (
    _flag(command, "config"),
    record["topology"],
    record.get("num_slices", 1),
    mesh,
    _flag(command, "batch_tokens"),
  )


def _configs_as_they_are() -> list[Record]:
  """compile_check's records without config overrides."""
  return [r for r in read_records("compile_check") if not _overrides(r["command"])]


def _v5e8() -> list[Record]:
  """The newest record of each WMT config on a v5e-8, where it is of the config's mesh."""
  key = lambda r: (_flag(r["command"], "config"), r["topology"])
  records = latest(_configs_as_they_are(), key=key)
  return [r for r in records if r["topology"] == "v5e-8" and _flag(r["command"], "mesh") is None]


def _v5e8_profiles() -> list[Record]:
  """Those with a per-op profile, at the paper's batch, sorted by config."""
  profiled = [r for r in _v5e8() if "profile" in r and _flag(r["command"], "batch_tokens") is None]
  return sorted(profiled, key=lambda r: _flag(r["command"], "config") or "")


def _launch_mesh(record: Record) -> str:
  """The mesh column: the in-slice mesh "data x fsdp x tensor" (the mesh over every slice,
  divided by the slices' dcn_* split) and who chose it (the config, --mesh or --search_mesh)."""
  asked, searched = _launch_key(record)[3], len(record.get("search", []))
  if "error" in record:
    if asked == "search":
      return f"--search_mesh ({searched} tried)"
    return "the config's" if asked is None else f"{asked.replace(',', 'x')} (--mesh)"
  dcn = record.get("dcn_mesh") or {}
  mesh = "x".join(str(record["mesh"][a] // dcn.get(a, 1)) for a in ("data", "fsdp", "tensor"))
  if asked == "search":
    return f"{mesh} (--search_mesh, best of {searched})"
  return f"{mesh} ({'the config' + chr(39) + 's' if asked is None else '--mesh'})"


_SLICE_ORDER = ("v5e-8", "v4-32", "v5p-128", "v5e-256")


def _memory(r: Record) -> str:
  return f"fits, {r['total'] / r['hbm']:.0%} of {r['hbm'] / 2**30:.0f} GiB"


@view
def before_you_launch() -> str:
  """compile_check's records: each WMT model on each slice, with the config's mesh and
  the best of --search_mesh (or a --mesh recorded where no search was), every figure a
  prediction of XLA's TPU compiler."""
  records = latest(_configs_as_they_are(), key=_launch_key)
  without_mesh = lambda key: key[:3] + key[4:]
  searched = {without_mesh(key) for key in map(_launch_key, records) if key[3] == "search"}
  # A search compiled each mesh a --mesh record would show.
  records = [
    r
    for r in records
    if _launch_key(r)[3] in (None, "search") or without_mesh(_launch_key(r)) not in searched
  ]

  def order(record: Record) -> tuple:
    model, topology, slices, asked, batch = _launch_key(record)
    where = _SLICE_ORDER.index(topology) if topology in _SLICE_ORDER else len(_SLICE_ORDER)
    return (model, slices, where, int(batch or 0), {None: 0, "search": 2}.get(asked, 1))

  rows = []
  for r in sorted(records, key=order):
    slices = f"{r['num_slices']} x " if r.get("num_slices", 1) > 1 else ""
    asked_tokens = _flag(r["command"], "batch_tokens")
    batch_note = f" (--batch_tokens {int(asked_tokens):,})" if asked_tokens else ""
    head = [_model(r), f"{slices}{r['topology']}", _launch_mesh(r)]
    if "error" in r:
      rows.append(head + [batch_note.strip(), f"no: {r['error']}"] + [""] * 5)
      continue
    batch = f"{r['rows']} x {r['seq_len']}{batch_note}"
    if "oom" in r:
      rows.append(head + [batch, r["oom"].split(" (predicted")[0]] + [""] * 5)
      continue
    p = r.get("profile")
    per_op = [_ms(p["step_s"]), f"{p['mfu']:.0%}", f"{p['tokens_per_s']:,.0f}"] if p else []
    roofline = f"{r['step_s'] * 1e3:,.0f} ms ({r['bound']}), {r['mfu']:.0%}"
    per_op = per_op or ["(older record)", "", ""]
    rows.append(head + [batch, _memory(r), *per_op, roofline, f"{r['flops_vs_formula']:+.1%}"])
  headers = (
    "model|slice|mesh|batch|memory per chip|step (per-op)|MFU (per-op)|target tokens/s (slice)"
    "|roofline step, MFU (not a bound)|XLA FLOPs vs formula"
  )
  return table(headers, rows) + "\n\n" + source("compile_check", records)


@view
def tpu_step_profile() -> str:
  """Where a v5e-8 step's time goes, by model part, for each WMT model: the per-op
  profile of compile_check's newest record of it (the config's mesh, the paper's batch)."""
  from transformer.tools import op_profile

  records = _v5e8_profiles()
  profiles = [r["profile"] for r in records]
  parts = list(dict.fromkeys(part for p in profiles for part in p["by_part_s"]))
  share = lambda s, p: f"{s * 1e3:.2f} ms ({s / p['step_s']:.0%})"
  rows = [(part, *(share(p["by_part_s"].get(part, 0.0), p) for p in profiles)) for part in parts]
  rows.append(("**step**", *(f"**{p['step_s'] * 1e3:.1f} ms**" for p in profiles)))
  rows.append(("**MFU**", *(f"**{p['mfu']:.0%}**" for p in profiles)))
  # An op JAX gave no source path (a collective the partitioner made) goes by its own name.
  op = lambda o: (
    f"{o['part']} {o['seconds'] * 1e3:.2f} ms "
    f"(`{o['op_name'].rsplit(')/', 1)[-1][-60:] or o['name']}`"
    + (f", x{o['runs']}" if o["runs"] > 1 else "")
    + ")"
  )
  top = []
  for r, p in zip(records, profiles):
    top.append(f"- {_model(r)}'s five longest ops: {'; '.join(map(op, p['top_ops'][:5]))}.")
    if p.get("uncosted"):  # records before it have none
      text = op_profile.uncosted_text(p["uncosted"][:3])
      top.append(f"- {_model(r)}'s ops with no estimate, not timed (the most bytes): {text}.")
  return (
    table(("part", *map(_model, records)), rows)
    + "\n\n"
    + "\n".join(top)
    + "\n\n"
    + source("compile_check", records)
  )


@view
def tpu_step_experiments() -> str:
  """Changes to the base step on a v5e-8, each compiled with config overrides and set
  against the step as the config stood when it was compiled (the newest record without
  overrides before it), by the per-op profile: dated, each row at its commits."""
  reference, against = None, {}
  for r in read_records("compile_check"):  # in the order made
    command = r["command"]
    what = (r["topology"], _flag(command, "config"), _flag(command, "mesh"), "profile" in r)
    if what != ("v5e-8", "configs/wmt14.py:base", None, True):
      continue
    if not _overrides(command):
      reference = r
    elif reference is not None:
      against[_overrides(command)] = (r, reference)
  if reference is None:
    return "No per-op record of the base step on a v5e-8 yet."
  hbm = lambda r: f"{r['total'] / r['hbm']:.0%}"
  now = reference["profile"]
  rows = [
    (
      "the config as it is now",
      "",
      _ms(now["step_s"]),
      f"{now['mfu']:.1%}",
      "",
      hbm(reference),
      reference["commit"],
    )
  ]
  history: list[Record] = []
  for overrides, (r, before) in sorted(against.items()):
    p, b = r["profile"]["by_part_s"], before["profile"]["by_part_s"]
    step, step_before = r["profile"]["step_s"], before["profile"]["step_s"]
    moved = sorted(set(p) | set(b), key=lambda k: -abs(p.get(k, 0) - b.get(k, 0)))[:3]
    commits = dict.fromkeys((before["commit"], r["commit"]))
    rows.append(
      (
        ", ".join(f"`{o}`" for o in overrides),
        _ms(step_before),
        f"{_ms(step)} ({step / step_before - 1:+.0%})",
        f"{r['profile']['mfu']:.1%}",
        ", ".join(f"{k} {(p.get(k, 0) - b.get(k, 0)) * 1e3:+.2f} ms" for k in moved),
        f"{hbm(r)} (from {hbm(before)})",
        ", ".join(commits),
      )
    )
    history += [r, before]
  headers = (
    "change|step before|step with it|MFU|parts that moved most|HBM per chip"
    "|compiled at (before, with it)"
  )
  return (
    table(headers, rows)
    + "\n\n"
    + source("compile_check", [reference])
    + "\n"
    + source("compile_check", list({id(r): r for r in history}.values()), history=True)
  )


def _priced(r: Record, steps: int) -> tuple[list[str], float]:
  """The step, MFU, time to `steps` and chip-hours of a compile_check record on a v5e-8
  (the per-op profile's step, or an older record's roofline, which it names); the hours."""
  if "profile" in r:
    step_s, mfu, how = r["profile"]["step_s"], r["profile"]["mfu"], "per-op"
  else:
    step_s, mfu, how = r["step_s"], r["mfu"], f"roofline, {r['bound']}"
  hours = step_s * steps / 3600
  cells = [f"{steps // 1000}K", f"{1000 * step_s:.1f} ms ({how})", f"{100 * mfu:.0f}%"]
  return cells + [f"{hours:.1f} hours", f"{hours * r['chips']:.0f}"], hours


@view
def table2_predicted_time() -> str:
  """Table 2's rows priced on a v5e-8: compile_check's predicted step time (the per-op
  profile, or an older record's roofline; not a measurement) times the config's steps."""
  from transformer import config as config_lib

  records = [r for r in _v5e8() if "error" not in r]
  steps = lambda r: config_lib.load_config(_flag(r["command"], "config") or "").num_train_steps
  rows = [[_model(r), *_priced(r, steps(r))[0]] for r in records]
  return (
    table("model|steps|step|MFU|time to its steps|chip-hours", rows)
    + "\n\n"
    + source("compile_check", records)
  )


@view
def table3_predicted_time() -> str:
  """Table 3's rows priced on a v5e-8: each row's train step compiled by
  `sweeps --compile_check v5e-8`, times the row's steps; the rows' total."""
  order = list(_paper_rows("table3"))
  records = latest(read_records("table3_compile_check"), key=lambda r: (r["row"], r["topology"]))
  by_row = {r["row"]: r for r in records if r["topology"] == "v5e-8"}
  rows, hours, chip_hours = [], 0.0, 0.0
  for r in (by_row[name] for name in order if name in by_row):
    if not r["fits"]:
      why = r.get("error") or r["oom"].split(" (predicted")[0]
      rows.append([r["row"], f"{r['num_train_steps'] // 1000}K", f"no: {why}"] + [""] * 4)
      continue
    cells, row_hours = _priced(r, r["num_train_steps"])
    rows.append([r["row"], cells[0], _memory(r), *cells[1:]])
    hours, chip_hours = hours + row_hours, chip_hours + row_hours * r["chips"]
  missing = [n for n in order if n not in by_row]
  return (
    table("row|steps|memory per chip|step|MFU|time to its steps|chip-hours", rows)
    + f"\n\nThe {len(by_row)} rows priced take {hours:.0f} hours "
    f"({chip_hours:,.0f} chip-hours) one after another on one v5e-8"
    + (f"; not yet compiled: {', '.join(missing)}" if missing else "")
    + ".\n\n"
    + source("table3_compile_check", list(by_row.values()))
  )
