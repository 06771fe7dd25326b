"""Each record file's producer, and the shown records that are older than what it computes.

A record carries `record_version`: the RECORD_VERSION its producer declared when it ran.
A producer bumps that constant when what it computes changes (a figure's meaning or
value), not when its code is moved or reworded. A record a view shows as a current
figure (`doc_views.source`) must carry its producer's version now; a record a view shows
as dated history (`source(..., history=True)`, each labelled with its commit) may be of
any version. Record files that no view shows are not checked.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

from docs.render import doc_views
from docs.render.doc_views import REPO_ROOT, RecordError

_BENCH = "transformer/tools/bench/__main__.py"
_SWEEPS = "transformer/sweeps/report.py"
_COMPILE_CHECK = "transformer/tools/compile_check.py"

# Record file (docs/results/NAME.jsonl) -> the file that declares its RECORD_VERSION.
# make_test has none: the suite's size and time are shown only as of their commit.
PRODUCERS: dict[str, str] = {
  "make_train": "train.py",
  "cpu": _BENCH,
  "gpu": _BENCH,
  "host_memory": _BENCH,
  "speculative": _BENCH,
  "flax_side_by_side": _BENCH,
  "memory": "transformer/tools/memory.py",
  "compile_check": _COMPILE_CHECK,
  "table3_compile_check": _COMPILE_CHECK,  # compile_check's report per row
  "table3_dry_run": _SWEEPS,
  "table3_small": _SWEEPS,
  "decoder_only_vs_encoder_decoder": _SWEEPS,
  "mixed_precision": _SWEEPS,
  "restore_memory": "transformer/tools/restore_memory.py",
  "input_pipeline": "transformer/tools/input_speed.py",
  "ctranslate2": "transformer/tools/compare_ctranslate2.py",
  "table3_converged": "transformer/sweeps/records.py",
}

_VERSION = re.compile(r"^RECORD_VERSION = (\d+)\b", re.MULTILINE)


def producer_version(name: str) -> int:
  """The RECORD_VERSION of docs/results/NAME.jsonl's producer, read from its source (the
  tools import JAX; reading them takes a millisecond)."""
  if name not in PRODUCERS:
    raise RecordError(
      f"docs/results/{name}.jsonl has no producer in PRODUCERS (docs/render/record_sources.py)"
    )
  path = os.path.join(REPO_ROOT, PRODUCERS[name])
  with open(path, encoding="utf-8") as f:
    match = _VERSION.search(f.read())
  if match is None:
    raise RecordError(f"{PRODUCERS[name]} declares no module-level RECORD_VERSION = <int>")
  return int(match.group(1))


def _line_number(name: str, record: doc_views.Record, results_dir: str) -> int:
  """Where a shown record is in its file (a view may have added to it: bench's records
  take their run's peak figures), or 0."""
  with open(os.path.join(results_dir, f"{name}.jsonl"), encoding="utf-8") as f:
    lines = enumerate(f, 1)
    return next(
      (n for n, line in lines if line.strip() and json.loads(line).items() <= record.items()), 0
    )


def outdated(
  views: dict[str, Callable[[], str]] | None = None, results_dir: str | None = None
) -> list[str]:
  """One line per record a view shows as current whose record_version is not its
  producer's RECORD_VERSION: rerun its command and append the new record."""
  problems = set()
  for view_name, view in (views or doc_views.views()).items():
    for name, record, history in doc_views.shown(view):
      if history:
        continue
      version = producer_version(name)
      if record.get("record_version") != version:
        line = _line_number(name, record, results_dir or doc_views.RESULTS_DIR)
        problems.add(
          f"docs/results/{name}.jsonl:{line} (view {view_name}): record_version "
          f"{record.get('record_version')}, {PRODUCERS[name]} is at {version}: rerun and append"
        )
  return sorted(problems)
