"""Goodput: every second of a start goes to one category; starts add up."""

from transformer.training import goodput


def test_a_clock_gives_each_second_to_one_category_and_starts_add_up(monkeypatch):
  now = [100.0]
  monkeypatch.setattr(goodput.time, "monotonic", lambda: now[0])
  clock = goodput.Clock()
  now[0] += 2  # building the run
  with clock.timing("restore"):
    now[0] += 1
  with clock.timing("compile"):  # the first step: what came before it is still start-up
    now[0] += 3
  clock.current = "recomputed"  # a step an earlier start had logged
  now[0] += 1.5
  with clock.timing("input"):
    now[0] += 0.5
  clock.current = "steps"
  now[0] += 4
  with clock.timing("checkpoints"):
    now[0] += 1
  record = clock.record()
  seconds = {c: record[f"{c}_s"] for c in goodput.CATEGORIES}
  assert seconds == {
    "startup": 2,
    "restore": 1,
    "compile": 3,
    "steps": 4,
    "input": 0.5,
    "checkpoints": 1,
    "eval": 0,
    "recomputed": 1.5,
  }
  assert record["wall_s"] == 13 == sum(seconds.values())
  total = goodput.summed([record, {**record, "steps_s": 17, "wall_s": 26}])
  assert total["wall_s"] == 39 and total["steps"] == 21 and total["starts"] == 2
  assert goodput.summary_line(total) == (
    "goodput 53.8%: compile 15.4%, input 2.6%, checkpoints 5.1%, eval 0.0%, "
    "recomputed 7.7% (startup 10.3%, restore 5.1%; 2 starts, 0m39s of wall time)"
  )
