"""The read side of a run's Orbax checkpoints: what serving a trained run needs.

Layout: WORKDIR/checkpoints/<step>/{state, data_iterator, config}, written by training
(transformer/training/checkpoints.py: `Checkpointer`, this module's `CheckpointReader`
plus the asynchronous saves and the full restore of a resumed run), or once by
`write_served` (an averaged run, which has no optimizer state). The `state` item is the
whole train state, {step, params, opt_state}; `restore_params` reads its `params` alone
(a partial restore), sharded straight onto the mesh, so that serving a run never reads,
or holds, the optimizer's moments: with Adam they are two thirds of the bytes. Every
read is bounded by `timeout_s` (config.storage_timeout_s) and is a `CheckpointTimeout`
naming the checkpoint after it, instead of a hang on a stalled bucket.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from transformer import config as config_lib
from transformer import storage
from transformer.config import ConfigError
from transformer.inference.model_setup import ModelSetup
from transformer.messages import first_line

ITEMS = ("state", "data_iterator", "config")  # a checkpoint's items, as training saves them


class CheckpointError(RuntimeError):
  """A checkpoint that could not be written or read; the message names the step."""


class CheckpointTimeout(CheckpointError, storage.StorageTimeout):
  """A save or a read past the time limit; Orbax's threads may be stuck in it."""


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
  # A scanned stack's parameters are one tree with a leading [layers] axis, an unrolled
  # stack's one subtree per layer (model.stack_layer_params converts).
  "scan_layers",
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


def save_args(state: Any, iterator_state: dict, config: ml_collections.ConfigDict):
  """A checkpoint's items (ITEMS) as Orbax saves them: the state's arrays, the data
  iterator's position and the config, as JSON."""
  return ocp.args.Composite(
    state=ocp.args.StandardSave(state),
    data_iterator=ocp.args.JsonSave(iterator_state),
    config=ocp.args.JsonSave(json.loads(config.to_json())),
  )


class CheckpointReader:
  """A run's checkpoints, read only: their steps, configs and parameters. Training's
  writer (transformer/training/checkpoints.py) is this reader plus the saves."""

  def __init__(self, workdir: str, timeout_s: float):
    self.workdir, self.timeout_s = workdir, timeout_s
    self.directory = checkpoint_dir(workdir)
    try:
      # Orbax's manager reads every checkpoint's metadata as it starts, and waits for
      # the other processes: bounded like any read, or a stalled bucket holds every host.
      self._manager = storage.read_within(
        timeout_s, f"the checkpoints in {self.directory}", self._open_manager
      )
    except storage.StorageTimeout as e:
      raise CheckpointTimeout(str(e)) from None
    except (ConfigError, CheckpointError):
      raise
    except Exception as e:  # pylint: disable=broad-except  (tf.errors.* are not OSError)
      raise CheckpointError(f"cannot read {self.directory}: {storage.error_text(e)}") from None

  def _open_manager(self) -> ocp.CheckpointManager:
    """The Orbax manager over `directory`, which must hold checkpoints already."""
    if not storage.is_dir(self.directory):
      raise ConfigError(f"{self.directory} holds no checkpoint")
    # Not Orbax's read_only option, which logs two warnings at every start: this manager
    # is never asked to save, and deletes nothing (no max_to_keep, no tmp clean-up).
    options = ocp.CheckpointManagerOptions(create=False)
    return ocp.CheckpointManager(storage.as_path(self.directory), options=options, item_names=ITEMS)

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def read(self, step: int, call: Callable[[ocp.CheckpointManager], Any]) -> Any:
    """`call(manager)`, a read of checkpoint `step`, within timeout_s; else a
    CheckpointTimeout naming it (a stalled bucket would hold every host for as long as
    its client retries)."""
    try:
      return storage.read_within(
        self.timeout_s, f"checkpoint {step} in {self.directory}", lambda: call(self._manager)
      )
    except storage.StorageTimeout as e:
      raise CheckpointTimeout(str(e)) from None

  def read_arrays(self, step: int, call: Callable[[ocp.CheckpointManager], Any]) -> Any:
    """`read`, for a read of arrays: a tree or shape that does not fit this config's
    model, or damaged files, is a one-line CheckpointError naming the checkpoint."""
    try:
      return self.read(step, call)
    except (ValueError, KeyError, TypeError, OSError) as e:
      raise CheckpointError(
        f"checkpoint {step} in {self.directory} cannot be loaded (a "
        f"model other than this config's, or damaged files): "
        f"{first_line(e, with_type=True)}"
      ) from e

  def saved_config(self, step: int) -> dict:
    return self.read(
      step,
      lambda m: m.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())),
    )["config"]

  def saved_iterator_state(self, step: int) -> dict:
    """The data iterator's state of checkpoint `step`, read without the arrays."""
    return self.read(
      step,
      lambda m: m.restore(step, args=ocp.args.Composite(data_iterator=ocp.args.JsonRestore())),
    )["data_iterator"]

  def params(self, step: int, target: Any) -> Any:
    """Checkpoint `step`'s parameters alone, placed as `target` (ShapeDtypeStructs with
    shardings) says; the optimizer's state in the same item is never read."""
    item = {"params": target}
    restore = ocp.args.PyTreeRestore(
      item=item,
      restore_args=ocp.checkpoint_utils.construct_restore_args(item),
      partial_restore=True,
    )
    restored = self.read_arrays(
      step, lambda m: m.restore(step, args=ocp.args.Composite(state=restore))
    )
    return restored["state"]["params"]

  def close(self) -> None:
    self._manager.close()


def write_served(
  workdir: str,
  step: int,
  params: Any,
  iterator_state: dict,
  config: ml_collections.ConfigDict,
  timeout_s: float,
) -> None:
  """Writes checkpoint `step` of a run to serve, at once: its state is {step, params}, no
  optimizer state (tools/average_checkpoints.py makes one), in the layout training
  writes, so that every reader takes it as a run's. A one-line CheckpointError naming it
  if it cannot be written; CheckpointTimeout if it has not been after `timeout_s`."""
  directory = checkpoint_dir(workdir)
  state = {"step": np.asarray(step, np.int32), "params": params}

  def write() -> None:
    storage.makedirs(directory)
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    manager = ocp.CheckpointManager(storage.as_path(directory), options=options, item_names=ITEMS)
    try:
      manager.save(step, args=save_args(state, iterator_state, config), force=True)
      manager.wait_until_finished()
    finally:
      manager.close()

  try:
    done, _ = storage.call_within(timeout_s, write, name="checkpoint-write")
  except Exception as e:  # pylint: disable=broad-except  (tf.errors.* are not OSError)
    raise CheckpointError(
      f"checkpoint {step} could not be written to {directory}: {first_line(e, with_type=True)}"
    ) from None
  if not done:
    raise CheckpointTimeout(
      storage.timeout_message(f"the checkpoint {storage.join(directory, str(step))}", timeout_s)
    )


# The running sum's steps, each compiled once per leaf shape; the sum's buffer is donated,
# so that a backend that can reuses it in place.
_add = jax.jit(lambda total, x: total + x.astype(total.dtype), donate_argnums=0)
_divide = jax.jit(
  lambda total, n, dtype: (total / n).astype(dtype), static_argnums=(1, 2), donate_argnums=0
)


def choose_steps(steps: list[int], workdir: str, step: int | None, average_last: int) -> list[int]:
  """The checkpoints to average: the newest `average_last` up to `step` (default: the
  newest); a one-line ConfigError where they are not there."""
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
  return chosen


def restore_params(
  workdir: str, setup: ModelSetup, step: int | None = None, average_last: int = 1
) -> tuple[Any, int]:
  """Parameters of checkpoint `step` (default: newest), or the mean of the newest k.

  `setup`: the run's model set-up; each checkpoint is read into its `params_target()`
  (the parameters' shapes and shardings), and its config is checked against the newest
  checkpoint's architecture and gives the storage timeout. Averaging follows the paper:
  the element-wise mean of the parameters of the last k checkpoints (5 for base, 20 for
  big), read part by part and summed in float32 one checkpoint at a time, so that what is
  held at once is the running sum and one part of one checkpoint being read (measured in
  docs/performance.md, "Restoring a trained run"). Returns (params, step of the newest
  checkpoint used).
  """
  config, target = setup.config, setup.params_target()
  reader = CheckpointReader(workdir, config.storage_timeout_s)
  try:
    chosen = choose_steps(reader.all_steps(), workdir, step, average_last)
    check_compatible(reader.saved_config(chosen[-1]), config)
    # Part by part (the embedding, the encoder, the decoder: the parameters' top-level
    # entries), so that what is being read at once is a part, not the whole checkpoint.
    parts = {}
    for name, part_target in target.items():
      if len(chosen) == 1:  # as saved, in the parameters' own dtype
        parts[name] = reader.params(chosen[0], {name: part_target})[name]
        continue
      total: list[Any] = []  # this part's running float32 sum, leaf by leaf
      for s in chosen:
        leaves = jax.tree.leaves(reader.params(s, {name: part_target})[name])
        if not total:  # the first checkpoint's part becomes the sum (float32 already)
          total = [x if x.dtype == jnp.float32 else x.astype(jnp.float32) for x in leaves]
        else:  # each read leaf dropped as soon as it is added
          for i in range(len(leaves)):
            total[i] = _add(total[i], leaves[i])
            leaves[i] = None
        del leaves  # before the next checkpoint is read
      refs = jax.tree.leaves(part_target)
      mean = [_divide(x, len(chosen), ref.dtype) for x, ref in zip(total, refs)]
      parts[name] = jax.tree.unflatten(jax.tree.structure(part_target), mean)
    return parts, chosen[-1]
  finally:
    reader.close()
