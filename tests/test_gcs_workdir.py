"""A run whose every file lives in a bucket (gs://...), as on a TPU pod whose hosts share
nothing but cloud storage: train, SIGTERM, resume, eval.py, checkpoint averaging and a
sweep, all against the local GCS fake (tests/helpers/gcs_fake.py). Everything a run writes must
be in the bucket, and nothing on local disk.

The corpus and the vocabulary cache are in the bucket too, so the parts that read through
TensorFlow's own GCS client (the TSV reader, the vocabulary cache) are exercised as well.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import sweep_helpers
from tests.helpers.gcs_fake import gcs, gcs_server  # noqa: F401  (fixtures)
from tests.helpers.tiny_run import OVERRIDES, REPO


def _local_files(*roots):
  return sorted(os.path.relpath(os.path.join(d, f), r)
                for r in roots for d, _, files in os.walk(r) for f in files)


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
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(gcs.env, HOME=str(home), XLA_FLAGS="--xla_force_host_platform_device_count=1",
             JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1",
             PYTHONPATH=REPO,
             # Libraries' own settings, which their imports write under HOME otherwise.
             MPLCONFIGDIR=str(tmp_path / "matplotlib"), KERAS_HOME=str(tmp_path / "keras"))
  flat = {**OVERRIDES, "dataset": f"tsv:{url}/corpus/small.tsv",
          "vocab_cache_dir": f"{url}/vocab"}
  flags = [f"--config.{k}={v}" for k, v in flat.items()]

  def start(args):
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

  def run(args, timeout=300):
    process = start(args)
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-3000:]
    return output

  yield start, run, url, flags, (cwd, home)


def _logged_steps(gcs, name):  # noqa: F811
  try:
    return len(gcs.read(name).decode().splitlines())
  except FileNotFoundError:
    return 0


def test_everything_a_user_does_works_on_a_bucket(gcs, bucket_run, small_corpus, tmp_path):  # noqa: F811
  start, run, url, flags, local_dirs = bucket_run
  train = [os.path.join(REPO, "train.py"), "--config", "configs/default.py",
           "--workdir", f"{url}/run"]

  # Train until SIGTERM: the current step is saved to the bucket, exit 0.
  process = start(train + flags + ["--config.num_train_steps=10000",
                                   "--config.checkpoint_every_steps=1000"])
  deadline = time.time() + 240
  while _logged_steps(gcs, "run/metrics.jsonl") < 3:
    assert process.poll() is None, process.stdout.read()[-3000:]
    assert time.time() < deadline, "no three logged steps"
    time.sleep(0.5)
  process.send_signal(signal.SIGTERM)
  output, _ = process.communicate(timeout=120)
  assert process.returncode == 0, output[-3000:]
  # Cloud storage marks a complete checkpoint with <step>/commit_success.txt.
  saved = sorted(int(n.split("/")[2]) for n in gcs.list_objects("run/checkpoints/")
                 if n.endswith("/commit_success.txt") and n.count("/") == 3)
  assert len(saved) == 1 and saved[0] >= 3, saved

  # The same command resumes from the bucket's checkpoint.
  final = saved[0] + 2
  output = run(train + flags + [f"--config.num_train_steps={final}",
                                "--config.checkpoint_every_steps=1000"])
  assert f"resumed from step {saved[0]}" in output
  records = [json.loads(line) for line in gcs.read("run/metrics.jsonl").decode().splitlines()]
  assert [r["step"] for r in records][-2:] == [final - 1, final]
  assert records[0]["step"] == 1  # the first run's lines are kept, not overwritten

  # eval.py reads the run from the bucket and writes its files there.
  output = run([os.path.join(REPO, "eval.py"), "--workdir", f"{url}/run", "--split", "test"])
  assert output.strip().splitlines()[-1].startswith("sacreBLEU ")
  report = json.loads(gcs.read(f"run/eval/test-{final}.json"))
  hypotheses = gcs.read(f"run/eval/test-{final}.hyp.txt").decode().splitlines()
  assert len(hypotheses) == report["num_sentences"] > 0

  # Averaging writes a new run into the bucket, which eval.py can use.
  run(["-m", "transformer.tools.average_checkpoints", "--workdir", f"{url}/run",
       "--average_last", "2", "--output_workdir", f"{url}/avg"])
  output = run([os.path.join(REPO, "eval.py"), "--workdir", f"{url}/avg",
                "--translate", "Hello."])
  assert output.strip()  # one translation printed

  # A two-row sweep: rows, their files, the sweep's log and its report, all in the bucket.
  inputs = tmp_path / "sweep_files"
  inputs.mkdir()
  sweep = sweep_helpers.write_sweep(
      inputs, (small_corpus[0], f"{url}/vocab"),
      '[Row("one", {}), Row("two", {"model.d_ff": 32})]',
      base_overrides='{"dataset": "tsv:%s/corpus/small.tsv", "num_train_steps": 2, '
                     '"eval_every_steps": 2}' % url)
  run(["-m", "transformer.sweeps", "--sweep", sweep, "--workdir", f"{url}/sweep",
       "--nofinal_eval"], timeout=600)
  output = run(["-m", "transformer.sweeps", "--sweep", sweep, "--workdir", f"{url}/sweep",
                "--collect"])
  assert "| one" in output and "| two" in output

  objects = gcs.list_objects()
  expected = ["run/config.json", "run/vocab.model", f"run/checkpoints/{final}/",
              f"run/eval/test-{final}.src.txt", f"run/eval/test-{final}.ref.txt",
              "run/tensorboard/events.out.tfevents", "avg/config.json", "avg/vocab.model",
              f"avg/checkpoints/{final}/", "vocab/", "sweep/sweep_log.jsonl",
              "sweep/one/metrics.jsonl", "sweep/two/checkpoints/2/",
              "sweep/tiny_sweep.md", "sweep/tiny_sweep.csv", "sweep/tiny_sweep.png"]
  for prefix in expected:
    assert any(name.startswith(prefix) for name in objects), (prefix, objects)
  assert len(json.loads(gcs.read("sweep/sweep_log.jsonl").decode().splitlines()[0])) > 0
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
  start, _, url, flags, _ = bucket_run
  for args, expected in (
      ([os.path.join(REPO, "train.py"), "--workdir", "gs://no-such-bucket/run"] + flags,
       "error: workdir gs://no-such-bucket/run is not writable: "),
      ([os.path.join(REPO, "eval.py"), "--workdir", f"{url}/never-trained"],
       f"error: --workdir {url}/never-trained does not exist")):
    process = start(args)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 1, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith(expected), last
    assert "Traceback" not in output
