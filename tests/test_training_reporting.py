"""metrics.jsonl (one JSON object per write, with step and kind), written off the
training thread at a cost per record that does not grow with the run, read back by
`reporting.read_metrics`; and the progress line."""

import json
import os
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from transformer import storage
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
    {"step": 20, "kind": "eval", "ce": 1.75, "bleu": 12.5},
  ]


def test_writer_keeps_the_lines_of_an_earlier_run(tmp_path):
  """A resumed run appends to metrics.jsonl; nothing written before is lost."""
  first = reporting.MetricsWriter(str(tmp_path))
  first.write(1, {"loss": 4.0})
  first.close()
  second = reporting.MetricsWriter(str(tmp_path))
  second.write(2, {"loss": 3.0})
  second.close()
  assert [(r["step"], r["loss"]) for r in read_lines(str(tmp_path))] == [(1, 4.0), (2, 3.0)]


def test_lines_are_on_disk_once_flushed(tmp_path):
  """A run killed mid-way leaves every metric flushed so far."""
  writer = reporting.MetricsWriter(str(tmp_path))
  writer.write(5, {"loss": 1.0})
  writer.flush()
  assert read_lines(str(tmp_path)) == [{"step": 5, "kind": "train", "loss": 1.0}]
  writer.close()


@pytest.fixture
def blocked_flush(monkeypatch):
  """AppendLog.flush held until the returned event is set: a storage that does not answer."""
  release = threading.Event()
  original = storage.AppendLog.flush

  def flush(self):
    release.wait()
    original(self)

  monkeypatch.setattr(storage.AppendLog, "flush", flush)
  yield release
  release.set()


def test_write_returns_while_the_storage_is_busy(tmp_path, blocked_flush):
  writer = reporting.MetricsWriter(str(tmp_path))
  for step in range(1, 4):  # the first upload is held; the others queue behind it
    writer.write(step, {"loss": 1.0})
  assert not os.path.exists(tmp_path / "metrics.jsonl")
  blocked_flush.set()
  writer.close()
  assert [r["step"] for r in reporting.read_metrics(str(tmp_path))] == [1, 2, 3]


def test_a_stalled_write_is_an_error_naming_the_object(tmp_path, blocked_flush):
  writer = reporting.MetricsWriter(str(tmp_path), timeout_s=0.3)
  writer.write(1, {"loss": 1.0})
  with pytest.raises(storage.StorageTimeout) as raised:
    writer.flush()
  message = str(raised.value)
  assert message.startswith(
    f"writing {tmp_path / 'metrics.jsonl'} did not finish within 0.3 s (config.storage_timeout_s)"
  ), message
  with pytest.raises(storage.StorageTimeout):
    writer.write(2, {"loss": 1.0})  # every later write says so too
  writer.close()  # returns: the stalled write is not waited for


def test_a_failed_write_is_raised_on_the_next_write_in_one_line(tmp_path):
  writer = reporting.MetricsWriter(str(tmp_path))
  (tmp_path / "metrics.jsonl").mkdir()  # a folder where the file should be
  writer.write(1, {"loss": 1.0})
  with pytest.raises(reporting.MetricsError) as raised:
    writer.flush()
  message = str(raised.value)
  assert (
    message.startswith(f"cannot write {tmp_path / 'metrics.jsonl'}: ") and "\n" not in message
  ), message
  with pytest.raises(reporting.MetricsError):
    writer.write(2, {"loss": 1.0})
  with pytest.raises(reporting.MetricsError):
    writer.close()


def test_readers_see_each_step_once_after_a_resume(tmp_path, monkeypatch):
  """A run logged steps 1-5 (validation at 4) and was killed, tearing its last line; its
  checkpoint was at step 3 (with a goodput record), so the rerun logged 4 and 5 again,
  then 6, and was killed too. Goodput records are per start, all kept."""
  path = str(tmp_path / "metrics.jsonl")
  first = [
    (1, "train"),
    (2, "train"),
    (3, "train"),
    (3, "goodput"),
    (4, "train"),
    (4, "validation"),
    (5, "train"),
  ]
  rerun = [
    (4, "train"),
    (4, "validation"),
    (5, "train"),
    (6, "train"),
    (6, "goodput"),
    (6, "validation"),
  ]
  for run, records in ((1, first), (2, rerun)):
    log = storage.AppendLog(path)  # opened again, as a rerun does
    for step, kind in records:
      log.write_line(json.dumps({"step": step, "kind": kind, "run": run}))
    log.write_line('{"step": 7, "ki')
    log.flush()
  warnings = []
  monkeypatch.setattr(reporting.logging, "warning", lambda *a: warnings.append(a[0] % a[1:]))
  records = reporting.read_metrics(str(tmp_path))
  assert warnings == [f"{path}: 2 torn line(s) skipped (a run killed while writing)"]
  assert [(r["step"], r["run"]) for r in reporting.read_metrics(str(tmp_path), "goodput")] == [
    (3, 1),
    (6, 2),
  ]
  assert [(r["step"], r["kind"], r["run"]) for r in records] == [
    (1, "train", 1),
    (2, "train", 1),
    (3, "train", 1),
    (4, "train", 2),
    (4, "validation", 2),
    (5, "train", 2),
    (6, "train", 2),
    (6, "validation", 2),
  ]
  assert [r["step"] for r in reporting.read_metrics(str(tmp_path), kind="validation")] == [4, 6]


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
  m = {
    "loss": 4.11349,
    "ppl": 45.2049,
    "accuracy": 0.30951,
    "lr": 3.1234e-4,
    "tokens_per_sec": 2950.4,
    "mfu": 0.38,
    "hfu": 0.4132,
    "padding_efficiency": 0.9215,
    "eta_s": 552.0,
  }
  return {**m, **overrides}


def test_progress_line_shows_every_number(monkeypatch):
  monkeypatch.setattr(reporting.time, "time", lambda: 1000.0)
  line = reporting.progress_line(500, 6000, metrics(), started=1000.0 - 125.0)
  assert line == (
    "step 500/6000 | loss 4.113 | ppl 45.20 | acc 0.310 | lr 3.12e-04 | "
    "2,950 tok/s | MFU 38.0% (HFU 41.3%, 92% real) | ETA 9m12s | 2m05s elapsed"
  )


def test_progress_line_with_unknown_eta_and_long_runs(monkeypatch):
  monkeypatch.setattr(reporting.time, "time", lambda: 10_000.0)
  line = reporting.progress_line(
    7,
    100_000,
    metrics(eta_s=float("inf"), mfu=0.0041, tokens_per_sec=1_234_567.0),
    started=10_000.0 - 7500.0,
  )
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


def test_bytes_uploaded_grow_linearly_with_the_records(gcs):  # noqa: F811
  """In a bucket, a record's upload must not carry the records before it again: the
  second 500 records cost about what the first 500 did (rewriting whole files, as
  before, costs three times as much), and no upload is much larger than a chunk."""
  record = {
    "loss": 4.1,
    "ce": 4.0,
    "ppl": 55.0,
    "accuracy": 0.3,
    "lr": 1e-4,
    "grad_norm": 1.5,
    "tokens_per_sec": 2950.4,
    "steps_per_sec": 3.1,
    "mfu": 0.38,
    "hfu": 0.41,
    "padding_efficiency": 0.92,
    "eta_s": 552.0,
    "elapsed_s": 10.0,
  }
  writer = reporting.MetricsWriter(f"{gcs.url}/run")
  uploaded = []
  for step in range(1, 1001):
    writer.write(step, record)
    if step % 10 == 0:
      writer.flush()  # an upload every 10 records (one per record takes 10x the time)
    if step % 500 == 0:
      uploaded.append(gcs.uploaded_bytes("run/"))
  writer.close()
  first, second = uploaded[0], uploaded[1] - uploaded[0]
  assert second < 1.25 * first, (first, second)
  line_bytes = len(json.dumps({"step": 1000, "kind": "train", **record})) + 1
  largest = max(r["bytes"] for r in gcs.requests() if r["object"].startswith("run/"))
  # A chunk of metrics.jsonl closes past LOG_CHUNK_BYTES; an event file holds
  # TENSORBOARD_VALUES_PER_FILE values of about 70 bytes.
  assert largest < storage.LOG_CHUNK_BYTES + 10 * line_bytes, largest
  records = reporting.read_metrics(f"{gcs.url}/run")
  assert [r["step"] for r in records] == list(range(1, 1001))
  assert records[-1] == {"step": 1000, "kind": "train", **record}
