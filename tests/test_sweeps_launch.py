"""Cluster scripts (launch.py): each row's SLURM or TPU-pod script runs the same train.py
and eval.py commands as a local sweep, with the cluster options in their places."""

from __future__ import annotations

import os
import shlex
import stat
import types

import pytest

from tests.helpers.sweep_helpers import TABLE3, run_sweep_command
from transformer.sweeps import launch, spec


@pytest.fixture(scope="module")
def table3():
  """(sweep, rows E and big, their configs)."""
  sweep = spec.load_sweep(TABLE3)
  rows = spec.select_rows(sweep, "E,big")
  return sweep, rows, {row.name: spec.row_config(sweep, row) for row in rows}


def test_launch_scripts_run_train_and_eval_for_each_row(tmp_path):
  sweep = spec.load_sweep(TABLE3)
  rows = spec.select_rows(sweep, "E,big")
  configs = {row.name: spec.row_config(sweep, row) for row in rows}
  options = launch.LaunchOptions(script_dir=str(tmp_path), tpu_name="pod", tpu_zone="z")
  slurm = launch.write_scripts("slurm", sweep, rows, configs, "gs://b/t3", options)
  tpu = launch.write_scripts("tpu", sweep, rows, configs, "gs://b/t3", options)
  assert [os.path.basename(p) for p in slurm] == ["E.sbatch", "big.sbatch", "slurm_all.sh"]
  script = open(slurm[1]).read()
  assert ("srun python train.py --config configs/wmt14.py:base --workdir gs://b/t3/big "
          "--config.model.d_model=1024 --config.model.d_ff=4096 --config.model.num_heads=16 "
          "--config.model.dropout_rate=0.3 --config.num_train_steps=300000\n") in script
  assert ("srun --nodes=1 --ntasks=1 python eval.py --workdir gs://b/t3/big --split validation "
          "--step 300000\n") in script
  assert "#SBATCH --signal=TERM@120 --requeue" in script
  assert open(slurm[2]).read().splitlines()[2:] == [f"sbatch {slurm[0]}", f"sbatch {slurm[1]}"]
  tpu_script = open(tpu[0]).read()
  assert ("gcloud compute tpus tpu-vm ssh pod --zone z --worker=all --command='cd "
          "$HOME/transformer && python train.py --config configs/wmt14.py:base --workdir "
          "gs://b/t3/E --config.model.positional=learned'") in tpu_script


def test_slurm_script_carries_every_option(tmp_path, table3):
  """Nodes, GPUs, time, extra #SBATCH line, job name, log path, repo and python command
  all land in the script, and the whole script is the expected text."""
  sweep, rows, configs = table3
  options = launch.LaunchOptions(script_dir=str(tmp_path), repo_dir="/srv/transformer",
                                 python="python3", slurm_nodes=4, slurm_gpus_per_node=2,
                                 slurm_time="1:00:00", slurm_extra="--partition=gpu")
  path = launch.write_scripts("slurm", sweep, rows[:1], configs, "/data/t3", options)[0]
  assert open(path).read() == f"""#!/bin/bash
# Row E of sweep table3. Submit with: sbatch {tmp_path}/E.sbatch
#SBATCH --job-name=table3-E
#SBATCH --nodes=4 --ntasks-per-node=1 --gpus-per-node=2
#SBATCH --time=1:00:00
#SBATCH --output={tmp_path}/E-%j.out
# SIGTERM two minutes before the time limit: train.py saves a checkpoint and exits 0.
# Requeued or resubmitted, the same script resumes from it.
#SBATCH --signal=TERM@120 --requeue
#SBATCH --partition=gpu
set -euo pipefail
cd /srv/transformer
# One process per node; jax.distributed reads the SLURM environment.
srun python3 train.py --config configs/wmt14.py:base --workdir /data/t3/E --config.model.positional=learned
# Beam search is one process's job: the final checkpoint on the whole validation split.
srun --nodes=1 --ntasks=1 python3 eval.py --workdir /data/t3/E --split validation --step 100000
"""


def test_slurm_script_without_extra_options_has_no_empty_sbatch_line(tmp_path, table3):
  sweep, rows, configs = table3
  options = launch.LaunchOptions(script_dir=str(tmp_path))
  path = launch.write_scripts("slurm", sweep, rows[:1], configs, "/data/t3", options)[0]
  lines = open(path).read().splitlines()
  assert [line for line in lines if line.startswith("#SBATCH")] == [
      "#SBATCH --job-name=table3-E",
      "#SBATCH --nodes=1 --ntasks-per-node=1 --gpus-per-node=8",
      "#SBATCH --time=24:00:00",
      f"#SBATCH --output={tmp_path}/E-%j.out",
      "#SBATCH --signal=TERM@120 --requeue"]


def test_tpu_scripts_run_on_every_worker_and_one_after_another(tmp_path, table3):
  """Each TPU script runs train.py then eval.py on all workers of the named slice; the
  starter runs the rows' scripts in turn with bash (one slice), not side by side."""
  sweep, rows, configs = table3
  options = launch.LaunchOptions(script_dir=str(tmp_path), repo_dir="/r", tpu_name="pod",
                                 tpu_zone="us-z")
  written = launch.write_scripts("tpu", sweep, rows, configs, "gs://b/t3/", options)
  assert [os.path.basename(p) for p in written] == ["E.sh", "big.sh", "tpu_all.sh"]
  lines = open(written[1]).read().splitlines()
  ssh = "gcloud compute tpus tpu-vm ssh pod --zone us-z --worker=all --command="
  assert lines[0] == "#!/bin/bash" and "set -euo pipefail" in lines
  commands = [line for line in lines if line.startswith("gcloud")]
  assert len(commands) == 2
  # What runs on each worker, once the shell has unquoted the --command argument.
  remote = [shlex.split(c[len(ssh):])[0] for c in commands if c.startswith(ssh)]
  assert remote == [
      "cd /r && python train.py --config configs/wmt14.py:base --workdir gs://b/t3/big "
      "--config.model.d_model=1024 --config.model.d_ff=4096 --config.model.num_heads=16 "
      "--config.model.dropout_rate=0.3 --config.num_train_steps=300000",
      "cd /r && python eval.py --workdir gs://b/t3/big --split validation --step 300000"]
  assert open(written[2]).read() == (
      f"#!/bin/bash\nset -euo pipefail\nbash {written[0]}\nbash {written[1]}\n")


def test_scripts_are_executable_and_default_to_workdir_launch(tmp_path, table3):
  """Without --script_dir the scripts go to WORKDIR/launch, all of them executable."""
  sweep, rows, configs = table3
  workdir = str(tmp_path / "runs")
  written = launch.write_scripts("slurm", sweep, rows, configs, workdir, launch.LaunchOptions())
  assert {os.path.dirname(p) for p in written} == {os.path.join(workdir, "launch")}
  for path in written:
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755, path


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
  train, evaluate = launch.row_commands(sweep, row, types.SimpleNamespace(num_train_steps=9),
                                        "/w/", "py")
  assert shlex.split(train) == ["py", "train.py", "--config", "configs/wmt14.py:big",
                                "--workdir", "/w/r", "--config.dataset=tsv:/data/my corpus.tsv"]
  assert evaluate == "py eval.py --workdir /w/r --split validation --step 9"


def test_launch_from_the_command_line_uses_the_flags(tmp_path):
  """`--launch slurm` with cluster flags writes scripts that carry them and prints the
  paths it wrote."""
  result = run_sweep_command(
      "--sweep", TABLE3, "--workdir", "/data/t3", "--only", "E", "--launch", "slurm",
      "--script_dir", str(tmp_path), "--slurm_nodes", "3", "--slurm_extra=--partition=p100",
      "--python", "python3.11", "--repo_dir", "/srv/t", timeout=60)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split() == [str(tmp_path / "E.sbatch"), str(tmp_path / "slurm_all.sh")]
  script = (tmp_path / "E.sbatch").read_text()
  assert "#SBATCH --nodes=3 --ntasks-per-node=1" in script
  assert "#SBATCH --partition=p100\n" in script and "cd /srv/t\n" in script
  assert "srun python3.11 train.py --config configs/wmt14.py:base --workdir /data/t3/E " in script
