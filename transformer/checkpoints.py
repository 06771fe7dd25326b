"""Orbax checkpoints: the train state, the data iterator's position and the config.

Layout: WORKDIR/checkpoints/<step>/{state, data_iterator, config}. Orbax writes each
checkpoint into a temporary directory and renames it when complete, so a save torn by
a crash is never listed, and `latest_step()` is always a whole checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import jax
import ml_collections
import orbax.checkpoint as ocp

from transformer.config import ConfigError

_ITEMS = ("state", "data_iterator", "config")


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


class Checkpointer:
  """Asynchronous saves every so often, keeping the newest `keep` checkpoints."""

  def __init__(self, workdir: str, keep: int, async_save: bool = True):
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(checkpoint_dir(workdir), options=options,
                                          item_names=_ITEMS)

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, iterator_state: dict,
           config: ml_collections.ConfigDict) -> None:
    """Starts writing; returns before the write finishes unless saving is synchronous."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data_iterator=ocp.args.JsonSave(iterator_state),
        config=ocp.args.JsonSave(json.loads(config.to_json()))), force=True)

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """(state placed as `abstract_state`'s shardings say, iterator state)."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data_iterator=ocp.args.JsonRestore()))
    return restored["state"], restored["data_iterator"]

  def saved_config(self, step: int) -> dict:
    return self._manager.restore(step, args=ocp.args.Composite(
        config=ocp.args.JsonRestore()))["config"]

  def reached_preemption(self, step: int) -> bool:
    """True on every host once jax.distributed has seen a preemption notice."""
    return self._manager.reached_preemption(step)

  def wait(self) -> None:
    """Blocks until the last asynchronous save is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying shardings: what Orbax restores into."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


# Model keys that change the parameter tree or its shapes: a checkpoint made with other
# values cannot be loaded.
_ARCHITECTURE_KEYS = ("num_layers", "d_model", "d_ff", "num_heads", "d_k", "d_v",
                      "positional", "activation", "tie_embeddings", "decoder_only", "norm")


def check_compatible(saved: dict, config: ml_collections.ConfigDict) -> None:
  """One-line ConfigError naming the first architecture key that differs."""
  pairs = [("vocab_size", saved.get("vocab_size"), config.vocab_size)]
  pairs += [(f"model.{k}", saved.get("model", {}).get(k), config.model[k])
            for k in _ARCHITECTURE_KEYS]
  for key, was, now in pairs:
    if was is not None and was != now:
      raise ConfigError(f"config.{key}: the checkpoint was trained with {was!r}, "
                        f"the config says {now!r}")
