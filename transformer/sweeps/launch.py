"""Scripts that run a sweep's rows on a SLURM cluster or a TPU pod (`sweep --launch`).

Only command generation: each row's script runs the same `train.py` and `eval.py`
commands as a local sweep, started the way README ("Pods and clusters") starts any multi-host
run. JAX reads the SLURM environment or the TPU runtime to connect the processes, and
a rerun of a script resumes the row from its newest checkpoint, so a preempted or
requeued job loses at most one checkpoint interval.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from typing import Any

from absl import flags

from transformer import config as config_lib
from transformer.sweeps import spec

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string(
    "script_dir",
    None,
    "Where --launch writes its scripts (default: WORKDIR/launch; required "
    "when WORKDIR is a gs:// path).",
  )
  flags.DEFINE_string(
    "repo_dir",
    "$HOME/transformer",
    "--launch: this repository's path on the cluster hosts (the scripts cd there).",
  )
  flags.DEFINE_string("python", "python", "--launch: the Python command on the cluster hosts.")
  flags.DEFINE_integer("slurm_nodes", 1, "--launch slurm: nodes per row (one process each).")
  flags.DEFINE_integer("slurm_gpus_per_node", 8, "--launch slurm: GPUs per node.")
  flags.DEFINE_string("slurm_time", "24:00:00", "--launch slurm: time limit per job.")
  flags.DEFINE_string(
    "slurm_extra", "", "--launch slurm: extra #SBATCH options, e.g. '--partition=gpu'."
  )
  flags.DEFINE_string("tpu_name", "TPU_NAME", "--launch tpu: the TPU VM (pod slice) name.")
  flags.DEFINE_string("tpu_zone", "ZONE", "--launch tpu: its zone.")


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
  script_dir: str = ""  # "" = WORKDIR/launch
  repo_dir: str = "$HOME/transformer"
  python: str = "python"
  slurm_nodes: int = 1
  slurm_gpus_per_node: int = 8
  slurm_time: str = "24:00:00"
  slurm_extra: str = ""
  tpu_name: str = "TPU_NAME"
  tpu_zone: str = "ZONE"


def options_from_flags() -> LaunchOptions:
  values: dict[str, Any] = {f.name: FLAGS[f.name].value for f in dataclasses.fields(LaunchOptions)}
  return LaunchOptions(**values)


def _command(python: str, script: str, args: list[str]) -> str:
  return " ".join([python, script] + [shlex.quote(a) for a in args])


def row_commands(
  sweep: spec.Sweep, row: spec.Row, config, workdir: str, python: str
) -> tuple[str, str]:
  """(train command, eval command) for one row, run from the repository root."""
  row_dir = f"{workdir.rstrip('/')}/{row.name}"
  relative = os.path.relpath(spec.config_file(sweep), config_lib.REPO_ROOT)  # the cluster's clone
  train = _command(python, "train.py", spec.train_args(sweep, row, row_dir, relative))
  evaluate = _command(python, "eval.py", spec.eval_args(row_dir, config.num_train_steps))
  return train, evaluate


def _slurm_script(
  sweep, row, train: str, evaluate: str, script_dir: str, options: LaunchOptions
) -> str:
  extra = f"#SBATCH {options.slurm_extra}\n" if options.slurm_extra else ""
  gpus = options.slurm_gpus_per_node
  return f"""#!/bin/bash
# Row {row.name} of sweep {sweep.name}. Submit with: sbatch {script_dir}/{row.name}.sbatch
#SBATCH --job-name={sweep.name}-{row.name}
#SBATCH --nodes={options.slurm_nodes} --ntasks-per-node=1 --gpus-per-node={gpus}
#SBATCH --time={options.slurm_time}
#SBATCH --output={script_dir}/{row.name}-%j.out
# SIGTERM two minutes before the time limit: train.py saves a checkpoint and exits 0.
# Requeued or resubmitted, the same script resumes from it.
#SBATCH --signal=TERM@120 --requeue
{extra}set -euo pipefail
cd {options.repo_dir}
# One process per node; jax.distributed reads the SLURM environment.
srun {train}
# Beam search is one process's job: the final checkpoint on the whole validation split.
srun --nodes=1 --ntasks=1 {evaluate}
"""


def _tpu_script(sweep, row, train: str, evaluate: str, options: LaunchOptions) -> str:
  ssh = (
    f"gcloud compute tpus tpu-vm ssh {options.tpu_name} --zone {options.tpu_zone} "
    "--worker=all --command="
  )
  # Every worker runs the same command; the TPU runtime connects them.
  return f"""#!/bin/bash
# Row {row.name} of sweep {sweep.name}; rerunning it resumes from the newest checkpoint.
set -euo pipefail
{ssh}{shlex.quote(f"cd {options.repo_dir} && {train}")}
{ssh}{shlex.quote(f"cd {options.repo_dir} && {evaluate}")}
"""


def write_scripts(
  kind: str, sweep: spec.Sweep, rows: list, configs: dict, workdir: str, options: LaunchOptions
) -> list[str]:
  """Writes <row>.sbatch (slurm) or <row>.sh (tpu) per row, plus one script for all."""
  script_dir = options.script_dir
  if not script_dir:
    if "://" in workdir:
      raise spec.SweepError(f"--script_dir is required with --workdir {workdir}")
    script_dir = os.path.join(workdir, "launch")
  os.makedirs(script_dir, exist_ok=True)
  written = []
  for row in rows:
    train, evaluate = row_commands(sweep, row, configs[row.name], workdir, options.python)
    if kind == "slurm":
      path = os.path.join(script_dir, f"{row.name}.sbatch")
      text = _slurm_script(sweep, row, train, evaluate, script_dir, options)
    else:
      path = os.path.join(script_dir, f"{row.name}.sh")
      text = _tpu_script(sweep, row, train, evaluate, options)
    with open(path, "w") as f:
      f.write(text)
    os.chmod(path, 0o755)
    written.append(path)
  # SLURM jobs queue side by side; one TPU slice runs the rows one after another.
  starter = "sbatch" if kind == "slurm" else "bash"
  all_path = os.path.join(script_dir, f"{kind}_all.sh")
  with open(all_path, "w") as f:
    f.write(
      "#!/bin/bash\nset -euo pipefail\n" + "".join(f"{starter} {shlex.quote(p)}\n" for p in written)
    )
  os.chmod(all_path, 0o755)
  return written + [all_path]
