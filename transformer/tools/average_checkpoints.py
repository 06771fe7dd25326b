r"""Write the mean of a run's last k checkpoints as a new run directory.

python -m transformer.tools.average_checkpoints --workdir RUN --average_last 5 \
--output_workdir RUN-avg5

The paper evaluates base models on the average of the last 5 checkpoints (written every
10 minutes) and big models on the last 20. The output holds one checkpoint, at the
newest averaged step, whose parameters are the element-wise mean (read one checkpoint at
a time, parameters only: `transformer.inference.restore`) and whose data-iterator state
is the newest checkpoint's (written by `inference.checkpoints.write_served`), plus the
run's config.json and vocab.model, so `eval.py --workdir RUN-avg5`, generate.py and the
export work on it unchanged. It holds no optimizer state: it is a run to serve, not one
to resume training from.
"""

from absl import flags

from transformer import cli, inference, storage
from transformer.config import ConfigError
from transformer.inference import checkpoints

_FLAG_VALUES = cli.program_flags(__name__)  # absl's only when run as a program
_WORKDIR = flags.DEFINE_string(
  "workdir", None, "The training run to average.", flag_values=_FLAG_VALUES
)
_AVERAGE_LAST = flags.DEFINE_integer(
  "average_last", 5, "How many of the newest checkpoints.", flag_values=_FLAG_VALUES
)
_STEP = flags.DEFINE_integer(
  "step", None, "Average the k checkpoints up to this step.", flag_values=_FLAG_VALUES
)
_OUTPUT = flags.DEFINE_string(
  "output_workdir", None, "Where the averaged run is written.", flag_values=_FLAG_VALUES
)


def average_into(
  workdir: str, output_workdir: str, average_last: int, step: int | None = None
) -> int:
  """Returns the step the averaged checkpoint is saved at."""
  if storage.join(workdir) == storage.join(output_workdir):
    raise ConfigError(
      "--output_workdir must differ from --workdir (a run's own checkpoints are never overwritten)"
    )
  if checkpoints.steps_on_disk(output_workdir):  # an empty one, from a failed try, is reused
    raise ConfigError(f"{output_workdir} already holds checkpoints")
  restored = inference.restore(workdir, step, average_last)
  config, newest = restored.config, restored.step
  timeout_s = config.storage_timeout_s  # each read and the save, as in the run
  source = checkpoints.CheckpointReader(workdir, timeout_s)
  try:
    iterator_state = source.saved_iterator_state(newest)
  finally:
    source.close()

  storage.makedirs(output_workdir)
  for name in ("config.json", "vocab.model"):
    storage.copy(storage.join(workdir, name), storage.join(output_workdir, name))
  checkpoints.write_served(
    output_workdir, newest, restored.params, iterator_state, config, timeout_s
  )
  return newest


def main(argv):
  del argv
  try:
    if not _WORKDIR.value or not _OUTPUT.value:
      raise ConfigError("--workdir and --output_workdir are required")
    step = average_into(_WORKDIR.value, _OUTPUT.value, _AVERAGE_LAST.value, _STEP.value)
  except (ConfigError, OSError, checkpoints.CheckpointError, storage.StorageTimeout) as e:
    cli.exit_with_error(e)  # at once after a stalled read or write: its thread is blocked
  print(
    f"wrote the mean of the last {_AVERAGE_LAST.value} checkpoints of {_WORKDIR.value} "
    f"to {_OUTPUT.value} (step {step})"
  )


if __name__ == "__main__":
  cli.run(main)
