"""metrics.jsonl (one JSON object per write, with step and kind) and the progress line."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from transformer.training import reporting


def read_lines(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_writer_appends_one_json_line_per_write(tmp_path):
  writer = reporting.MetricsWriter(str(tmp_path))
  writer.write(np.int64(10), {"loss": np.float32(2.5), "lr": jnp.float32(0.25), "rows": 3})
  writer.write(20, {"ce": 1.75, "bleu": 12.5}, kind="eval")
  writer.close()
  assert read_lines(str(tmp_path)) == [
      {"step": 10, "kind": "train", "loss": 2.5, "lr": 0.25, "rows": 3},
      {"step": 20, "kind": "eval", "ce": 1.75, "bleu": 12.5}]


def test_writer_keeps_the_lines_of_an_earlier_run(tmp_path):
  """A resumed run appends to metrics.jsonl; nothing written before is lost."""
  first = reporting.MetricsWriter(str(tmp_path))
  first.write(1, {"loss": 4.0})
  first.close()
  second = reporting.MetricsWriter(str(tmp_path))
  second.write(2, {"loss": 3.0})
  second.close()
  assert [(r["step"], r["loss"]) for r in read_lines(str(tmp_path))] == [(1, 4.0), (2, 3.0)]


def test_lines_are_on_disk_before_close(tmp_path):
  """Line-buffered: a run killed mid-way leaves every metric written so far."""
  writer = reporting.MetricsWriter(str(tmp_path))
  writer.write(5, {"loss": 1.0})
  assert read_lines(str(tmp_path)) == [{"step": 5, "kind": "train", "loss": 1.0}]
  writer.close()


def test_values_json_cannot_hold_become_strings(tmp_path):
  """Strings and ints pass through; numbers become floats; anything else its str()."""
  writer = reporting.MetricsWriter(str(tmp_path))
  writer.write(1, {"name": "base", "shape": [1, 2], "nan": float("nan"), "flag": np.bool_(True)})
  writer.close()
  with open(os.path.join(str(tmp_path), "metrics.jsonl")) as f:
    line = f.read()
  record = json.loads(line)
  assert record["name"] == "base"
  assert record["shape"] == "[1, 2]"
  assert record["flag"] == 1.0
  assert np.isnan(record["nan"])


def test_tensorboard_summaries_hold_each_scalar(tmp_path):
  import tensorflow as tf
  writer = reporting.MetricsWriter(str(tmp_path))
  writer.write(1, {"loss": 2.0, "name": "not a scalar"})
  writer.write(2, {"ce": 1.5}, kind="eval")
  writer.close()
  events = list((tmp_path / "tensorboard").iterdir())
  assert len(events) == 1 and events[0].name.startswith("events.out.tfevents")
  scalars = {}
  for record in tf.data.TFRecordDataset(str(events[0])):
    event = tf.compat.v1.Event.FromString(record.numpy())
    for value in event.summary.value:
      scalars[(value.tag, event.step)] = float(tf.make_ndarray(value.tensor))
  assert scalars == {("train/loss", 1): 2.0, ("eval/ce", 2): 1.5}


def test_disabled_writer_writes_nothing(tmp_path):
  """Processes other than 0 get a writer that creates no files."""
  writer = reporting.MetricsWriter(str(tmp_path), enabled=False)
  writer.write(1, {"loss": 2.0})
  writer.write(2, {"ce": 1.0}, kind="eval")
  writer.close()
  assert os.listdir(str(tmp_path)) == []


def metrics(**overrides):
  m = {"loss": 4.11349, "ppl": 45.2049, "accuracy": 0.30951, "lr": 3.1234e-4,
       "tokens_per_sec": 2950.4, "mfu": 0.38, "hfu": 0.4132, "padding_efficiency": 0.9215,
       "eta_s": 552.0}
  return {**m, **overrides}


def test_progress_line_shows_every_number(monkeypatch):
  monkeypatch.setattr(reporting.time, "time", lambda: 1000.0)
  line = reporting.progress_line(500, 6000, metrics(), started=1000.0 - 125.0)
  assert line == ("step 500/6000 | loss 4.113 | ppl 45.20 | acc 0.310 | lr 3.12e-04 | "
                  "2,950 tok/s | MFU 38.0% (HFU 41.3%, 92% real) | ETA 9m12s | 2m05s elapsed")


def test_progress_line_with_unknown_eta_and_long_runs(monkeypatch):
  monkeypatch.setattr(reporting.time, "time", lambda: 10_000.0)
  line = reporting.progress_line(7, 100_000, metrics(eta_s=float("inf"), mfu=0.0041,
                                                     tokens_per_sec=1_234_567.0),
                                 started=10_000.0 - 7500.0)
  assert line.startswith("step 7/100000 | ")
  assert "| 1,234,567 tok/s |" in line
  assert "| MFU 0.4% (HFU 41.3%, 92% real) |" in line
  assert "| ETA ? |" in line
  assert line.endswith("| 2h05m elapsed")


def test_progress_line_without_a_known_peak(monkeypatch):
  """An unknown device kind: the record has no mfu or hfu, and the line says n/a."""
  monkeypatch.setattr(reporting.time, "time", lambda: 1000.0)
  m = metrics()
  del m["mfu"], m["hfu"]
  line = reporting.progress_line(500, 6000, m, started=1000.0 - 125.0)
  assert "| 2,950 tok/s | MFU n/a (92% real) | ETA 9m12s |" in line
  del m["padding_efficiency"]
  line = reporting.progress_line(500, 6000, m, started=1000.0 - 125.0)
  assert "| 2,950 tok/s | MFU n/a | ETA 9m12s |" in line
