"""Measured test durations, kept in tests/durations.json: they order and split the suite.

  make durations      # the full suite, then the fast tier, rewriting both files below

tests/durations.json maps each test's node id to its seconds (setup, call and teardown
together; a session fixture's set-up counts for the first test that uses it), measured on
three xdist workers as `make test` runs; tests/durations_fast.json the same, measured in the
fast tier's own run (`-m "not slow"`), where a test is often the first of its worker to
compile a program or build a shared fixture that a slow test built before it in the full
suite (a test of 1.4 s there took 25 s here). Two things follow from them:

- Order: files run longest first (files not yet measured before them all). `make test`
  hands whole files to three workers (--dist loadfile, in collection order with
  --no-loadscope-reorder); a long file picked up last would leave one worker running it
  alone while the others sit idle.
- The fast tier: a test measured above SLOW_TEST_S in either run is marked `slow`, so
  `pytest -m "not slow"` (make test-fast) skips it, except each file's quickest test,
  which stays (if under QUICKEST_KEPT_MAX_S), so that the fast tier still touches every
  module the suite tests.
  A test may also carry @pytest.mark.slow itself. Tests not yet measured count as fast.

Remeasure after adding or changing slow tests; the file is small and reviewed like code.
"""

from __future__ import annotations

import collections
import json
import os

import pytest

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(_TESTS, "durations.json")  # the full suite's run
FAST_PATH = os.path.join(_TESTS, "durations_fast.json")  # the fast tier's own run
# Measured with three workers on a 2-core machine: every test above this, in either run,
# goes to the full suite only.
SLOW_TEST_S = 2.0
# A file's quickest test stays fast only up to this: a file of one long test (a pod
# rehearsal of many processes) is an end-to-end check, not a module's quick test.
QUICKEST_KEPT_MAX_S = 15.0
OPTION = "--store-durations"


def load(path: str | None = None) -> dict[str, float]:
  path = path or PATH
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def longer(*runs: dict[str, float]) -> dict[str, float]:
  """Each test's longest time over the runs that measured it."""
  merged: dict[str, float] = {}
  for run in runs:
    for node_id, seconds in run.items():
      merged[node_id] = max(seconds, merged.get(node_id, 0.0))
  return merged


def slow_tests(
  durations: dict[str, float],
  threshold_s: float = SLOW_TEST_S,
  quickest_kept_max_s: float = QUICKEST_KEPT_MAX_S,
) -> set[str]:
  """Node ids measured above threshold_s, less each file's quickest test unless that one
  too is above quickest_kept_max_s."""
  by_file = collections.defaultdict(list)
  for node_id, seconds in durations.items():
    by_file[node_id.split("::")[0]].append((seconds, node_id))
  slow = set()
  for tests in by_file.values():
    quickest_s, quickest = min(tests)
    keep = quickest if quickest_s <= quickest_kept_max_s else None
    slow |= {node_id for seconds, node_id in tests if seconds > threshold_s and node_id != keep}
  return slow


def file_seconds(items, durations: dict[str, float]) -> dict[str, float]:
  """Each file's measured total over `items` (the tests that will run)."""
  totals: dict[str, float] = collections.defaultdict(float)
  for item in items:
    totals[item.location[0]] += durations.get(item.nodeid, 0.0)
  return totals


class MarkSlow:
  """Marks the tests measured as slow, before `-m` deselects by marker."""

  def __init__(self, durations: dict[str, float]):
    self.slow = slow_tests(durations)

  @pytest.hookimpl(tryfirst=True)
  def pytest_collection_modifyitems(self, items):
    for item in items:
      if item.nodeid in self.slow:
        item.add_marker(pytest.mark.slow)


class LongestFilesFirst:
  """Orders what is left after deselection: files never measured first (a new file may be
  long), then the others by measured total, longest first."""

  def __init__(self, durations: dict[str, float]):
    self.durations = durations
    self.measured_files = {node_id.split("::")[0] for node_id in durations}

  @pytest.hookimpl(trylast=True)
  def pytest_collection_modifyitems(self, items):
    totals = file_seconds(items, self.durations)
    items.sort(
      key=lambda item: (
        item.location[0] in self.measured_files,  # stable: file
        -totals[item.location[0]],
      )
    )  # order kept


class StoreDurations:
  """--store-durations: adds each test's setup, call and teardown times, in the process
  that reports them (the xdist controller, or pytest alone), and writes them at the end.
  A file that ran has its entries replaced by this run's (a renamed or removed test goes);
  files that did not run keep theirs, unless the file is gone."""

  def __init__(self, rootdir: str, path: str = PATH):
    self.rootdir, self.path = rootdir, path
    self.measured: dict[str, float] = collections.defaultdict(float)

  def pytest_runtest_logreport(self, report):
    self.measured[report.nodeid] += report.duration

  def pytest_sessionfinish(self):
    ran = {node_id.split("::")[0] for node_id in self.measured}
    durations = {
      node_id: seconds
      for node_id, seconds in load(self.path).items()
      if node_id.split("::")[0] not in ran
      and os.path.exists(os.path.join(self.rootdir, node_id.split("::")[0]))
    }
    durations.update({node_id: round(seconds, 2) for node_id, seconds in self.measured.items()})
    with open(self.path, "w", encoding="utf-8") as f:
      json.dump(dict(sorted(durations.items())), f, indent=0)
      f.write("\n")


def addoption(parser: pytest.Parser) -> None:
  parser.addoption(
    OPTION,
    nargs="?",
    const="full",
    choices=("full", "fast"),
    help="Record each test's duration in tests/durations.json, or with "
    "=fast (for a run of the fast tier) in tests/durations_fast.json.",
  )


def register(config: pytest.Config) -> None:
  """Installs the plugins above (from conftest's pytest_configure)."""
  durations = load()
  config.pluginmanager.register(MarkSlow(longer(durations, load(FAST_PATH))), "durations-mark-slow")
  config.pluginmanager.register(LongestFilesFirst(durations), "durations-order")
  store = config.getoption(OPTION)
  if store and not hasattr(config, "workerinput"):
    path = FAST_PATH if store == "fast" else PATH
    config.pluginmanager.register(StoreDurations(str(config.rootpath), path), "durations-store")
