"""tests/helpers/durations.py: the slow tier and the order come from measured times."""

import json
import types

from tests.helpers import durations

MEASURED = {
  "tests/test_a.py::test_quick": 0.1,
  "tests/test_a.py::test_long": 30.0,
  "tests/test_b.py::test_only_one_and_long": 40.0,
  "tests/test_c.py::test_long_1": 9.0,
  "tests/test_c.py::test_long_2": 8.0,
}


def test_tests_over_the_threshold_are_slow_except_each_files_quickest():
  assert durations.slow_tests(MEASURED, threshold_s=5.0, quickest_kept_max_s=60.0) == {
    "tests/test_a.py::test_long",
    "tests/test_c.py::test_long_1",
  }
  # A file whose quickest test is itself long keeps none in the fast tier.
  assert durations.slow_tests(MEASURED, threshold_s=5.0, quickest_kept_max_s=30.0) == {
    "tests/test_a.py::test_long",
    "tests/test_c.py::test_long_1",
    "tests/test_b.py::test_only_one_and_long",
  }


def _items(*node_ids):
  return [
    types.SimpleNamespace(nodeid=node_id, location=(node_id.split("::")[0], 0, ""))
    for node_id in node_ids
  ]


def test_files_are_totalled_over_the_tests_that_run():
  items = _items(
    "tests/test_a.py::test_quick",
    "tests/test_c.py::test_long_1",
    "tests/test_c.py::test_long_2",
    "tests/test_d.py::test_new",
  )
  assert durations.file_seconds(items, MEASURED) == {
    "tests/test_a.py": 0.1,
    "tests/test_c.py": 17.0,
    "tests/test_d.py": 0.0,
  }


def test_new_files_first_then_the_longest_keeping_the_order_inside_each():
  items = _items(
    "tests/test_a.py::test_quick",
    "tests/test_a.py::test_long",
    "tests/test_c.py::test_long_1",
    "tests/test_c.py::test_long_2",
    "tests/test_d.py::test_new",
  )
  durations.LongestFilesFirst(MEASURED).pytest_collection_modifyitems(items)
  assert [item.nodeid for item in items] == [
    "tests/test_d.py::test_new",
    "tests/test_a.py::test_quick",
    "tests/test_a.py::test_long",
    "tests/test_c.py::test_long_1",
    "tests/test_c.py::test_long_2",
  ]


def test_stored_durations_merge_and_drop_files_that_are_gone(tmp_path):
  """A file that ran keeps only this run's tests (test_renamed goes); one that did not
  run keeps its entries; a file that is gone loses them."""
  (tmp_path / "tests").mkdir()
  for name in ("test_a.py", "test_b.py"):
    (tmp_path / "tests" / name).write_text("")
  path = tmp_path / "durations.json"
  path.write_text(
    json.dumps(
      {
        "tests/test_a.py::test_old": 1.0,
        "tests/test_b.py::test_x": 2.0,
        "tests/test_b.py::test_renamed": 4.0,
        "tests/test_gone.py::test_y": 3.0,
      }
    )
  )
  store = durations.StoreDurations(str(tmp_path), str(path))
  for when, seconds in (("setup", 0.5), ("call", 1.5), ("teardown", 0.5)):
    store.pytest_runtest_logreport(
      types.SimpleNamespace(nodeid="tests/test_b.py::test_x", when=when, duration=seconds)
    )
  store.pytest_sessionfinish()
  assert json.loads(path.read_text()) == {
    "tests/test_a.py::test_old": 1.0,
    "tests/test_b.py::test_x": 2.5,
  }


def test_a_test_is_slow_when_either_run_measured_it_slow():
  """The fast tier's own run can find a test slow that the full suite found quick."""
  full = {
    "tests/test_a.py::test_quick": 0.5,
    "tests/test_a.py::test_first_compile": 1.0,
    "tests/test_a.py::test_long": 9.0,
  }
  fast = {"tests/test_a.py::test_quick": 0.6, "tests/test_a.py::test_first_compile": 20.0}
  merged = durations.longer(full, fast)
  assert merged == {
    "tests/test_a.py::test_quick": 0.6,
    "tests/test_a.py::test_first_compile": 20.0,
    "tests/test_a.py::test_long": 9.0,
  }
  assert durations.slow_tests(merged, threshold_s=2.0) == {
    "tests/test_a.py::test_first_compile",
    "tests/test_a.py::test_long",
  }
  assert durations.slow_tests(full, threshold_s=2.0) == {"tests/test_a.py::test_long"}
