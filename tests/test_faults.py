"""Faults: killed mid-step and mid-save, a full disk, NaN/Inf, bad data and configs, bad
eval input, a dead host. Each either carries on or stops with one line saying why, and
no good checkpoint is lost. docs/reliability.md lists every fault and the test for it.

Processes that must really die run `train.py` / `eval.py` as subprocesses on one CPU
device; faults that need to sit inside Orbax's background save use
tests/helpers/fault_injection.py.
"""

import math
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.processes import subprocess_env
from tests.helpers.tiny_run import REPO, flag_overrides, free_port, make_config, read_metrics
from transformer import config as config_lib
from transformer.config import ConfigError
from transformer.data import sources, tsv
from transformer.inference import checkpoints as inference_checkpoints
from transformer.inference import sharding
from transformer.training import checkpoints, goodput, loop, state

STEPS = 40  # long enough that a kill polled from outside lands before the end
EVERY = 4  # checkpoint_every_steps


def _env(devices=1, **extra):
  return subprocess_env(devices, PYTHONUNBUFFERED="1", **extra)


def _train_command(workdir, corpus, *extra, launcher=False, **overrides):
  entry = (
    [sys.executable, "tests/helpers/fault_injection.py", "train.py"]
    if launcher
    else [sys.executable, "train.py"]
  )
  return (
    entry
    + ["--config", "configs/default.py", "--workdir", workdir, *extra]
    + flag_overrides(
      corpus,
      **{
        "num_train_steps": STEPS,
        "checkpoint_every_steps": EVERY,
        "keep_checkpoints": STEPS // EVERY,
        **overrides,
      },
    )
  )


def _start(command, log, **env):
  return subprocess.Popen(
    command, cwd=REPO, env=_env(**env), stdout=log, stderr=subprocess.STDOUT, text=True
  )


def _wait_until(condition, process, what, timeout=240):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if condition():
      return
    assert process.poll() is None, f"exited ({process.returncode}) before {what}"
    time.sleep(0.05)
  raise AssertionError(f"timed out waiting for {what}")


def _logged_steps(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = f.read().splitlines()
  return len(lines)


def _steps_on_disk(workdir):
  """Complete checkpoints, read without Orbax (safe while a run is writing)."""
  directory = checkpoints.checkpoint_dir(workdir)
  names = os.listdir(directory) if os.path.isdir(directory) else []
  return sorted(int(name) for name in names if name.isdigit())


def _tmp_dirs(workdir):
  return sorted(n for n in os.listdir(checkpoints.checkpoint_dir(workdir)) if "tmp" in n)


def _last_line(text):
  lines = [line for line in text.strip().splitlines() if line.strip()]
  return lines[-1] if lines else ""


def _params(workdir, config, step):
  params, used = inference_checkpoints.restore_params(workdir, state.setup(config), step=step)
  assert used == step
  return jax.device_get(params)


@pytest.fixture(scope="module")
def straight_run(small_corpus, tmp_path_factory):
  """An uninterrupted `train.py` run to STEPS: what every interrupted run must end equal to."""
  workdir = str(tmp_path_factory.mktemp("straight"))
  result = subprocess.run(
    _train_command(workdir, small_corpus),
    cwd=REPO,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir


# --- 1, 2: kill -9 just after a save commits, then in the middle of an asynchronous save.


@pytest.mark.slow
def test_kill_9_after_a_save_and_mid_save_then_rerun_ends_bitwise_equal_with_every_step_logged(
  small_corpus, straight_run, tmp_path
):
  """Killed twice, the run's log holds every step once, with the uninterrupted run's
  losses, and its goodput counts the steps trained twice."""
  workdir = str(tmp_path / "killed")
  # Seeded: the same checkpoint every run, one of 8, 12, ..., 20.
  killed_save = EVERY * random.Random(20261129).randint(2, 20 // EVERY)
  log = open(tmp_path / "log.txt", "w+")  # noqa: SIM115 (the runs write it; read at the end)

  # 1. kill -9 as soon as checkpoint `killed_save` is committed, with the log's writes
  # slowed (as a bucket's uploads are), so that its records would still be queued: the
  # resumed run starts after them and never logs them again.
  process = _start(
    _train_command(workdir, small_corpus, launcher=True),
    log,
    FAULT_KILL_AFTER_SAVE_STEP=str(killed_save),
    FAULT_SLOW_LOG_S="0.5",
  )
  assert process.wait(timeout=240) == -signal.SIGKILL
  first = _steps_on_disk(workdir)
  assert first == list(range(EVERY, killed_save + 1, EVERY)), first
  assert [r["step"] for r in read_metrics(workdir)] == list(range(1, killed_save + 1))

  # 2. The same command resumes from the newest complete checkpoint; this time the save
  # after it stalls in Orbax's background write and the process is killed mid-save.
  torn_step = first[-1] + EVERY
  marker = str(tmp_path / "stalled")
  process = _start(
    _train_command(workdir, small_corpus, launcher=True),
    log,
    FAULT_SLOW_SAVE_STEP=str(torn_step),
    FAULT_SLOW_SAVE_MARKER=marker,
  )
  torn_dir = os.path.join(checkpoints.checkpoint_dir(workdir), f"{torn_step}.orbax-checkpoint-tmp")
  _wait_until(lambda: os.path.exists(marker), process, f"the save of step {torn_step}")
  time.sleep(0.5)  # the other items are being written beside the stalled one
  process.send_signal(signal.SIGKILL)
  assert process.wait(timeout=60) == -signal.SIGKILL
  assert os.path.isdir(torn_dir)  # a torn checkpoint is on disk ...
  assert _steps_on_disk(workdir) == first  # ... and is not a step
  assert checkpoints.Checkpointer(workdir, keep=100).latest_step() == first[-1]

  logged_before_rerun = max(r["step"] for r in read_metrics(workdir))
  assert logged_before_rerun >= torn_step  # steps past the last checkpoint, trained again

  # 3. Rerunning the same command loads the previous checkpoint, not the torn one,
  # removes the torn directory and ends with the parameters of the uninterrupted run.
  rerun_started = time.monotonic()
  rerun = subprocess.run(
    _train_command(workdir, small_corpus),
    cwd=REPO,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  rerun_wall_s = time.monotonic() - rerun_started
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  log.seek(0)
  first_log = log.read()
  assert f"resumed from step {first[-1]}" in first_log, first_log[-3000:]
  assert f"resumed from step {first[-1]}" in rerun.stderr
  assert _tmp_dirs(workdir) == []
  assert torn_step in _steps_on_disk(workdir) and STEPS in _steps_on_disk(workdir)

  straight_losses = {r["step"]: r["loss"] for r in read_metrics(straight_run)}
  records = read_metrics(workdir)  # every run's log, the killed ones included
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # each step once
  for record in records:
    assert record["loss"] == straight_losses[record["step"]], record["step"]

  # Goodput over the three starts: the last one trained steps first-1 .. logged_before_rerun
  # again; each start's categories add up to its wall time.
  starts = {r["start_time"]: r for r in read_metrics(workdir, kind="goodput")}
  assert len(starts) == 3
  last = starts[max(starts)]
  categories = [last[f"{c}_s"] for c in goodput.CATEGORIES]
  assert last["recomputed_s"] > 0 and min(categories) >= 0
  for record in starts.values():
    assert (
      abs(sum(record[f"{c}_s"] for c in goodput.CATEGORIES) - record["wall_s"])
      <= 0.02 * record["wall_s"]
    )
  assert last["wall_s"] < rerun_wall_s  # measured inside the process, without its imports
  line = [text for text in rerun.stdout.splitlines() if text.startswith("goodput ")]
  assert line == [goodput.summary_line(goodput.summed(list(starts.values())))], line
  assert "; 3 starts, " in line[0]
  config = make_config(small_corpus)
  jax.tree.map(
    np.testing.assert_array_equal,
    _params(workdir, config, STEPS),
    _params(straight_run, config, STEPS),
  )


# --- 4: a full disk at a later save.


def test_failed_save_is_reported_and_earlier_checkpoints_survive(small_corpus, tmp_path):
  workdir = str(tmp_path / "full")
  # keep_checkpoints=1: Orbax plans to delete step 2 when step 4 is saved; it must not,
  # since step 4 never completes.
  overrides = dict(num_train_steps=8, checkpoint_every_steps=2, keep_checkpoints=1)
  result = subprocess.run(
    _train_command(workdir, small_corpus, launcher=True, **overrides),
    cwd=REPO,
    env=_env(FAULT_FULL_DISK_STEP="4"),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 1, result.stderr[-3000:]
  line = _last_line(result.stderr)
  # Noticed when the next save (step 6) waits for it; the run stops there.
  assert line.startswith(
    "error: the checkpoint at step 4 could not be written (OSError: "
    "[Errno 28] No space left on device"
  ), result.stderr[-3000:]
  assert line.endswith(f"complete checkpoints in {checkpoints.checkpoint_dir(workdir)}: [2]")
  assert "Traceback" not in result.stderr  # Orbax's record of it is not shown (cli.py)
  assert max(r["step"] for r in read_metrics(workdir)) == 6
  assert _steps_on_disk(workdir) == [2]
  config = make_config(small_corpus)
  params = _params(workdir, config, 2)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))

  # With space again, the same command resumes from step 2 and finishes.
  rerun = subprocess.run(
    _train_command(workdir, small_corpus, **overrides),
    cwd=REPO,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert "resumed from step 2" in rerun.stderr
  assert _steps_on_disk(workdir) == [8] and _tmp_dirs(workdir) == []


def _read_only_workdir(tmp_path):
  """A workdir this process cannot write. Root ignores file modes, so for root a path
  under /proc, which no one can create files in."""
  if os.geteuid() == 0:
    return "/proc/self/no_workdir_here"
  workdir = tmp_path / "read_only"
  workdir.mkdir()
  workdir.chmod(0o500)
  return str(workdir)


def test_unwritable_workdir_fails_at_start_in_one_line(small_corpus, tmp_path):
  workdir = _read_only_workdir(tmp_path)
  with pytest.raises(loop.TrainingError, match="is not writable") as error:
    loop.train_and_evaluate(make_config(small_corpus), workdir)
  assert str(error.value).startswith(f"workdir {workdir} is not writable: ")
  assert "\n" not in str(error.value)


def test_unusable_checkpoint_directory_fails_at_start_in_one_line(small_corpus, tmp_path):
  workdir = tmp_path / "blocked"
  workdir.mkdir()
  (workdir / "checkpoints").write_text("a file where the checkpoint directory goes")
  with pytest.raises(checkpoints.CheckpointError, match="cannot use .*checkpoints") as error:
    loop.train_and_evaluate(make_config(small_corpus), str(workdir))
  assert "\n" not in str(error.value)
  assert not (workdir / "metrics.jsonl").exists()  # it stopped before training


# --- 5: NaN / Inf (a diverging step, fault_injection.diverge_at_step: test_training_loop.py).


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_loss_names_the_step(bad):
  progress = loop.Progress(peak_flops=1.0, total_steps=10)
  progress.add(6, {"loss": jnp.float32(2.5)}, step_flops=1)
  progress.check_finite()  # step 6 is checked once; a later check starts after it
  for step, loss in ((7, 2.5), (8, bad), (9, 1.0)):
    progress.add(step, {"loss": jnp.float32(loss)}, step_flops=1)
  with pytest.raises(loop.TrainingError, match=f"loss is {bad} at step 8"):
    progress.check_finite()


# --- 6: bad data.


def _write(path, data: bytes):
  path.write_bytes(data)
  return str(path)


@pytest.mark.parametrize(
  "name,data,expected",
  [
    ("empty.tsv", b"", "TSV file is empty"),
    ("blank.tsv", b"\n \n\r\n", "TSV file is empty"),
    (
      "malformed.tsv",
      b"no tab\n\tno source\nno target\t\n",
      "no usable source<TAB>target line: {path} (skipped: 2 empty side, 1 no tab)",
    ),
    ("latin1.tsv", "caf\u00e9\tcaf\u00e9\n".encode("latin-1") * 3, "(skipped: 3 not UTF-8)"),
    ("huge.tsv", b"x" * (3 << 20) + b"\ty\n", f"(skipped: 1 over {tsv.MAX_LINE_BYTES} bytes)"),
    ("not_gzip.tsv.gz", b"plain text\tnot gzip\n", "TSV file cannot be read"),
  ],
)
def test_bad_tsv_is_one_line(tmp_path, name, data, expected):
  path = _write(tmp_path / name, data)
  with pytest.raises(ConfigError) as error:
    tsv.read_tsv(path)
  message = str(error.value)
  assert expected.format(path=path) in message and path in message and "\n" not in message


def test_bad_lines_are_skipped_and_counted_around_good_ones(tmp_path):
  path = _write(
    tmp_path / "mixed.tsv",
    b"".join(
      [
        b"Hello.\tHola.\n",
        b"x" * (2 << 20) + b"\tlong\n",
        b"\xff\xfe\tbad\n",
        b"Thanks.\tGracias.\n",
      ]
    ),
  )
  contents = tsv.read_tsv(path)
  assert contents.pairs == [("Hello.", "Hola."), ("Thanks.", "Gracias.")]
  assert contents.skipped == {f"over {tsv.MAX_LINE_BYTES} bytes": 1, "not UTF-8": 1}


def test_directory_and_missing_file_are_one_line(tmp_path):
  with pytest.raises(ConfigError, match="cannot be read") as error:
    tsv.read_tsv(str(tmp_path))
  assert "\n" not in str(error.value)
  config = config_lib.base_config()
  config.dataset = "tsv:" + str(tmp_path / "missing.tsv")
  with pytest.raises(ConfigError, match="not found.*missing.tsv"):
    sources.make_source(config)


def test_train_py_stops_on_bad_data_in_one_line(small_corpus, tmp_path):
  bad = _write(tmp_path / "bad.tsv", b"no tab here\n" * 10)
  command = _train_command(str(tmp_path / "run"), small_corpus, dataset=f"tsv:{bad}")
  result = subprocess.run(
    command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 1
  assert _last_line(result.stderr) == (
    f"error: TSV file has no usable source<TAB>target line: {bad} (skipped: 10 no tab)"
  )
  assert "Traceback" not in result.stderr


# --- 7: bad configs, each one line naming the key, before anything is built.


def _invalid(mutate):
  config = config_lib.base_config()
  mutate(config)
  with pytest.raises(ConfigError) as error:
    config_lib.validate(config)
  assert "\n" not in str(error.value)
  return str(error.value)


def test_model_sizes_that_do_not_split_over_the_mesh_are_named():
  def set_(**values):  # model__num_heads=6 sets config.model.num_heads
    def mutate(c):
      config_lib.apply_overrides(c, {k.replace("__", "."): v for k, v in values.items()})

    return mutate

  assert _invalid(set_(model__num_heads=6, mesh__tensor=4)).startswith(
    "config.model.num_heads: 6 does not split evenly over mesh.tensor=4"
  )
  assert _invalid(set_(model__d_model=36, mesh__fsdp=8, mesh__data=1)).startswith(
    "config.model.d_model: 36 does not split evenly over mesh.fsdp=8"
  )
  assert _invalid(set_(model__d_ff=1000, mesh__tensor=16, model__num_heads=16)).startswith(
    "config.model.d_ff:"
  )
  assert _invalid(set_(vocab_size=8001, mesh__tensor=2)).startswith("config.vocab_size:")
  assert _invalid(set_(tokens_per_batch=32)).startswith(
    "config.tokens_per_batch: 32 is below max_len=64"
  )


def test_mesh_that_does_not_match_the_devices_is_named():
  assert jax.device_count() == 8
  config = config_lib.base_config()
  config.mesh.data = 3
  with pytest.raises(ConfigError, match=r"^config.mesh: .* use 3 devices but 8 are"):
    sharding.create_mesh(config)
  # A size that only fails once -1 is resolved to the device count: d_model over fsdp=8.
  config = config_lib.base_config()
  config.mesh.data, config.mesh.fsdp, config.model.d_model = 1, -1, 36
  config_lib.validate(config)
  with pytest.raises(ConfigError, match="^config.model.d_model: 36 does not split"):
    sharding.create_mesh(config)


@pytest.mark.parametrize(
  "overrides,expected",
  [
    (
      ["--config.model.num_heds=4"],
      "error: bad config override --config.model.num_heds=4: 'num_heds' Did you mean \"num_heads\"",
    ),
    (["--config.max_len=long"], "error: flag --config.max_len=long: invalid literal for int"),
    (
      ["--config.model.num_heads=3", "--config.mesh.tensor=2"],
      "error: config.model.num_heads: 3 does not split evenly over mesh.tensor=2",
    ),
    (["--config.tokens_per_batch=8"], "error: config.tokens_per_batch: 8 is below max_len"),
    (["--config.mesh.data=2"], "error: config.mesh: in-slice sizes"),
    (
      ["--coordinator_address=localhost:1", "--num_processes=2", "--process_id=2"],
      "error: cannot start jax.distributed (--coordinator_address=localhost:1, "
      "--process_id=2, --num_processes=2): process_id and num_processes must be",
    ),
  ],
)
def test_train_py_rejects_bad_config_before_building_anything(
  small_corpus, tmp_path, overrides, expected
):
  workdir = tmp_path / "run"
  command = _train_command(str(workdir), small_corpus) + overrides
  result = subprocess.run(
    command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120
  )
  assert result.returncode != 0
  assert _last_line(result.stderr).startswith(expected), result.stderr[-2000:]
  assert "Traceback" not in result.stderr
  # Once: no log line repeats the message.
  assert result.stderr.count(expected[len("error: ") :]) == 1, result.stderr[-2000:]
  # Nothing was built: no vocabulary copied, no checkpoint, no metrics.
  built = sorted(os.listdir(workdir)) if workdir.exists() else []
  assert not {"vocab.model", "checkpoints", "metrics.jsonl"} & set(built), built


# --- 8: evaluation and translation.


# Its module's `straight_run` (a train.py run, about 25 s) is built for it in the fast tier.
@pytest.mark.slow
def test_eval_without_checkpoint_or_with_a_broken_config_json_is_one_line(straight_run, tmp_path):
  from transformer.evaluation import translate

  workdir = tmp_path / "no_checkpoint"  # a run killed before its first save completed
  workdir.mkdir()
  for name in ("config.json", "vocab.model"):
    (workdir / name).write_bytes(pathlib.Path(straight_run, name).read_bytes())
  with pytest.raises(ConfigError, match="holds no checkpoint") as error:
    translate.Translator(checkpoints.load_run_config(str(workdir)), str(workdir))
  assert "\n" not in str(error.value)
  (workdir / "config.json").write_text('{"vocab_size": 25')  # cut off mid-write
  with pytest.raises(ConfigError, match="config.json is not valid JSON") as error:
    checkpoints.load_run_config(str(workdir))
  assert "\n" not in str(error.value)


def _run(script, *args, stdin=None):
  return subprocess.run(
    [sys.executable, script, *args],
    cwd=REPO,
    env=_env(),
    input=stdin,
    capture_output=True,
    timeout=300,
  )


def test_generate_py_translates_empty_long_and_broken_lines(straight_run):
  lines = [
    b"I like cats.",
    b"",
    b"   ",
    b" ".join([b"the cat sat on the mat"] * 40),
    b"caf\xe9 \xff\xfe",
    b"Where is the station?",
  ]
  result = _run(
    "generate.py",
    "translate",
    "--workdir",
    straight_run,
    "--input_file",
    "-",
    stdin=b"\n".join(lines) + b"\n",
  )
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  outputs = result.stdout.decode("utf-8").split("\n")[:-1]
  assert len(outputs) == len(lines)
  assert outputs[1] == "" and outputs[2] == ""  # an empty line stays empty
  assert all(outputs[i] for i in (0, 3, 5))  # the tiny model always says something


def test_eval_py_names_the_key_of_an_incompatible_checkpoint(small_corpus, straight_run):
  flags = [f for f in flag_overrides(small_corpus) if not f.startswith("--config.model.d_ff")]
  result = _run(
    "eval.py",
    "--workdir",
    straight_run,
    "--config",
    "configs/default.py",
    *flags,
    "--config.model.d_ff=48",
  )
  assert result.returncode == 1
  stderr = result.stderr.decode()
  assert _last_line(stderr) == (
    "error: config.model.d_ff: the checkpoint was trained with 64, the config says 48"
  ), stderr[-2000:]


# --- 9: a dead host.


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_when_one_of_two_processes_dies_the_other_exits_in_bounded_time(
  small_corpus, tmp_path, fault
):
  """SIGKILL: a dead process (its connections close). SIGSTOP: a frozen host (connections
  stay open, no heartbeats): the coordination service declares it dead after
  --heartbeat_timeout_s and terminates the survivor."""
  workdir = str(tmp_path / "two_hosts")
  port = free_port()
  heartbeat_timeout_s = 10
  logs = [open(tmp_path / f"process{i}.txt", "w+") for i in range(2)]  # noqa: SIM115 (processes write them)
  processes = [
    _start(
      _train_command(
        workdir,
        small_corpus,
        f"--coordinator_address=localhost:{port}",
        "--num_processes=2",
        f"--process_id={i}",
        f"--heartbeat_timeout_s={heartbeat_timeout_s}",
        num_train_steps=100_000,
        checkpoint_every_steps=1000,
      ),
      logs[i],
    )
    for i in range(2)
  ]
  try:
    _wait_until(lambda: _logged_steps(workdir) >= 3, processes[0], "three steps")
    processes[1].send_signal(getattr(signal, fault))
    stopped = time.time()
    returncode = processes[0].wait(timeout=180)  # without the timeouts: a hang
    waited = time.time() - stopped
  finally:
    for p in processes:
      if p.poll() is None:
        p.kill()
  logs[0].seek(0)
  output = logs[0].read()
  assert returncode != 0, output[-3000:]
  assert waited < heartbeat_timeout_s + 60, waited
  if fault == "SIGKILL":
    assert returncode == 1, output[-3000:]
    assert _last_line(output).startswith(
      "error: a collective operation with the other processes failed; another process "
      "has probably died"
    ), output[-3000:]
  else:
    assert (
      "Terminating process because the JAX distributed service detected fatal errors" in output
    ), output[-3000:]
    assert "stopped sending heartbeats" in output
