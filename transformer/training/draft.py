"""Training a shallow draft (transformer/model/draft.py) with train.py.

A run whose config has draft.num_layers > 0 reads its target, the trained run in
draft.target_workdir: `prepare_config` checks that the config describes the target's
model and fills in what the draft takes from it (its vocabulary, and the decoding
shortlist of the most frequent target-side ids); `init_from_target` copies the
target's encoder and embedding into a fresh draft, which then trains only its decoder.
Both do nothing for any other run.
"""

from __future__ import annotations

import jax
import ml_collections
import numpy as np

from transformer import data, inference
from transformer.config import EOS_ID, ConfigError
from transformer.data import tokenizer as tokenizer_lib
from transformer.inference import checkpoints

# Model keys that only training reads: a draft may set them apart from its target.
_TRAINING_ONLY_MODEL_KEYS = ("dropout_rate", "attention_dropout_rate", "remat")
# The draft reuses these parts of the target's parameters, frozen.
FROZEN_PARTS = ("shared_embedding", "encoder")


def prepare_config(config: ml_collections.ConfigDict) -> None:
  """For a shallow draft run: a one-line ConfigError unless config.model, vocab_size and
  max_len are the target run's; sets vocab_from to the target run and fills
  draft.shortlist (when draft.shortlist_size > 0 and it is empty)."""
  d = config.draft
  if not d.num_layers:
    if d.target_workdir or d.shortlist or d.shortlist_size or d.d_ff:
      raise ConfigError(
        "config.draft.num_layers: is 0 but other draft keys are set: set "
        "num_layers to train a shallow draft"
      )
    return
  target_workdir = config.draft.target_workdir
  target = checkpoints.load_run_config(target_workdir)
  pairs = [
    (f"model.{key}", target.model[key], config.model[key])
    for key in config.model
    if key not in _TRAINING_ONLY_MODEL_KEYS
  ]
  pairs += [
    (key, target[key], config[key]) for key in ("vocab_size", "max_len", "max_decode_extra_len")
  ]
  for key, was, now in pairs:
    if was != now:
      raise ConfigError(
        f"config.{key}: the draft's target ({target_workdir}) has {was!r}, "
        f"this config {now!r}; a shallow draft must describe its target"
      )
  config.vocab_from = target_workdir
  if config.draft.shortlist_size and not config.draft.shortlist:
    tokenizer = tokenizer_lib.vocab_from_run(target_workdir, config.vocab_size)
    config.draft.shortlist = frequent_target_ids(config, tokenizer, config.draft.shortlist_size)


def frequent_target_ids(
  config: ml_collections.ConfigDict, tokenizer: data.Tokenizer, count: int
) -> list[int]:
  """The `count` ids most frequent on the target side of the training split (EOS
  included), most frequent first; ties go to the lower id."""
  targets = [target for _, target in data.load_raw_pairs(config, "train")]
  ids = np.concatenate(
    [np.asarray(row, np.int64) for row in tokenizer.encode_batch(targets)]
    + [np.full(len(targets), EOS_ID, np.int64)]
  )
  counts_V = np.bincount(ids, minlength=config.vocab_size)
  order_V = np.argsort(-counts_V, kind="stable")
  return [int(i) for i in order_V[:count]]


def init_from_target(setup, fresh_state):
  """A fresh draft's train state with the target's embedding and encoder in place of
  their random initialization (on the draft's shardings); other runs' states as given."""
  config = setup.config
  if not config.draft.num_layers:
    return fresh_state
  # The target's parameters only (inference.restore), on the draft's mesh.
  target_params = inference.restore(config.draft.target_workdir, mesh=setup.mesh).params
  params = dict(fresh_state.params)
  for part in FROZEN_PARTS:
    params[part] = jax.tree.map(
      lambda copied, fresh: jax.device_put(copied, fresh.sharding),
      target_params[part],
      params[part],
    )
  return fresh_state.replace(params=params)
