"""Where training reports go: a progress line, WORKDIR/metrics.jsonl and TensorBoard.

Only process 0 writes; the others get a writer that does nothing.
"""

from __future__ import annotations

import json
import os
import time

from absl import logging

from transformer.messages import format_duration


class MetricsWriter:
  """Appends one JSON object per call to metrics.jsonl and mirrors it to TensorBoard."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    self._jsonl = None
    self._tensorboard = None
    if enabled:
      self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", buffering=1)
      try:
        from tensorboardX import SummaryWriter
        self._tensorboard = SummaryWriter(os.path.join(workdir, "tensorboard"))
      except ImportError:  # TensorBoard summaries are optional
        logging.warning("tensorboardX is not installed: no TensorBoard summaries")

  def write(self, step: int, metrics: dict, kind: str = "train") -> None:
    if not self.enabled:
      return
    record = {"step": int(step), "kind": kind, **{k: _plain(v) for k, v in metrics.items()}}
    self._jsonl.write(json.dumps(record) + "\n")
    if self._tensorboard is not None:
      for key, value in record.items():
        if key not in ("step", "kind") and isinstance(value, (int, float)):
          self._tensorboard.add_scalar(f"{kind}/{key}", value, step)

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tensorboard is not None:
      self._tensorboard.close()


def _plain(value):
  try:
    return float(value) if not isinstance(value, (int, str)) else value
  except (TypeError, ValueError):
    return str(value)


def progress_line(step: int, total: int, m: dict, started: float) -> str:
  """e.g. `step 500/6000 | loss 4.113 | ppl 45.2 | acc 0.31 | lr 3.1e-04 | 2,950 tok/s | MFU 38.0% | ETA 9m12s`."""
  elapsed = time.time() - started
  return (f"step {step}/{total} | loss {m['loss']:.3f} | ppl {m['ppl']:.2f} | "
          f"acc {m['accuracy']:.3f} | lr {m['lr']:.2e} | {m['tokens_per_sec']:,.0f} tok/s | "
          f"MFU {100 * m['mfu']:.1f}% | ETA {format_duration(m['eta_s'])} "
          f"| {format_duration(elapsed)} elapsed")
