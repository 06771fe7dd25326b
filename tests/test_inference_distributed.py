"""Start-up (distributed.py): which environments start jax.distributed, and how. Under
SLURM one process per GPU, and together the processes drive every GPU of the allocation; a
layout that would leave GPUs idle stops in one line. On a Cloud TPU VM slice made with
`gcloud` (no TPU_WORKER_HOSTNAMES), JAX's own detection finds the workers through the GCE
metadata server, faked here on localhost."""

from __future__ import annotations

import contextlib
import http.server
import json
import subprocess
import sys
import threading

import pytest

from tests.helpers import jax_clusters, tiny_run
from tests.helpers.processes import subprocess_env
from transformer.inference import distributed

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
from transformer.inference import distributed
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


def test_which_environments_start_jax_distributed_and_how():
  """The decision, environment by environment: a gcloud TPU slice (no TPU_WORKER_HOSTNAMES
  in the ssh session) starts it as GKE does, one SLURM task (the job's final eval.py) and
  a laptop do not, --distributed=on insists, off never starts it."""
  start = distributed.how_to_start
  laptop: dict[str, str] = {}
  slurm_step = slurm_environ(0, "8", "0,1,2,3,4,5,6,7")
  one_task = {**slurm_step, "SLURM_NTASKS": "1"}
  assert start("auto", False, laptop, on_tpu_vm=False) is None
  assert start("auto", False, laptop, on_tpu_vm=True) == distributed.TPU_START  # gcloud
  gke = {"TPU_WORKER_HOSTNAMES": "w-0,w-1,w-2,w-3", "TPU_WORKER_ID": "2"}
  assert start("auto", False, gke, on_tpu_vm=True) == distributed.TPU_START
  assert start("auto", False, slurm_step, on_tpu_vm=False) == distributed.SLURM_START
  assert start("auto", False, one_task, on_tpu_vm=False) is None
  assert start("auto", True, laptop, on_tpu_vm=False) == distributed.FLAGS_START
  assert start("auto", True, slurm_step, on_tpu_vm=True) == distributed.FLAGS_START
  assert start("on", False, laptop, on_tpu_vm=False) == distributed.DETECTED_START
  assert start("on", False, laptop, on_tpu_vm=True) == distributed.TPU_START
  for environ in (laptop, slurm_step, gke):
    assert start("off", True, environ, on_tpu_vm=True) is None


def test_jax_still_keeps_the_cloud_tpu_vm_flag_its_detection_reads():
  """on_cloud_tpu_vm reads a flag in a private JAX module: an upgrade that moves it must
  fail here, not silently run every host of a slice alone."""
  set_by_import, read_by_detection = jax_clusters.cloud_tpu_vm_flags()
  assert set_by_import is read_by_detection is False  # this machine has no TPU
  assert distributed.on_cloud_tpu_vm() is False


class _MetadataServer(http.server.BaseHTTPRequestHandler):
  """GCE's metadata server as a TPU VM's worker sees it: its own number, the slice's
  workers (all this machine), and a tpu-env without slices."""

  attributes: dict[str, str] = {}

  def do_GET(self):  # noqa: N802 (http.server's name)
    key = self.path.rsplit("/", 1)[-1]
    found = self.headers.get("Metadata-Flavor") == "Google" and key in self.attributes
    body = self.attributes.get(key, "not found").encode()
    self.send_response(200 if found else 404)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  def log_message(self, *args):
    pass


@contextlib.contextmanager
def metadata_server(**attributes: str):
  handler = type("Handler", (_MetadataServer,), {"attributes": attributes})
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield f"127.0.0.1:{server.server_address[1]}"
  finally:
    server.shutdown()
    server.server_close()


# As train.py starts: JAX_FORCE_TPU_INIT makes `import jax` take this machine for a Cloud
# TPU VM; without TPU chips it also sets TPU_SKIP_MDS_QUERY, which a real one does not.
_TPU_VM_START = """
import os, sys, json, jax
os.environ.pop("TPU_SKIP_MDS_QUERY", None)
from absl import flags, logging
from transformer.inference import distributed
distributed.define_flags()
flags.FLAGS(["start"] + sys.argv[1:])
logging.use_absl_handler()
logging.set_verbosity(logging.INFO)
distributed.initialize_from_flags()
print(json.dumps({"processes": jax.process_count(), "index": jax.process_index(),
                  "devices": jax.device_count()}))
"""


def _start_on_tpu_vm(metadata_ip: str, port: str, *flags: str) -> subprocess.Popen:
  return subprocess.Popen(
    [sys.executable, "-c", _TPU_VM_START, *flags],
    cwd=REPO_ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=subprocess_env(
      devices=2, JAX_FORCE_TPU_INIT="1", GCE_METADATA_IP=metadata_ip, JAX_COORDINATOR_PORT=port
    ),
  )


@pytest.mark.slow
def test_faked_gcloud_tpu_slice_starts_jax_distributed_from_the_metadata_server():
  """Two workers of a slice made with `gcloud compute tpus tpu-vm create`: no worker list in
  the environment, each worker's number and the slice's endpoints only on its metadata
  server. With no flags they join one job of two processes, and each says so in its first
  log line (docs/clusters.md)."""
  port = str(tiny_run.free_port())
  endpoints = "127.0.0.1,127.0.0.1"
  with (
    metadata_server(
      **{
        "agent-worker-number": "0",
        "worker-network-endpoints": endpoints,
        "tpu-env": "ACCELERATOR_TYPE: 'v5litepod-8'",
      }
    ) as worker0,
    metadata_server(
      **{
        "agent-worker-number": "1",
        "worker-network-endpoints": endpoints,
        "tpu-env": "ACCELERATOR_TYPE: 'v5litepod-8'",
      }
    ) as worker1,
  ):
    processes = [_start_on_tpu_vm(ip, port) for ip in (worker0, worker1)]
    outputs = [p.communicate(timeout=120) for p in processes]
  assert [p.returncode for p in processes] == [0, 0], [err[-2000:] for _, err in outputs]
  reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
  assert sorted(r["index"] for r in reports) == [0, 1]
  assert all(r["processes"] == 2 and r["devices"] == 4 for r in reports)
  for index, (_, err) in enumerate(outputs):
    assert f"jax.distributed (Cloud TPU VM): process {index} of 2, 2 local / 4 global" in err


@pytest.mark.slow
def test_a_tpu_vm_without_a_slice_runs_alone_unless_distributed_is_on():
  """A TPU VM whose metadata server knows no worker number (not made by gcloud's TPU API):
  auto runs it as one process and says why in one warning; --distributed=on stops in
  one line."""
  port = str(tiny_run.free_port())
  with metadata_server() as nothing:
    alone = _start_on_tpu_vm(nothing, port)
    out, err = alone.communicate(timeout=120)
    assert alone.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["processes"] == 1
    assert "JAX found no TPU slice around this TPU VM" in err
    insisted = _start_on_tpu_vm(nothing, port, "--distributed=on")
    out, err = insisted.communicate(timeout=120)
  assert insisted.returncode == 1
  assert (
    err.strip().splitlines()[-1].startswith("error: cannot start jax.distributed (Cloud TPU VM): ")
  )
