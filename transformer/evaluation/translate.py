"""Translation with a trained run: restored parameters, beam search, detokenized text.

`Translator` loads a workdir's (optionally averaged) parameters and vocabulary onto the
config's mesh; `beam_translate` turns raw sentences into translations, in order.
"""

from __future__ import annotations

from typing import Iterable

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from transformer import config as config_lib
from transformer import data
from transformer.model import decoding
from transformer.training import checkpoints, sharding
from transformer.training import state as state_lib


def search_batch(model, params, config: ml_collections.ConfigDict, mesh, rules,
                 source_BxS: np.ndarray) -> np.ndarray:
  """Beam search (config's beam size and alpha) on padded source ids -> tokens [B, C].

  Every process passes the same whole batch and gets every row's output back, row r for
  row r: each device searches only its own rows, and the gather follows the global
  array's indices, not an assumed order of processes over the mesh.
  """
  source = sharding.global_batch_from_whole({"source": source_BxS}, mesh, rules)["source"]
  with sharding.activation_sharding(mesh, rules):  # traced with the activations' axes
    tokens, _ = decoding.beam_search(
        model, params, source, beam_size=config.beam_size, alpha=config.length_penalty_alpha,
        max_decode_extra_len=config.max_decode_extra_len)
  if jax.process_count() > 1:
    return np.asarray(multihost_utils.process_allgather(tokens, tiled=True))
  return np.asarray(jax.device_get(tokens))


def beam_translate(model, params, tokenizer, config: ml_collections.ConfigDict, mesh,
                   rules, lines: list[str]) -> list[str]:
  """Beam-search translations of raw sentences, in order; an empty line stays empty.

  Inputs longer than max_len are clipped to it (the model never saw longer ones).
  """
  outputs = [""] * len(lines)
  batch_size = config.eval_batch_size
  todo = [i for i, line in enumerate(lines) if line.strip()]
  for start in range(0, len(todo), batch_size):
    chunk = todo[start:start + batch_size]
    ids = tokenizer.encode_for_model([lines[i] for i in chunk], config.max_len)
    tokens = search_batch(model, params, config, mesh, rules,
                          data.pad_batch(ids, rows=batch_size))
    for row, i in enumerate(chunk):
      outputs[i] = tokenizer.decode(tokens[row].tolist())
  return outputs


class Translator:
  """Restored parameters + tokenizer + the jitted beam search, on the run's mesh."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, *,
               step: int | None = None, average_last: int = 1):
    config_lib.validate(config)
    if config.model.decoder_only:
      raise config_lib.ConfigError("config.model.decoder_only: translation needs the "
                                   "encoder-decoder model")
    self.config = config
    self.workdir = workdir
    self.setup = state_lib.setup(config)
    self.mesh, self.rules, self.model = self.setup.mesh, self.setup.rules, self.setup.model
    self.tokenizer = data.load_workdir_tokenizer(workdir)
    self.params, self.step = checkpoints.restore_params(
        workdir, self.setup, step=step, average_last=average_last)
    self.average_last = average_last

  def translate_lines(self, lines: Iterable[str]) -> list[str]:
    """Detokenized translations of raw sentences, in order (an empty line stays empty)."""
    return beam_translate(self.model, self.params, self.tokenizer, self.config, self.mesh,
                          self.rules, list(lines))
