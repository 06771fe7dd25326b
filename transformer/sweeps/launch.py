"""Scripts that run a sweep's rows on a SLURM cluster or a TPU pod (`sweep --launch`).

Only command generation: each row's script runs the same `train.py` and `eval.py`
commands as a local sweep, with the repository's `.venv/bin/python`, started the way
docs/clusters.md starts any multi-host run. Each script first prepares the row's dataset
and vocabulary once (`transformer.tools.prepare_data`), so the hosts read one copy
instead of each building its own; trains (JAX reads the SLURM environment, or a TPU
slice's metadata server, to connect the processes); and beam-searches the validation
split only once `train.py --print_step` shows the row's last step
(`config.final_step`: batches, not updates), not after a run stopped early. A SLURM job
stopped by its time limit or a preemption, in training or in its final evaluation,
requeues itself; a rerun of any script resumes the row from its newest checkpoint, so a
stopped job loses at most one checkpoint interval.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from typing import Any

from absl import flags

from transformer import config as config_lib
from transformer.inference import distributed
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
    "",
    "--launch: this repository's path on the cluster hosts, where the scripts cd (default: "
    "this clone's own path, where the sweep command runs: a clone every host sees there).",
  )
  flags.DEFINE_string(
    "python",
    ".venv/bin/python",
    "--launch: the Python command on the cluster hosts, from --repo_dir (the one that "
    "`make install` made).",
  )
  flags.DEFINE_integer("slurm_nodes", 1, "--launch slurm: nodes per row.")
  flags.DEFINE_integer(
    "slurm_gpus_per_node", 8, "--launch slurm: GPUs per node, one process (task) each."
  )
  flags.DEFINE_integer(
    "slurm_cpus_per_task",
    8,
    "--launch slurm: CPU cores per GPU process, for tf.data, SentencePiece and XLA's "
    "compiler (a cluster that pins tasks to cores gives each one core otherwise).",
  )
  flags.DEFINE_string(
    "slurm_mem_per_gpu", "32G", "--launch slurm: host memory per GPU ('' leaves it out)."
  )
  flags.DEFINE_bool(
    "slurm_exclusive", False, "--launch slurm: the nodes to the job alone (#SBATCH --exclusive)."
  )
  flags.DEFINE_string("slurm_time", "24:00:00", "--launch slurm: time limit per job.")
  flags.DEFINE_integer(
    "slurm_notice_s",
    120,
    "--launch slurm: seconds between the SIGTERM notice and the time limit: enough for a "
    "step, a checkpoint's save and the processes' shutdown (docs/clusters.md).",
  )
  flags.DEFINE_string(
    "slurm_extra", "", "--launch slurm: extra #SBATCH options, e.g. '--partition=gpu'."
  )
  flags.DEFINE_string("tpu_name", "TPU_NAME", "--launch tpu: the TPU VM (pod slice) name.")
  flags.DEFINE_string("tpu_zone", "ZONE", "--launch tpu: its zone.")


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
  script_dir: str = ""  # "" = WORKDIR/launch
  repo_dir: str = ""  # "" = this clone's path (config_lib.REPO_ROOT)
  python: str = ".venv/bin/python"
  slurm_nodes: int = 1
  slurm_gpus_per_node: int = 8
  slurm_cpus_per_task: int = 8
  slurm_mem_per_gpu: str = "32G"
  slurm_exclusive: bool = False
  slurm_time: str = "24:00:00"
  slurm_notice_s: int = 120
  slurm_extra: str = ""
  tpu_name: str = "TPU_NAME"
  tpu_zone: str = "ZONE"


def options_from_flags() -> LaunchOptions:
  values: dict[str, Any] = {f.name: FLAGS[f.name].value for f in dataclasses.fields(LaunchOptions)}
  return LaunchOptions(**values)


def _command(python: str, script: str, args: list[str]) -> str:
  return " ".join([python, script] + [shlex.quote(a) for a in args])


@dataclasses.dataclass(frozen=True)
class RowCommands:
  """What a row's script runs, from the repository root: each a shell command line."""

  row_dir: str  # the row's workdir
  prepare: str  # the dataset and vocabulary, on one host, before training
  train: str
  evaluate: str
  print_step: str  # prints the newest checkpoint's step
  last_step: int  # what print_step prints once training is finished (config.final_step)


def row_commands(
  sweep: spec.Sweep,
  run: spec.Run,
  config,
  workdir: str,
  python: str,
  extra_args: tuple[str, ...] = (),
) -> RowCommands:
  """A run's commands; `extra_args` go to its train.py and eval.py (the TPU script's
  --distributed=on)."""
  row_dir = run.directory(workdir)
  relative = os.path.relpath(spec.config_file(sweep), config_lib.REPO_ROOT)  # the cluster's clone
  train_args = spec.train_args(sweep, run, row_dir, relative)
  config_args = train_args[:2] + train_args[4:]  # without --workdir DIR
  return RowCommands(
    row_dir=row_dir,
    prepare=_command(python, "-m transformer.tools.prepare_data", config_args),
    train=_command(python, "train.py", train_args + list(extra_args)),
    evaluate=_command(
      python, "eval.py", spec.eval_args(row_dir, config, sweep.average_last) + list(extra_args)
    ),
    print_step=_command(python, "train.py", ["--workdir", row_dir, "--print_step"]),
    last_step=config_lib.final_step(config),
  )


def _repo_dir(options: LaunchOptions) -> str:
  """Where the scripts cd on the hosts: --repo_dir, else this clone's own path."""
  return options.repo_dir or config_lib.REPO_ROOT


def _slurm_script(
  sweep, row, commands: RowCommands, script_dir: str, options: LaunchOptions
) -> str:
  gpus, cpus = options.slurm_gpus_per_node, options.slurm_cpus_per_task
  resources = [f"--cpus-per-task={cpus}"]
  if options.slurm_mem_per_gpu:
    resources.append(f"--mem-per-gpu={options.slurm_mem_per_gpu}")
  if options.slurm_exclusive:
    resources.append("--exclusive")
  extra = f"#SBATCH {options.slurm_extra}\n" if options.slurm_extra else ""
  return f"""#!/bin/bash
# Row {row.name} of sweep {sweep.name}. Submit with: sbatch {script_dir}/{row.name}.sbatch
#SBATCH --job-name={sweep.name}-{row.name}
#SBATCH --nodes={options.slurm_nodes} --ntasks-per-node={gpus} --gpus-per-node={gpus}
#SBATCH {" ".join(resources)}
#SBATCH --time={options.slurm_time}
#SBATCH --output={script_dir}/{row.name}-%j.out
# SIGTERM {options.slurm_notice_s} s before the time limit, to the job's steps: train.py saves a
# checkpoint at once (skipping any validation due) and exits 0, and the job requeues
# itself below; the requeued job resumes from that checkpoint, under the same job id, its
# output appended to the same log.
#SBATCH --signal=TERM@{options.slurm_notice_s} --requeue --open-mode=append
{extra}set -euo pipefail
cd {shlex.quote(_repo_dir(options))}
# The dataset and vocabulary, built once here rather than by every process at once.
{commands.prepare}
# One process per GPU, each with its cores (srun does not take --cpus-per-task from
# #SBATCH since SLURM 22.05); jax.distributed reads the SLURM environment (docs/clusters.md).
srun --cpus-per-task={cpus} {commands.train}
# Stopped before the last step (time limit, preemption): back into the queue, to resume.
step=$({commands.print_step})
if [ "$step" != {commands.last_step} ]; then
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
# Beam search is one process's job: the final checkpoint on the whole validation split,
# with every core of the node. A notice stops it between batches, exit status
# {distributed.NOTICE_EXIT_CODE}: back into the queue, to evaluate again. Other failures fail it.
status=0
srun --nodes=1 --ntasks=1 --cpus-per-task={cpus * gpus} {commands.evaluate} || status=$?
if [ "$status" = {distributed.NOTICE_EXIT_CODE} ]; then
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
"""


def _tpu_start(repo_dir: str, log: str, commands: RowCommands) -> str:
  """The command that starts the row on a worker: `log` is the worker's log, without ".log"."""
  # Once the job has ended (finished, stopped or failed), each worker's log (every start
  # of the row on that worker) goes into the row's workdir as well, as logs/<host>.log: a
  # bucket cannot be appended to while it runs.
  saved_log = f"{commands.row_dir}/logs/$(hostname).log"
  if "://" in commands.row_dir:
    keep_log = f"gcloud storage cp {log}.log {saved_log}"
  else:
    keep_log = f"mkdir -p {commands.row_dir}/logs && cp {log}.log {saved_log}"
  # On every worker, detached from the ssh session (setsid, nohup): train, and evaluate
  # only if training reached its last step. The job's shell records its process id, so
  # that `stop` can SIGTERM the command it runs, train.py or eval.py, and the shell
  # itself goes on to keep the log.
  job = (
    f'echo $$ > {log}.pid; echo "=== $(date -u) start on $(hostname)"; {commands.train} && '
    f'[ "$({commands.print_step})" = {commands.last_step} ] && {commands.evaluate}; '
    f"{keep_log}"
  )
  return (
    f"cd {repo_dir} && mkdir -p logs && "
    f"nohup setsid bash -c {shlex.quote(job)} >> {log}.log 2>&1 < /dev/null &"
  )


def _tpu_script(sweep, row, commands: RowCommands, options: LaunchOptions) -> str:
  repo_dir = shlex.quote(_repo_dir(options))
  # Per worker (the clone may be on a disk every worker shares), kept across restarts: the
  # log is appended to, and the pid file is the newest start's.
  log = f"logs/{sweep.name}-{row.name}.$(hostname)"
  start = _tpu_start(repo_dir, log, commands)
  prepare = f"cd {repo_dir} && {commands.prepare}"
  watch = f"cd {repo_dir} && tail -n 100 -F {log}.log"
  stop = f"cd {repo_dir} && pkill -TERM -P $(cat {log}.pid)"
  running = f"cd {repo_dir} && kill -0 $(cat {log}.pid) 2>/dev/null"
  finished = f'cd {repo_dir} && [ "$({commands.print_step})" = {commands.last_step} ]'
  return f"""#!/bin/bash
# Row {row.name} of sweep {sweep.name} on the TPU slice {options.tpu_name}: every worker
# runs the same commands, and jax.distributed connects them (--distributed=on: JAX finds
# the slice's workers on the metadata server; docs/clusters.md).
# bash {row.name}.sh start (the default): prepare the dataset once (worker 0), then train
#   on every worker, detached from ssh; the job evaluates after its last step.
# bash {row.name}.sh watch: follow worker 0's log, {_repo_dir(options)}/{log}.log
#   (each worker's own, appended to at every start; each goes to
#   {commands.row_dir}/logs/ when the job ends).
# bash {row.name}.sh stop: SIGTERM to every worker, as a preemption: all save and exit.
# bash {row.name}.sh wait: return once the job has ended, 0 if it reached its last step.
# Running it again resumes from the newest checkpoint.
set -euo pipefail
tpu_ssh() {{
  gcloud compute tpus tpu-vm ssh {options.tpu_name} --zone {options.tpu_zone} "$@"
}}
case "${{1:-start}}" in
  start)
    tpu_ssh --worker=0 --command={shlex.quote(prepare)}
    tpu_ssh --worker=all --command={shlex.quote(start)}
    ;;
  watch) tpu_ssh --worker=0 --command={shlex.quote(watch)} ;;
  stop) tpu_ssh --worker=all --command={shlex.quote(stop)} ;;
  wait)
    while tpu_ssh --worker=0 --command={shlex.quote(running)}; do sleep 300; done
    tpu_ssh --worker=0 --command={shlex.quote(finished)}
    ;;
  *) echo "usage: bash $0 [start|watch|stop|wait]" >&2; exit 2 ;;
esac
"""


def _check_shared_data_dir(kind: str, row: spec.Row, config, options: LaunchOptions) -> None:
  """A tfds dataset on several hosts needs one data_dir every host reads, where the script
  prepares it once; otherwise each host without a shared home builds its own."""
  if config.dataset.startswith("tsv:") or config.data_dir:
    return
  if kind == "tpu":
    raise spec.SweepError(
      f"row {row.name}: --launch tpu needs a data_dir every worker reads, where the dataset "
      f"is prepared once: pass --config.data_dir=gs://BUCKET/tfds"
    )
  if options.slurm_nodes > 1:
    raise spec.SweepError(
      f"row {row.name}: --launch slurm over {options.slurm_nodes} nodes needs a data_dir every "
      "node reads, where the dataset is prepared once: pass --config.data_dir=/SHARED/tfds"
    )


def write_scripts(
  kind: str, sweep: spec.Sweep, rows: list, configs: dict, workdir: str, options: LaunchOptions
) -> list[str]:
  """Writes <row>.sbatch (slurm) or <row>.sh (tpu) per run (<row>-seed<k> for a row with
  seeds), plus one script for all."""
  script_dir = options.script_dir
  if not script_dir:
    if "://" in workdir:
      raise spec.SweepError(f"--script_dir is required with --workdir {workdir}")
    script_dir = os.path.join(workdir, "launch")
  os.makedirs(script_dir, exist_ok=True)
  for row in rows:
    _check_shared_data_dir(kind, row, configs[row.name], options)
  # A TPU slice's workers must find each other: JAX's detection, and an error if it fails.
  extra_args = ("--distributed=on",) if kind == "tpu" else ()
  written = []
  for run in spec.runs(rows):
    config = configs[run.row.name]
    commands = row_commands(sweep, run, config, workdir, options.python, extra_args)
    # A run of a row with seeds is named for its seed in its script, job and log names.
    label = run.row.name if run.seed is None else f"{run.row.name}-seed{run.seed}"
    row = dataclasses.replace(run.row, name=label)
    if kind == "slurm":
      path = os.path.join(script_dir, f"{row.name}.sbatch")
      text = _slurm_script(sweep, row, commands, script_dir, options)
    else:
      path = os.path.join(script_dir, f"{row.name}.sh")
      text = _tpu_script(sweep, row, commands, options)
    with open(path, "w") as f:
      f.write(text)
    os.chmod(path, 0o755)
    written.append(path)
  # SLURM jobs queue side by side; one TPU slice runs the rows one after another, each
  # started once the one before has reached its last step.
  if kind == "slurm":
    starts = [f"sbatch {shlex.quote(p)}\n" for p in written]
  else:
    starts = [f"bash {shlex.quote(p)} start\nbash {shlex.quote(p)} wait\n" for p in written]
  all_path = os.path.join(script_dir, f"{kind}_all.sh")
  with open(all_path, "w") as f:
    f.write("#!/bin/bash\nset -euo pipefail\n" + "".join(starts))
  os.chmod(all_path, 0o755)
  return written + [all_path]
