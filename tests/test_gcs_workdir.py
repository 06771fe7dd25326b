"""A run whose every file lives in a bucket (gs://...), as on a TPU pod whose hosts share
nothing but cloud storage: train, SIGTERM, resume, eval.py, checkpoint averaging and a
sweep, all against the local GCS fake (tests/helpers/gcs_fake.py), with about 5% of the bucket's
requests failing (429, 503, dropped connections) as real buckets sometimes do.
Everything a run writes must be in the bucket, and nothing on local disk. A write that
stalls ends the run in one line instead of hanging it.

The corpus and the vocabulary cache are in the bucket too, so the parts that read through
TensorFlow's own GCS client (the TSV reader, the vocabulary cache) are exercised as well.
"""

import collections
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.processes import subprocess_env
from tests.helpers.tiny_run import OVERRIDES, REPO
from transformer import storage


def _local_files(*roots):
  return sorted(
    os.path.relpath(os.path.join(d, f), r)
    for r in roots
    for d, _, files in os.walk(r)
    for f in files
  )


@pytest.fixture
def bucket_run(gcs, small_corpus, tmp_path):  # noqa: F811
  """(run(args) -> CompletedProcess, url, flags) with the corpus copied into the bucket,
  and processes started in an empty directory with an empty HOME."""
  url = gcs.url
  corpus_path, _ = small_corpus
  with open(corpus_path, "rb") as f:
    corpus = f.read()
  import tensorflow as tf  # the test process writes the corpus through the fake too

  with tf.io.gfile.GFile(f"{url}/corpus/small.tsv", "wb") as f:
    f.write(corpus)
  cwd, home = tmp_path / "cwd", tmp_path / "home"
  cwd.mkdir()
  home.mkdir()
  env = subprocess_env(devices=1)
  env.update(
    gcs.env,
    HOME=str(home),
    PYTHONUNBUFFERED="1",
    PYTHONDONTWRITEBYTECODE="1",
    PYTHONPATH=REPO,
    # Libraries' own settings, which their imports write under HOME otherwise.
    MPLCONFIGDIR=str(tmp_path / "matplotlib"),
    KERAS_HOME=str(tmp_path / "keras"),
  )
  flat = {**OVERRIDES, "dataset": f"tsv:{url}/corpus/small.tsv", "vocab_cache_dir": f"{url}/vocab"}
  flags = [f"--config.{k}={v}" for k, v in flat.items()]

  def start(args, **extra_env):
    return subprocess.Popen(
      [sys.executable, *args],
      cwd=cwd,
      env={**env, **extra_env},
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )

  def run(args, timeout=300):
    process = start(args)
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-3000:]
    return output

  yield start, run, url, flags, (cwd, home), flat


def _logged_steps(gcs, run):  # noqa: F811
  """Lines of the run's metrics so far, read past the faults (and TensorFlow's caches)."""
  chunks = [n for n in gcs.list_objects(f"{run}/metrics-") if n.endswith(".jsonl")]
  return sum(len(gcs.read(name).decode().splitlines()) for name in chunks)


def _committed_steps(gcs, run):  # noqa: F811
  """Cloud storage marks a complete checkpoint with <step>/commit_success.txt."""
  return sorted(
    int(n.split("/")[2])
    for n in gcs.list_objects(f"{run}/checkpoints/")
    if n.endswith("/commit_success.txt") and n.count("/") == 3
  )


def test_everything_a_user_does_works_on_a_bucket(gcs, bucket_run, tmp_path):  # noqa: F811
  from transformer.training import reporting

  start, run, url, flags, local_dirs, flat = bucket_run
  train = [os.path.join(REPO, "train.py"), "--config", "configs/default.py"]
  # From here on the bucket fails 4% of requests with 429 or 503 and drops the
  # connection of 1% more. The clients retry them (docs/reliability.md); nothing may
  # be lost.
  faults = dict(error_rate=0.04, drop_rate=0.01, seed=23)
  gcs.set_faults(**faults)

  # Train until SIGTERM: the current step is saved to the bucket, exit 0.
  process = start(
    train
    + ["--workdir", f"{url}/run"]
    + flags
    + ["--config.num_train_steps=10000", "--config.checkpoint_every_steps=1000"]
  )
  deadline = time.time() + 240
  while _logged_steps(gcs, "run") < 3:
    assert process.poll() is None, process.stdout.read()[-3000:]
    assert time.time() < deadline, "no three logged steps"
    time.sleep(0.5)
  process.send_signal(signal.SIGTERM)
  output, _ = process.communicate(timeout=120)
  assert process.returncode == 0, output[-3000:]
  saved = _committed_steps(gcs, "run")
  assert len(saved) == 1 and saved[0] >= 3, saved

  # The same command resumes from the bucket's checkpoint, saving every 2 steps.
  final = saved[0] + 4
  output = run(
    train
    + ["--workdir", f"{url}/run"]
    + flags
    + [f"--config.num_train_steps={final}", "--config.checkpoint_every_steps=2"]
  )
  assert f"resumed from step {saved[0]}" in output
  assert _committed_steps(gcs, "run") == sorted(
    {saved[0], final} | {s for s in range(saved[0] + 1, final) if s % 2 == 0}
  )
  losses = {r["step"]: r["loss"] for r in reporting.read_metrics(f"{url}/run", "train")}
  assert sorted(losses) == list(range(1, final + 1))
  injected = collections.Counter(r["status"] for r in gcs.requests() if r["fault"])
  assert injected[429] and injected[503] and injected["-"], injected

  # eval.py reads the run from the bucket and writes its files there.
  output = run(
    [
      os.path.join(REPO, "eval.py"),
      "--workdir",
      f"{url}/run",
      "--split",
      "test",
      "--search",
      "greedy",
    ]
  )  # the storage is tried here, not the search
  assert output.strip().splitlines()[-1].startswith("sacreBLEU ")
  report = json.loads(gcs.read(f"run/eval/test-{final}-greedy.json"))
  hypotheses = gcs.read(f"run/eval/test-{final}-greedy.hyp.txt").decode().splitlines()
  assert len(hypotheses) == report["num_sentences"] > 0

  # Averaging writes a new run into the bucket, which generate.py can use.
  run(
    [
      "-m",
      "transformer.tools.average_checkpoints",
      "--workdir",
      f"{url}/run",
      "--average_last",
      "2",
      "--output_workdir",
      f"{url}/avg",
    ]
  )
  output = run(
    [os.path.join(REPO, "generate.py"), "translate", "--workdir", f"{url}/avg", "Hello."]
  )
  assert output.strip()  # one translation printed

  # A two-row sweep: rows, their files, the sweep's log and its report, all in the bucket,
  # which behaves again. Its base is the run above, so row "one" is that run never
  # stopped: every step of the stopped, resumed run has its loss (under faults, the
  # sweep's saves would cost minutes of the clients' backoff; the run above saved so).
  # Each row validates at its end (perplexity only), which the report tabulates.
  gcs.set_faults()
  inputs = tmp_path / "sweep_files"
  inputs.mkdir()
  sweep = inputs / "bucket_sweep.py"
  row_base = dict(
    flat,
    num_train_steps=final,
    checkpoint_every_steps=final,
    eval_every_steps=final,
    eval_bleu_sentences=0,
  )
  sweep.write_text(
    "from transformer.sweeps import Row\n\n"
    f"BASE_CONFIG = {os.path.join(REPO, 'configs/default.py')!r}\n"
    f"BASE_OVERRIDES = {row_base!r}\n\n"
    "def get_sweep():\n"
    "  return [Row('one', {}), Row('two', {'model.d_ff': 32})]\n"
  )
  run(
    [
      "-m",
      "transformer.sweeps",
      "--sweep",
      str(sweep),
      "--workdir",
      f"{url}/sweep",
      "--nofinal_eval",
    ],
    timeout=600,
  )
  straight = {r["step"]: r["loss"] for r in reporting.read_metrics(f"{url}/sweep/one", "train")}
  assert losses == straight
  output = run(
    ["-m", "transformer.sweeps", "--sweep", str(sweep), "--workdir", f"{url}/sweep", "--collect"]
  )
  assert "| one" in output and "| two" in output

  objects = gcs.list_objects()
  expected = [
    "run/config.json",
    "run/vocab.model",
    f"run/checkpoints/{final}/",
    f"run/eval/test-{final}-greedy.src.txt",
    f"run/eval/test-{final}-greedy.ref.txt",
    "run/tensorboard/events.out.tfevents",
    "avg/config.json",
    "avg/vocab.model",
    f"avg/checkpoints/{final}/",
    "vocab/",
    "sweep/sweep_log-000000.jsonl",
    "sweep/one/metrics-000000.jsonl",
    f"sweep/two/checkpoints/{final}/",
    "sweep/bucket_sweep.md",
    "sweep/bucket_sweep.csv",
    "sweep/bucket_sweep.png",
  ]
  for prefix in expected:
    assert any(name.startswith(prefix) for name in objects), (prefix, objects)
  sweep_log = [json.loads(line) for line in storage.read_log_lines(f"{url}/sweep/sweep_log.jsonl")]
  assert [(e["row"], e["phase"]) for e in sweep_log] == [("one", "train"), ("two", "train")]
  assert _local_files(*local_dirs) == []  # nothing went to the working directory or HOME
  assert not os.path.exists(os.path.join(REPO, "gs:"))


def test_a_checkpoint_without_its_commit_marker_is_not_a_step(gcs):  # noqa: F811
  """On cloud storage a torn save leaves `<step>/` without commit_success.txt."""
  import tensorflow as tf

  from transformer.training import checkpoints

  for name in ("4/commit_success.txt", "4/state/data", "6/state/data"):
    with tf.io.gfile.GFile(f"{gcs.url}/run/checkpoints/{name}", "w") as f:
      f.write("x")
  assert checkpoints.steps_on_disk(f"{gcs.url}/run") == [4]


def test_a_bucket_that_cannot_be_used_is_a_one_line_error(bucket_run):
  start, _, url, flags, *_ = bucket_run
  for args, expected in (
    (
      [os.path.join(REPO, "train.py"), "--workdir", "gs://no-such-bucket/run"] + flags,
      "error: workdir gs://no-such-bucket/run is not writable: ",
    ),
    (
      [os.path.join(REPO, "eval.py"), "--workdir", f"{url}/never-trained"],
      f"error: --workdir {url}/never-trained does not exist",
    ),
  ):
    process = start(args)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 1, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith(expected), last
    assert "Traceback" not in output


@pytest.mark.parametrize(
  "stalled, named",
  [
    ("run/metrics-", "gs://test-bucket/run/metrics-000000.jsonl"),
    ("run/checkpoints/2/", "the checkpoint gs://test-bucket/run/checkpoints/2"),
  ],
)
def test_a_stalled_write_ends_the_run_in_one_line(gcs, bucket_run, stalled, named):  # noqa: F811
  """A request about the object that hangs for 10 minutes: the run stops after
  storage_timeout_s with an error naming it, instead of waiting, and nothing else."""
  start, _, url, flags, *_ = bucket_run
  gcs.set_faults(stall_s=600, stall_match=stalled, stall_count=1)
  process = start(
    [
      os.path.join(REPO, "train.py"),
      "--config",
      "configs/default.py",
      "--workdir",
      f"{url}/run",
      *flags,
      "--config.num_train_steps=50",
      "--config.storage_timeout_s=3",
    ]
  )
  output, _ = process.communicate(timeout=240)  # far less than the stall
  assert process.returncode == 1, output[-3000:]
  last = output.strip().splitlines()[-1]
  assert last.startswith(
    f"error: writing {named} did not finish within 3 s (config.storage_timeout_s)"
  ), last
  assert "Traceback" not in output
  # Orbax's own record of the failed save (checkpoints: its thread has always given up
  # and logged by the time the process exits) is not shown: the one line says it.
  errors = [line for line in output.splitlines() if re.match(r"E\d{4} ", line)]
  assert all(" distributed.py:" in line for line in errors), errors


@pytest.mark.slow  # three train.py processes on the bucket, two side by side
def test_a_kill_just_after_a_save_loses_no_logged_step_in_a_bucket(gcs, bucket_run):  # noqa: F811
  """kill -9 as soon as checkpoint 4 is committed, with every upload of the log slowed,
  so records would still be queued: the bucket already holds steps 1 to 4. The rerun
  resumes there, and the log has each step once, with the uninterrupted run's losses."""
  from transformer.training import goodput, reporting

  start, run, url, flags, *_ = bucket_run

  def train(workdir):
    return [
      os.path.join(REPO, "train.py"),
      "--config",
      "configs/default.py",
      "--workdir",
      f"{url}/{workdir}",
      *flags,
      "--config.num_train_steps=6",
    ]

  launcher = [os.path.join(REPO, "tests/helpers/fault_injection.py")]
  # The same run, never interrupted, beside it: most of each is start-up, one core each.
  straight = start(train("straight"))
  process = start(launcher + train("run"), FAULT_KILL_AFTER_SAVE_STEP="4", FAULT_SLOW_LOG_S="1")
  output, _ = process.communicate(timeout=300)
  straight_output, _ = straight.communicate(timeout=300)
  assert straight.returncode == 0, straight_output[-3000:]
  assert process.returncode == -signal.SIGKILL, output[-3000:]
  assert _committed_steps(gcs, "run") == [2, 4]
  assert [r["step"] for r in reporting.read_metrics(f"{url}/run")] == [1, 2, 3, 4]

  output = run(train("run"))
  assert "resumed from step 4" in output
  records = reporting.read_metrics(f"{url}/run")
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
  losses = {r["step"]: r["loss"] for r in reporting.read_metrics(f"{url}/straight")}
  assert {r["step"]: r["loss"] for r in records} == losses
  assert len({r["start_time"] for r in reporting.read_metrics(f"{url}/run", "goodput")}) == 2
  [line] = [line for line in output.splitlines() if line.startswith("goodput ")]
  assert "; 2 starts, " in line
  assert all(f"{category} " in line for category in goodput.CATEGORIES if category != "steps")
