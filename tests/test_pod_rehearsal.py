"""A pod rehearsal: 4 processes x 2 devices on a data=2 fsdp=2 tensor=2 mesh, sharing
nothing but a bucket (the local GCS fake) for the corpus and the run. Each host has its
own HOME, where the default vocabulary cache is: only process 0 reads it.

One process is killed with SIGKILL mid-run; the others must stop in bounded time. The
four are started again and resume: their losses are those of an uninterrupted run. The
same run then moves to a smaller slice (2 processes x 1 device) and continues it, and
is evaluated across those two processes.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from tests.helpers.gcs_fake import gcs, gcs_server  # noqa: F401  (fixtures)
from tests.helpers.tiny_run import OVERRIDES, REPO, free_port

POD_STEPS = 12  # the 4-process run's last step
SLICE_STEPS = 16  # ... and the 2-process run's
HEARTBEAT_TIMEOUT_S = 10
POD_MESH = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}


class Bucket:
  """The runs' shared storage, and processes started as the hosts of a job."""

  def __init__(self, fake, small_corpus, tmp_path):
    self.fake, self.url, self.tmp_path = fake, fake.url, tmp_path
    import tensorflow as tf
    with open(small_corpus[0], "rb") as f, \
        tf.io.gfile.GFile(f"{self.url}/corpus/small.tsv", "wb") as out:
      out.write(f.read())
    self.overrides = {**OVERRIDES, "dataset": f"tsv:{self.url}/corpus/small.tsv",
                      "vocab_cache_dir": "", "checkpoint_every_steps": 2}

  def start(self, script, workdir, num_processes, devices, *extra, **overrides):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(self.fake.env, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    flat = {**self.overrides, **overrides}
    command = [sys.executable, script, "--workdir", f"{self.url}/{workdir}", *extra]
    if script == "train.py":
      command += ["--config", "configs/default.py"] + [f"--config.{k}={v}"
                                                       for k, v in flat.items()]
    port = free_port()
    job = len(list(self.tmp_path.glob("*.txt")))  # names this job's logs and HOMEs
    hosts = []
    for i in range(num_processes):
      cluster = ([f"--coordinator_address=localhost:{port}", f"--num_processes={num_processes}",
                  f"--process_id={i}", f"--heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}"]
                 if num_processes > 1 else [])
      log = open(self.tmp_path / f"{workdir}-{job}-{i}.txt", "w+")
      home = self.tmp_path / f"home-{workdir}-{job}-{i}"  # the host's own disk
      home.mkdir()
      hosts.append((subprocess.Popen(command + cluster, cwd=REPO,
                                     env={**env, "HOME": str(home)}, stdout=log,
                                     stderr=subprocess.STDOUT, text=True), log))
    return hosts

  def run(self, *args, **overrides):
    """Starts the job's processes and waits; every one must succeed. Returns outputs."""
    hosts = self.start(*args, **overrides)
    outputs = []
    for process, log in hosts:
      process.wait(timeout=420)
      log.seek(0)
      outputs.append(log.read())
      assert process.returncode == 0, outputs[-1][-3000:]
    return outputs

  def losses(self, workdir):
    """{step: loss} of the run's train records; a step logged twice keeps the last."""
    text = self.fake.read(f"{workdir}/metrics.jsonl").decode()
    records = [json.loads(line) for line in text.splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}

  def logged_steps(self, workdir):
    try:
      return len(self.fake.read(f"{workdir}/metrics.jsonl").decode().splitlines())
    except FileNotFoundError:
      return 0


def test_pod_survives_a_dead_host_resumes_exactly_and_moves_to_a_smaller_slice(
    gcs, small_corpus, tmp_path):  # noqa: F811
  bucket = Bucket(gcs, small_corpus, tmp_path)
  # The uninterrupted run, on the same mesh in one process.
  bucket.run("train.py", "reference", 1, 8, num_train_steps=SLICE_STEPS, **POD_MESH)
  reference = bucket.losses("reference")
  assert sorted(reference) == list(range(1, SLICE_STEPS + 1))

  # Four hosts; one dies (SIGKILL) once a few steps are logged.
  hosts = bucket.start("train.py", "pod", 4, 2, num_train_steps=10_000, **POD_MESH)
  deadline = time.time() + 300
  while bucket.logged_steps("pod") < 5:
    assert all(p.poll() is None for p, _ in hosts), "a host exited before the kill"
    assert time.time() < deadline, "the pod logged no five steps"
    time.sleep(0.2)
  hosts[3][0].send_signal(signal.SIGKILL)
  killed = time.time()
  for process, log in hosts[:3]:
    process.wait(timeout=HEARTBEAT_TIMEOUT_S + 90)  # without the timeouts: a hang
    log.seek(0)
    assert process.returncode != 0, log.read()[-3000:]
  assert time.time() - killed < HEARTBEAT_TIMEOUT_S + 90
  # On cloud storage a checkpoint is complete once its commit_success.txt is written.
  saved = sorted(int(n.split("/")[2]) for n in gcs.list_objects("pod/checkpoints/")
                 if n.endswith("/commit_success.txt") and n.count("/") == 3)
  assert saved and saved[-1] >= 2, saved

  # All four again: they resume from the newest complete checkpoint, and every step
  # (before the kill and after it) has the loss of the uninterrupted run.
  outputs = bucket.run("train.py", "pod", 4, 2, num_train_steps=POD_STEPS, **POD_MESH)
  assert f"resumed from step {saved[-1]}" in outputs[0]
  pod = bucket.losses("pod")
  assert sorted(pod) == list(range(1, POD_STEPS + 1))
  np.testing.assert_allclose([pod[s] for s in sorted(pod)],
                             [reference[s] for s in sorted(pod)], rtol=1e-5)

  # A smaller slice (2 hosts x 1 device) continues the same run.
  outputs = bucket.run("train.py", "pod", 2, 1, num_train_steps=SLICE_STEPS,
                       **{"mesh.data": 2, "mesh.fsdp": 1, "mesh.tensor": 1})
  assert f"resumed from step {POD_STEPS}" in outputs[0]
  continued = bucket.losses("pod")
  later = list(range(POD_STEPS + 1, SLICE_STEPS + 1))
  np.testing.assert_allclose([continued[s] for s in later], [reference[s] for s in later],
                             atol=2e-3)

  # Evaluated across the two processes: process 0 prints and writes into the bucket.
  outputs = bucket.run("eval.py", "pod", 2, 1, "--split", "test")
  assert outputs[0].strip().splitlines()[-1].startswith("sacreBLEU ")
  assert "sacreBLEU" not in outputs[1]
  report = json.loads(gcs.read(f"pod/eval/test-{SLICE_STEPS}.json"))
  hypotheses = gcs.read(f"pod/eval/test-{SLICE_STEPS}.hyp.txt").decode().splitlines()
  assert len(hypotheses) == report["num_sentences"] > 0

  # Only process 0 of each job ever read or wrote the vocabulary cache on its own disk;
  # the other hosts got the vocabulary from it (or from the workdir's copy).
  caches = [p.parent.parent.name for p in tmp_path.glob("home-*/.cache/transformer_vocab")]
  assert caches and all(name.endswith("-0") for name in caches), caches
