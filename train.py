"""Train a Transformer: `python train.py --config configs/default.py --workdir DIR`.

Config overrides go after the config, e.g. `--config.model.num_layers=4`. Rerunning
the same command resumes from the newest checkpoint in DIR. `--dry_run` prints the
model's size and cost as one JSON line and exits without touching data or devices'
memory. `--print_step` prints the step of the newest complete checkpoint in WORKDIR (0
if none) and exits: how a cluster script tells a finished run from one stopped early
(docs/clusters.md). For several hosts see README ("Pods and clusters").
"""

import json

from absl import app, flags, logging
from ml_collections import config_flags

from transformer import cli
from transformer.config import DEFAULT_CONFIG
from transformer.inference import distributed

# Its docs/results records' version: bump when what it computes changes, not on a reformat.
RECORD_VERSION = 1

_CONFIG = config_flags.DEFINE_config_file(
  "config", DEFAULT_CONFIG, "Config file, optionally FILE:ARG.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, logs and the vocabulary go.")
_DRY_RUN = flags.DEFINE_bool(
  "dry_run", False, "Print parameters, FLOPs per token and the mesh as JSON; exit."
)
_PRINT_STEP = flags.DEFINE_bool(
  "print_step", False, "Print the newest complete checkpoint's step in --workdir (0: none); exit."
)
distributed.define_flags()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if _PRINT_STEP.value:  # one process, whatever the job: nothing to coordinate
    from transformer.training import checkpoints

    if not _WORKDIR.value:
      raise app.UsageError("--print_step needs --workdir")
    print(([0] + checkpoints.steps_on_disk(_WORKDIR.value))[-1])
    return
  distributed.initialize_from_flags()

  # Imported after jax.distributed is up: nothing may touch devices before that.
  from transformer import config as config_lib
  from transformer import storage
  from transformer.training import describe

  config = _CONFIG.value
  try:
    config_lib.validate(config)
    if _DRY_RUN.value:
      print(json.dumps(describe.describe(config)))
      return
    if not _WORKDIR.value:
      raise app.UsageError("--workdir is required (where checkpoints and logs go)")
    from transformer.evaluation import validation
    from transformer.training import loop

    result = loop.train_and_evaluate(
      config, _WORKDIR.value, validation=validation.ValidationWithBleu
    )
  except (config_lib.ConfigError, RuntimeError) as e:
    # After a stalled write its thread is still blocked in the storage client, and a
    # normal exit would wait for it.
    distributed.exit_with_error(e, force=isinstance(e, storage.StorageTimeout))
  logging.info("finished: %s", result)


if __name__ == "__main__":
  cli.run(main)
