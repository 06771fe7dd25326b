"""Cluster scripts (launch.py): each row's SLURM or TPU-pod script runs the same train.py
and eval.py commands as a local sweep, with the cluster options in their places. The
scripts themselves run here against fake `srun`, `scontrol`, `sbatch` and `gcloud` (a
worker is this machine) and a fake python that records its arguments."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shlex
import socket
import stat
import subprocess
import sys
import time
import types

import pytest

from tests.helpers.sweep_helpers import REPO, TABLE3, run_sweep_command
from transformer.sweeps import launch, spec


@pytest.fixture(scope="module")
def table3():
  """(sweep, rows E and big, their configs)."""
  sweep = dataclasses.replace(
    spec.load_sweep(TABLE3), command_line_overrides={"data_dir": "gs://b/tfds"}
  )
  rows = spec.select_rows(sweep, "E,big")
  return sweep, rows, {row.name: spec.row_config(sweep, row) for row in rows}


def test_slurm_script_carries_every_option(tmp_path, table3):
  """Nodes, one task per GPU, time, extra #SBATCH line, job name, log path, repo and python
  command all land in the script, and the whole script is the expected text."""
  sweep, rows, configs = table3
  options = launch.LaunchOptions(
    script_dir=str(tmp_path),
    repo_dir="/srv/transformer",
    python="python3",
    slurm_nodes=4,
    slurm_gpus_per_node=2,
    slurm_cpus_per_task=6,
    slurm_mem_per_gpu="80G",
    slurm_exclusive=True,
    slurm_time="1:00:00",
    slurm_notice_s=300,
    slurm_extra="--partition=gpu",
  )
  path = launch.write_scripts("slurm", sweep, rows[:1], configs, "/data/t3", options)[0]
  overrides = "--config.model.positional=learned --config.data_dir=gs://b/tfds"
  assert (
    pathlib.Path(path).read_text()
    == f"""#!/bin/bash
# Row E of sweep table3. Submit with: sbatch {tmp_path}/E.sbatch
#SBATCH --job-name=table3-E
#SBATCH --nodes=4 --ntasks-per-node=2 --gpus-per-node=2
#SBATCH --cpus-per-task=6 --mem-per-gpu=80G --exclusive
#SBATCH --time=1:00:00
#SBATCH --output={tmp_path}/E-%j.out
# SIGTERM 300 s before the time limit, to the job's steps: train.py saves a
# checkpoint at once (skipping any validation due) and exits 0, and the job requeues
# itself below; the requeued job resumes from that checkpoint, under the same job id, its
# output appended to the same log.
#SBATCH --signal=TERM@300 --requeue --open-mode=append
#SBATCH --partition=gpu
set -euo pipefail
cd /srv/transformer
# The dataset and vocabulary, built once here rather than by every process at once.
python3 -m transformer.tools.prepare_data --config configs/wmt14.py:base {overrides}
# One process per GPU, each with its cores (srun does not take --cpus-per-task from
# #SBATCH since SLURM 22.05); jax.distributed reads the SLURM environment (docs/clusters.md).
srun --cpus-per-task=6 python3 train.py --config configs/wmt14.py:base --workdir /data/t3/E \
{overrides}
# Stopped before the last step (time limit, preemption): back into the queue, to resume.
step=$(python3 train.py --workdir /data/t3/E --print_step)
if [ "$step" != 100000 ]; then
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
# Beam search is one process's job: the final checkpoint on the whole validation split,
# with every core of the node. A notice stops it between batches, exit status
# 143: back into the queue, to evaluate again. Other failures fail it.
status=0
srun --nodes=1 --ntasks=1 --cpus-per-task=12 python3 eval.py --workdir /data/t3/E --split \
validation --step 100000 || status=$?
if [ "$status" = 143 ]; then
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
"""
  )


def test_slurm_script_without_extra_options_has_no_empty_sbatch_line(tmp_path, table3):
  sweep, rows, configs = table3
  options = launch.LaunchOptions(script_dir=str(tmp_path))
  path = launch.write_scripts("slurm", sweep, rows[:1], configs, "/data/t3", options)[0]
  lines = pathlib.Path(path).read_text().splitlines()
  assert [line for line in lines if line.startswith("#SBATCH")] == [
    "#SBATCH --job-name=table3-E",
    "#SBATCH --nodes=1 --ntasks-per-node=8 --gpus-per-node=8",
    "#SBATCH --cpus-per-task=8 --mem-per-gpu=32G",
    "#SBATCH --time=24:00:00",
    f"#SBATCH --output={tmp_path}/E-%j.out",
    "#SBATCH --signal=TERM@120 --requeue --open-mode=append",
  ]


def test_scripts_are_executable_and_default_to_workdir_launch(tmp_path, table3):
  """Without --script_dir the scripts go to WORKDIR/launch, all of them executable; without
  --repo_dir they cd to this clone's own path (where the sweep ran), not a guess."""
  sweep, rows, configs = table3
  workdir = str(tmp_path / "runs")
  written = launch.write_scripts("slurm", sweep, rows, configs, workdir, launch.LaunchOptions())
  assert {os.path.dirname(p) for p in written} == {os.path.join(workdir, "launch")}
  for path in written:
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755, path
  for path in written[:-1]:
    assert f"\ncd {REPO}\n" in pathlib.Path(path).read_text()


def test_cloud_workdir_needs_a_script_dir(table3):
  """Scripts cannot be written under gs://...: --script_dir must say where, before any
  file is written."""
  sweep, rows, configs = table3
  with pytest.raises(spec.SweepError, match=r"^--script_dir is required with --workdir gs://b/t3$"):
    launch.write_scripts("tpu", sweep, rows, configs, "gs://b/t3", launch.LaunchOptions())


def test_row_commands_quote_values_and_name_the_config_relative_to_the_repo():
  """A value with spaces stays one shell word; the config path is the clone's relative
  one whatever the sweep wrote; a trailing slash on the workdir is not doubled."""
  sweep = spec.Sweep("s", "configs/wmt14.py:big", {}, [])
  row = spec.Row("r", {"dataset": "tsv:/data/my corpus.tsv"})
  config = types.SimpleNamespace(num_train_steps=9, grad_accum_steps=1)
  commands = launch.row_commands(sweep, spec.Run(row), config, "/w/", "py")
  assert shlex.split(commands.train) == [
    "py",
    "train.py",
    "--config",
    "configs/wmt14.py:big",
    "--workdir",
    "/w/r",
    "--config.dataset=tsv:/data/my corpus.tsv",
  ]
  assert shlex.split(commands.prepare) == [
    "py",
    "-m",
    "transformer.tools.prepare_data",
    "--config",
    "configs/wmt14.py:big",
    "--config.dataset=tsv:/data/my corpus.tsv",
  ]
  assert commands.evaluate == "py eval.py --workdir /w/r --split validation --step 9"
  assert commands.print_step == "py train.py --workdir /w/r --print_step"


def test_launch_from_the_command_line_uses_the_flags(tmp_path):
  """`--launch slurm` with cluster flags writes scripts that carry them and prints the
  paths it wrote."""
  result = run_sweep_command(
    "--sweep",
    TABLE3,
    "--workdir",
    "/data/t3",
    "--only",
    "E",
    "--launch",
    "slurm",
    "--script_dir",
    str(tmp_path),
    "--slurm_nodes",
    "3",
    "--slurm_extra=--partition=p100",
    "--python",
    "python3.11",
    "--repo_dir",
    "/srv/t",
    "--slurm_cpus_per_task=4",
    "--slurm_mem_per_gpu=64G",
    "--slurm_exclusive",
    "--config.data_dir=/shared/tfds",
    timeout=60,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split() == [str(tmp_path / "E.sbatch"), str(tmp_path / "slurm_all.sh")]
  script = (tmp_path / "E.sbatch").read_text()
  assert "#SBATCH --nodes=3 --ntasks-per-node=8 --gpus-per-node=8\n" in script
  assert "#SBATCH --cpus-per-task=4 --mem-per-gpu=64G --exclusive\n" in script
  assert "\nsrun --cpus-per-task=4 python3.11 train.py " in script
  assert "#SBATCH --partition=p100\n" in script and "cd /srv/t\n" in script
  assert "train.py --config configs/wmt14.py:base --workdir /data/t3/E " in script


def test_the_default_python_is_the_venvs():
  assert launch.LaunchOptions().python == ".venv/bin/python"


def test_tpu_scripts_need_a_shared_data_dir_for_a_tfds_dataset(tmp_path):
  sweep = spec.load_sweep(TABLE3)
  rows = spec.select_rows(sweep, "E")
  configs = {"E": spec.row_config(sweep, rows[0])}
  options = launch.LaunchOptions(script_dir=str(tmp_path))
  with pytest.raises(
    spec.SweepError,
    match=r"^row E: --launch tpu needs a data_dir .* "
    r"pass --config.data_dir=gs://BUCKET/tfds$",
  ):
    launch.write_scripts("tpu", sweep, rows, configs, "gs://b/t3", options)
  # SLURM over several nodes likewise (their homes may not be shared); one node is fine.
  two_nodes = dataclasses.replace(options, slurm_nodes=2)
  with pytest.raises(
    spec.SweepError,
    match=r"^row E: --launch slurm over 2 nodes needs a data_dir every node reads, .* "
    r"pass --config.data_dir=/SHARED/tfds$",
  ):
    launch.write_scripts("slurm", sweep, rows, configs, "/runs", two_nodes)
  assert launch.write_scripts("slurm", sweep, rows, configs, "/runs", options)


# Fakes on PATH: each records its arguments, one line per call, in $CALLS. The python
# fake's eval.py exits with $EVAL_STATUS (143: stopped by a notice).
_FAKE_PYTHON = """#!/bin/bash
echo "python $*" >> "$CALLS"
case "$*" in
  *--print_step*) cat "$STEP_FILE" ;;
  "train.py --config"*) if [ -e "$SLOW_TRAINING" ]; then exec sleep 60; fi ;;
  "eval.py "*) exit "${EVAL_STATUS:-0}" ;;
esac
"""
_FAKE_RECORDER = """#!/bin/bash
echo "$(basename "$0") $*" >> "$CALLS"
if [ "$(basename "$0")" = srun ]; then
  while [ "${1#--}" != "$1" ]; do shift; done  # srun's options, then its command
  exec "$@"
fi
"""
# gcloud runs the --command here, as the one worker of the slice (unless RECORD_ONLY).
_FAKE_GCLOUD = """#!/bin/bash
echo "gcloud $*" >> "$CALLS"
[ -n "${RECORD_ONLY:-}" ] && exit 0
for arg in "$@"; do
  case "$arg" in --command=*) exec bash -c "${arg#--command=}" ;; esac
done
"""


def _fakes(tmp_path, last_step):
  """(environment with the fakes first on PATH, the python fake, the calls file)."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for name, text in [
    ("python", _FAKE_PYTHON),
    ("gcloud", _FAKE_GCLOUD),
    ("srun", _FAKE_RECORDER),
    ("scontrol", _FAKE_RECORDER),
    ("sbatch", _FAKE_RECORDER),
  ]:
    (bin_dir / name).write_text(text)
    (bin_dir / name).chmod(0o755)
  calls = tmp_path / "calls"
  calls.write_text("")
  (tmp_path / "step").write_text(str(last_step))
  env = dict(
    os.environ,
    PATH=f"{bin_dir}:{os.environ['PATH']}",
    CALLS=str(calls),
    STEP_FILE=str(tmp_path / "step"),
    SLOW_TRAINING=str(tmp_path / "slow"),
    SLURM_JOB_ID="77",
  )
  return env, str(bin_dir / "python"), calls


def _calls(calls, python):
  """The calls, srun's command (which the fake srun runs) not listed a second time."""
  lines = [line.replace(python, "python") for line in calls.read_text().splitlines()]
  return [
    line
    for i, line in enumerate(lines)
    if not (i and lines[i - 1].startswith("srun ") and lines[i - 1].endswith(line))
  ]


def _tiny_sweep(grad_accum_steps=1):
  overrides = {"data_dir": "gs://b/tfds", "num_train_steps": "30"}
  if grad_accum_steps > 1:
    overrides["grad_accum_steps"] = str(grad_accum_steps)
  sweep = dataclasses.replace(spec.load_sweep(TABLE3), command_line_overrides=overrides)
  rows = spec.select_rows(sweep, "E")
  return sweep, rows, {"E": spec.row_config(sweep, rows[0])}


def _config(grad_accum_steps=1):
  accumulate = f" --config.grad_accum_steps={grad_accum_steps}" if grad_accum_steps > 1 else ""
  return (
    "--config configs/wmt14.py:base --config.model.positional=learned "
    "--config.data_dir=gs://b/tfds --config.num_train_steps=30" + accumulate
  )


def _slurm_job(tmp_path, stopped_at, grad_accum_steps=1, eval_status=0):
  """Runs a row's .sbatch as SLURM would, the newest checkpoint at `stopped_at`; returns
  (its exit status, the calls it made, the scripts written)."""
  sweep, rows, configs = _tiny_sweep(grad_accum_steps)
  tmp_path.mkdir()
  env, python, calls = _fakes(tmp_path, last_step=stopped_at)
  options = launch.LaunchOptions(script_dir=str(tmp_path), repo_dir=str(tmp_path), python=python)
  written = launch.write_scripts("slurm", sweep, rows, configs, "/runs", options)
  job = subprocess.run(
    ["bash", written[0]], env=dict(env, EVAL_STATUS=str(eval_status)), timeout=60
  )
  return job.returncode, _calls(calls, python), written, env


@pytest.mark.parametrize("grad_accum_steps", [1, 2])
def test_slurm_job_requeues_itself_when_stopped_early_and_evaluates_when_finished(
  tmp_path, grad_accum_steps
):
  """The .sbatch as SLURM runs it: prepare, train on every task, then either `scontrol
  requeue` (the newest checkpoint is short of the last step: time limit, preemption) or
  the final evaluation, never both. With 2 batches an update the last step is 60, not 30:
  a job stopped at step 30 requeues instead of scoring a half-trained run. slurm_all.sh
  submits the job with sbatch."""
  config = _config(grad_accum_steps)
  last = 30 * grad_accum_steps
  for stopped_at in sorted({20, 30, last}):
    status, done, written, env = _slurm_job(
      tmp_path / str(stopped_at), stopped_at, grad_accum_steps
    )
    assert status == 0
    assert done == [
      f"python -m transformer.tools.prepare_data {config}",
      "srun --cpus-per-task=8 python train.py "
      + config.replace(" --config.", " --workdir /runs/E --config.", 1),
      "python train.py --workdir /runs/E --print_step",
    ] + (
      ["scontrol requeue 77"]
      if stopped_at < last
      else [
        "srun --nodes=1 --ntasks=1 --cpus-per-task=64 python eval.py --workdir /runs/E "
        f"--split validation --step {last}"
      ]
    )
    subprocess.run(["bash", written[-1]], env=env, check=True, timeout=60)
    sbatch = (tmp_path / str(stopped_at) / "calls").read_text().splitlines()[-1]
    assert sbatch == f"sbatch {written[0]}"


def test_a_notice_to_the_final_evaluation_requeues_the_job_and_a_failure_fails_it(tmp_path):
  """eval.py stopped by the time limit's notice (exit 143) puts the job back in the queue,
  where it evaluates again, rather than failing under `set -e`; any other failure of
  eval.py fails the job, with its status, and never requeues it."""
  status, done, _, _ = _slurm_job(tmp_path / "notice", 30, eval_status=143)
  assert status == 0
  assert done[-2].startswith("srun --nodes=1 --ntasks=1 ") and done[-1] == "scontrol requeue 77"
  status, done, _, _ = _slurm_job(tmp_path / "failed", 30, eval_status=1)
  assert status == 1
  assert done[-1].startswith("srun --nodes=1 --ntasks=1 ") and "scontrol requeue 77" not in done


def _wait_for(condition, timeout_s=60.0):
  deadline = time.time() + timeout_s
  while not condition():
    assert time.time() < deadline, "the detached job did not get there in time"
    time.sleep(0.1)


def _tpu_script(tmp_path, last_step, grad_accum_steps=1):
  sweep, rows, configs = _tiny_sweep(grad_accum_steps)
  env, python, calls = _fakes(tmp_path, last_step)
  options = launch.LaunchOptions(
    script_dir=str(tmp_path), repo_dir=str(tmp_path), python=python, tpu_name="pod", tpu_zone="us-z"
  )
  written = launch.write_scripts("tpu", sweep, rows, configs, "gs://b/t3", options)
  return written, env, python, calls


@pytest.mark.parametrize("grad_accum_steps", [1, 2])
def test_tpu_script_prepares_once_then_trains_detached_and_evaluates_at_the_end(
  tmp_path, grad_accum_steps
):
  """Every worker trains and evaluates with --distributed=on (JAX must find the slice);
  the job evaluates only at the row's last step, 60 with 2 batches an update."""
  last = 30 * grad_accum_steps
  (script, starter), env, python, calls = _tpu_script(tmp_path, last, grad_accum_steps)
  # `start` returns while the job goes on, detached, its output in logs/; when it has
  # ended, each worker's log goes to the row's workdir too.
  subprocess.run(["bash", script], env=env, check=True, timeout=60)
  host = socket.gethostname()
  log = f"logs/table3-E.{host}.log"
  keep_log = f"gcloud storage cp {log} gs://b/t3/E/logs/{host}.log"
  _wait_for(lambda: keep_log in _calls(calls, python))
  done = _calls(calls, python)
  ssh = "gcloud compute tpus tpu-vm ssh pod --zone us-z"
  assert [c.split(" --command=")[0] for c in done if c.startswith("gcloud")] == [
    f"{ssh} --worker=0",
    f"{ssh} --worker=all",
    keep_log,
  ]
  config = _config(grad_accum_steps)
  evaluate = f"python eval.py --workdir gs://b/t3/E --split validation --step {last}"
  assert [c for c in done if not c.startswith("gcloud")] == [
    f"python -m transformer.tools.prepare_data {config}",
    "python train.py "
    + config.replace(" --config.", " --workdir gs://b/t3/E --config.", 1)
    + " --distributed=on",
    "python train.py --workdir gs://b/t3/E --print_step",
    evaluate + " --distributed=on",
  ]
  assert (tmp_path / log).read_text().startswith("=== ")
  # `wait` finds the job ended at its last step; `watch` follows worker 0's log.
  subprocess.run(["bash", script, "wait"], env=env, check=True, timeout=60)
  subprocess.run(["bash", script, "watch"], env=dict(env, RECORD_ONLY="1"), check=True, timeout=60)
  assert _calls(calls, python)[-1] == (
    f"{ssh} --worker=0 --command=cd {tmp_path} && tail -n 100 -F logs/table3-E.$(hostname).log"
  )
  starts = pathlib.Path(starter).read_text().splitlines()[2:]
  assert starts == [f"bash {script} start", f"bash {script} wait"]


def test_tpu_stop_sigterms_the_jobs_training_which_then_does_not_evaluate(tmp_path):
  """`stop` is a preemption: SIGTERM to what the job runs on every worker, train.py; a job
  stopped short of its last step does not evaluate (it keeps its log), and `wait` says so.
  Its pid and log files are this worker's own (a clone on a disk every worker shares
  keeps one per host), and a second start appends to the log rather than replacing it."""
  (script, _), env, python, calls = _tpu_script(tmp_path, last_step=20)
  host = socket.gethostname()
  pid_file = tmp_path / "logs" / f"table3-E.{host}.pid"

  def start_and_stop():
    (tmp_path / "slow").write_text("")  # training runs until stopped
    before = len(_calls(calls, python))
    subprocess.run(["bash", script, "start"], env=env, check=True, timeout=60)
    _wait_for(
      lambda: (
        pid_file.exists()
        and any(c.startswith("python train.py --config") for c in _calls(calls, python)[before:])
      )
    )
    job = int(pid_file.read_text())
    subprocess.run(["bash", script, "stop"], env=env, check=True, timeout=60)
    assert (
      "gcloud compute tpus tpu-vm ssh pod --zone us-z --worker=all "
      f"--command=cd {tmp_path} && pkill -TERM -P $(cat logs/table3-E.$(hostname).pid)"
    ) in _calls(calls, python)

    def ended():
      try:
        os.kill(job, 0)
        return False
      except ProcessLookupError:
        return True

    _wait_for(ended, timeout_s=30)
    _wait_for(lambda: _calls(calls, python)[-1].startswith("gcloud storage cp "))

  start_and_stop()
  done = _calls(calls, python)
  assert not any(c.startswith("python eval.py") for c in done)
  assert done[-1] == f"gcloud storage cp logs/table3-E.{host}.log gs://b/t3/E/logs/{host}.log"
  assert subprocess.run(["bash", script, "wait"], env=env, timeout=60).returncode != 0
  start_and_stop()  # a restart: the log keeps the first start's lines
  log = (tmp_path / "logs" / f"table3-E.{host}.log").read_text()
  assert log.count("=== ") == 2 and log.count(f" start on {host}") == 2


@pytest.mark.slow  # a train.py process, and the shared trained run
def test_print_step_is_the_newest_checkpoint_even_inside_a_slurm_job(trained_run, tmp_path):
  """What the scripts compare with the last step: run in the batch script of a SLURM job
  of many tasks, it answers alone, without starting jax.distributed."""
  from tests.helpers.processes import subprocess_env
  from tests.helpers.tiny_run import REPO

  env = subprocess_env(
    SLURM_JOB_ID="5",
    SLURM_STEP_NODELIST="localhost",
    SLURM_NTASKS="16",
    SLURM_PROCID="0",
    SLURM_LOCALID="0",
  )
  for workdir, step in ((trained_run[1], "30"), (str(tmp_path), "0")):
    result = subprocess.run(
      [sys.executable, "train.py", "--workdir", workdir, "--print_step"],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
    )
    assert (result.returncode, result.stdout) == (0, step + "\n"), result.stderr[-2000:]


@pytest.mark.parametrize("kind", ["slurm", "tpu"])
def test_every_table3_row_gets_a_script_bash_can_read_that_waits_for_its_final_step(tmp_path, kind):
  """All of Table 3, as `--launch` writes it: each script parses (`bash -n`) and compares
  the newest checkpoint with its row's final step (batches, with its grad_accum_steps)."""
  sweep = dataclasses.replace(
    spec.load_sweep(TABLE3), command_line_overrides={"data_dir": "gs://b/tfds"}
  )
  configs = {row.name: spec.row_config(sweep, row) for row in sweep.rows}
  options = launch.LaunchOptions(script_dir=str(tmp_path), slurm_nodes=2)
  written = launch.write_scripts(kind, sweep, sweep.rows, configs, "gs://b/t3", options)
  assert len(written) == len(sweep.rows) + 1
  for row, path in zip(sweep.rows, written):
    assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0, path
    final = configs[row.name].num_train_steps * configs[row.name].grad_accum_steps
    assert f"--step {final}" in pathlib.Path(path).read_text()
