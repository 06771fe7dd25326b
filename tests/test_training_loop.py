"""The whole training run: resume, preemption, NaN guard, several hosts.

A small slice of the bundled corpus (tsv:PATH) and a one-layer model keep each run to
seconds. Runs that must really die or span processes go through `train.py`.
"""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import fault_injection
from tests.helpers.processes import subprocess_env
from tests.helpers.tiny_run import REPO, flag_overrides, make_config, read_metrics
from transformer.inference import checkpoints as inference_checkpoints
from transformer.model import ModelConfig
from transformer.training import checkpoints, flops, loop, reporting, state


def restored_params(workdir, config, step):
  params, used = inference_checkpoints.restore_params(workdir, state.setup(config), step=step)
  assert used == step
  return jax.device_get(params)


def test_stop_and_resume_equals_straight_run(small_corpus, tmp_path):
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  loop.train_and_evaluate(make_config(small_corpus, num_train_steps=6), straight)
  loop.train_and_evaluate(make_config(small_corpus, num_train_steps=3), resumed)
  assert checkpoints.Checkpointer(resumed, keep=5).all_steps() == [2, 3]
  loop.train_and_evaluate(make_config(small_corpus, num_train_steps=6), resumed)

  losses = {r["step"]: r["loss"] for r in read_metrics(straight)}
  resumed_losses = {r["step"]: r["loss"] for r in read_metrics(resumed)}
  assert sorted(resumed_losses) == [1, 2, 3, 4, 5, 6]
  assert resumed_losses == losses  # bitwise: same batches, same dropout, same math
  config = make_config(small_corpus)
  jax.tree.map(
    np.testing.assert_array_equal,
    restored_params(straight, config, 6),
    restored_params(resumed, config, 6),
  )


def half_padded_batch(rows=4, length=8):
  """Every row half real: a source and a target sentence of length / 2 tokens."""
  half = np.zeros((rows, length), np.int32)
  half[:, : length // 2] = 9
  return {"source": half, "target": half.copy()}


WINDOW_S = 1000.0


def progress_record(peak, cfg, batch, steps=2, remeasure_peak=None):
  """Progress over `steps` steps of `batch` (padded FLOPs as the loop charges them), in a
  window of 1000 s (give or take the milliseconds this takes)."""
  progress = loop.Progress(
    peak_flops=peak, total_steps=10, model_config=cfg, remeasure_peak=remeasure_peak
  )
  rows, length = batch["target"].shape
  for step in range(1, steps + 1):
    metrics = {
      "loss": jnp.float32(2.0),
      "loss_sum": 8.0,
      "ce_sum": 8.0,
      "correct_sum": 1.0,
      "num_tokens": 4.0,
      "lr": 1e-3,
      "grad_norm": 1.0,
    }
    progress.add(
      step, metrics, flops.training_flops(cfg, rows, length, length), flops.count_tokens(batch)
    )
  progress._window_start = time.time() - WINDOW_S
  return progress.record(steps)


def test_mfu_counts_real_tokens_and_hfu_the_padded_shape():
  cfg = ModelConfig(
    vocab_size=40, max_position=16, num_layers=2, d_model=12, d_ff=20, num_heads=3, d_k=4, d_v=5
  )
  peak = 1e6
  record = progress_record(peak, cfg, half_padded_batch())
  # Computed here from the shapes: 2 steps of 4 rows, 8 slots padded, 4 tokens real.
  padded = 2 * 4 * flops.training_flops(cfg, 1, 8, 8)
  real = 2 * 4 * flops.training_flops(cfg, 1, 4, 4)
  assert record["hfu"] == pytest.approx(padded / WINDOW_S / peak, rel=1e-3)
  assert record["mfu"] == pytest.approx(real / WINDOW_S / peak, rel=1e-3)
  assert record["mfu"] == pytest.approx(record["hfu"] * real / padded, rel=1e-12)
  assert record["mfu"] < 0.6 * record["hfu"]  # attention is quadratic: below the 50% real
  assert record["padding_efficiency"] == 0.5
  assert record["source_padding_efficiency"] == 0.5
  line = reporting.progress_line(2, 10, record, started=0.0)
  assert f"| MFU {100 * record['mfu']:.1f}% (HFU {100 * record['hfu']:.1f}%, 50% real) |" in line


def test_a_window_faster_than_the_peak_has_the_peak_measured_again():
  cfg = ModelConfig(
    vocab_size=40, max_position=16, num_layers=2, d_model=12, d_ff=20, num_heads=3, d_k=4, d_v=5
  )
  padded_per_s = 2 * 4 * flops.training_flops(cfg, 1, 8, 8) / WINDOW_S
  readings = []

  def remeasure():
    readings.append(4 * padded_per_s)
    return readings[-1]

  # A peak read at half of what the window computed: HFU would be 200%.
  record = progress_record(padded_per_s / 2, cfg, half_padded_batch(), remeasure_peak=remeasure)
  assert len(readings) == 1
  assert record["hfu"] == pytest.approx(0.25, rel=1e-3)
  # A plausible peak is left alone.
  record = progress_record(2 * padded_per_s, cfg, half_padded_batch(), remeasure_peak=remeasure)
  assert len(readings) == 1 and record["hfu"] == pytest.approx(0.5, rel=1e-3)


def test_unknown_peak_reports_padding_but_no_utilisation():
  cfg = ModelConfig(
    vocab_size=40, max_position=16, num_layers=1, d_model=8, d_ff=16, num_heads=2, d_k=4, d_v=4
  )
  record = progress_record(None, cfg, half_padded_batch())
  assert "mfu" not in record and "hfu" not in record
  assert record["padding_efficiency"] == 0.5
  assert "| MFU n/a (50% real) |" in reporting.progress_line(2, 10, record, started=0.0)


def test_logged_records_carry_mfu_hfu_and_padding(small_corpus, tmp_path):
  workdir = str(tmp_path / "mfu")
  loop.train_and_evaluate(make_config(small_corpus, num_train_steps=2), workdir)
  for r in read_metrics(workdir):
    # Packed rows of the corpus are mostly, never wholly, real.
    assert 0.5 < r["padding_efficiency"] < 1 and 0.5 < r["source_padding_efficiency"] < 1
    assert 0 < r["mfu"] < r["hfu"]


def test_nan_stops_with_the_step_and_keeps_the_last_good_checkpoint(
  small_corpus, tmp_path, monkeypatch
):
  workdir = str(tmp_path / "nan")
  fault_injection.diverge_at_step(monkeypatch, 5)
  config = make_config(small_corpus, num_train_steps=8, log_every_steps=4)
  with pytest.raises(loop.TrainingError, match="at step 5"):
    loop.train_and_evaluate(config, workdir)
  assert checkpoints.Checkpointer(workdir, keep=5).all_steps() == [2, 4]
  params = restored_params(workdir, config, 4)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


def test_unwritable_workdir_is_a_one_line_error(small_corpus, tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(loop.TrainingError, match="not writable"):
    loop.train_and_evaluate(make_config(small_corpus), str(blocker / "workdir"))


def _env(devices):
  return subprocess_env(devices, PYTHONUNBUFFERED="1")


def test_sigterm_saves_the_current_step_and_exits_zero(small_corpus, tmp_path):
  workdir = str(tmp_path / "preempted")
  base = [sys.executable, "train.py", "--config", "configs/default.py", "--workdir", workdir]
  command = base + flag_overrides(small_corpus, num_train_steps=10_000, checkpoint_every_steps=1000)
  process = subprocess.Popen(
    command, cwd=REPO, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  metrics = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + 240
  while time.time() < deadline and process.poll() is None:
    if os.path.exists(metrics) and len(pathlib.Path(metrics).read_text().splitlines()) >= 3:
      break
    time.sleep(0.5)
  assert process.poll() is None, process.stdout.read()[-3000:]
  process.send_signal(signal.SIGTERM)
  output, _ = process.communicate(timeout=120)
  assert process.returncode == 0, output[-3000:]
  steps = checkpoints.Checkpointer(workdir, keep=5).all_steps()
  last_logged = read_metrics(workdir)[-1]["step"]
  assert len(steps) == 1 and steps[0] >= 3 and steps[0] >= last_logged

  # The same command resumes from that step.
  rerun = subprocess.run(
    base + flag_overrides(small_corpus, num_train_steps=steps[0] + 2, checkpoint_every_steps=1000),
    cwd=REPO,
    env=_env(1),
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert f"resumed from step {steps[0]}" in rerun.stderr
  assert read_metrics(workdir)[-1]["step"] == steps[0] + 2


def test_on_several_processes_sigterm_is_left_to_jax_and_ctrl_c_becomes_it():
  """jax.distributed's own SIGTERM handler (here a stand-in) must stay installed: it is
  what tells every host. Ctrl-C is turned into a SIGTERM to this process; a second one
  aborts."""
  notices = []
  jax_handler = lambda signum, frame: notices.append(signum)  # noqa: E731
  previous = signal.signal(signal.SIGTERM, jax_handler)
  preemption = loop.PreemptionSignal(several_processes=True)
  try:
    assert signal.getsignal(signal.SIGTERM) is jax_handler
    signal.raise_signal(signal.SIGINT)
    assert notices == [signal.SIGTERM] and preemption.received == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
      signal.raise_signal(signal.SIGINT)
  finally:
    preemption.restore()
    signal.signal(signal.SIGTERM, previous)
  single = loop.PreemptionSignal()  # one process: both signals are noted here
  try:
    signal.raise_signal(signal.SIGTERM)
    assert single.received == "SIGTERM" and notices == [signal.SIGTERM]
  finally:
    single.restore()


def test_time_based_checkpoints(small_corpus, tmp_path):
  workdir = str(tmp_path / "timed")
  config = make_config(
    small_corpus,
    num_train_steps=4,
    log_every_steps=2,
    checkpoint_every_steps=0,
    checkpoint_every_minutes=1e-6,
  )
  loop.train_and_evaluate(config, workdir)
  # Time is checked at log steps (where hosts can agree on it), and the last step saves.
  assert checkpoints.Checkpointer(workdir, keep=5).all_steps() == [2, 4]


def test_decoder_only_language_model_trains_on_the_same_pairs(small_corpus, tmp_path):
  workdir = str(tmp_path / "lm")
  config = make_config(
    small_corpus,
    num_train_steps=4,
    eval_every_steps=4,
    eval_bleu_sentences=0,
    **{"model.decoder_only": True},
  )
  result = loop.train_and_evaluate(config, workdir)
  assert np.isfinite(result["ppl"]) and result["ppl"] > 1
  params = restored_params(workdir, config, 4)
  assert "encoder" not in params
  assert all(np.isfinite(r["loss"]) for r in read_metrics(workdir))


def test_time_based_checkpoints_follow_process_0_on_every_host(small_corpus, monkeypatch):
  """With several processes, each one joins the broadcast at every log step, even when its
  own clock says no save is due (a host that skipped it would hang the others), and
  saves exactly when process 0 says so."""
  run = object.__new__(loop.TrainingRun)
  run.config = make_config(
    small_corpus, checkpoint_every_steps=0, log_every_steps=2, checkpoint_every_minutes=1.0
  )
  run.last_save_time = time.time()  # this host's clock: nothing is due
  broadcasts = []

  def process_0_says_due(value):
    broadcasts.append(value)
    return True

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax.experimental.multihost_utils, "broadcast_one_to_all", process_0_says_due)
  assert run._checkpoint_due(3) is False and broadcasts == []  # not a log step
  assert run._checkpoint_due(4) is True and broadcasts == [False]
  monkeypatch.setattr(jax, "process_count", lambda: 1)
  assert run._checkpoint_due(4) is False and broadcasts == [False]


def test_validation_and_saves_are_left_out_of_the_throughput_window(monkeypatch):
  # The loop's clock, moved by the test alone: no figure depends on this machine's speed.
  now = [1000.0]
  monkeypatch.setattr(loop, "time", types.SimpleNamespace(time=lambda: now[0]))
  progress = loop.Progress(peak_flops=None, total_steps=10)
  metrics = {
    "loss": jnp.float32(2.0),
    "loss_sum": 8.0,
    "ce_sum": 8.0,
    "correct_sum": 1.0,
    "num_tokens": 400.0,
    "lr": 1e-3,
    "grad_norm": 1.0,
  }
  progress.add(1, metrics, 0)
  now[0] += 2.0  # two seconds of training
  with progress.paused():
    now[0] += 1.0  # a validation: not training time
  now[0] += 2.0  # two more of training
  record = progress.record(1)
  # 400 tokens in the 4 s of training, not 5 s.
  assert record["tokens_per_sec"] == pytest.approx(100.0, rel=1e-12)


@pytest.mark.slow
def test_a_stalled_read_ends_the_run_in_one_line_with_the_checkpoint_intact(
  trained_run, tmp_path, monkeypatch
):
  """A read that hangs (storage_timeout_s=3; each stall lasts 5 s, so that its thread
  ends soon after), in a copy of the shared run resumed from its last checkpoint: the
  corpus's next chunk in the middle of an epoch, then the checkpoints' first read on the
  rerun. Each is one line naming what and how long; the checkpoint stays, and loads."""
  from tests.helpers import fault_injection
  from transformer import storage
  from transformer.data import pipeline

  trained_config, trained_workdir = trained_run
  workdir = str(tmp_path / "run")
  shutil.copytree(trained_workdir, workdir)
  saved = checkpoints.steps_on_disk(workdir)
  config = trained_config.copy_and_resolve_references()
  config.num_train_steps, config.checkpoint_every_steps = 100, 1000
  config.storage_timeout_s = 3.0
  # Chunks of 64 pairs, about two batches each; the resumed run's one read is epoch 0's
  # (its plan is the checkpoint's), replayed up to the checkpoint's batch: its 21st chunk
  # is a few steps past it.
  monkeypatch.setattr(pipeline, "TOKENIZE_CHUNK", 64)
  tokenized_chunks = pipeline.tokenized_chunks

  def stalling(*args, **kwargs):
    for index, chunk in enumerate(tokenized_chunks(*args, **kwargs)):
      if index == 20:
        time.sleep(5)
      yield chunk

  monkeypatch.setattr(pipeline, "tokenized_chunks", stalling)
  with pytest.raises(storage.StorageTimeout) as error:
    loop.train_and_evaluate(config, workdir)
  message = str(error.value)
  assert "\n" not in message and message.startswith(
    f"reading the training data of {config.dataset} did not finish within 3 s "
    "(config.storage_timeout_s)"
  ), message
  logged = max(r["step"] for r in read_metrics(workdir))
  assert saved[-1] < logged < 100  # it trained past the checkpoint, into the epoch
  assert checkpoints.steps_on_disk(workdir) == saved
  monkeypatch.setattr(pipeline, "tokenized_chunks", tokenized_chunks)

  fault_injection.arm(slow_restore_s=5)
  try:
    with pytest.raises(checkpoints.CheckpointTimeout) as error:
      loop.train_and_evaluate(config, workdir)
  finally:
    fault_injection.disarm()
  # The first read is the checkpoint manager's, of every checkpoint's metadata.
  assert str(error.value).startswith(
    f"reading the checkpoints in {checkpoints.checkpoint_dir(workdir)} did not "
    "finish within 3 s (config.storage_timeout_s): the storage stalled; rerun"
  ), error.value
  assert checkpoints.steps_on_disk(workdir) == saved
  params = restored_params(workdir, config, saved[-1])
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
