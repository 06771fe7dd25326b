"""A sweep's numbers: sizes before training (`--dry_run`), results after (`--collect`).

`collect` writes OUTPUT_DIR/<sweep>.md (a markdown table), <sweep>.csv (the same rows)
and <sweep>.png (perplexity and BLEU per row). Perplexity is the unsmoothed validation
perplexity per subword token at the final step; BLEU is detokenized sacreBLEU of the
final checkpoint's beam search, without checkpoint averaging, as in the paper's Table 3.
"""

from __future__ import annotations

import csv
import io

from transformer import config as config_lib
from transformer import storage
from transformer.messages import format_duration
from transformer.sweeps import runner, spec
from transformer.training import describe

# Its docs/results records' version: bump when what it computes changes, not on a reformat.
RECORD_VERSION = 1

# Table 3's column names for the keys its rows change.
_SHORT_NAMES = {
  "model.num_layers": "N",
  "model.d_model": "d_model",
  "model.d_ff": "d_ff",
  "model.num_heads": "h",
  "model.d_k": "d_k",
  "model.d_v": "d_v",
  "model.dropout_rate": "P_drop",
  "label_smoothing": "eps_ls",
  "model.positional": "positional",
  "num_train_steps": "steps",
}

# BLEU is sacreBLEU; tok BLEU the paper's protocol (Moses tokens, compounds split).
COLUMNS = (
  "row",
  "changed values",
  "params (M)",
  "ppl",
  "BLEU",
  "tok BLEU",
  "paper ppl",
  "paper BLEU",
  "paper params (M)",
)


def changed_values(row: spec.Row) -> str:
  """A row's overrides in Table 3's notation, e.g. 'h=1 d_k=512 d_v=512'."""
  if not row.overrides:
    return "(base)"
  return " ".join(f"{_SHORT_NAMES.get(k, k)}={v}" for k, v in row.overrides.items())


def describe_rows(rows: list, configs: dict) -> list[dict]:
  """Parameters and training FLOPs per target token of each row, from shapes alone."""
  described = []
  for row in rows:
    info = describe.describe(configs[row.name])
    described.append(
      {
        "name": row.name,
        "overrides": row.overrides,
        "num_params": info["num_params"],
        "flops_per_token": info["flops_per_token"],
        "paper_params_m": row.paper_params_m,
      }
    )
  return described


def dry_run_table(sweep: spec.Sweep, described: list[dict]) -> str:
  """A fixed-width table of --dry_run's numbers, with the paper's params where given."""
  rows = [("row", "overrides", "params", "FLOPs/token", "paper params", "diff")]
  for entry in described:
    paper = entry["paper_params_m"]
    rows.append(
      (
        entry["name"],
        changed_values(spec.Row(entry["name"], entry["overrides"])),
        f"{entry['num_params'] / 1e6:.1f}M",
        f"{entry['flops_per_token']:.3g}",
        f"{paper}M" if paper else "",
        f"{entry['num_params'] / (paper * 1e6) - 1:+.1%}" if paper else "",
      )
    )
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = [f"sweep {sweep.name} on {sweep.base_config}"]
  lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
  return "\n".join(lines)


def _number(value, digits: int) -> str:
  return "" if value is None else f"{value:.{digits}f}"


def collect_rows(
  sweep: spec.Sweep, rows: list, configs: dict, workdir: str, bleu_sources: dict | None = None
) -> list[dict]:
  """One dict per row (COLUMNS as keys, numbers as numbers; None where missing).

  bleu_sources, if given, is filled with {which sentences BLEU was computed on: rows}.
  """
  bleu_sources = {} if bleu_sources is None else bleu_sources
  collected = []
  for row in rows:
    config = configs[row.name]
    results = (
      runner.final_results(f"{workdir.rstrip('/')}/{row.name}", config_lib.final_step(config)) or {}
    )
    if results.get("bleu") is None:
      bleu_on = None
    elif results["source"] == "eval.py":
      bleu_on = f"the whole validation split ({results['bleu_sentences']} sentences, eval.py)"
    else:
      bleu_on = (
        f"the first {config.eval_bleu_sentences} validation sentences (the training "
        "run's last evaluation)"
      )
    bleu_sources.setdefault(bleu_on, []).append(row.name)
    collected.append(
      {
        "row": row.name,
        "changed values": changed_values(row),
        "params (M)": describe.count_params(config) / 1e6,
        "ppl": results.get("ppl"),
        "BLEU": results.get("bleu"),
        "tok BLEU": results.get("bleu_tok"),
        "paper ppl": row.paper_ppl,
        "paper BLEU": row.paper_bleu,
        "paper params (M)": row.paper_params_m,
      }
    )
  return collected


def markdown_table(collected: list[dict]) -> str:
  lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  for r in collected:
    cells = [
      r["row"],
      r["changed values"],
      _number(r["params (M)"], 1),
      _number(r["ppl"], 2),
      _number(r["BLEU"], 2),
      _number(r["tok BLEU"], 2),
      _number(r["paper ppl"], 2),
      _number(r["paper BLEU"], 1),
      "" if r["paper params (M)"] is None else f"{r['paper params (M)']:g}",
    ]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def relative_to_base(values: list, base) -> list:
  """Percent change from the base row; None where a value or the base is missing, or the
  base is 0 (a base row of BLEU 0, from a run too short to translate, has no change)."""
  if not base:
    return [None] * len(values)
  return [None if v is None else 100.0 * (v / base - 1.0) for v in values]


def plot(collected: list[dict], title: str, path: str) -> None:
  """Two panels, perplexity and BLEU, each row's change from its sweep's base row (%),
  each bar labelled with its absolute value.

  Ours and the paper's are compared as changes from their own base row, because a
  scaled-down sweep's absolute numbers are on another scale from the paper's.
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  names = [r["row"] for r in collected]
  base = next((r for r in collected if r["row"] == "base"), collected[0])
  x = np.arange(len(names))
  fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.55 * len(names) + 2), 7), sharex=True)
  for ax, ours_key, paper_key, label in (
    (axes[0], "ppl", "paper ppl", "perplexity"),
    (axes[1], "BLEU", "paper BLEU", "BLEU"),
  ):
    for offset, key, who, color in (
      (-0.2, ours_key, "this run", "tab:blue"),
      (0.2, paper_key, "paper", "tab:gray"),
    ):
      change = relative_to_base([r[key] for r in collected], base[key])
      heights = [np.nan if c is None else c for c in change]
      bars = ax.bar(x + offset, heights, width=0.4, label=who, color=color)
      # The absolute value on each bar: the scale of the change is in the axis.
      ax.bar_label(
        bars,
        labels=["" if r[key] is None else f"{r[key]:.3g}" for r in collected],
        fontsize=7,
        padding=2,
      )
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_ylabel(f"{label}: % change\nfrom row {base['row']}")
    ax.margins(y=0.15)  # room for the labels
    ax.grid(axis="y", alpha=0.3)
  axes[0].set_title(title + "\n(perplexity: lower is better; BLEU: higher is better)")
  axes[0].legend(loc="best")
  axes[1].set_xticks(x, names)
  fig.tight_layout()
  png = io.BytesIO()  # rendered in memory, then written whole: the path may be gs://
  fig.savefig(png, format="png", dpi=120)
  plt.close(fig)
  storage.write_bytes(path, png.getvalue())


def collect(
  sweep: spec.Sweep, rows: list, configs: dict, workdir: str, output_dir: str
) -> list[str]:
  """Writes <sweep>.md, .csv and .png to output_dir; returns their paths (md first)."""
  bleu_sources: dict[str, list[str]] = {}
  collected = collect_rows(sweep, rows, configs, workdir, bleu_sources)
  storage.makedirs(output_dir)
  stem = storage.join(output_dir, sweep.name)
  missing = [r["row"] for r in collected if r["ppl"] is None]
  note = f"\nNot finished yet (blank): {', '.join(missing)}.\n" if missing else ""
  described = [(on, names) for on, names in bleu_sources.items() if on is not None]
  if len(described) == 1:
    bleu_on = f" BLEU is computed on {described[0][0]}."
  else:
    bleu_on = "".join(
      f" BLEU of {', '.join(names)} is computed on {on}." for on, names in described
    )
  storage.write_text(
    f"{stem}.md",
    f"Sweep `{sweep.name}` on `{sweep.base_config}`: final validation perplexity "
    "(unsmoothed, per subword token) and BLEU of the last checkpoint, no averaging. "
    "BLEU is sacreBLEU; tok BLEU is the paper's protocol (tokenized, compounds "
    f"split).{bleu_on}\n\n" + markdown_table(collected) + note,
  )
  table = io.StringIO(newline="")
  writer = csv.DictWriter(table, fieldnames=COLUMNS)
  writer.writeheader()
  writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in collected)
  storage.write_text(f"{stem}.csv", table.getvalue())
  plot(collected, f"Sweep {sweep.name}: each row against its base row", f"{stem}.png")
  return [f"{stem}.md", f"{stem}.csv", f"{stem}.png"]


def why_not(check: dict) -> str:
  """One line: why a row cannot run on the slice (compile_check's error or OOM line)."""
  return check.get("error") or check.get("oom") or "does not fit"


def compile_check_table(topology: str, rows: list, described: list[dict], checks: dict) -> str:
  """A Markdown table of every row's train step compiled for a TPU slice
  (transformer/tools/compile_check.py's reports, `checks` by row name): its changes,
  parameters, bytes per chip, whether it fits, predicted step time and MFU, and the
  time to its step count. Every figure is a prediction of XLA's TPU compiler."""
  params = {e["name"]: e["num_params"] for e in described}
  lines = [
    f"Train step of each row on {topology}, per chip, predicted by XLA's TPU compiler "
    "(libtpu), not measured:",
    "",
    "| row | changes | parameters | bytes per chip | fits | step | MFU | time to its steps |",
    "|---|---|---:|---:|---|---:|---:|---:|",
  ]
  for row in rows:
    c = checks[row.name]
    head = f"| {row.name} | {changed_values(row)} | {params[row.name] / 1e6:,.1f}M"
    if "step_s" not in c or not c["fits"]:
      lines.append(f"{head} | | no: {why_not(c)} | | | |")
      continue
    to_the_end = c["step_s"] * c["grad_accum_steps"] * c["num_train_steps"]
    lines.append(
      f"{head} | {c['total'] / 2**30:.2f} GiB | yes, {c['total'] / c['hbm']:.0%} of "
      f"{c['hbm'] / 2**30:.0f} GiB | {c['step_s'] * 1e3:,.1f} ms | {c['mfu']:.0%} | "
      f"{format_duration(to_the_end)} |"
    )
  return "\n".join(lines)
