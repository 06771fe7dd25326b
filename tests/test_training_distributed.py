"""Start-up under SLURM (distributed.py): one process per GPU, and together the processes
drive every GPU of the allocation; a layout that would leave GPUs idle stops in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import tiny_run
from tests.helpers.processes import subprocess_env
from transformer.training import distributed

REPO_ROOT = __file__.rsplit("/tests/", 1)[0]


def slurm_environ(local_id: int, tasks_per_node: str, gpus: str, node_id: int = 0) -> dict:
  """What srun sets for one task (plus the GPUs that --gpus-per-node gives the node)."""
  return {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "localhost",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": str(local_id),
    "SLURM_LOCALID": str(local_id),
    "SLURM_NODEID": str(node_id),
    "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
    "CUDA_VISIBLE_DEVICES": gpus,
  }


def test_each_task_drives_the_gpu_of_its_local_id():
  ids = [
    distributed.slurm_local_device_ids(slurm_environ(i, "8(x4)", "0,1,2,3,4,5,6,7"))
    for i in range(8)
  ]
  assert ids == [[i] for i in range(8)]
  # Tasks bound to one GPU each see it as GPU 0.
  assert distributed.slurm_local_device_ids(slurm_environ(5, "8(x4)", "5")) == [0]
  assert distributed.slurm_local_device_ids({"CUDA_VISIBLE_DEVICES": "0,1"}) is None  # no SLURM


def test_one_task_for_a_node_of_gpus_is_refused_in_one_line():
  """README's old layout (--ntasks-per-node=1 --gpus-per-node=8) trained on 1 GPU of 8."""
  with pytest.raises(ValueError) as error:
    distributed.slurm_local_device_ids(slurm_environ(0, "1(x4)", "0,1,2,3,4,5,6,7"))
  assert "\n" not in str(error.value)
  assert str(error.value).startswith("SLURM runs 1 tasks on a node with 8 GPUs")
  assert str(error.value).endswith("(srun --ntasks-per-node=8 --gpus-per-node=8)")
  # The last node of '8(x3),4' runs 4 tasks: also short of its 8 GPUs.
  with pytest.raises(ValueError, match="runs 4 tasks"):
    distributed.slurm_local_device_ids(slurm_environ(0, "8(x3),4", "0,1,2,3,4,5,6,7", node_id=3))


_START = """
import json, jax
from absl import flags
from transformer.training import distributed
distributed.define_flags()
flags.FLAGS(["start"])
distributed.initialize_from_flags()
print(json.dumps({"gpus": jax.config.read("jax_cuda_visible_devices"),  # from local_device_ids
                  "processes": jax.process_count(), "devices": jax.device_count(),
                  "local": jax.local_device_count()}))
"""


@pytest.mark.slow
def test_faked_slurm_job_step_drives_every_gpu_of_the_node():
  """Two tasks on a node with two GPUs, started as srun would (JAX's SLURM detection, no
  flags): they find each other, and the GPUs they drive are the node's two. (On CPU the
  GPU choice is jax_cuda_visible_devices, what jax.distributed sets from local_device_ids.)"""
  port = str(tiny_run.free_port())
  processes = [
    subprocess.Popen(
      [sys.executable, "-c", _START],
      cwd=REPO_ROOT,
      stdout=subprocess.PIPE,
      text=True,
      env=subprocess_env(devices=2, JAX_COORDINATOR_PORT=port, **slurm_environ(i, "2", "0,1")),
    )
    for i in range(2)
  ]
  reports = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in processes]
  assert [p.returncode for p in processes] == [0, 0]
  assert sorted(r["gpus"] for r in reports) == ["0", "1"]
  assert all(r["processes"] == 2 and r["devices"] == 2 * r["local"] == 4 for r in reports)
