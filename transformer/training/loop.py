"""The training run: setup, data, model, sharding, restore, loop, final evaluation.

`train_and_evaluate(config, workdir)` is what `train.py` calls. Rerunning it on the same
workdir resumes from the newest complete checkpoint, with the data iterator where it
was, so an interrupted run ends with the same parameters as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.experimental.multihost_utils
import ml_collections
import numpy as np
from absl import logging

from transformer import config as config_lib
from transformer import data, storage, versions
from transformer.inference import metrics, sharding
from transformer.inference.metrics import ValidationLoss
from transformer.model import ModelConfig
from transformer.training import (
  checkpoints,
  draft,
  flops,
  goodput,
  prefetch,
  reporting,
  state,
  steps,
)


class TrainingError(RuntimeError):
  """A run that must stop: the message says why and at which step."""


class PreemptionSignal:
  """SIGTERM/SIGINT ask the loop to checkpoint and exit 0; a second SIGINT aborts.

  One process: Python handlers note either signal in `received`. Several processes:
  SIGTERM is left to jax.distributed's preemption service. Its own handler, installed by
  `jax.distributed.initialize`, tells every host through the coordination service, which
  picks one step for all of them (`TrainingRun._preempted`); a Python handler here would
  replace it, and each host would then stop alone at its own step while the others wait
  for it in a collective. Ctrl-C on one host becomes that same notice: the handler sends
  SIGTERM to its own process.
  """

  def __init__(self, several_processes: bool = False):
    self.received = None
    # Set once the loop has ended (`TrainingRun.train`): a notice then only waits for the
    # last checkpoint's commit, which the process does anyway before it exits 0.
    self.finishing = False
    self._several_processes = several_processes
    self._previous = {}
    signals = (signal.SIGINT,) if several_processes else (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
      self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    if self.received is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.received = signal.Signals(signum).name
    if self._several_processes:  # jax.distributed's handler takes it from here
      os.kill(os.getpid(), signal.SIGTERM)
    if self.finishing:
      logging.warning(
        "%s received: the run is finishing; exiting once its last checkpoint is written",
        self.received,
      )
    else:
      logging.warning(
        "%s received: saving a checkpoint after this step, then exiting", self.received
      )

  def restore(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def check_workdir_writable(workdir: str) -> None:
  try:
    storage.check_writable(workdir)
  except OSError as e:
    raise TrainingError(f"workdir {workdir} is not writable: {e}") from None


def write_run_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """WORKDIR/config.json, written whole: a kill never leaves half of it. Its `versions`
  are the libraries of the process that last started the run (versions.py)."""
  record = json.loads(config.to_json_best_effort())
  record["versions"] = versions.library_versions()
  storage.write_json(storage.join(workdir, "config.json"), record)


class Progress:
  """Step metrics kept on device until a log step, then one logged record.

  Losses are checked for NaN/Inf in order, each step once: at log steps and before
  every checkpoint, so a NaN state is never written.

  Utilisation, against `peak_flops` (None: unknown device, so neither is reported):
    hfu  the FLOPs of the padded batch shapes (`step_flops`): what the hardware computed;
    mfu  the FLOPs the model needs for the real tokens (`token_counts`, from
         flops.count_tokens, with `model_config`): comparable across batchings, and
         the figure tokens/s (real target tokens) goes with.
  and padding_efficiency (real target tokens / target slots; source_padding_efficiency
  likewise), which is why the two differ. A window's time leaves out validation and
  checkpoint saves (`paused`): throughput is the training step's.

  A window that computed faster than the peak (HFU above 100%) shows the peak was read
  low: `remeasure_peak` (the loop's: flops.total_peak_flops with remeasure=True) gives it
  again, between windows so outside their time, and the higher value stays.
  """

  def __init__(
    self,
    peak_flops: float | None,
    total_steps: int,
    model_config: ModelConfig | None = None,
    remeasure_peak: Callable[[], float | None] | None = None,
  ):
    self.peak_flops = peak_flops
    self.remeasure_peak = remeasure_peak
    self.total_steps = total_steps
    self.model_config = model_config
    self._pending: list[tuple[int, dict]] = []  # (step, metrics) since the last record
    self._checked = 0  # how many of _pending are known finite
    self._pending_flops = 0  # padded-shape FLOPs since the last record
    self._pending_counts: list[dict] = []  # flops.count_tokens of each step, on device
    self._window_start = time.time()

  def add(
    self, step: int, step_metrics: dict, step_flops: int, token_counts: dict | None = None
  ) -> None:
    self._pending.append((step, step_metrics))
    self._pending_flops += step_flops
    if token_counts is not None:
      self._pending_counts.append(token_counts)

  @contextlib.contextmanager
  def paused(self):
    """Leaves what runs inside (validation, a checkpoint's save) out of the window's time,
    so tokens/s and MFU measure training alone. The steps already dispatched finish
    first, inside the window."""
    if self._pending:
      jax.block_until_ready(self._pending[-1][1])
    start = time.time()
    try:
      yield
    finally:
      self._window_start += time.time() - start

  def pending_steps(self) -> int:
    """Steps added since the last record."""
    return len(self._pending)

  def check_finite(self) -> None:
    """Raises at the first step whose loss is NaN or Inf (fetches unchecked losses)."""
    unchecked = self._pending[self._checked :]
    losses = jax.device_get([m["loss"] for _, m in unchecked])
    for (step, _), loss in zip(unchecked, losses):
      if not math.isfinite(float(loss)):
        raise TrainingError(
          f"loss is {float(loss)} at step {step}: stopping; the last checkpoint before it is intact"
        )
    self._checked = len(self._pending)

  def record(self, step: int) -> dict[str, float | None]:
    """Averages since the last record, throughput, MFU/HFU and ETA; starts a new window."""
    self.check_finite()
    count = len(self._pending)
    sums = metrics.sum_metrics([m for _, m in self._pending])
    elapsed = max(time.time() - self._window_start, 1e-9)
    steps_per_sec = count / elapsed
    averages = metrics.token_averages(sums)
    del averages["num_tokens"]
    record = {
      **averages,
      "lr": sums["lr"] / count,
      "grad_norm": sums["grad_norm"] / count,
      "tokens_per_sec": sums["num_tokens"] / elapsed,
      "steps_per_sec": steps_per_sec,
      **self._utilisation(elapsed, count),
      "eta_s": (self.total_steps - step) / max(steps_per_sec, 1e-9),
    }
    self._pending, self._checked, self._pending_flops = [], 0, 0
    self._pending_counts = []
    self._window_start = time.time()
    return record

  def _utilisation(self, elapsed: float, count: int) -> dict[str, float | None]:
    """mfu, hfu, padding_efficiency (and the source's): each only where it is known."""
    out: dict[str, float | None] = {}
    counts = None
    if self.model_config is not None and count and len(self._pending_counts) == count:
      per_step = jax.device_get(self._pending_counts)
      counts = {k: sum(float(c[k]) for c in per_step) for k in flops.TOKEN_COUNT_KEYS}
      out["padding_efficiency"] = counts["target_tokens"] / counts["target_slots"]
      if counts["source_slots"]:
        out["source_padding_efficiency"] = counts["source_tokens"] / counts["source_slots"]
    if (
      self.peak_flops is not None
      and self.remeasure_peak is not None
      and self._pending_flops / elapsed > self.peak_flops
    ):
      remeasured = self.remeasure_peak()
      if remeasured is not None:
        self.peak_flops = max(self.peak_flops, remeasured)
    if self.peak_flops is not None:
      if counts is not None and self.model_config is not None:
        out["mfu"] = flops.utilisation(
          flops.real_training_flops(self.model_config, counts), elapsed, self.peak_flops
        )
      out["hfu"] = flops.utilisation(self._pending_flops, elapsed, self.peak_flops)
    return out


def train_and_evaluate(
  config: ml_collections.ConfigDict, workdir: str, validation=ValidationLoss
) -> dict[str, Any]:
  """Trains (or resumes) in `workdir`; returns the last validation metrics.

  validation: what runs every config.eval_every_steps, built as
  `validation(config, setup, tokenizer)` and called with the parameters.
  """
  clock = goodput.Clock()
  # Everything that can be wrong is checked before any compile.
  config_lib.validate(config)
  check_workdir_writable(workdir)
  run = TrainingRun(config, workdir, validation, clock)
  try:
    result = run.train()
    run.report_goodput(result["step"])
    return result
  finally:
    run.close()


def shared_tokenizer(config: ml_collections.ConfigDict, workdir: str) -> data.Tokenizer:
  """The run's vocabulary on every process: process 0 loads or trains it (and copies it
  into the workdir), then broadcasts the model's bytes to the others.

  No host but process 0 reads the vocabulary cache or waits for a file to appear, so
  the cache may be on a disk only process 0 sees (the default, ~/.cache).
  """
  if jax.process_count() == 1:
    return data.get_tokenizer(config, workdir)
  model_proto = data.get_tokenizer(config, workdir).model_proto if jax.process_index() == 0 else b""
  broadcast = jax.experimental.multihost_utils.broadcast_one_to_all
  size = int(broadcast(np.int64(len(model_proto))))
  buffer = np.zeros(size, np.uint8)
  buffer[: len(model_proto)] = np.frombuffer(model_proto, np.uint8)
  return data.Tokenizer(np.asarray(broadcast(buffer)).tobytes())


def _log_model(setup: state.Setup) -> None:
  """Logs the parameter count and what the model computes with: an "auto" dtype or
  attention kernel as resolved on this platform."""
  model_config = setup.model.config
  logging.info(
    "%s parameters; computes in %s, attention kernel %s",
    f"{setup.num_params:,}",
    model_config.dtype.name,
    model_config.attention_kernel,
  )


def _progress(
  config: ml_collections.ConfigDict, total_steps: int, model_config: ModelConfig
) -> Progress:
  """The run's Progress, its MFU taken against the devices' peak (logged with its source)."""
  peak = flops.total_peak_flops(configured=config.peak_flops_per_device)
  if peak is not None:  # MFU's denominator, and where it came from
    logging.info(
      "Peak %.1f TFLOP/s for MFU (%s)",
      peak / 1e12,
      flops.peak_source(config.peak_flops_per_device),
    )
  return Progress(
    peak,
    total_steps,
    model_config,
    remeasure_peak=functools.partial(
      flops.total_peak_flops, remeasure=True, configured=config.peak_flops_per_device
    ),
  )


class TrainingRun:
  """One run in a workdir: built (and restored) at construction, then `train()`, then
  `close()` (which the signal handlers `train()` installs last until)."""

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    workdir: str,
    validation=ValidationLoss,
    clock: goodput.Clock | None = None,
  ):
    self.config = config
    self.clock = clock or goodput.Clock()
    self.is_chief = jax.process_index() == 0
    draft.prepare_config(config)  # a shallow draft reads its target run's settings
    # --- Mesh, model, optimizer and the sharded state's shapes.
    self.setup = state.setup(config)
    logging.info(
      "mesh %s over %d devices, %d processes",
      dict(self.setup.mesh.shape),
      jax.device_count(),
      jax.process_count(),
    )
    if self.is_chief:
      write_run_config(config, workdir)
    # --- Data.
    self.tokenizer = shared_tokenizer(config, workdir)
    self.train_iter = data.make_train_iterator(
      config,
      self.tokenizer,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      row_multiple=sharding.batch_row_multiple(self.setup.mesh, self.setup.rules),
    )
    # --- Restore, or start fresh.
    self.checkpointer = checkpoints.Checkpointer(
      workdir, config.keep_checkpoints, clean_torn=True, timeout_s=config.storage_timeout_s
    )
    self.state = self._restore_or_init()
    _log_model(self.setup)
    self.writer = reporting.MetricsWriter(
      workdir, enabled=self.is_chief, timeout_s=config.storage_timeout_s
    )
    self.total_steps = config_lib.final_step(config)  # batches, grad_accum_steps an update
    self.progress = _progress(config, self.total_steps, self.setup.model.config)
    self.validate = (
      validation(config, self.setup.model_setup, self.tokenizer)
      if (config.eval_every_steps)
      else None
    )
    # This workdir's earlier starts (process 0 reports goodput): their last goodput
    # records, and the highest global step they logged, up to which steps are recomputed.
    self.earlier_goodput, self.highest_logged_step = (
      goodput.read_earlier(workdir) if self.is_chief else ({}, 0)
    )
    self.trained = False  # whether train() ran steps: a goodput line to print
    self.batches: prefetch.Prefetcher  # set by train(): the global batches, built ahead
    self.started = time.time()  # train()'s start, for the progress line's elapsed time
    # The run's signal handlers, from train()'s loop until close(): they cover the wait
    # for the last checkpoint's commit (report_goodput, close), which a SIGTERM would
    # otherwise cut short with the default action (exit 143, and SLURM does not requeue).
    self.preemption: PreemptionSignal | None = None
    self.last_save_time = time.time()

  def _restore_or_init(self) -> state.TrainState:
    latest = self.checkpointer.latest_step()
    if latest is None:
      fresh = self.setup.init_state(jax.random.key(self.config.seed))
      return draft.init_from_target(self.setup, fresh)  # a shallow draft's frozen parts
    with self.clock.timing("restore"):
      checkpoints.check_compatible(self.checkpointer.saved_config(latest), self.config)
      # The data first: a batch plan this mesh cannot split fails before the arrays load.
      self.train_iter.set_state(
        self.checkpointer.saved_iterator_state(latest),
        layout=f"mesh {dict(self.setup.mesh.shape)} over {jax.process_count()} processes",
      )
      restored, _ = self.checkpointer.restore(latest, self.setup.restore_target())
    logging.info("resumed from step %d", latest)
    return restored

  def train(self) -> dict[str, Any]:
    """The loop. Metrics stay on device until a log step, so steps run back to back; two
    global batches are built ahead on a thread (its state is that of the consumed ones).

    Installs the run's SIGTERM/SIGINT handlers (PreemptionSignal), which `close()` gives
    back once the last save is committed: a notice while it commits must not kill the
    process (the default action) but let it finish and exit 0."""
    start_step = int(jax.device_get(self.state.step))
    if start_step >= self.total_steps:
      logging.info("already trained to step %d of %d", start_step, self.total_steps)
      return {"step": start_step}
    p_train_step = steps.jit_train_step(self.setup)
    self.batches = self._global_batches()
    if self.preemption is None:
      self.preemption = PreemptionSignal(several_processes=jax.process_count() > 1)
    preemption = self.preemption
    preemption.finishing = False
    self.started = started = time.time()
    eval_metrics: dict[str, Any] = {}
    finished = False
    clock = self.clock
    try:
      for step in range(start_step + 1, self.total_steps + 1):
        with clock.timing("input"):
          batch = next(self.batches)
        clock.current = "recomputed" if step <= self.highest_logged_step else "steps"
        with clock.timing("compile") if step == start_step + 1 else contextlib.nullcontext():
          self.state, step_metrics = p_train_step(self.state, batch)
        self.trained = True
        token_counts = step_metrics.pop("token_counts")
        self.progress.add(step, step_metrics, self._step_flops(batch), token_counts)
        is_last = step == self.total_steps
        if step % self.config.log_every_steps == 0 or is_last:
          self._log(step, started)
        # Asked before any validation: after a notice, the time left (SLURM's
        # --signal=TERM@120) is for the save alone. Every host asks here after every step
        # and gets the same answer, so all of them skip the validation together; the
        # last step's can be had from eval.py.
        preempted = self._preempted(step, start_step, preemption)
        if (
          self.validate and not preempted and (step % self.config.eval_every_steps == 0 or is_last)
        ):
          with self.progress.paused(), clock.timing("eval"):
            eval_metrics = self._evaluate(step)
        if self._checkpoint_due(step) or is_last or preempted:
          with self.progress.paused(), clock.timing("checkpoints"):
            self._save(step)
        if preempted:
          self._wait_for_last_save(step, preemption)
          break
      finished = True
    finally:
      self.batches.close(close_iterator=finished)  # on an error the process exits right after
      # The handlers stay until close(), after the last save's commit.
      preemption.finishing = True
    return {"step": step, **eval_metrics}

  def _global_batches(self) -> prefetch.Prefetcher:
    """The training iterator's batches as global arrays, two built ahead on a thread."""
    return prefetch.Prefetcher(
      self.train_iter,
      lambda b: sharding.global_batch(b, self.setup.mesh, self.setup.rules),
      size=2,
      timeout_s=self.config.storage_timeout_s,
      what=f"the training data of {self.config.dataset}",
    )

  def _wait_for_last_save(self, step: int, preemption: PreemptionSignal) -> None:
    """After a preemption notice: waits for `step`'s checkpoint to commit, and says so."""
    with self.clock.timing("checkpoints"):
      self.checkpointer.wait()
    logging.info(
      "checkpoint at step %d written after %s; exiting",
      step,
      preemption.received or "preemption notice",
    )

  def _step_flops(self, batch) -> int:
    """FLOPs of the batch's padded shape (HFU); MFU's real-token FLOPs come from
    flops.count_tokens."""
    rows, target_len = batch["decoder_input"].shape
    source_len = batch["source"].shape[1] if "source" in batch else 0
    return flops.training_flops(self.setup.model.config, rows, source_len, target_len)

  def _log(self, step: int, started: float) -> None:
    record = self.progress.record(step)
    record["elapsed_s"] = time.time() - started
    self.writer.write(step, record)
    if self.is_chief:
      print(reporting.progress_line(step, self.total_steps, record, started), flush=True)

  def _evaluate(self, step: int) -> dict[str, Any]:
    assert self.validate is not None  # called only when validation is on
    result = self.validate(self.state.params)
    self.writer.write(step, result, kind="validation")
    if self.is_chief:
      bleu_text = f" | BLEU {result['bleu']:.2f}" if "bleu" in result else ""
      print(
        f"validation at step {step}: ce {result['ce']:.4f} | ppl {result['ppl']:.2f}{bleu_text}",
        flush=True,
      )
    return result

  def _checkpoint_due(self, step: int) -> bool:
    """Every checkpoint_every_steps, or (checked at log steps) checkpoint_every_minutes."""
    config = self.config
    if config.checkpoint_every_steps and step % config.checkpoint_every_steps == 0:
      return True
    if not (config.checkpoint_every_minutes and step % config.log_every_steps == 0):
      return False
    due = time.time() - self.last_save_time >= 60 * config.checkpoint_every_minutes
    if jax.process_count() > 1:
      # Hosts' clocks differ: every host takes part in the broadcast, whatever its own
      # clock says, and all follow process 0's. A host that skipped it would leave the
      # others waiting in a collective.
      due = bool(jax.experimental.multihost_utils.broadcast_one_to_all(due))
    return due

  def _preempted(self, step: int, start_step: int, preemption: PreemptionSignal) -> bool:
    """Whether to save and stop after `step`: on several processes, the same answer at the
    same step on every host, whichever hosts got the notice and when.

    jax.distributed's preemption sync takes the largest count any host last gave it
    when the notice arrives, and answers true on every host when it is given that count
    plus one. Every host must ask after every step. It counts the steps taken since this
    start, from 0 as JAX's counter does, so that a notice during start-up, before any
    host has asked, stops the run after its first step; counted in global steps from a
    checkpoint, the count chosen (1) would already be behind every host, and no host
    would ever stop. This is the only place that gives the sync a count: Orbax's save
    would give it the global step (checkpoints._Manager keeps it from asking), and a
    notice between the two would be agreed a start step late, that is never.
    """
    if jax.process_count() > 1:
      return self.checkpointer.reached_preemption(step - start_step)
    return preemption.received is not None

  def _save(self, step: int) -> None:
    """Every step up to `step` is in the log before its checkpoint can commit: a run
    resumed from it never logs them again, so a record still queued when the process
    is killed (kill -9, the OOM killer, JAX's heartbeat abort) would be a gap for good.
    A save between log steps logs the steps since the last record first."""
    self.progress.check_finite()  # a NaN state is never written
    if self.progress.pending_steps():
      self._log(step, self.started)
    self.writer.write(step, self.clock.record(), kind=goodput.KIND)
    self.writer.flush()  # metrics.jsonl and TensorBoard, in the file or the bucket
    self.checkpointer.save(step, self.state, self.batches.get_state(), self.config)
    self.last_save_time = time.time()

  def report_goodput(self, step: int) -> None:
    """After the last save is written: this start's goodput record, and the workdir's
    line, summed over its starts (goodput.py)."""
    if not self.trained:
      return
    with self.clock.timing("checkpoints"):
      self.checkpointer.wait()
    record = self.clock.record()
    self.writer.write(step, record, kind=goodput.KIND)
    if self.is_chief:
      starts = {**self.earlier_goodput, record["start_time"]: record}
      print(goodput.summary_line(goodput.summed(list(starts.values()))), flush=True)

  def close(self) -> None:
    """Waits for the last save's commit, closes the log, then gives the signals back."""
    try:
      try:
        self.checkpointer.close()
      finally:
        self.writer.close()
    finally:
      if self.preemption is not None:
        self.preemption.restore()
        self.preemption = None
