r"""Write the mean of a run's last k checkpoints as a new run directory.

    python -m transformer.tools.average_checkpoints --workdir RUN --average_last 5 \
        --output_workdir RUN-avg5

The paper evaluates base models on the average of the last 5 checkpoints (written every
10 minutes) and big models on the last 20. The output holds one checkpoint, at the
newest averaged step, whose parameters are the element-wise mean and whose optimizer
and data-iterator state are the newest checkpoint's, plus the run's config.json and
vocab.model, so `eval.py --workdir RUN-avg5` works on it unchanged.
"""

from absl import flags

from transformer import cli, storage
from transformer.config import ConfigError
from transformer.training import checkpoints, state

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
  config = checkpoints.load_run_config(workdir)
  run = state.setup(config)
  params, newest = checkpoints.restore_params(workdir, run, step=step, average_last=average_last)
  timeout_s = config.storage_timeout_s  # each read and the save, as in the run
  source = checkpoints.Checkpointer(workdir, keep=10**6, async_save=False, timeout_s=timeout_s)
  newest_state, iterator_state = source.restore(newest, run.restore_target())
  source.close()

  storage.makedirs(output_workdir)
  for name in ("config.json", "vocab.model"):
    storage.copy(storage.join(workdir, name), storage.join(output_workdir, name))
  target = checkpoints.Checkpointer(output_workdir, keep=1, async_save=False, timeout_s=timeout_s)
  target.save(newest, newest_state.replace(params=params), iterator_state, config)
  target.close()
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
