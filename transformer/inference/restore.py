"""`restore(workdir)`: a trained run's model, parameters and vocabulary, ready to serve.

The one way everything that uses a trained model loads it (eval.py, generate.py, the
export, checkpoint averaging, a draft's warm start): parameters only, never the optimizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections
from jax.sharding import Mesh

from transformer import config as config_lib
from transformer import data
from transformer.inference import checkpoints
from transformer.inference.model_setup import ModelSetup, setup


@dataclasses.dataclass(frozen=True)
class Restored:
  """A trained run, restored: its model set-up, parameters, vocabulary and step (the
  newest checkpoint the parameters come from)."""

  setup: ModelSetup
  params: Any
  tokenizer: data.Tokenizer
  step: int

  @property
  def config(self) -> ml_collections.ConfigDict:
    return self.setup.config


def restore(
  workdir: str,
  step: int | None = None,
  average_last: int = 1,
  *,
  config: ml_collections.ConfigDict | None = None,
  mesh: Mesh | None = None,
) -> Restored:
  """The run in `workdir` at checkpoint `step` (default: the newest), or the mean of its
  newest `average_last` checkpoints up to it.

  config: default the run's own (WORKDIR/config.json); one given must match the
  checkpoint's architecture (a one-line ConfigError naming the key). mesh: default the
  config's over every device. Every check runs, and the vocabulary is read, before any
  parameter is; each read is bounded by config.storage_timeout_s.
  """
  if config is None:
    config = checkpoints.load_run_config(workdir)
  config_lib.validate(config)
  model_setup = setup(config, mesh)
  tokenizer = data.load_workdir_tokenizer(workdir, config.storage_timeout_s)
  params, newest = checkpoints.restore_params(
    workdir, model_setup, step=step, average_last=average_last
  )
  return Restored(model_setup, params, tokenizer, newest)
