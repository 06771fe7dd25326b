"""A sweep's runs over seeds: each row's mean, spread and change against base, by record.

`python -m transformer.sweeps --sweep S --records FILE --collect` reads FILE's records
(records.py: one per row and seed), and writes <sweep>.md, .csv and .png (the validation
curves) to --output_dir. For each row and metric (validation perplexity, sacreBLEU):

- mean and spread: the sample standard deviation over the row's seeds;
- delta: the row minus base at the same seed, averaged over the seeds both have;
- interval of that delta: a 95% t-interval with three seeds or more, the range with two;
- for BLEU, sacreBLEU's paired bootstrap (1,000 resamples) of each seed against base at
  the same seed, on the whole validation split; the largest p-value is shown;
- whether it agrees with the paper, whose delta is its row minus its base in Table 3:
  "yes" when every seed's delta has the paper's sign and |mean delta| is more than twice
  base's spread, "no" when every seed's delta has the opposite sign by the same margin,
  else "too small to tell". Where the paper shows no change, "yes" when ours is within
  that margin too.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import os
import statistics

from transformer import storage
from transformer.sweeps import records, report, spec

METRICS = (("ppl", "perplexity", -1), ("bleu", "BLEU", +1))  # key, name, better sign


@dataclasses.dataclass
class MetricSummary:
  """One metric of one row over its seeds."""

  values: dict[int, float]  # seed -> value
  mean: float
  spread: float | None  # sample standard deviation; None with one seed
  deltas: dict[int, float]  # seed -> row minus base at that seed
  interval: tuple[float, float] | None  # of the mean delta
  paper_delta: float | None
  agrees: str  # "yes", "no", "too small to tell", "" (base, or no paper figure)
  p_value: float | None = None  # BLEU: the largest paired-bootstrap p over the seeds


def interval(deltas: list[float]) -> tuple[float, float] | None:
  """95% t-interval of the mean for three values or more, their range for two."""
  if len(deltas) < 2:
    return None
  if len(deltas) == 2:
    return (min(deltas), max(deltas))
  from scipy import stats  # type: ignore[import-untyped]  # JAX's own dependency

  t95 = float(stats.t.ppf(0.975, df=len(deltas) - 1))  # two-sided 95%
  half = t95 * statistics.stdev(deltas) / math.sqrt(len(deltas))
  mean = statistics.fmean(deltas)
  return (mean - half, mean + half)


def verdict(deltas: list[float], paper_delta: float | None, base_spread: float | None) -> str:
  """'yes', 'no' or 'too small to tell': see the module's docstring."""
  if paper_delta is None or not deltas or base_spread is None:
    return ""
  margin = 2.0 * base_spread
  mean = statistics.fmean(deltas)
  if paper_delta == 0:
    return "yes" if abs(mean) <= margin else "no"
  sign = math.copysign(1.0, paper_delta)
  if abs(mean) > margin and all(d * sign > 0 for d in deltas):
    return "yes"
  if abs(mean) > margin and all(d * sign < 0 for d in deltas):
    return "no"
  return "too small to tell"


def paired_bootstrap_p(hypotheses: list[str], base: list[str], references: list[str]) -> float:
  """sacreBLEU's paired bootstrap p-value of `hypotheses` against `base` (1,000 resamples,
  sacreBLEU's fixed seed, so the same files give the same p)."""
  from sacrebleu.metrics import BLEU
  from sacrebleu.significance import PairedTest

  test = PairedTest(
    [("base", base), ("row", hypotheses)], {"BLEU": BLEU()}, [references], test_type="bs"
  )
  _, scores = test()
  result = scores["BLEU"][1]  # [0] is the baseline's
  assert not isinstance(result, str) and result.p_value is not None
  return float(result.p_value)


def summarize(sweep: spec.Sweep, found: list[dict], records_path: str) -> list[dict]:
  """Per row of the sweep with at least one record: its record-level facts and a
  MetricSummary per metric key ("ppl", "bleu")."""
  by_row: dict[str, dict[int, dict]] = {}
  for r in found:
    by_row.setdefault(r["row"], {})[r["seed"]] = r
  base_runs = by_row.get("base", {})
  paper_base = next((row for row in sweep.rows if row.name == "base"), None)
  if paper_base is None:
    raise spec.SweepError(f"sweep {sweep.name} has no row named base to compare against")
  references = None
  summaries = []
  for row in sweep.rows:
    runs = by_row.get(row.name)
    if not runs:
      continue
    entry = {
      "row": row.name,
      "changed values": report.changed_values(row),
      "seeds": sorted(runs),
      "epochs": min(r["epochs"] for r in runs.values()),
      "steps": max(r["steps"] for r in runs.values()),
    }
    for key, _, _ in METRICS:
      values = {s: r[key] for s, r in sorted(runs.items())}
      base_values = {s: r[key] for s, r in sorted(base_runs.items())}
      deltas = {s: values[s] - base_values[s] for s in values if s in base_values}
      paper = None
      paper_key = "paper_ppl" if key == "ppl" else "paper_bleu"
      if (
        row.name != "base"
        and paper_base
        and None
        not in (
          getattr(row, paper_key),
          getattr(paper_base, paper_key),
        )
      ):
        paper = getattr(row, paper_key) - getattr(paper_base, paper_key)
      base_spread = statistics.stdev(base_values.values()) if len(base_values) > 1 else None
      summary = MetricSummary(
        values=values,
        mean=statistics.fmean(values.values()),
        spread=statistics.stdev(values.values()) if len(values) > 1 else None,
        deltas=deltas,
        interval=interval(list(deltas.values()))
        if row.name != "base"
        else interval(list(values.values())),
        paper_delta=paper,
        agrees=verdict(list(deltas.values()), paper, base_spread) if row.name != "base" else "",
      )
      if key == "bleu" and row.name != "base" and deltas:
        if references is None:
          references = records.read_lines_gz(
            os.path.join(os.path.splitext(records_path)[0], "validation.ref.txt.gz")
          )
        summary.p_value = max(
          paired_bootstrap_p(
            _hypotheses(records_path, row, seed),
            _hypotheses(records_path, paper_base, seed),
            references,
          )
          for seed in deltas
        )
      entry[key] = summary
    summaries.append(entry)
  return summaries


def _hypotheses(records_path: str, row: spec.Row, seed: int) -> list[str]:
  path = os.path.join(
    records.artefact_dir(records_path, spec.Run(row, seed)), "validation.hyp.txt.gz"
  )
  return records.read_lines_gz(path)


def _pm(s: MetricSummary, digits: int) -> str:
  return f"{s.mean:.{digits}f}" + ("" if s.spread is None else f" ± {s.spread:.{digits}f}")


def _signed(value: float | None, digits: int) -> str:
  return "" if value is None else f"{value:+.{digits}f}"


def _range(pair: tuple[float, float] | None, digits: int, signed: bool = True) -> str:
  if pair is None:
    return ""
  form = f"{{:{'+' if signed else ''}.{digits}f}}"
  return f"[{form.format(pair[0])}, {form.format(pair[1])}]"


COLUMNS = (
  "row",
  "changed values",
  "seeds",
  "epochs",
  "ppl (mean ± sd)",
  "Δ ppl (interval)",
  "paper Δ ppl",
  "ppl agrees with the paper",
  "BLEU (mean ± sd)",
  "Δ BLEU (interval)",
  "bootstrap p",
  "paper Δ BLEU",
  "BLEU agrees with the paper",
)


def table_cells(entry: dict) -> list[str]:
  """One row of the Markdown table and the CSV (COLUMNS)."""
  ppl, bleu = entry["ppl"], entry["bleu"]
  is_base = entry["row"] == "base"

  def delta(s: MetricSummary, digits: int) -> str:
    if is_base:  # base's own interval: of its value
      return f"(value {_range(s.interval, digits, signed=False)})" if s.interval else ""
    if not s.deltas:
      return ""
    mean = statistics.fmean(s.deltas.values())
    return f"{mean:+.{digits}f} {_range(s.interval, digits)}".strip()

  return [
    entry["row"],
    entry["changed values"],
    ",".join(str(s) for s in entry["seeds"]),
    f"{entry['epochs']:.1f}",
    _pm(ppl, 2),
    delta(ppl, 2),
    _signed(ppl.paper_delta, 2),
    ppl.agrees,
    _pm(bleu, 2),
    delta(bleu, 2),
    "" if bleu.p_value is None else f"{bleu.p_value:.3f}",
    _signed(bleu.paper_delta, 1),
    bleu.agrees,
  ]


def markdown_table(summaries: list[dict]) -> str:
  lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  lines += ["| " + " | ".join(table_cells(e)) + " |" for e in summaries]
  return "\n".join(lines) + "\n"


def plot_curves(found: list[dict], title: str, path: str) -> None:
  """Validation perplexity against epochs, one line per row (the mean over its seeds at
  each evaluation), the seeds' range shaded."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  by_row: dict[str, list[dict]] = {}
  for r in found:
    by_row.setdefault(r["row"], []).append(r)
  fig, ax = plt.subplots(figsize=(8, 5))
  for name, runs in by_row.items():
    steps = sorted(set.intersection(*({h["step"] for h in r["ppl_history"]} for r in runs)))
    if not steps:
      continue
    table = np.array(
      [[{h["step"]: h["ppl"] for h in r["ppl_history"]}[s] for s in steps] for r in runs]
    )
    epochs = np.array(steps) * runs[0]["epochs"] / runs[0]["steps"]
    style = {"color": "black", "linewidth": 2.2} if name == "base" else {"linewidth": 1.2}
    (line,) = ax.plot(epochs, table.mean(axis=0), marker="o", markersize=3, label=name, **style)
    ax.fill_between(
      epochs, table.min(axis=0), table.max(axis=0), color=line.get_color(), alpha=0.15
    )
  ax.set_yscale("log")
  ax.set_xlabel("epochs of the training split")
  ax.set_ylabel("validation perplexity (unsmoothed)")
  ax.set_title(title)
  ax.grid(alpha=0.3, which="both")
  ax.legend(ncol=3, fontsize=8)
  fig.tight_layout()
  png = io.BytesIO()
  fig.savefig(png, format="png", dpi=110)
  plt.close(fig)
  storage.write_bytes(path, png.getvalue())


def missing_runs(sweep: spec.Sweep, found: list[dict]) -> list[str]:
  """The names of the sweep's runs (row and seed) that no record in `found` is of."""
  return [
    run.name for run in spec.runs(sweep.rows) if not any(records.is_of(r, run) for r in found)
  ]


def collect(sweep: spec.Sweep, records_path: str, output_dir: str) -> list[str]:
  """Writes <sweep>.md, .csv and .png (curves) to output_dir from the records; returns
  their paths, the table first."""
  found = [r for r in records.read_records(records_path) if r.get("sweep") == sweep.name]
  if not found:
    raise spec.SweepError(f"{records_path} holds no record of sweep {sweep.name}")
  summaries = summarize(sweep, found, records_path)
  missing = missing_runs(sweep, found)
  storage.makedirs(output_dir)
  stem = storage.join(output_dir, sweep.name)
  note = f"\nNot recorded yet: {', '.join(missing)}.\n" if missing else ""
  storage.write_text(f"{stem}.md", markdown_table(summaries) + note)
  table = io.StringIO(newline="")
  writer = csv.writer(table)
  writer.writerow(COLUMNS)
  writer.writerows(table_cells(e) for e in summaries)
  storage.write_text(f"{stem}.csv", table.getvalue())
  plot_curves(found, f"Sweep {sweep.name}: validation perplexity, mean over seeds", f"{stem}.png")
  return [f"{stem}.md", f"{stem}.csv", f"{stem}.png"]
