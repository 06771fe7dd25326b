"""Orbax checkpoints: the train state, the data iterator's position and the config.

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

import json
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.experimental.multihost_utils
import ml_collections
import orbax.checkpoint as ocp

from transformer import config as config_lib
from transformer import storage
from transformer.config import ConfigError
from transformer.messages import first_line

_ITEMS = ("state", "data_iterator", "config")
_ORBAX_FINALIZE_THREAD = "save_finalize"  # CheckpointManager's thread that ends a save


class CheckpointError(RuntimeError):
  """A checkpoint that could not be written or read; the message names the step."""


class CheckpointTimeout(CheckpointError, storage.StorageTimeout):
  """A save still not written after the time limit; Orbax's threads may be stuck in it."""


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


def checkpoint_dir(workdir: str) -> str:
  """WORKDIR/checkpoints: absolute if local, the URL itself if gs://..."""
  return storage.join(workdir, "checkpoints")


def steps_on_disk(workdir: str) -> list[int]:
  """Steps of the complete checkpoints in a run's workdir, as the storage lists them.

  A save torn by a crash is never listed: on local disk Orbax renames a checkpoint to
  its step only once it is complete; on cloud storage, which cannot rename a folder,
  it writes straight into `<step>/` and adds `commit_success.txt` last. Reads the
  storage, not Orbax's in-memory list, which forgets steps it meant to delete once a
  newer save started. `workdir` may be gs://...
  """
  directory = storage.as_path(checkpoint_dir(workdir))
  if not directory.exists():
    return []
  return sorted(
    int(p.name) for p in directory.iterdir() if p.name.isdigit() and ocp.step.is_path_finalized(p)
  )


class Checkpointer:
  """Asynchronous saves every so often, keeping the newest `keep` checkpoints."""

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
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep,
      create=True,
      enable_async_checkpointing=async_save,
      cleanup_tmp_directories=clean_torn,
      async_options=ocp.AsyncOptions(timeout_secs=max(1, math.ceil(timeout_s))),
    )
    self.timeout_s = timeout_s
    self._started = 0.0  # time.monotonic() at the start of the last save
    self.workdir = workdir
    self.directory = checkpoint_dir(workdir)
    try:
      # Created here, so that a path that cannot hold checkpoints fails now, not at the
      # first save (Orbax creates it lazily).
      storage.makedirs(self.directory)
      # Orbax's manager reads every checkpoint's metadata as it starts, and waits for
      # the other processes: bounded like any read, or a stalled bucket holds every host.
      self._manager = storage.read_within(
        timeout_s,
        f"the checkpoints in {self.directory}",
        lambda: _Manager(storage.as_path(self.directory), options=options, item_names=_ITEMS),
      )
    except storage.StorageTimeout as e:
      raise CheckpointTimeout(str(e)) from None
    except Exception as e:  # pylint: disable=broad-except  (tf.errors.* are not OSError)
      raise CheckpointError(
        f"cannot use {self.directory} for checkpoints: {storage.error_text(e)}"
      ) from None
    self._writing: int | None = None  # the step of a save that may still be running
    self._reported: CheckpointError | None = None

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

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

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
        lambda: self._manager.save(
          step,
          args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data_iterator=ocp.args.JsonSave(iterator_state),
            config=ocp.args.JsonSave(json.loads(config.to_json())),
          ),
          force=True,
        )
      )
    except CheckpointTimeout:
      raise
    except Exception as e:  # this save's synchronous part failed
      raise self._failed(e) from e

  def _read(self, step: int, call: Callable[[], Any]) -> Any:
    """`call()`, a read of checkpoint `step`, within timeout_s; else CheckpointTimeout
    naming it (a stalled bucket would hold every host for as long as its client retries)."""
    try:
      return storage.read_within(self.timeout_s, f"checkpoint {step} in {self.directory}", call)
    except storage.StorageTimeout as e:
      raise CheckpointTimeout(str(e)) from None

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """(state placed as `abstract_state`'s shardings say, iterator state)."""
    try:
      restored = self._read(
        step,
        lambda: self._manager.restore(
          step,
          args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data_iterator=ocp.args.JsonRestore()
          ),
        ),
      )
    except (ValueError, KeyError, TypeError, OSError) as e:
      # A tree or shape that does not fit this config's model, or damaged files.
      raise CheckpointError(
        f"checkpoint {step} in {self.directory} cannot be loaded (a "
        f"model other than this config's, or damaged files): "
        f"{first_line(e, with_type=True)}"
      ) from e
    return restored["state"], restored["data_iterator"]

  def saved_iterator_state(self, step: int) -> dict:
    """The data iterator's state of checkpoint `step`, read without the arrays."""
    return self._read(
      step,
      lambda: self._manager.restore(
        step, args=ocp.args.Composite(data_iterator=ocp.args.JsonRestore())
      ),
    )["data_iterator"]

  def saved_config(self, step: int) -> dict:
    return self._read(
      step,
      lambda: self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())),
    )["config"]

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


# Model keys that change the parameter tree or its shapes: a checkpoint made with other
# values cannot be loaded.
_ARCHITECTURE_KEYS = (
  "num_layers",
  "d_model",
  "d_ff",
  "num_heads",
  "d_k",
  "d_v",
  "positional",
  "activation",
  "tie_embeddings",
  "decoder_only",
  "norm",
)


def check_compatible(saved: dict, config: ml_collections.ConfigDict) -> None:
  """One-line ConfigError naming the first architecture key that differs."""
  pairs = [("vocab_size", saved.get("vocab_size"), config.vocab_size)]
  pairs += [
    (f"model.{k}", saved.get("model", {}).get(k), config.model[k]) for k in _ARCHITECTURE_KEYS
  ]
  for key, was, now in pairs:
    if was is not None and was != now:
      raise ConfigError(
        f"config.{key}: the checkpoint was trained with {was!r}, the config says {now!r}"
      )


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a run in `workdir` was trained with (WORKDIR/config.json)."""
  path = storage.join(workdir, "config.json")
  if not storage.exists(path):
    raise ConfigError(f"{workdir} holds no trained run: {path} is missing")
  try:
    saved = json.loads(storage.read_text(path))
  except ValueError as e:
    raise ConfigError(
      f"{path} is not valid JSON ({e}); rerunning train.py on the workdir writes it again"
    ) from None
  saved.pop("versions", None)  # what it was trained with, a record rather than a setting
  config = config_lib.base_config()
  config.update(saved)
  return config


def restore_params(
  workdir: str, setup, step: int | None = None, average_last: int = 1
) -> tuple[Any, int]:
  """Parameters of checkpoint `step` (default: newest), or the mean of the newest k.

  `setup`: the config's `training.state.Setup`, which says the shapes and shardings to
  restore into. Averaging follows the paper: the element-wise mean of the parameters of
  the last k checkpoints (5 for base, 20 for big), accumulated in float32. Returns
  (params, step of the newest checkpoint used).
  """
  # Each read within the run's storage_timeout_s: a stalled bucket is a CheckpointTimeout.
  checkpointer = Checkpointer(
    workdir, keep=10**6, async_save=False, timeout_s=setup.config.storage_timeout_s
  )
  steps = checkpointer.all_steps()
  if not steps:
    raise ConfigError(f"{checkpoint_dir(workdir)} holds no checkpoint")
  if step is not None and step not in steps:
    raise ConfigError(
      f"no checkpoint at step {step} in {checkpoint_dir(workdir)}; there are {steps}"
    )
  upto = step if step is not None else steps[-1]
  chosen = [s for s in steps if s <= upto][-average_last:]
  if len(chosen) < average_last:
    raise ConfigError(
      f"--average_last {average_last}: only {len(chosen)} checkpoints up to step {upto} ({chosen})"
    )
  check_compatible(checkpointer.saved_config(chosen[-1]), setup.config)
  target = setup.restore_target()
  total = None
  for s in chosen:
    state, _ = checkpointer.restore(s, target)
    params = jax.tree.map(lambda x: x.astype("float32"), state.params)
    total = params if total is None else jax.tree.map(lambda a, b: a + b, total, params)
  checkpointer.close()
  averaged = jax.tree.map(
    lambda x, ref: (x / len(chosen)).astype(ref.dtype), total, setup.abstract_state.params
  )
  return averaged, chosen[-1]
