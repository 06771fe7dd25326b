"""A pod rehearsal: 4 processes x 2 devices on a data=2 fsdp=2 tensor=2 mesh, sharing
nothing but a bucket (the local GCS fake) for the corpus and the run. Each host has its
own HOME, where the default vocabulary cache is: only process 0 reads it.

One job, started again and again on the same workdir, meets the faults of a pod in turn:
preemption notices (SIGTERM), to every host at staggered times while an asynchronous
checkpoint is being written, then to one host only during validation; then one process
killed with SIGKILL mid-run (the others must stop in bounded time). After each notice
every host exits 0, having written its part of one new checkpoint at one step they all
agree on, and the next start resumes from it. Every step the job logged, before each
fault and after it, has the loss of an uninterrupted run of the same job, bit for bit.
The run moves to a smaller slice (2 processes x 1 device), which continues the same
global batches from the dead job's last checkpoint. (Evaluation across processes is
tests/test_evaluation_multihost.py's, and eval.py on a bucket tests/test_gcs_workdir.py's.)
"""

import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from tests.helpers.processes import subprocess_env
from tests.helpers.tiny_run import OVERRIDES, REPO, free_port

HEARTBEAT_TIMEOUT_S = 10
EXIT_AFTER_NOTICE_S = 180  # every host of a preempted job has exited by then
POD_MESH = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}
SLICE_MESH = {"mesh.data": 2, "mesh.fsdp": 1, "mesh.tensor": 1}
NO_PERIODIC_SAVES = {"checkpoint_every_steps": 10_000, "num_train_steps": 10_000}


class Bucket:
  """The runs' shared storage, and processes started as the hosts of a job."""

  def __init__(self, fake, small_corpus, tmp_path):
    self.fake, self.url, self.tmp_path = fake, fake.url, tmp_path
    import tensorflow as tf

    with (
      open(small_corpus[0], "rb") as f,
      tf.io.gfile.GFile(f"{self.url}/corpus/small.tsv", "wb") as out,
    ):
      out.write(f.read())
    self.overrides = {
      **OVERRIDES,
      "dataset": f"tsv:{self.url}/corpus/small.tsv",
      "vocab_cache_dir": "",
      "checkpoint_every_steps": 2,
      "keep_checkpoints": 100,
    }
    self.started = []  # every process, so that a failed test leaves none behind

  def start(self, script, workdir, num_processes, devices, *extra, faults=None, **overrides):
    """faults: tests/helpers/fault_injection.py's variables; the job then runs under it."""
    env = subprocess_env(devices, PYTHONUNBUFFERED="1", **(faults or {}))
    env.update(
      self.fake.env,
      # One matplotlib font cache for all hosts: in each fresh HOME it would
      # be built again, by every process of every job.
      MPLCONFIGDIR=str(self.tmp_path / "matplotlib"),
    )
    flat = {**self.overrides, **overrides}
    entry = ["tests/helpers/fault_injection.py", script] if faults else [script]
    command = [sys.executable, *entry, "--workdir", f"{self.url}/{workdir}", *extra]
    if script == "train.py":
      command += ["--config", "configs/default.py"] + [f"--config.{k}={v}" for k, v in flat.items()]
    port = free_port()
    job = len(list(self.tmp_path.glob("*.txt")))  # names this job's logs and HOMEs
    hosts = []
    for i in range(num_processes):
      cluster = (
        [
          f"--coordinator_address=localhost:{port}",
          f"--num_processes={num_processes}",
          f"--process_id={i}",
          f"--heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}",
        ]
        if num_processes > 1
        else []
      )
      log = open(self.tmp_path / f"{workdir}-{job}-{i}.txt", "w+")  # noqa: SIM115 (the host writes it)
      home = self.tmp_path / f"home-{workdir}-{job}-{i}"  # the host's own disk
      home.mkdir()
      hosts.append(
        (
          subprocess.Popen(
            command + cluster,
            cwd=REPO,
            env={**env, "HOME": str(home)},
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
          ),
          log,
        )
      )
    self.started += [process for process, _ in hosts]
    return hosts

  def finish(self, hosts, timeout=600):
    """Waits for every host; returns (return codes, outputs)."""
    deadline = time.time() + timeout
    codes, outputs = [], []
    for process, log in hosts:
      try:
        codes.append(process.wait(timeout=max(1.0, deadline - time.time())))
      except subprocess.TimeoutExpired:
        codes.append(None)  # still running: a hang
      log.seek(0)
      outputs.append(log.read())
    return codes, outputs

  def run(self, *args, **overrides):
    """Starts the job's processes and waits; every one must succeed. Returns outputs."""
    codes, outputs = self.finish(self.start(*args, **overrides))
    for code, output in zip(codes, outputs):
      assert code == 0, output[-3000:]
    return outputs

  def kill_all(self):
    for process in self.started:
      if process.poll() is None:
        process.kill()
        process.wait()

  def losses(self, workdir):
    """{step: loss} of the run's train records, as readers see them (each step once)."""
    from transformer.training import reporting

    return {
      r["step"]: r["loss"] for r in reporting.read_metrics(f"{self.url}/{workdir}", kind="train")
    }

  def logged_records(self, workdir):
    """Lines logged so far, read from the fake directly (no client cache in between)."""
    chunks = [n for n in self.fake.list_objects(f"{workdir}/metrics-") if n.endswith(".jsonl")]
    return sum(len(self.fake.read(name).decode().splitlines()) for name in chunks)

  def committed_steps(self, workdir):
    """Steps whose checkpoint is complete: on cloud storage, once commit_success.txt is."""
    return sorted(
      int(n.split("/")[2])
      for n in self.fake.list_objects(f"{workdir}/checkpoints/")
      if n.endswith("/commit_success.txt") and n.count("/") == 3
    )

  def writers(self, workdir, step):
    """Processes whose own array files are in checkpoint `step` (ocdbt.process_<i>/)."""
    names = self.fake.list_objects(f"{workdir}/checkpoints/{step}/state/")
    return sorted(
      {int(m.group(1)) for n in names for m in [re.search(r"/ocdbt\.process_(\d+)/", n)] if m}
    )


def wait_until(condition, hosts, what, timeout=600):
  deadline = time.time() + timeout
  while not condition():
    for i, (process, log) in enumerate(hosts):
      if process.poll() is not None:
        log.seek(0)
        raise AssertionError(
          f"host {i} exited ({process.returncode}) before {what}:\n{log.read()[-3000:]}"
        )
    assert time.time() < deadline, f"timed out waiting for {what}"
    time.sleep(0.1)


def send_sigterm(hosts, delays_s):
  """SIGTERM to hosts[i] delays_s[i] seconds from now (None: never); returns at once."""

  def send(process, delay):
    time.sleep(delay)
    if process.poll() is None:
      process.send_signal(signal.SIGTERM)

  threads = [
    threading.Thread(target=send, args=(process, delay))
    for (process, _), delay in zip(hosts, delays_s)
    if delay is not None
  ]
  for thread in threads:
    thread.start()
  return threads


def preempt(bucket, hosts, delays_s, when, what):
  """Sends the notices once `when()` holds; every host must then exit 0, all having saved
  at the same step, in one new committed checkpoint with every host's arrays in it.
  Returns (that step, the committed steps that are new, the outputs)."""
  before = set(bucket.committed_steps("pod"))
  wait_until(when, hosts, what)
  for thread in send_sigterm(hosts, delays_s):
    thread.join()
  codes, outputs = bucket.finish(hosts, timeout=EXIT_AFTER_NOTICE_S)
  for code, output in zip(codes, outputs):
    assert code == 0, f"{what}: {code}\n{output[-3000:]}"
  saved = [
    re.findall(r"checkpoint at step (\d+) written after .*; exiting", out) for out in outputs
  ]
  assert all(len(steps) == 1 for steps in saved), (what, saved)
  steps = {int(steps[0]) for steps in saved}
  assert len(steps) == 1, (what, saved)  # one step, agreed by every host
  (step,) = steps
  new = sorted(set(bucket.committed_steps("pod")) - before)
  assert step in new and bucket.writers("pod", step) == [0, 1, 2, 3], (what, new)
  return step, new, outputs


def test_pod_survives_a_dead_host_and_preemptions_resumes_exactly_and_moves_to_a_smaller_slice(
  gcs, small_corpus, tmp_path
):  # noqa: F811
  bucket = Bucket(gcs, small_corpus, tmp_path)
  try:
    rehearse(bucket, tmp_path)
  finally:
    bucket.kill_all()


def rehearse(bucket, tmp_path):
  # --- Preemption notices. Each job resumes from the checkpoint the one before left.
  # (a) every host, at staggered times (0, 1 and 3 s after the first), while (c) an
  # asynchronous save is being written: the periodic save at step `in_flight` stalls
  # 6 s in its background commit. It completes, then the preemption's.
  every = 4
  in_flight = every
  marker = tmp_path / "save-stalled"
  hosts = bucket.start(
    "train.py",
    "pod",
    4,
    2,
    **POD_MESH,
    num_train_steps=10_000,
    checkpoint_every_steps=every,
    faults={
      "FAULT_SLOW_SAVE_STEP": str(in_flight),
      "FAULT_SLOW_SAVE_S": "6",
      "FAULT_SLOW_SAVE_MARKER": str(marker),
    },
  )
  step, new, outputs = preempt(
    bucket, hosts, [3, 0, 1, 3], marker.exists, "staggered notices during an asynchronous save"
  )
  # The stalled save, any periodic ones the hosts reached while the notices arrived (on
  # a loaded machine training goes on for seconds), and the preemption's.
  assert step > in_flight, (step, in_flight)
  assert new == sorted({*range(in_flight, step, every), step}), new
  resume_from = step

  # (b) one host only, not process 0, (d) during validation (which waits 6 s in it):
  # every host saves at that step.
  evaluated = (resume_from // every + 1) * every
  marker = tmp_path / "validating"
  hosts = bucket.start(
    "train.py",
    "pod",
    4,
    2,
    **NO_PERIODIC_SAVES,
    **POD_MESH,
    eval_every_steps=every,
    eval_bleu_sentences=0,
    num_eval_batches=1,
    faults={"FAULT_SLOW_VALIDATION_S": "6", "FAULT_SLOW_VALIDATION_MARKER": str(marker)},
  )
  step, new, outputs = preempt(
    bucket, hosts, [None, None, 0, None], marker.exists, "a notice to one host during validation"
  )
  # The step validated, unless validation outlasted the hosts' agreement (a loaded machine).
  assert new == [step] and step in (evaluated, evaluated + 1), (new, evaluated)
  assert f"validation at step {evaluated}" in outputs[0]
  assert f"resumed from step {resume_from}" in outputs[0]
  resume_from = step

  # --- Resumed again, a host dies (SIGKILL) once a few more steps are logged: the others
  # must stop in bounded time, and no committed checkpoint is lost.
  logged = bucket.logged_records("pod")
  hosts = bucket.start("train.py", "pod", 4, 2, num_train_steps=10_000, **POD_MESH)
  wait_until(lambda: bucket.logged_records("pod") >= logged + 5, hosts, "five more steps")
  hosts[3][0].send_signal(signal.SIGKILL)
  killed = time.time()
  codes, outputs = bucket.finish(hosts[:3], timeout=HEARTBEAT_TIMEOUT_S + 90)
  for code, output in zip(codes, outputs):  # None: still running, a hang
    assert code is not None and code != 0, output[-3000:]
  assert time.time() - killed < HEARTBEAT_TIMEOUT_S + 90
  assert f"resumed from step {resume_from}" in outputs[0]
  resume_from = bucket.committed_steps("pod")[-1]

  # --- Every step logged so far, before each fault and after it (the resumed jobs' and
  # those the dead job did past its last checkpoint), has the loss of an uninterrupted
  # run of the same job (4 processes x 2 devices), bit for bit.
  pod = bucket.losses("pod")
  pod_steps = max(pod)
  assert sorted(pod) == list(range(1, pod_steps + 1))
  slice_steps = pod_steps + 3
  bucket.run(
    "train.py",
    "reference",
    4,
    2,
    num_train_steps=slice_steps,
    checkpoint_every_steps=10_000,
    **POD_MESH,
  )
  reference = bucket.losses("reference")
  assert sorted(reference) == list(range(1, slice_steps + 1))
  assert [pod[s] for s in sorted(pod)] == [reference[s] for s in sorted(pod)]

  # --- A smaller slice (2 hosts x 1 device) continues the same run from the dead job's
  # last checkpoint, on the same global batches (the checkpoint's batch plan): only the
  # sums' order differs.
  outputs = bucket.run("train.py", "pod", 2, 1, num_train_steps=slice_steps, **SLICE_MESH)
  assert f"resumed from step {resume_from}" in outputs[0]
  continued = bucket.losses("pod")
  later = list(range(resume_from + 1, slice_steps + 1))
  np.testing.assert_allclose(
    [continued[s] for s in later], [reference[s] for s in later], rtol=1e-5
  )

  # Only process 0 of each job ever read or wrote the vocabulary cache on its own disk;
  # the other hosts got the vocabulary from it (or from the workdir's copy).
  caches = [p.parent.parent.name for p in tmp_path.glob("home-*/.cache/transformer_vocab")]
  assert caches and all(name.endswith("-0") for name in caches), caches
