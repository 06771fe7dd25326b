"""Every command that restores a checkpoint ends in one line, soon, after a stalled read.

A read stalled in a storage client (a bucket that stops answering) is given up after
config.storage_timeout_s with `error: reading ... did not finish within ...`, and the
command then exits at once: the thread of the read is still blocked in the client (here
in Orbax's JSON reader), and a normal exit would wait for it (Orbax's worker threads are
joined as the interpreter ends). tests/helpers/fault_injection.py stalls every read of a
checkpoint's JSON items for STALL_S, far longer than the bound each command must exit
within, so a command that waits for the stalled thread runs into the subprocess timeout.

train.py's own stalled reads: tests/test_training_loop.py and tests/test_preemption.py.
"""

import json
import shutil
import subprocess
import sys
import time

import pytest

from tests.helpers.processes import subprocess_env
from tests.helpers.tiny_run import REPO
from transformer import storage
from transformer.training import checkpoints

TIMEOUT_S = 3  # the run's config.storage_timeout_s
STALL_S = 600  # each stalled read: far past the bound below
# Start-up (imports, the mesh, the model's abstract state) on a slow CPU, on top of the
# timeout; the stall itself lasts STALL_S, so a command that waits for it exceeds this.
EXIT_WITHIN_S = TIMEOUT_S + 120

COMMANDS = {
  "eval": lambda run, out: ["eval.py", "--workdir", run, "--search", "greedy"],
  "generate": lambda run, out: [
    "generate.py",
    "translate",
    "--workdir",
    run,
    "--search",
    "greedy",
    "I like cats.",
  ],
  "export": lambda run, out: ["transformer/tools/export.py", "--workdir", run, "--out", out],
  "average_checkpoints": lambda run, out: [
    "transformer/tools/average_checkpoints.py",
    "--workdir",
    run,
    "--output_workdir",
    out,
    "--average_last",
    "2",
  ],
}


@pytest.fixture
def run_with_short_timeout(trained_run, tmp_path):
  """A copy of the shared run whose config.json says storage_timeout_s=TIMEOUT_S."""
  _, trained = trained_run
  workdir = tmp_path / "run"
  shutil.copytree(trained, workdir)
  saved = json.loads((workdir / "config.json").read_text())
  saved["storage_timeout_s"] = float(TIMEOUT_S)
  (workdir / "config.json").write_text(json.dumps(saved))
  return str(workdir)


@pytest.mark.slow
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_stalled_checkpoint_read_ends_the_command_in_one_line_within_the_timeout(
  command, run_with_short_timeout, tmp_path
):
  """Exit code 1, stderr's last line the one error naming the stalled read, no traceback,
  and the exit within the timeout plus start-up, not after the stall."""
  workdir = run_with_short_timeout
  steps = checkpoints.steps_on_disk(workdir)
  args = COMMANDS[command](workdir, str(tmp_path / "out"))
  env = subprocess_env(1, PYTHONUNBUFFERED="1", FAULT_SLOW_RESTORE_S=str(STALL_S))
  start = time.monotonic()
  try:
    result = subprocess.run(
      [sys.executable, "tests/helpers/fault_injection.py", *args],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=EXIT_WITHIN_S,
    )
  except subprocess.TimeoutExpired as e:
    stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
    pytest.fail(
      f"{command} still running {EXIT_WITHIN_S} s after it started (storage_timeout_s="
      f"{TIMEOUT_S}): it waited for the stalled read; stderr ends: {(stderr or '')[-2000:]}"
    )
  elapsed = time.monotonic() - start
  print(f"{command}: exited {result.returncode} after {elapsed:.1f} s")
  assert result.returncode == 1, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  directory = checkpoints.checkpoint_dir(workdir)
  assert last.startswith("error: reading "), result.stderr[-3000:]
  assert directory in last, last
  assert f"did not finish within {TIMEOUT_S} s (config.storage_timeout_s)" in last, last
  assert sum(line.startswith("error: ") for line in result.stderr.splitlines()) == 1
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  assert checkpoints.steps_on_disk(workdir) == steps  # nothing written to the run


# A command (cli.run) whose main lets a StorageTimeout through, with the stalled read's
# thread still running: a plain (non-daemon) thread, which a normal exit would join.
_LETS_A_TIMEOUT_THROUGH = """
import threading, time
from transformer import cli, storage

def main(argv):
  threading.Thread(target=time.sleep, args=(%d,), name="stalled-read").start()
  raise storage.StorageTimeout(storage.timeout_message("gs://bucket/x", %d, doing="reading"))

cli.run(main)
"""


def test_a_storage_timeout_a_command_lets_through_still_ends_it_in_one_line_at_once():
  """cli.run's net for the commands that do not catch StorageTimeout themselves
  (prepare_data, input_speed, bench: a stalled vocabulary or corpus read)."""
  start = time.monotonic()
  result = subprocess.run(
    [sys.executable, "-c", _LETS_A_TIMEOUT_THROUGH % (STALL_S, TIMEOUT_S)],
    cwd=REPO,
    env=subprocess_env(1),
    capture_output=True,
    text=True,
    timeout=EXIT_WITHIN_S,
  )
  assert result.returncode == 1, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == "error: " + storage.timeout_message(
    "gs://bucket/x", TIMEOUT_S, doing="reading"
  )
  assert "Traceback" not in result.stderr
  assert time.monotonic() - start < EXIT_WITHIN_S
