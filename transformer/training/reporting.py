"""Where training reports go: a progress line, WORKDIR/metrics.jsonl and TensorBoard.

Only process 0 writes; the others get a writer that does nothing. Records are written
by a thread of their own, so a slow bucket never holds up a training step, and the
cost of a record does not grow with the run: metrics.jsonl is chunked in a bucket
(`storage.AppendLog`), and TensorBoard's event file, which TensorFlow's GCS client
uploads whole at each flush, is started anew every `TENSORBOARD_VALUES_PER_FILE` values
(TensorBoard reads a folder's event files as one stream). `read_metrics` reads the
records back, as everything that reads metrics.jsonl should.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from typing import Any

from absl import logging

from transformer import storage
from transformer.messages import format_duration
from transformer.training import flops

# About 56 KiB of events (a scalar's event is about 70 bytes); see the module's docstring.
TENSORBOARD_VALUES_PER_FILE = 800
# Records waiting for the writer thread before `write` waits for it: only a storage far
# behind the loop (or stalled, which `storage_timeout_s` ends) fills it.
_QUEUE_RECORDS = 1000
_POLL_S = 0.05
_STOP = object()


class MetricsError(RuntimeError):
  """A record that could not be written; the message names the object."""


class MetricsWriter:
  """Adds one JSON object per call to metrics.jsonl and mirrors it to TensorBoard.

  `write` hands the record to the writer thread and returns; an error there is raised
  by the next `write`, `flush` or `close`, in one line. A write that has not finished
  after `timeout_s` raises `storage.StorageTimeout` naming the object, rather than
  waiting for it.
  """

  def __init__(self, workdir: str, enabled: bool = True, timeout_s: float = 600.0):
    self.enabled = enabled
    self.timeout_s = timeout_s
    if not enabled:
      return
    self._jsonl = storage.AppendLog(storage.join(workdir, "metrics.jsonl"))
    import tensorflow as tf  # already loaded by the input pipeline

    self._tf = tf
    self._tensorboard_dir = storage.join(workdir, "tensorboard")
    self._rotate = storage.is_remote(workdir)  # local files are appended to in place
    self._tensorboard: Any = None  # a tf.summary.SummaryWriter once opened
    self._tensorboard_values = 0
    self._tensorboard_opened = 0.0
    self._scalar_metadata = tf.compat.v1.SummaryMetadata(
      plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars")
    )
    self._queue: queue.Queue = queue.Queue(maxsize=_QUEUE_RECORDS)
    self._submitted = self._written = 0
    self._progress = threading.Condition()
    self._error: BaseException | None = None
    self._busy_with = ""  # the write in progress
    self._busy_since: float | None = None
    self._thread = threading.Thread(target=self._run, name="metrics-writer", daemon=True)
    self._thread.start()

  # ---- the training thread's side ------------------------------------------------

  def write(self, step: int, metrics: dict, kind: str = "train") -> None:
    """Queues one record; it is in the file (and the bucket) once `flush` returns."""
    if not self.enabled:
      return
    self._check()
    record = {"step": int(step), "kind": kind, **{k: _plain(v) for k, v in metrics.items()}}
    while True:
      try:
        self._queue.put(record, timeout=_POLL_S)
        break
      except queue.Full:
        self._check()
    with self._progress:
      self._submitted += 1

  def flush(self) -> None:
    """Waits until every record written so far is stored; raises if one cannot be."""
    if not self.enabled:
      return
    with self._progress:
      while self._written < self._submitted:
        self._check()
        self._progress.wait(_POLL_S)
    self._check()

  def close(self) -> None:
    """Flushes and stops the thread. After a stall it returns at once: the stalled write
    cannot be waited for."""
    if not self.enabled or isinstance(self._error, storage.StorageTimeout):
      return
    if self._thread.is_alive():
      self.flush()
      self._queue.put(_STOP)
      self._thread.join(self.timeout_s)
    self._check()

  def _check(self) -> None:
    """Raises the writer thread's error, or a timeout if its write is overdue."""
    if self._error is not None:
      raise self._error
    started = self._busy_since
    if started is not None and time.monotonic() - started > self.timeout_s:
      self._error = storage.StorageTimeout(storage.timeout_message(self._busy_with, self.timeout_s))
      raise self._error

  # ---- the writer thread -------------------------------------------------------------

  def _run(self) -> None:
    stop = False
    while not stop:
      records = [self._queue.get()]
      while True:  # everything waiting goes out in one upload per file
        try:
          records.append(self._queue.get_nowait())
        except queue.Empty:
          break
      stop = records[-1] is _STOP
      records = [r for r in records if r is not _STOP]
      try:
        self._store(records)
      except Exception as e:  # pylint: disable=broad-except  (tf.errors.* are not OSError)
        if self._error is None:
          self._error = MetricsError(f"cannot write {self._busy_with}: {storage.error_text(e)}")
        return
      finally:
        self._busy_since = None
      with self._progress:
        self._written += len(records)
        self._progress.notify_all()
    if self._tensorboard is not None:
      self._busy(f"TensorBoard events in {self._tensorboard_dir}")
      try:
        self._tensorboard.close()
      except Exception as e:  # pylint: disable=broad-except
        self._error = MetricsError(f"cannot write {self._busy_with}: {storage.error_text(e)}")
      finally:
        self._busy_since = None

  def _busy(self, what: str) -> None:
    self._busy_with, self._busy_since = what, time.monotonic()

  def _store(self, records: list[dict]) -> None:
    if not records:
      return
    for record in records:
      self._jsonl.write_line(json.dumps(record))
    self._busy(self._jsonl.object_name())
    self._jsonl.flush()
    self._busy(f"TensorBoard events in {self._tensorboard_dir}")
    for record in records:
      if self._tensorboard is None or (
        self._rotate and self._tensorboard_values >= TENSORBOARD_VALUES_PER_FILE
      ):
        self._open_tensorboard_file()
      values = {
        key: value
        for key, value in record.items()
        if key not in ("step", "kind") and isinstance(value, (int, float))
      }
      # One Summary of scalar-plugin values per record: what tf.summary.scalar writes,
      # without the tensorboard package, and in one op rather than one per value.
      summary = self._tf.compat.v1.Summary(
        value=[
          self._tf.compat.v1.Summary.Value(
            tag=f"{record['kind']}/{key}",
            metadata=self._scalar_metadata,
            tensor=self._tf.make_tensor_proto(float(value), self._tf.float32),
          )
          for key, value in values.items()
        ]
      )
      self._tf.summary.experimental.write_raw_pb(summary.SerializeToString(), step=record["step"])
      self._tensorboard_values += len(values)
    self._tensorboard.flush()

  def _open_tensorboard_file(self) -> None:
    """A new event file. Its name starts with the time in whole seconds, and TensorBoard
    reads a folder's files in name order: the next file waits for the next second."""
    if self._tensorboard is not None:
      self._tensorboard.close()
      time.sleep(max(0.0, math.floor(self._tensorboard_opened) + 1 - time.time()))
    self._tensorboard_opened = time.time()
    # Uploads only when this writer flushes: by default the file would also be flushed
    # (uploaded whole, on GCS) after every 10 values and every 2 minutes.
    self._tensorboard = self._tf.summary.create_file_writer(
      self._tensorboard_dir,
      max_queue=10 * TENSORBOARD_VALUES_PER_FILE,
      flush_millis=24 * 3600 * 1000,
    )
    # The default writer of this thread (the writer thread) only. Not `as_default()`:
    # leaving that context flushes the file, which on GCS means uploading it whole.
    self._tensorboard.set_as_default()
    self._tensorboard_values = 0


def read_metrics(workdir: str, kind: str | None = None) -> list[dict]:
  """The records of WORKDIR/metrics.jsonl in order (of `kind` only, if given).

  A resumed run logs again the steps after its checkpoint that the interrupted run had
  logged already: a record whose step is below an earlier one, or repeats one of its
  kind, starts over from that step, and the earlier records from there on are left out.
  Each step's records are the ones of the run that went on. Lines torn by a kill (the
  last line a killed run wrote on local disk) are skipped, with one warning.

  Goodput records (kind "goodput", training/goodput.py) belong to a start of the run,
  not to a step: they are all kept, in order, and only returned for kind="goodput".

  Reads the file or, in a bucket, its chunks (`storage.read_log_lines`): the one reader
  of a run's records, for the tools, the sweeps' --collect and render_docs alike.
  """
  path = storage.join(workdir, "metrics.jsonl")
  records: list[dict] = []
  per_start: list[dict] = []
  torn = 0
  for line in storage.read_log_lines(path):
    try:
      record = json.loads(line)
    except ValueError:
      torn += 1
      continue
    if record.get("kind") == "goodput":
      per_start.append(record)
      continue
    step = record.get("step", 0)
    tail = 0  # kept records at this step or later (they are in step order)
    while tail < len(records) and records[-1 - tail].get("step", 0) >= step:
      tail += 1
    if any(
      r.get("step", 0) > step or r.get("kind") == record.get("kind")
      for r in records[len(records) - tail :]
    ):
      del records[len(records) - tail :]
    records.append(record)
  if torn:
    logging.warning("%s: %d torn line(s) skipped (a run killed while writing)", path, torn)
  if kind == "goodput":
    return per_start
  return [r for r in records if kind is None or r.get("kind") == kind]


def _plain(value):
  try:
    return float(value) if not isinstance(value, (int, str)) else value
  except (TypeError, ValueError):
    return str(value)


def progress_line(step: int, total: int, m: dict, started: float) -> str:
  """e.g. `step 500/6000 | loss 4.113 | ppl 45.2 | acc 0.31 | lr 3.1e-04 | 2,950 tok/s |
  MFU 38.0% (HFU 41.3%, 92% real) | ETA 9m12s | 2m05s elapsed`.

  MFU counts real tokens, HFU the padded shape and "real" is the target side's padding
  efficiency (`loop.Progress`); `MFU n/a` where the device's peak is unknown.
  """
  elapsed = time.time() - started
  return (
    f"step {step}/{total} | loss {m['loss']:.3f} | ppl {m['ppl']:.2f} | "
    f"acc {m['accuracy']:.3f} | lr {m['lr']:.2e} | {m['tokens_per_sec']:,.0f} tok/s | "
    f"{_utilisation_text(m)} | ETA {format_duration(m['eta_s'])} "
    f"| {format_duration(elapsed)} elapsed"
  )


def _utilisation_text(m: dict) -> str:
  mfu = flops.utilisation_text("MFU", m.get("mfu"))
  details = []
  if m.get("hfu") is not None:
    details.append(flops.utilisation_text("HFU", m["hfu"]))
  if m.get("padding_efficiency") is not None:
    details.append(f"{100 * m['padding_efficiency']:.0f}% real")
  return f"{mfu} ({', '.join(details)})" if details else mfu
