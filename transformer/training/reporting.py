"""Where training reports go: a progress line, WORKDIR/metrics.jsonl and TensorBoard.

Only process 0 writes; the others get a writer that does nothing. Both files may live in
a bucket (gs://...): metrics.jsonl is rewritten whole at each record (see
`storage.AppendLog`), and TensorBoard events go through TensorFlow's summary writer,
which reaches gs:// with the same `tf.io.gfile` client as every other file of the run.
"""

from __future__ import annotations

import json
import time

from transformer import storage
from transformer.messages import format_duration


class MetricsWriter:
  """Adds one JSON object per call to metrics.jsonl and mirrors it to TensorBoard."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    self._jsonl = None
    self._tensorboard = None
    if enabled:
      self._jsonl = storage.AppendLog(storage.join(workdir, "metrics.jsonl"))
      import tensorflow as tf  # already loaded by the input pipeline
      self._tf = tf
      self._tensorboard = tf.summary.create_file_writer(storage.join(workdir, "tensorboard"))
      self._scalar_metadata = tf.compat.v1.SummaryMetadata(
          plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars"))

  def write(self, step: int, metrics: dict, kind: str = "train") -> None:
    """One record, in the file (and the bucket) when this returns."""
    if not self.enabled:
      return
    record = {"step": int(step), "kind": kind, **{k: _plain(v) for k, v in metrics.items()}}
    self._jsonl.write_line(json.dumps(record))
    self._jsonl.flush()
    with self._tensorboard.as_default():
      for key, value in record.items():
        if key not in ("step", "kind") and isinstance(value, (int, float)):
          # tf.summary.write with the scalar plugin's tag: what tf.summary.scalar writes,
          # without needing the tensorboard package in the training environment.
          self._tf.summary.write(f"{kind}/{key}", self._tf.constant(float(value)),
                                 step=int(step), metadata=self._scalar_metadata)
    self._tensorboard.flush()

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.flush()
    if self._tensorboard is not None:
      self._tensorboard.close()


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
  return (f"step {step}/{total} | loss {m['loss']:.3f} | ppl {m['ppl']:.2f} | "
          f"acc {m['accuracy']:.3f} | lr {m['lr']:.2e} | {m['tokens_per_sec']:,.0f} tok/s | "
          f"{_utilisation_text(m)} | ETA {format_duration(m['eta_s'])} "
          f"| {format_duration(elapsed)} elapsed")


def _utilisation_text(m: dict) -> str:
  mfu = f"MFU {100 * m['mfu']:.1f}%" if m.get("mfu") is not None else "MFU n/a"
  details = []
  if m.get("hfu") is not None:
    details.append(f"HFU {100 * m['hfu']:.1f}%")
  if m.get("padding_efficiency") is not None:
    details.append(f"{100 * m['padding_efficiency']:.0f}% real")
  return f"{mfu} ({', '.join(details)})" if details else mfu
