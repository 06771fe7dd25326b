"""A preemption notice on a resumed run of two processes, landed on purpose in each
window where the hosts' counts for jax.distributed's preemption sync could differ.

Every run after a pod's first preemption is a resumed one, so here the job starts from a
checkpoint at step START, well past the save interval, and one host (process 1) gets
SIGTERM: while a periodic save is in flight, just after a save commits, while the first
step compiles, and after the first step of a restore. tests/helpers/fault_injection.py
sends the signal from inside each window and holds the host there until every host has
told the sync its count. Each job must exit 0 on every host within EXIT_AFTER_NOTICE_S
of the notice, having saved at one step they all agree on, a step or two after it. Every
checkpoint the jobs commit equals the uninterrupted run's at that step (arrays and data
position), bit for bit; the next job resumes from it, and every step from START on is
logged once, with the loss of the uninterrupted run of the same job.

When Orbax's save also gave the sync a count (the global step, 20), a notice during a
save was agreed a start step late (at 16 + 21 = 37): the first window's job trained on
to its last step instead.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.helpers.processes import subprocess_env
from tests.helpers.tiny_run import REPO, flag_overrides, free_port, make_config
from transformer.data import tokenizer as tokenizer_lib
from transformer.training import checkpoints, state

pytestmark = pytest.mark.slow

EVERY = 4  # checkpoint_every_steps
START = 16  # the step the preempted jobs first resume from
TOTAL = 32  # num_train_steps: past the last window's step (at most 30)
EXIT_AFTER_NOTICE_S = 120  # every host of a preempted job has exited by then
SAVED = r"checkpoint at step (\d+) written after preemption notice; exiting"


def _start(workdir, corpus, tmp_path, faults=None, every=EVERY):
  """The job's two processes (one CPU device each); `faults`: fault_injection's variables."""
  port = free_port()
  env = subprocess_env(1, PYTHONUNBUFFERED="1", **(faults or {}))
  entry = ["tests/helpers/fault_injection.py", "train.py"] if faults else ["train.py"]
  command = [
    sys.executable,
    *entry,
    "--config",
    "configs/default.py",
    "--workdir",
    str(workdir),
    *flag_overrides(
      corpus, num_train_steps=TOTAL, checkpoint_every_steps=every, keep_checkpoints=100
    ),
  ]
  job = len(list(tmp_path.glob("*-process0.txt")))
  hosts = []
  for i in range(2):
    log = open(tmp_path / f"job{job}-process{i}.txt", "w+")  # noqa: SIM115 (the process writes it)
    cluster = [
      f"--coordinator_address=localhost:{port}",
      "--num_processes=2",
      f"--process_id={i}",
      "--heartbeat_timeout_s=30",
    ]
    hosts.append(
      (
        subprocess.Popen(
          command + cluster, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True
        ),
        log,
      )
    )
  return hosts


def _finish(hosts, timeout, what):
  """Waits for every host; each must exit 0 within `timeout`. Returns the outputs."""
  outputs = []
  try:
    for process, log in hosts:
      try:
        code = process.wait(timeout=timeout)
      except subprocess.TimeoutExpired:
        code = None  # still running: a hang
      log.seek(0)
      outputs.append(log.read())
      assert code == 0, f"{what}: exit {code}\n{outputs[-1][-3000:]}"
  finally:
    for process, _ in hosts:
      if process.poll() is None:
        process.kill()
        process.wait()
  return outputs


def _train_records(workdir):
  """Every train record in the run's metrics.jsonl, resumes included, in order."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return [r for r in records if r.get("kind", "train") == "train"]


def _preempted(workdir, corpus, tmp_path, what, faults, marker):
  """Runs a job with `faults`; every host must exit 0 once the notice is sent, all having
  saved at one step. Returns (that step, the checkpoints the job committed, outputs)."""
  before = set(checkpoints.steps_on_disk(str(workdir)))
  hosts = _start(
    workdir,
    corpus,
    tmp_path,
    {**faults, "FAULT_NOTICE_PROCESS": "1", "FAULT_NOTICE_MARKER": str(marker)},
  )
  deadline = time.time() + 300  # start-up and compile
  while (
    not marker.exists()
    and time.time() < deadline
    and all(process.poll() is None for process, _ in hosts)
  ):
    time.sleep(0.1)
  outputs = _finish(hosts, EXIT_AFTER_NOTICE_S, what)
  assert marker.exists(), f"{what}: no notice was sent\n{outputs[1][-3000:]}"
  saved = [re.findall(SAVED, out) for out in outputs]
  assert all(len(steps) == 1 for steps in saved), f"{what}: {saved}\n{outputs[1][-3000:]}"
  steps = {int(steps[0]) for steps in saved}
  assert len(steps) == 1, (what, saved)  # one step, agreed by every host
  (step,) = steps
  new = sorted(set(checkpoints.steps_on_disk(str(workdir))) - before)
  return step, new, outputs


def _checkpoint(workdir, step, setup):
  """(train state as numpy arrays, data iterator state) of checkpoint `step`."""
  checkpointer = checkpoints.Checkpointer(str(workdir), keep=10**6)
  train_state, iterator_state = checkpointer.restore(step, setup.restore_target())
  checkpointer.close()
  return jax.device_get(train_state), iterator_state


def test_a_notice_on_a_resumed_run_is_agreed_at_once_in_every_window(small_corpus, tmp_path):
  # The uninterrupted run of the same job, with a checkpoint at every step: the resumed
  # jobs start from its START, and end on checkpoints equal to its own.
  reference = tmp_path / "reference"
  _finish(_start(reference, small_corpus, tmp_path, every=1), 300, "the uninterrupted run")
  straight = {r["step"]: r["loss"] for r in _train_records(reference)}
  assert sorted(straight) == list(range(1, TOTAL + 1))
  workdir = tmp_path / "resumed"
  shutil.copytree(reference / "checkpoints" / str(START), workdir / "checkpoints" / str(START))
  shutil.copy(reference / tokenizer_lib.WORKDIR_VOCAB_NAME, workdir)

  def expect_new(start, step):
    """The periodic saves after `start` and before `step`, then the preemption's."""
    return sorted({*range((start // EVERY + 1) * EVERY, step, EVERY), step})

  start = START
  # 1. While the periodic save of `in_flight` is in flight: the notice comes once Orbax's
  # save returned, and its commit stalls 3 s. Both hosts had last counted in_flight -
  # start, so the step agreed is the next one.
  in_flight = (start // EVERY + 1) * EVERY
  step, new, outputs = _preempted(
    workdir,
    small_corpus,
    tmp_path,
    "a notice during an asynchronous save",
    {
      "FAULT_NOTICE_IN_SAVE": str(in_flight),
      "FAULT_SLOW_SAVE_STEP": str(in_flight),
      "FAULT_SLOW_SAVE_S": "3",
    },
    tmp_path / "notice-1",
  )
  assert f"resumed from step {start}" in outputs[0]
  assert step == in_flight + 1 and new == [in_flight, step], (step, new)
  start = step

  # 2. Just after a save commits: once the step after it is logged and its folder exists.
  committed = (start // EVERY + 1) * EVERY
  step, new, outputs = _preempted(
    workdir,
    small_corpus,
    tmp_path,
    "a notice just after a save commits",
    {
      "FAULT_NOTICE_AFTER_STEP": str(committed + 1),
      "FAULT_NOTICE_WAIT_FOR": str(workdir / "checkpoints" / str(committed)),
    },
    tmp_path / "notice-2",
  )
  assert f"resumed from step {start}" in outputs[0]
  assert step in (committed + 1, committed + 2) and new == expect_new(start, step), (step, new)
  start = step

  # 3. While the first step compiles (no host has counted yet), and 4. once the first
  # step after the restore is logged: the first or second step of the job.
  for n, what, faults in [
    (3, "a notice during compilation", lambda start: {"FAULT_NOTICE_AT_COMPILE": "1"}),
    (
      4,
      "a notice in the first steps after a restore",
      lambda start: {"FAULT_NOTICE_AFTER_STEP": str(start + 1)},
    ),
  ]:
    step, new, outputs = _preempted(
      workdir, small_corpus, tmp_path, what, faults(start), tmp_path / f"notice-{n}"
    )
    assert f"resumed from step {start}" in outputs[0]
    assert step in (start + 1, start + 2) and new == expect_new(start, step), (what, step, new)
    start = step

  # Every step from START on was logged once, by the job that trained it, with the
  # uninterrupted run's loss (the resumes from windows 1 to 3), and every checkpoint the
  # jobs committed is the uninterrupted run's (window 4's too), arrays and data position.
  logged = _train_records(workdir)
  assert [r["step"] for r in logged] == list(range(START + 1, start + 1))
  assert {r["step"]: r["loss"] for r in logged} == {
    s: straight[s] for s in range(START + 1, start + 1)
  }
  setup = state.setup(make_config(small_corpus))
  for step in checkpoints.steps_on_disk(str(workdir)):
    (ours, our_position), (theirs, their_position) = (
      _checkpoint(workdir, step, setup),
      _checkpoint(reference, step, setup),
    )
    assert our_position == their_position, step
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)


def test_a_restore_stalled_on_one_host_ends_every_host_with_the_checkpoint_intact(
  trained_run, small_corpus, tmp_path
):
  """Process 1's checkpoint reads hang (each for 600 s) with storage_timeout_s=3, on a
  copy of the shared run: process 1 exits 1 with the one line naming the checkpoints and
  the wait, process 0 (whose reads went through) does not wait for it forever but exits
  in one line too, and the checkpoint is as it was."""
  _, trained = trained_run
  workdir = tmp_path / "run"
  shutil.copytree(trained, workdir)
  saved = checkpoints.steps_on_disk(str(workdir))
  first, last = saved[0], saved[-1]
  before = workdir / "checkpoints" / str(last)
  files_before = sorted(
    (p.relative_to(before), p.stat().st_size) for p in before.rglob("*") if p.is_file()
  )
  port = free_port()
  command = [
    sys.executable,
    "tests/helpers/fault_injection.py",
    "train.py",
    "--config",
    "configs/default.py",
    "--workdir",
    str(workdir),
    *flag_overrides(
      small_corpus, num_train_steps=last + 4, checkpoint_every_steps=first, max_decode_extra_len=5
    ),
    "--config.storage_timeout_s=3",
    f"--coordinator_address=localhost:{port}",
    "--num_processes=2",
    "--heartbeat_timeout_s=30",
  ]
  hosts = []
  for i in range(2):
    env = subprocess_env(
      1, PYTHONUNBUFFERED="1", **({"FAULT_SLOW_RESTORE_S": "600"} if i == 1 else {})
    )
    hosts.append(
      subprocess.Popen(
        command + [f"--process_id={i}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )
    )
  outputs, codes = [], []
  try:
    for process in hosts:
      try:
        outputs.append(process.communicate(timeout=240)[0])  # far less than the stall
      except subprocess.TimeoutExpired:
        outputs.append("(still running: a hang)")
      codes.append(process.poll())
  finally:
    for process in hosts:
      if process.poll() is None:
        process.kill()
        process.wait()
  assert codes[1] == 1, outputs[1][-3000:]
  assert (
    outputs[1]
    .strip()
    .splitlines()[-1]
    .startswith(
      f"error: reading the checkpoints in {checkpoints.checkpoint_dir(str(workdir))} did "
      "not finish within 3 s (config.storage_timeout_s)"
    )
  ), outputs[1][-3000:]
  # Process 0 waited for process 1 in Orbax's start (a barrier): it ends in one line too.
  assert codes[0] == 1, outputs[0][-3000:]
  assert outputs[0].strip().splitlines()[-1].startswith("error: "), outputs[0][-3000:]
  assert "Traceback" not in outputs[0] + outputs[1]
  assert checkpoints.steps_on_disk(str(workdir)) == saved
  assert (
    sorted((p.relative_to(before), p.stat().st_size) for p in before.rglob("*") if p.is_file())
    == files_before
  )
