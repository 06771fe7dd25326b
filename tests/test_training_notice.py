"""A preemption notice (SIGTERM) at the loop's edges, where SLURM's `--signal=TERM@120`
leaves no time to spare: what follows the notice must fit the save, the wait and the
shutdown, or SLURM kills the batch shell too and the job never requeues.

- At a step that is due a validation (BLEU's beam search on a real run), or the last
  step: the run skips the validation and saves at once. It used to validate first.
- After the last step, while the final checkpoint commits: the handler is still there,
  the process exits 0 once the checkpoint is committed. It used to be restored as the
  loop ended, before the wait, so the notice killed the process mid-commit (exit 143).

tests/helpers/fault_injection.py sends the signal from inside each window.
"""

import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.helpers.processes import subprocess_env
from tests.helpers.tiny_run import REPO, flag_overrides, free_port, make_config, read_metrics
from transformer.training import checkpoints, state

EVAL_EVERY = 4
# A validation that waits this long: the old order (validate, then save) shows in the
# marker it leaves, and in the time.
SLOW_VALIDATION_S = "5"
# Validation as cheap as it gets: one batch, no beam search.
CHEAP_VALIDATION = {"eval_bleu_sentences": 0, "num_eval_batches": 1}


def _command(workdir, corpus, **overrides):
  return [
    sys.executable,
    "tests/helpers/fault_injection.py",
    "train.py",
    "--config",
    "configs/default.py",
    "--workdir",
    str(workdir),
    *flag_overrides(corpus, **overrides),
  ]


def _train(workdir, corpus, faults, **overrides):
  """One process of train.py with fault_injection's `faults`; (exit code, output)."""
  env = subprocess_env(1, PYTHONUNBUFFERED="1", **faults)
  done = subprocess.run(
    _command(workdir, corpus, **overrides),
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    timeout=240,
  )
  return done.returncode, done.stdout


def _restored_step(workdir, corpus, step) -> int:
  """The step of checkpoint `step`, read back whole: arrays, data position and config."""
  setup = state.setup(make_config(corpus))
  checkpointer = checkpoints.Checkpointer(str(workdir), keep=10**6)
  try:
    checkpoints.check_compatible(checkpointer.saved_config(step), make_config(corpus))
    assert checkpointer.saved_iterator_state(step)
    restored, _ = checkpointer.restore(step, setup.restore_target())
  finally:
    checkpointer.close()
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(restored.params)))
  return int(jax.device_get(restored.step))


@pytest.mark.parametrize("total_steps", [2 * EVAL_EVERY, EVAL_EVERY], ids=["mid-run", "last"])
def test_a_notice_before_a_validation_skips_it_and_saves_at_once(
  small_corpus, tmp_path, total_steps
):
  """The notice comes once step 4 is logged, the first step due a validation: in the
  middle of the run, or its last step (whose final validation eval.py can do later)."""
  notice_step = EVAL_EVERY
  workdir = tmp_path / "run"
  notice, validating = tmp_path / "notice", tmp_path / "validating"
  code, output = _train(
    workdir,
    small_corpus,
    {
      "FAULT_NOTICE_PROCESS": "0",
      "FAULT_NOTICE_AFTER_STEP": str(notice_step),  # once the step is logged
      "FAULT_NOTICE_MARKER": str(notice),
      "FAULT_SLOW_VALIDATION_S": SLOW_VALIDATION_S,
      "FAULT_SLOW_VALIDATION_MARKER": str(validating),
    },
    num_train_steps=total_steps,
    eval_every_steps=EVAL_EVERY,
    checkpoint_every_steps=1000,
    **CHEAP_VALIDATION,
  )
  assert code == 0, output[-3000:]
  assert notice.exists(), output[-3000:]
  # No validation ran: none before the notice (none was due), none at its step.
  assert not validating.exists(), output[-3000:]
  assert read_metrics(str(workdir), kind="validation") == []
  assert f"validation at step {notice_step}" not in output
  assert f"checkpoint at step {notice_step} written after SIGTERM; exiting" in output
  assert checkpoints.steps_on_disk(str(workdir)) == [notice_step]
  assert [r["step"] for r in read_metrics(str(workdir))] == list(range(1, notice_step + 1))
  assert _restored_step(workdir, small_corpus, notice_step) == notice_step


def test_a_notice_while_the_final_checkpoint_commits_exits_zero_with_it_complete(
  small_corpus, tmp_path
):
  """The notice comes as the process starts waiting for the last step's save (after the
  loop), whose commit stalls 3 s: the handler must still be the run's."""
  workdir = tmp_path / "run"
  notice = tmp_path / "notice"
  last = 4
  code, output = _train(
    workdir,
    small_corpus,
    {
      "FAULT_NOTICE_PROCESS": "0",
      "FAULT_NOTICE_IN_WAIT": str(last),
      "FAULT_SLOW_SAVE_STEP": str(last),
      "FAULT_SLOW_SAVE_S": "3",
      "FAULT_NOTICE_MARKER": str(notice),
    },
    num_train_steps=last,
    checkpoint_every_steps=2,
  )
  assert notice.exists(), output[-3000:]
  assert code == 0, f"exit {code}\n{output[-3000:]}"
  assert "Traceback" not in output
  assert checkpoints.steps_on_disk(str(workdir)) == [2, last]
  assert _restored_step(workdir, small_corpus, last) == last
  # The goodput record written after the final wait is there too.
  assert read_metrics(str(workdir), kind="goodput")[-1]["step"] == last


@pytest.mark.slow  # two processes: over 20 s
def test_on_two_processes_a_notice_at_a_validation_step_skips_it_on_both(small_corpus, tmp_path):
  """Process 1 gets the notice once step 4 is logged, every step due a validation. The
  hosts agree on step 4 or 5 (5 when process 0 had asked the sync at step 4 before the
  notice reached it); at the agreed step neither host validates, both save and exit 0."""
  workdir = tmp_path / "run"
  notice = tmp_path / "notice"
  after = 4
  port = free_port()
  env = subprocess_env(
    1,
    PYTHONUNBUFFERED="1",
    FAULT_NOTICE_PROCESS="1",
    FAULT_NOTICE_AFTER_STEP=str(after),
    FAULT_NOTICE_MARKER=str(notice),
  )
  command = _command(
    workdir,
    small_corpus,
    num_train_steps=20,
    eval_every_steps=1,
    checkpoint_every_steps=1000,
    **CHEAP_VALIDATION,
  )
  hosts = []
  for i in range(2):
    log = open(tmp_path / f"process{i}.txt", "w+")  # noqa: SIM115 (the process writes it)
    cluster = [
      f"--coordinator_address=localhost:{port}",
      "--num_processes=2",
      f"--process_id={i}",
      "--heartbeat_timeout_s=30",
    ]
    process = subprocess.Popen(
      command + cluster, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True
    )
    hosts.append((process, log))
  outputs, codes = [], []
  try:
    for process, log in hosts:
      try:
        codes.append(process.wait(timeout=300))
      except subprocess.TimeoutExpired:
        codes.append(None)  # still running: a hang
      log.seek(0)
      outputs.append(log.read())
  finally:
    for process, log in hosts:
      if process.poll() is None:
        process.kill()
        process.wait()
      log.close()
  for code, output in zip(codes, outputs):
    assert code == 0, f"exit {code}\n{output[-3000:]}"
  assert notice.exists(), outputs[1][-3000:]
  (saved,) = checkpoints.steps_on_disk(str(workdir))
  assert saved in (after, after + 1), saved
  for output in outputs:
    assert f"checkpoint at step {saved} written after preemption notice; exiting" in output
  validated = [r["step"] for r in read_metrics(str(workdir), kind="validation")]
  assert validated == list(range(1, saved)), validated  # every step's but the agreed one
  print(f"the hosts agreed on step {saved} (the notice came after step {after})")
  assert f"validation at step {saved}" not in outputs[0]
  assert _restored_step(workdir, small_corpus, saved) == saved
