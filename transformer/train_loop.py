"""The training run: setup, data, model, sharding, restore, loop, final evaluation.

`train_and_evaluate(config, workdir)` is what `train.py` calls. Rerunning it on the same
workdir resumes from the newest complete checkpoint, with the data iterator where it
was, so an interrupted run ends with the same parameters as an uninterrupted one.
"""

from __future__ import annotations

import math
import os
import signal
import tempfile
import time
from typing import Any

import jax
import jax.experimental.multihost_utils
import ml_collections
from absl import logging

from transformer import (checkpoints, data, eval_loop, evaluation, flops, prefetch, reporting,
                         sharding, trainer)
from transformer import config as config_lib


class TrainingError(RuntimeError):
  """A run that must stop: the message says why and at which step."""


class PreemptionSignal:
  """SIGTERM/SIGINT ask the loop to checkpoint and exit 0; a second SIGINT aborts."""

  def __init__(self):
    self.received = None
    self._previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    if self.received is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.received = signal.Signals(signum).name
    logging.warning("%s received: saving a checkpoint after this step, then exiting",
                    self.received)

  def restore(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def check_workdir_writable(workdir: str) -> None:
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=workdir):
      pass
  except OSError as e:
    raise TrainingError(f"workdir {workdir} is not writable: {e.strerror or e}") from None


class _Progress:
  """Accumulates step metrics on device and turns them into a logged record."""

  def __init__(self, peak_flops: float, total_steps: int):
    self.peak_flops = peak_flops
    self.total_steps = total_steps
    self.pending: list[dict] = []
    self.pending_flops = 0
    self.window_start = time.time()

  def add(self, metrics: dict, step_flops: int) -> None:
    self.pending.append(metrics)
    self.pending_flops += step_flops

  def check_finite(self, first_step: int) -> None:
    """Raises at the first step whose loss is NaN or Inf (fetches pending losses)."""
    losses = jax.device_get([m["loss"] for m in self.pending])
    for offset, loss in enumerate(losses):
      if not math.isfinite(float(loss)):
        raise TrainingError(
            f"loss is {float(loss)} at step {first_step + offset}: stopping; "
            "the last checkpoint before it is intact")

  def record(self, step: int) -> dict[str, float]:
    sums = eval_loop.sum_metrics(self.pending)
    elapsed = max(time.time() - self.window_start, 1e-9)
    tokens = max(sums["num_tokens"], 1.0)
    ce = sums["ce_sum"] / tokens
    steps_per_sec = len(self.pending) / elapsed
    record = {
        "loss": sums["loss_sum"] / tokens,
        "ce": ce,
        "ppl": math.exp(min(ce, 50.0)),
        "accuracy": sums["correct_sum"] / tokens,
        "lr": sums["lr"] / len(self.pending),
        "grad_norm": sums["grad_norm"] / len(self.pending),
        "tokens_per_sec": sums["num_tokens"] / elapsed,
        "steps_per_sec": steps_per_sec,
        "mfu": self.pending_flops / elapsed / self.peak_flops,
        "eta_s": (self.total_steps - step) / max(steps_per_sec, 1e-9),
    }
    self.pending, self.pending_flops, self.window_start = [], 0, time.time()
    return record


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains (or resumes) in `workdir`; returns the last validation metrics."""
  # --- Setup: everything that can be wrong is checked before any compile.
  config_lib.validate(config)
  is_chief = jax.process_index() == 0
  check_workdir_writable(workdir)
  mesh = sharding.create_mesh(config)
  rules = sharding.axis_rules(config)
  logging.info("mesh %s over %d devices, %d processes", dict(mesh.shape),
               jax.device_count(), jax.process_count())
  if is_chief:  # written whole and renamed, so a kill never leaves half a config.json
    path = os.path.join(workdir, "config.json")
    with open(path + ".tmp", "w") as f:
      f.write(config.to_json_best_effort(indent=2))
    os.replace(path + ".tmp", path)

  # --- Data.
  tokenizer = data.get_tokenizer(config, workdir)
  train_iter = data.make_train_iterator(
      config, tokenizer, process_index=jax.process_index(),
      process_count=jax.process_count(),
      row_multiple=sharding.batch_row_multiple(mesh, rules))

  # --- Model, optimizer and sharded state.
  model = trainer.build_model(config)
  optimizer = trainer.make_optimizer(config)
  abstract_state, state_shardings = trainer.state_shardings(model, optimizer, config, mesh)

  # --- Restore, or start fresh.
  checkpointer = checkpoints.Checkpointer(workdir, config.keep_checkpoints, clean_torn=True)
  latest = checkpointer.latest_step()
  if latest is not None:
    checkpoints.check_compatible(checkpointer.saved_config(latest), config)
    state, iterator_state = checkpointer.restore(
        latest, checkpoints.abstract_with_shardings(abstract_state, state_shardings))
    train_iter.set_state(iterator_state)
    logging.info("resumed from step %d", latest)
  else:
    state = trainer.create_train_state(model, optimizer, config, state_shardings,
                                       jax.random.key(config.seed))
  num_params = sum(x.size for x in jax.tree.leaves(abstract_state.params))
  logging.info("%s parameters", f"{num_params:,}")

  p_train_step = trainer.jit_train_step(model, optimizer, config, state_shardings, mesh)
  p_eval_step = trainer.jit_eval_step(model, config, state_shardings.params, mesh)
  writer = reporting.MetricsWriter(workdir, enabled=is_chief)
  peak = flops.device_peak_flops()
  if jax.devices()[0].platform != "cpu":  # fake CPU devices share the same cores
    peak *= jax.device_count()
  total_steps = config.num_train_steps * config.grad_accum_steps
  start_step = int(jax.device_get(state.step))
  progress = _Progress(peak, total_steps)
  if start_step >= total_steps:
    logging.info("already trained to step %d of %d", start_step, total_steps)
    checkpointer.close()
    return {"step": start_step}
  started = last_save_time = time.time()
  first_unchecked = start_step + 1
  eval_metrics: dict[str, Any] = {}

  def save(step: int) -> None:
    nonlocal first_unchecked, last_save_time
    progress.check_finite(first_unchecked)  # a NaN state is never written
    first_unchecked = step + 1
    checkpointer.save(step, state, batches.get_state(), config)
    last_save_time = time.time()

  eval_batches, bleu_pairs = [], []
  if config.eval_every_steps:
    eval_batches = data.make_eval_batches(config, tokenizer, "validation",
                                          process_index=jax.process_index(),
                                          process_count=jax.process_count())
    if config.eval_bleu_sentences and not config.model.decoder_only:
      bleu_pairs = data.load_raw_pairs(config, "validation")[:config.eval_bleu_sentences]

  def evaluate(step: int) -> dict[str, Any]:
    """Validation loss and perplexity; BLEU of a beam-searched subset."""
    metrics = eval_loop.evaluate_loss(p_eval_step, state.params, eval_batches, mesh, rules,
                                      config.num_eval_batches)
    if bleu_pairs:
      hypotheses = eval_loop.beam_translate(model, state.params, tokenizer, config, mesh,
                                            rules, [s for s, _ in bleu_pairs])
      metrics["bleu"] = evaluation.sacre_bleu(hypotheses, [r for _, r in bleu_pairs]).score
    writer.write(step, metrics, kind="validation")
    if is_chief:
      bleu = f" | BLEU {metrics['bleu']:.2f}" if "bleu" in metrics else ""
      print(f"validation at step {step}: ce {metrics['ce']:.4f} | ppl {metrics['ppl']:.2f}"
            f"{bleu}", flush=True)
    return metrics

  # --- The loop. Metrics stay on device until a log step, so steps run back to back;
  # two global batches are built ahead on a thread (its state is that of the consumed ones).
  batches = prefetch.Prefetcher(train_iter, lambda b: sharding.global_batch(b, mesh, rules),
                                size=2)
  preemption = PreemptionSignal()
  finished = False
  try:
    for step in range(start_step + 1, total_steps + 1):
      batch = next(batches)
      state, metrics = p_train_step(state, batch)
      rows = batch["decoder_input"].shape[0]
      source_len = batch["source"].shape[1] if "source" in batch else 0
      progress.add(metrics, flops.training_flops(model.config, rows, source_len,
                                                 batch["decoder_input"].shape[1]))

      is_last = step == total_steps
      if step % config.log_every_steps == 0 or is_last:
        progress.check_finite(first_unchecked)
        first_unchecked = step + 1
        record = progress.record(step)
        record["elapsed_s"] = time.time() - started
        writer.write(step, record)
        if is_chief:
          print(reporting.progress_line(step, total_steps, record, started), flush=True)

      if config.eval_every_steps and (step % config.eval_every_steps == 0 or is_last):
        eval_metrics = evaluate(step)

      by_steps = config.checkpoint_every_steps and step % config.checkpoint_every_steps == 0
      by_time = (config.checkpoint_every_minutes and step % config.log_every_steps == 0 and
                 time.time() - last_save_time >= 60 * config.checkpoint_every_minutes)
      if by_time and jax.process_count() > 1:  # every host must agree to save
        by_time = bool(jax.experimental.multihost_utils.broadcast_one_to_all(by_time))
      preempted = preemption.received is not None
      if jax.process_count() > 1:  # hosts agree on the step through jax.distributed
        preempted = checkpointer.reached_preemption(step) or preempted
      if by_steps or by_time or is_last or preempted:
        save(step)
      if preempted:
        checkpointer.wait()
        logging.info("checkpoint at step %d written after %s; exiting", step,
                     preemption.received or "preemption notice")
        break
    finished = True
  finally:
    batches.close(close_iterator=finished)  # on an error the process exits right after
    preemption.restore()
    checkpointer.close()
    writer.close()
  return {"step": step, **eval_metrics}
