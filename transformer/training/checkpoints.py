"""Orbax checkpoints: writing the train state, the data iterator's position and the config,
and restoring all of it to resume a run. `Checkpointer` is the read side below training
(transformer/inference/checkpoints.py: `CheckpointReader`, through which serving reads
parameters alone) plus the saves; this module shares that module's names.

Layout: WORKDIR/checkpoints/<step>/{state, data_iterator, config}. Orbax writes each
checkpoint into `<step>.orbax-checkpoint-tmp` and renames it to `<step>` when complete
(on gs://, into `<step>/`, marked complete by a last `commit_success.txt`), so a save
torn by a crash is never listed, `latest_step()` is always a whole checkpoint,
and the training run's next start deletes the leftover. A save that fails (a full disk)
surfaces as a one-line `CheckpointError` at the next save or at the end; Orbax deletes
old checkpoints only after a newer one is complete, so the earlier ones stay intact.
A save that has not finished `timeout_s` after it began (a stalled bucket) is a
`CheckpointTimeout` naming the checkpoint, at the next save or at the end, instead of a
hang: the training thread never waits on Orbax longer than that. A read (a restore)
gets as long, and is a `CheckpointTimeout` naming the checkpoint too.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.experimental.multihost_utils
import ml_collections
import orbax.checkpoint as ocp

from transformer import storage
from transformer.inference.checkpoints import (
  ITEMS,
  CheckpointError,
  CheckpointReader,
  CheckpointTimeout,
  check_compatible,
  checkpoint_dir,
  load_run_config,
  save_args,
  steps_on_disk,
)
from transformer.messages import first_line

__all__ = [  # the read side's names, used with the writer's
  "CheckpointError",
  "CheckpointReader",
  "CheckpointTimeout",
  "Checkpointer",
  "check_compatible",
  "checkpoint_dir",
  "load_run_config",
  "steps_on_disk",
]

_ORBAX_FINALIZE_THREAD = "save_finalize"  # CheckpointManager's thread that ends a save


def _join_orbax_threads(timeout_s: float = 60.0, name: str | None = None) -> None:
  """Waits for Orbax's background threads of a failed save (those called `name`, if
  given). When one item of a save fails, the others' commit threads keep running; left
  alone they would outlive the process's error and print their own tracebacks at exit,
  after the one-line message."""
  deadline = time.time() + timeout_s
  for thread in threading.enumerate():
    if (
      thread is not threading.current_thread()
      and type(thread).__module__.startswith("orbax.")
      and name in (None, thread.name)
    ):
      thread.join(max(0.0, deadline - time.time()))


class _Manager(ocp.CheckpointManager):
  """Orbax's CheckpointManager, kept from asking JAX's preemption sync.

  Its `save` asks `reached_preemption(step)` with the step it saves (only to log it).
  JAX's sync manager keeps the last count any caller gave it, and when a notice arrives
  it agrees on (the largest count any host last gave) + 1. Given the global step by
  Orbax between two of the loop's questions, counted from this start, it agreed on a
  count the loop would reach only a start step later: on a resumed run, never. Here the
  loop is the only one that asks (`Checkpointer.reached_preemption`); nothing Orbax does
  with the answer matters to a save made with `force=True`.
  """

  def reached_preemption(self, step: int) -> bool:
    del step  # not passed on: the loop owns the sync manager's count
    return False


class Checkpointer(CheckpointReader):
  """Asynchronous saves every so often, keeping the newest `keep` checkpoints; the
  reader's reads (steps, config, data state, parameters) and the full restore of a
  resumed run."""

  def __init__(
    self,
    workdir: str,
    keep: int,
    async_save: bool = True,
    clean_torn: bool = False,
    timeout_s: float = 600.0,
  ):
    """clean_torn: delete the `<step>.orbax-checkpoint-tmp` directories that saves torn by
    a kill left behind (they are never listed as steps). Only the training run may: for
    anyone else reading the workdir they can be saves still in progress.
    timeout_s: how long a save may take, from its start to its commit (config.storage_timeout_s);
    Orbax's own background thread gives up after it too. Each read of a checkpoint (its
    config, data state or arrays) gets as long."""
    self._options = ocp.CheckpointManagerOptions(
      max_to_keep=keep,
      create=True,
      enable_async_checkpointing=async_save,
      cleanup_tmp_directories=clean_torn,
      async_options=ocp.AsyncOptions(timeout_secs=max(1, math.ceil(timeout_s))),
    )
    self._started = 0.0  # time.monotonic() at the start of the last save
    self._writing: int | None = None  # the step of a save that may still be running
    self._reported: CheckpointError | None = None
    super().__init__(workdir, timeout_s)

  def _open_manager(self) -> ocp.CheckpointManager:
    """A manager that saves, over a directory created now: a path that cannot hold
    checkpoints fails here, not at the first save (Orbax creates it lazily)."""
    try:
      storage.makedirs(self.directory)
      return _Manager(storage.as_path(self.directory), options=self._options, item_names=ITEMS)
    except Exception as e:  # pylint: disable=broad-except  (tf.errors.* are not OSError)
      raise CheckpointError(
        f"cannot use {self.directory} for checkpoints: {storage.error_text(e)}"
      ) from None

  def steps_on_disk(self) -> list[int]:
    return steps_on_disk(self.workdir)

  def _failed(self, e: Exception) -> CheckpointError:
    if isinstance(e, TimeoutError):  # Orbax's background thread ran out of timeout_s
      return self._timed_out()
    _join_orbax_threads()
    step = f" at step {self._writing}" if self._writing is not None else ""
    self._writing = None
    self._reported = CheckpointError(
      f"the checkpoint{step} could not be written ({first_line(e, with_type=True)}); "
      f"complete checkpoints in {self.directory}: {self.steps_on_disk()}"
    )
    return self._reported

  def _timed_out(self) -> CheckpointTimeout:
    """The error of a save past its time; the storage is not asked anything more.

    Orbax's own thread that finishes the save (`save_finalize`) gives up at the same
    limit (AsyncOptions.timeout_secs), counted from a little later, logs its error with
    a traceback, and ends; the writes it waited on stay stuck in the storage client.
    Waiting for that thread here means it has always logged before the process exits,
    on a fast machine as on a slow one, and the terminal shows the same (cli.py keeps
    that log off it: this error says the same in one line).
    """
    _join_orbax_threads(min(self.timeout_s, 60.0), name=_ORBAX_FINALIZE_THREAD)
    where = (
      storage.join(self.directory, str(self._writing))
      if self._writing is not None
      else self.directory
    )
    self._writing = None
    self._reported = CheckpointTimeout(
      storage.timeout_message(f"the checkpoint {where}", self.timeout_s)
    )
    return self._reported

  def _within_time_left(self, call: Callable[[], Any]) -> None:
    """`call`, given what is left of the current save's time; CheckpointTimeout after."""
    left = self.timeout_s
    if self._writing is not None:
      left -= time.monotonic() - self._started
    if not storage.call_within(left, call, name="checkpoint-wait")[0]:
      raise self._timed_out()

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(
    self, step: int, state: Any, iterator_state: dict, config: ml_collections.ConfigDict
  ) -> None:
    """Starts writing; returns before the write finishes unless saving is synchronous.

    Raises CheckpointError if the previous asynchronous save failed (it is awaited here).
    """
    if self._writing is not None:
      self.wait()  # within the previous save's time: Orbax's save would wait without end
    self._started, self._writing = time.monotonic(), step
    try:
      self._within_time_left(
        lambda: self._manager.save(step, args=save_args(state, iterator_state, config), force=True)
      )
    except CheckpointTimeout:
      raise
    except Exception as e:  # this save's synchronous part failed
      raise self._failed(e) from e

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """(state placed as `abstract_state`'s shardings say, iterator state)."""
    items = ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state), data_iterator=ocp.args.JsonRestore()
    )
    restored = self.read_arrays(step, lambda m: m.restore(step, args=items))
    return restored["state"], restored["data_iterator"]

  def reached_preemption(self, steps_since_start: int) -> bool:
    """True on every host at the same count after any host got a preemption notice
    (jax.distributed's sync), provided every host asks once after every step.

    The only caller of JAX's sync in the process (Orbax's is turned off: `_Manager`), so
    the count it holds is always the loop's: it cannot be given two counters.
    """
    return jax.experimental.multihost_utils.reached_preemption_sync_point(steps_since_start)

  def wait(self) -> None:
    """Blocks until the last asynchronous save is on disk; CheckpointError if it failed."""
    try:
      self._within_time_left(self._manager.wait_until_finished)
      self._manager.check_for_errors()
    except CheckpointTimeout:
      raise
    except Exception as e:
      raise self._failed(e) from e
    self._writing = None

  def close(self) -> None:
    if isinstance(self._reported, CheckpointTimeout):
      return  # Orbax's close would wait for the stalled save
    try:
      if self._reported is None:  # an error already raised is not raised again
        self.wait()
    finally:
      try:
        self._manager.close()  # waits again, and raises a failed save's error again
      except Exception:  # pylint: disable=broad-except
        if self._reported is None:
          raise
