"""Faults that a test cannot cause from outside a process, injected into Orbax's save.

As a launcher it runs an entry point with the fault armed:

  FAULT_SLOW_SAVE_STEP=8 python tests/helpers/fault_injection.py train.py --config ...

- FAULT_SLOW_SAVE_STEP=N: the background write of checkpoint N stalls (FAULT_SLOW_SAVE_S
  seconds, default 600) after Orbax created `N.orbax-checkpoint-tmp`, so a `kill -9` lands
  in the middle of an asynchronous save. The stall creates the file FAULT_SLOW_SAVE_MARKER
  (if set) as it begins, for a test to wait on.
- FAULT_SLOW_RESTORE_S=S: every read of a checkpoint's JSON items (the first reads of a
  restore) waits S seconds first, as on a stalled bucket.
- FAULT_FULL_DISK_STEP=N: writing checkpoint N fails with OSError(ENOSPC), as on a full disk.
- FAULT_KILL_AFTER_SAVE_STEP=N: the process kills itself (SIGKILL) as soon as checkpoint
  N is committed, as the loop goes on: the kill that finds records still queued.
- FAULT_SLOW_LOG_S=S: every flush of an `AppendLog` (metrics.jsonl, on disk or in a
  bucket) waits S seconds first, as a slow bucket's uploads do, so records queue up.
- FAULT_SLOW_VALIDATION_S=S: every validation waits S seconds before it computes, after
  creating the file FAULT_SLOW_VALIDATION_MARKER (if set), so a signal lands inside it.
- A preemption notice from inside a window of the run, on several processes: process
  FAULT_NOTICE_PROCESS sends itself SIGTERM at the point below, then stays there until
  every process has told jax.distributed's preemption sync the count it last gave (the
  step the hosts will agree on is then fixed), so the notice is decided inside the window
  and not wherever the host has run on to by then. It creates FAULT_NOTICE_MARKER (if
  set) as it sends the signal, and prints the counts it saw.
  - FAULT_NOTICE_IN_SAVE=N: once Orbax's CheckpointManager.save of step N has returned,
    its commit in flight (with FAULT_SLOW_SAVE_STEP=N it stays in flight);
  - FAULT_NOTICE_IN_WAIT=N: once the process first waits for checkpoint N's commit after
    its save returned (CheckpointManager.wait_until_finished; with FAULT_SLOW_SAVE_STEP=N
    still in flight): for the last step, the wait after the loop has ended;
  - FAULT_NOTICE_AFTER_STEP=N: once step N is logged (the metrics writer's `write`,
    which every process calls), and, with FAULT_NOTICE_WAIT_FOR=PATH, once PATH exists
    (a checkpoint's folder: just after it commits);
  - FAULT_NOTICE_AT_COMPILE=1: as the first training step starts compiling;
  - FAULT_NOTICE_AFTER_BATCH=N: once eval.py or generate.py has searched its N-th batch
    (evaluation.translate.run_search).

In-process tests can call `arm(...)` / `disarm()` instead (for the save and validation
faults). The hook sits in Orbax's JSON
item writer, which every checkpoint here runs in its background commit (the
`data_iterator` and `config` items), before the final rename; validation's in
`run.metrics.evaluate_loss`, which the loop's validation calls.
"""

import errno
import os
import runpy
import signal
import sys
import threading
import time

import orbax.checkpoint as ocp
from orbax.checkpoint._src.handlers import json_checkpoint_handler

_ORIGINAL_SAVE = json_checkpoint_handler.JsonCheckpointHandler._save_fn
_ORIGINAL_MANAGER_SAVE = ocp.CheckpointManager.save
_ORIGINAL_RESTORE = json_checkpoint_handler.JsonCheckpointHandler.restore
_original_evaluate_loss = None  # set while validation is slowed


def _step_of(directory) -> int | None:
  """The step of a checkpoint item directory: <step>.orbax-checkpoint-tmp/<item>[-tmp]."""
  head = directory.parent.name.split(".")[0]
  return int(head) if head.isdigit() else None


def arm(
  slow_save_step: int | None = None,
  slow_save_s: float = 600.0,
  full_disk_step: int | None = None,
  slow_save_marker: str = "",
  slow_validation_s: float = 0.0,
  slow_validation_marker: str = "",
  slow_restore_s: float = 0.0,
) -> None:
  """slow_restore_s: every read of a checkpoint's JSON item (its config and data state,
  the first reads of a restore) waits that long first, as on a stalled bucket."""

  async def save_fn(self, item, directory):
    step = _step_of(directory)
    if step is not None and step == slow_save_step:
      if slow_save_marker:
        open(slow_save_marker, "w").close()
      time.sleep(slow_save_s)
    if step is not None and step == full_disk_step:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
    return await _ORIGINAL_SAVE(self, item, directory)

  json_checkpoint_handler.JsonCheckpointHandler._save_fn = save_fn

  if slow_restore_s:

    def restore(self, *args, **kwargs):
      time.sleep(slow_restore_s)
      return _ORIGINAL_RESTORE(self, *args, **kwargs)

    json_checkpoint_handler.JsonCheckpointHandler.restore = restore

  if slow_validation_s:
    _slow_validation(slow_validation_s, slow_validation_marker)


def _slow_validation(seconds: float, marker: str) -> None:
  global _original_evaluate_loss
  # Imported here: the launcher puts the repository on the path first, and nothing of
  # the package loads before the entry point starts jax.distributed.
  from transformer.inference import metrics

  _original_evaluate_loss = _original_evaluate_loss or metrics.evaluate_loss
  original = _original_evaluate_loss

  def evaluate_loss(*args, **kwargs):
    if marker:
      open(marker, "w").close()
    time.sleep(seconds)
    return original(*args, **kwargs)

  metrics.evaluate_loss = evaluate_loss


# Where jax.distributed's preemption sync keeps each host's count once a notice arrived
# (xla/tsl/distributed_runtime/preemption/preemption_sync_manager.cc).
_PREEMPTION_COUNTS_KEY = "PREEMPTION_CURRENT_COUNTER/"


def _notice_counts() -> list:
  from jax._src import distributed

  return distributed.global_state.client.key_value_dir_get(_PREEMPTION_COUNTS_KEY)


def _send_notice(marker: str) -> None:
  if marker:
    open(marker, "w").close()
  print(f"fault injection: SIGTERM to process {os.getpid()}", flush=True)
  os.kill(os.getpid(), signal.SIGTERM)  # to jax.distributed's handler


def _wait_until_the_notice_is_decided(timeout_s: float = 120.0) -> None:
  """Until every process has given the sync its count (they can no longer change it)."""
  import jax

  if jax.process_count() == 1:
    return  # no sync: the process's own handler took the signal
  deadline = time.time() + timeout_s
  while len(counts := _notice_counts()) < jax.process_count():
    if time.time() > deadline:
      raise RuntimeError(f"the preemption notice was not taken up within {timeout_s} s")
    time.sleep(0.02)
  print(f"fault injection: the hosts' preemption counts {sorted(counts)}", flush=True)


def arm_notice(
  process: int,
  in_save: int | None = None,
  in_wait: int | None = None,
  after_step: int | None = None,
  wait_for: str = "",
  at_compile: bool = False,
  after_batch: int | None = None,
  marker: str = "",
) -> None:
  """A preemption notice to `process` inside one window (the module's docstring)."""
  import jax
  import orbax.checkpoint as ocp

  # The project's modules are imported by the windows that need them (the evaluation
  # ones load TensorFlow, which the entry point sets up before its own import).
  def ours() -> bool:
    return jax.process_index() == process

  def notice_now() -> None:
    _send_notice(marker)
    _wait_until_the_notice_is_decided()

  if in_save is not None:
    original_save = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
      saved = original_save(self, step, *args, **kwargs)
      if step == in_save and ours():
        notice_now()
      return saved

    ocp.CheckpointManager.save = save

  if in_wait is not None:
    saved_before_wait, original_wait = (
      ocp.CheckpointManager.save,
      ocp.CheckpointManager.wait_until_finished,
    )
    armed = []

    def save_then_arm(self, step, *args, **kwargs):
      saved = saved_before_wait(self, step, *args, **kwargs)
      if step == in_wait and ours():
        armed.append(step)
      return saved

    def wait_until_finished(self):
      if armed:
        armed.clear()
        notice_now()
      return original_wait(self)

    ocp.CheckpointManager.save = save_then_arm
    ocp.CheckpointManager.wait_until_finished = wait_until_finished

  if after_step is not None:
    from transformer.training import reporting

    original_write = reporting.MetricsWriter.write

    def write(self, step, metrics, kind="train"):
      original_write(self, step, metrics, kind)
      if step == after_step and kind == "train" and ours():
        while wait_for and not os.path.exists(wait_for):
          time.sleep(0.02)
        notice_now()

    reporting.MetricsWriter.write = write

  if at_compile:
    from transformer.training import steps

    original_jit = steps.jit_train_step

    def jit_train_step(setup):
      compiled = original_jit(setup)
      calls = []

      def first_compiles(*args):
        if calls or not ours():
          return compiled(*args)
        calls.append(1)
        threading.Thread(target=_send_notice, args=(marker,)).start()
        out = compiled(*args)  # traced and compiled while the notice is taken up
        _wait_until_the_notice_is_decided()
        return out

      return first_compiles

    steps.jit_train_step = jit_train_step

  if after_batch is not None:
    from transformer.evaluation import translate

    original_search = translate.run_search
    searched = []

    def run_search(*args, **kwargs):
      out = original_search(*args, **kwargs)
      searched.append(1)
      if len(searched) == after_batch and ours():
        notice_now()
      return out

    translate.run_search = run_search


def kill_after_save(step: int) -> None:
  """SIGKILL as soon as checkpoint `step` is committed (Orbax's commit is awaited)."""

  def save(self, save_step, *args, **kwargs):
    saved = _ORIGINAL_MANAGER_SAVE(self, save_step, *args, **kwargs)
    if save_step == step:
      self.wait_until_finished()
      os.kill(os.getpid(), signal.SIGKILL)
    return saved

  ocp.CheckpointManager.save = save


def slow_log_flushes(seconds: float) -> None:
  from transformer import storage  # only the storage layer: it imports no JAX

  original = storage.AppendLog.flush

  def flush(self):
    time.sleep(seconds)
    original(self)

  storage.AppendLog.flush = flush


def diverge_at_step(monkeypatch, step: int) -> None:
  """In this process, training diverges at `step` (1-based, as logged): that step's loss
  and the parameters it writes are NaN, as a real divergence leaves them, for the NaN
  guard's tests. steps.jit_train_step compiles whatever `steps.train_step` is then."""
  import jax
  import jax.numpy as jnp

  from transformer.training import steps

  real_train_step = steps.train_step

  def diverging_train_step(state, batch, **kwargs):
    new_state, metrics = real_train_step(state, batch, **kwargs)
    diverged = state.step + 1 == step
    nan_there = lambda x: jnp.where(diverged, jnp.nan, x)
    new_state = new_state.replace(params=jax.tree.map(nan_there, new_state.params))
    return new_state, {**metrics, "loss": nan_there(metrics["loss"])}

  monkeypatch.setattr(steps, "train_step", diverging_train_step)


def disarm() -> None:
  global _original_evaluate_loss
  json_checkpoint_handler.JsonCheckpointHandler._save_fn = _ORIGINAL_SAVE
  json_checkpoint_handler.JsonCheckpointHandler.restore = _ORIGINAL_RESTORE
  if _original_evaluate_loss is not None:
    from transformer.inference import metrics

    metrics.evaluate_loss, _original_evaluate_loss = _original_evaluate_loss, None


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  return int(value) if value else None


if __name__ == "__main__":
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  sys.path.insert(0, repo)
  # As the entry points' cli.run does before TensorFlow loads, which a fault's patching
  # may import first.
  os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
  arm(
    slow_save_step=_env_int("FAULT_SLOW_SAVE_STEP"),
    slow_save_s=float(os.environ.get("FAULT_SLOW_SAVE_S", "600")),
    full_disk_step=_env_int("FAULT_FULL_DISK_STEP"),
    slow_save_marker=os.environ.get("FAULT_SLOW_SAVE_MARKER", ""),
    slow_validation_s=float(os.environ.get("FAULT_SLOW_VALIDATION_S", "0")),
    slow_validation_marker=os.environ.get("FAULT_SLOW_VALIDATION_MARKER", ""),
    slow_restore_s=float(os.environ.get("FAULT_SLOW_RESTORE_S", "0")),
  )
  if os.environ.get("FAULT_NOTICE_PROCESS"):
    arm_notice(
      int(os.environ["FAULT_NOTICE_PROCESS"]),
      in_save=_env_int("FAULT_NOTICE_IN_SAVE"),
      in_wait=_env_int("FAULT_NOTICE_IN_WAIT"),
      after_step=_env_int("FAULT_NOTICE_AFTER_STEP"),
      wait_for=os.environ.get("FAULT_NOTICE_WAIT_FOR", ""),
      at_compile=bool(os.environ.get("FAULT_NOTICE_AT_COMPILE")),
      after_batch=_env_int("FAULT_NOTICE_AFTER_BATCH"),
      marker=os.environ.get("FAULT_NOTICE_MARKER", ""),
    )
  if _env_int("FAULT_KILL_AFTER_SAVE_STEP") is not None:
    kill_after_save(_env_int("FAULT_KILL_AFTER_SAVE_STEP"))
  if os.environ.get("FAULT_SLOW_LOG_S"):
    slow_log_flushes(float(os.environ["FAULT_SLOW_LOG_S"]))
  script, sys.argv = sys.argv[1], sys.argv[1:]
  runpy.run_path(script, run_name="__main__")
