r"""Host memory and time of restoring a trained run's averaged parameters, two ways.

    python -m transformer.tools.restore_memory --config configs/wmt14.py:big \
        --average_last 5 --json

Writes `--average_last` checkpoints of the config's whole train state (random parameters
and Adam moments, as training saves them) into `--workdir` (default: a temporary folder,
deleted after), timing each save (`save_s`: the whole state written, which a preemption
notice's margin must hold, docs/clusters.md), then restores the mean of their parameters
in a fresh process per way, the ways taking turns for `--rounds`:

  params_only  what every command does (`transformer.inference.checkpoints.restore_params`):
               a partial restore of each checkpoint's parameters, part by part (the
               embedding, the encoder, the decoder), summed into one float32 sum;
  full_state   what they did before: each checkpoint's whole train state restored
               (parameters and both Adam moments, `training.checkpoints.Checkpointer`),
               its parameters added to the sum, the moments thrown away.

Each process reports its peak resident memory (VmHWM) above what it held before the
restore began (the imports and the abstract set-up), the parameters' and the state's
bytes, and the restore's wall time. One JSON line per process with --json;
docs/performance.md renders them ("Restoring a trained run").
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
from absl import flags
from ml_collections import config_flags

from transformer import cli, storage, versions
from transformer import config as config_lib

# Its docs/results records' version: bump when what it computes changes, not on a reformat.
RECORD_VERSION = 1

_FLAG_VALUES = cli.program_flags(__name__)  # absl's only when run as a program
_CONFIG = config_flags.DEFINE_config_file(
  "config", config_lib.DEFAULT_CONFIG, "Config file.", flag_values=_FLAG_VALUES
)
_AVERAGE_LAST = flags.DEFINE_integer(
  "average_last", 5, "Checkpoints written and averaged.", flag_values=_FLAG_VALUES
)
_ROUNDS = flags.DEFINE_integer(
  "rounds", 1, "Turns of the two ways (each a fresh process).", flag_values=_FLAG_VALUES
)
_WORKDIR = flags.DEFINE_string(
  "workdir",
  None,
  "Where the checkpoints go (default: a temporary folder).",
  flag_values=_FLAG_VALUES,
)
_JSON = flags.DEFINE_bool("json", False, "One JSON line per process.", flag_values=_FLAG_VALUES)
_MEASURE = flags.DEFINE_enum(
  "measure",
  None,
  ["params_only", "full_state"],
  "(internal) restore --workdir's checkpoints this way in this process and print the result.",
  flag_values=_FLAG_VALUES,
)

WAYS = ("params_only", "full_state")


def _status_kib(field: str) -> int:
  """A field of /proc/self/status in KiB (VmRSS, VmHWM); 0 where there is no /proc."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1])
  except OSError:
    pass
  return 0


def write_checkpoints(config, workdir: str, count: int) -> dict[str, int]:
  """`count` checkpoints (steps 1..count) of a random train state of the config's shapes,
  and its config.json; returns the parameters' and the whole state's bytes."""
  from transformer.training import checkpoints, state

  setup = state.setup(config)
  train_state = setup.init_state(jax.random.key(0))
  storage.makedirs(workdir)
  storage.write_json(storage.join(workdir, "config.json"), json.loads(config.to_json()))
  writer = checkpoints.Checkpointer(
    workdir, keep=count, async_save=False, timeout_s=config.storage_timeout_s
  )
  save_s = []
  for step in range(1, count + 1):
    started = time.perf_counter()
    writer.save(step, dataclasses.replace(train_state, step=train_state.step + step), {}, config)
    save_s.append(round(time.perf_counter() - started, 2))  # synchronous: the whole write
  writer.close()
  nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
  return {
    "params_bytes": nbytes(train_state.params),
    "state_bytes": nbytes(train_state),
    "save_s": save_s,
  }


def _full_state_mean(config, workdir: str, average_last: int) -> Any:
  """The restore as it was: whole train states, one at a time, their parameters summed."""
  from transformer.training import checkpoints, state

  setup = state.setup(config)
  reader = checkpoints.Checkpointer(
    workdir, keep=10**6, async_save=False, timeout_s=config.storage_timeout_s
  )
  chosen = reader.all_steps()[-average_last:]
  total = None
  for step in chosen:
    restored, _ = reader.restore(step, setup.restore_target())
    params = jax.tree.map(lambda x: x.astype("float32"), restored.params)
    total = params if total is None else jax.tree.map(lambda a, b: a + b, total, params)
    del restored, params
  reader.close()
  return jax.tree.map(lambda x: x / len(chosen), total)


def measure(way: str, config, workdir: str, average_last: int) -> dict[str, Any]:
  """Restores the mean of the newest `average_last` checkpoints `way` in this process."""
  from transformer import inference
  from transformer.inference import checkpoints as inference_checkpoints

  model_setup = inference.setup(config)  # abstract: nothing allocated yet
  before_kib = _status_kib("VmRSS")
  started = time.perf_counter()
  if way == "params_only":
    params, _ = inference_checkpoints.restore_params(
      workdir, model_setup, average_last=average_last
    )
  else:
    params = _full_state_mean(config, workdir, average_last)
  jax.block_until_ready(params)
  seconds = time.perf_counter() - started
  peak_kib = _status_kib("VmHWM")
  return {
    "name": "restore_memory",
    "way": way,
    "average_last": average_last,
    "restore_s": round(seconds, 2),
    "peak_rss_bytes": peak_kib * 1024,
    "held_by_restore_bytes": max(peak_kib - before_kib, 0) * 1024,
    "params_bytes": sum(x.nbytes for x in jax.tree.leaves(params)),
    "num_params": model_setup.num_params,
  }


def _child(way: str, workdir: str, argv_config: list[str]) -> dict[str, Any]:
  command = [sys.executable, "-m", "transformer.tools.restore_memory", *argv_config]
  command += [f"--measure={way}", f"--workdir={workdir}", f"--average_last={_AVERAGE_LAST.value}"]
  result = subprocess.run(command, capture_output=True, text=True)
  if result.returncode != 0:
    last = (result.stderr.strip().splitlines() or ["no output"])[-1]
    raise RuntimeError(f"restoring {way} failed: {last}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv):
  del argv
  config = _CONFIG.value
  if _MEASURE.value:
    print(json.dumps(measure(_MEASURE.value, config, _WORKDIR.value, _AVERAGE_LAST.value)))
    return
  try:
    config_lib.validate(config)
    if _AVERAGE_LAST.value < 1 or _ROUNDS.value < 1:
      raise config_lib.ConfigError("--average_last and --rounds: must be at least 1")
  except config_lib.ConfigError as e:
    cli.exit_with_error(e)
  # The child processes read the same config: its file and this command line's overrides.
  argv_config = [f"--config={_FLAG_VALUES['config'].config_filename}"]
  argv_config += [a for a in sys.argv[1:] if a.startswith("--config.")]
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="restore-memory-")
  try:
    sizes = write_checkpoints(config, workdir, _AVERAGE_LAST.value)
    for _ in range(_ROUNDS.value):
      for way in WAYS:
        record = {**_child(way, workdir, argv_config), **sizes}
        record["versions"] = versions.library_versions()
        if _JSON.value:
          print(json.dumps(record), flush=True)
        else:
          print(describe(record), flush=True)
  finally:
    if not _WORKDIR.value:
      shutil.rmtree(workdir, ignore_errors=True)


def describe(record: dict[str, Any]) -> str:
  gib = 2**30
  return (
    f"{record['way']}: mean of {record['average_last']} checkpoints in "
    f"{record['restore_s']:.1f} s, {record['held_by_restore_bytes'] / gib:.2f} GiB held "
    f"by the restore at its peak (parameters {record['params_bytes'] / gib:.2f} GiB, "
    f"train state {record['state_bytes'] / gib:.2f} GiB)"
  )


if __name__ == "__main__":
  if os.environ.get("JAX_PLATFORMS") is None:
    os.environ["JAX_PLATFORMS"] = "cpu"  # host memory is what this measures
  cli.run(main)
