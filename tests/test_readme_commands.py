"""Every command README prints runs as printed, shrunk: its code blocks are read here, and
each command line runs in order from the repository root, as a new user would run them
after `make train` (with that environment's python).

Shrinking changes sizes, never the command's flags: a run of the tiny test model, three
steps per checkpoint, on a slice of the bundled corpus in place of `make train`'s, with as many
checkpoints as the default config writes and keeps (so `--average_last` finds what it
finds on a real `make train` run); the tiny model in place of big ones; one mesh
for the memory tool, one row for a sweep's dry run and its run (two steps, the training
run's own validation in place of eval.py's), one measurement for the benchmark. Paths the
commands write go to a temporary directory. Commands that only launch cluster jobs
(`srun`) run against a fake that checks the layout and runs the command with --dry_run;
bench/cpu.sh runs with PYTHON set to a fake bench. `make train` is what the shared run
is; `make test` is this suite.

A command with a flag that no longer exists, or that fails, fails the test; so does a
command line no rule below knows how to shrink. About 16 processes, each a command of
README (100 s of CPU): slow, and the reason the run is shared.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from tests.helpers import tiny_run
from tests.helpers.processes import TEST_XLA_FLAGS, subprocess_env
from transformer.tools import compile_check

REPO = tiny_run.REPO
COMMAND = re.compile(r"^(python|bash|make|srun|gcloud) ")


def readme_commands() -> list[str]:
  """The command lines of README's code blocks, continuations joined, comments dropped."""
  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    text = f.read()
  commands = []
  for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
    for line in block.replace("\\\n", " ").splitlines():
      line = line.strip()
      if COMMAND.match(line):
        commands.append(shlex.join(shlex.split(line, comments=True)))
  return commands


def test_readme_has_the_commands_this_test_runs():
  """The parse finds every block's commands (a change to README's layout that hid them
  from the test would otherwise pass unnoticed)."""
  commands = readme_commands()
  assert commands[:2] == ["make train", "make test"]
  assert len(commands) >= 14
  assert sum(c.startswith("python train.py") for c in commands) >= 3
  assert any(c.startswith("srun ") for c in commands)


def _make_train_shape() -> dict:
  """configs/default.py's checkpoints, as many as on a `make train` run, three steps apart
  (its own interval is 100): the layout `eval.py --average_last` meets there."""
  from transformer import config as config_lib

  default = config_lib.load_config("configs/default.py")
  saves = -(-default.num_train_steps // default.checkpoint_every_steps)  # the last included
  return {
    "num_train_steps": 3 * saves,
    "checkpoint_every_steps": 3,
    "keep_checkpoints": default.keep_checkpoints,
  }


_FAKE_BENCH = """#!/bin/bash
# bench/cpu.sh's python: a bench run prints its record (or fails for $FAIL_LABEL); the
# summary at the end is the real python's.
if [ "$1 $2" = "-m transformer.tools.bench" ]; then
  label=$(printf '%s\\n' "$@" | sed -n '/^--label$/{n;p}')
  [ "$label" = "${FAIL_LABEL:-}" ] && exit 1
  echo "{\\"name\\": \\"train_step\\", \\"label\\": \\"$label\\", \\"step_time_s\\": 0.5}"
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""

# srun: the layout README promises (one process per GPU), then the command at --dry_run.
_FAKE_SRUN = """#!/bin/bash
tasks= gpus=
while [ "${1#--}" != "$1" ]; do
  case "$1" in
    --ntasks-per-node=*) tasks=${1#*=} ;;
    --gpus-per-node=*) gpus=${1#*=} ;;
  esac
  shift
done
[ -n "$tasks" ] && [ "$tasks" = "$gpus" ] ||
  { echo "error: $tasks tasks for $gpus GPUs" >&2; exit 3; }
exec "$@" --dry_run
"""


@pytest.fixture(scope="module")
def place(small_corpus, tmp_path_factory):
  """(tmp dir, environment): the fakes on PATH, the input files README names."""
  tmp = tmp_path_factory.mktemp("readme")
  (tmp / "bin").mkdir()
  for name, text in (("python-bench", _FAKE_BENCH), ("srun", _FAKE_SRUN)):
    (tmp / "bin" / name).write_text(text)
    (tmp / "bin" / name).chmod(0o755)
  with open(small_corpus[0], encoding="utf-8") as f:
    pairs = [line.rstrip("\n").split("\t")[:2] for line in f][:400]
  (tmp / "pairs.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in pairs))
  (tmp / "news.en").write_text("".join(s + "\n" for s, _ in pairs[:5]))
  (tmp / "news.es").write_text("".join(t + "\n" for _, t in pairs[:5]))
  env = subprocess_env(
    devices=1, PATH=f"{tmp / 'bin'}:{os.environ['PATH']}", REAL_PYTHON=sys.executable
  )
  return tmp, env


def shrink(command: str, tmp, small_corpus) -> tuple[list[str], dict]:
  """README's command as argv to run here, smaller, and extra environment variables."""
  words = shlex.split(command)
  places = {
    "workdirs/mine": str(tmp / "mine"),
    "W": str(tmp / "sweep"),
    "pairs.tsv": str(tmp / "pairs.tsv"),
    "news.en": str(tmp / "news.en"),
    "news.es": str(tmp / "news.es"),
    "mine-ct2": str(tmp / "mine-ct2"),
  }
  words = [places.get(w, w) for w in words]
  words = [
    w.replace("tsv:pairs.tsv", f"tsv:{tmp / 'pairs.tsv'}").replace("gs://B/tfds", str(tmp / "tfds"))
    for w in words
  ]
  words = [
    "configs/default.py" if w.startswith("configs/wmt14.py") and "--dry_run" not in words else w
    for w in words
  ]
  if words[0] == "python":
    words[0] = sys.executable
  elif words[0] == "srun":
    words[words.index(".venv/bin/python")] = sys.executable
  tiny = tiny_run.flag_overrides(small_corpus, max_decode_extra_len=5, **_make_train_shape())
  program = " ".join(words[1:3])
  if words[0] == "bash" and words[1] == "bench/cpu.sh":
    return words, {"PYTHON": str(tmp / "bin" / "python-bench"), "OUT": str(tmp / "bench")}
  if program.startswith("train.py") and "--dry_run" not in words and words[0] != "srun":
    own_data = any(w.startswith("--config.dataset=") for w in words)
    extra = [t for t in tiny if not (own_data and t.startswith("--config.dataset="))]
    if own_data:  # a second run: two steps are enough to show it trains on that data
      extra += ["--config.num_train_steps=2", "--config.checkpoint_every_steps=2"]
    return words + extra, {}
  if program == "-m transformer.sweeps":
    if "--dry_run" in words:
      return words + ["--only", "base"], {}
    if "--collect" in words:
      return words, {}
    only = words.index("--only") + 1  # one row of those named
    words[only] = words[only].split(",")[0]
    return words + tiny + [
      "--config.num_train_steps=2",
      "--config.eval_every_steps=2",
      "--nofinal_eval",
    ], {}
  if program == "-m transformer.tools.bench":
    return words + tiny + ["--steps=1", "--warmup=0", "--only=train_step"], {}
  if program == "-m transformer.tools.memory":
    # One device, as on a laptop: the tool makes the CPU devices its mesh needs.
    return words + tiny + ["--mesh", "2,1,1"], {"XLA_FLAGS": TEST_XLA_FLAGS}
  if program == "-m transformer.tools.compile_check":
    # A 4-chip slice of the same kind: the tiny model's rows do not split over 256 chips.
    words[words.index("--topology") + 1] = "v5e-4"
    return words + tiny, {}
  if program == "-m transformer.tools.prepare_data":
    # The bundled tfds dataset, built into the data_dir; a small vocabulary.
    return words + ["--config.vocab_size=256", "--config.vocab_max_sentences=2000"], {}
  if (
    program.startswith(("eval.py", "generate.py"))
    or program == "-m transformer.tools.export"
    or words[0] == "srun"
    or "--dry_run" in words
  ):
    return words, {}
  raise AssertionError(f"no rule shrinks README's command: {command}")


@pytest.mark.slow  # every README command, about 16 processes
def test_every_readme_command_runs_as_printed(place, small_corpus):
  tmp, env = place
  ran = []
  for command in readme_commands():
    if command in ("make train", "make test"):
      continue  # the shared run below is make train's; make test is this suite
    if "transformer.tools.compile_check" in command and compile_check.tpu_library_path() is None:
      print(f"skipped (libtpu is not installed): {command}")
      continue
    argv, extra_env = shrink(command, tmp, small_corpus)
    started = time.time()
    result = subprocess.run(
      argv, cwd=REPO, env={**env, **extra_env}, capture_output=True, text=True, timeout=600
    )
    print(f"{time.time() - started:5.1f} s  {command}")
    assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
    ran.append((command, result))
  outputs = {command: result.stdout for command, result in ran}

  def output(prefix):
    return next(out for command, out in outputs.items() if command.startswith(prefix))

  # What each promised: a checkpoint layout with five to average, their scores...
  assert "sacreBLEU" in output("python eval.py --workdir workdirs/mine --split test")
  steps = _make_train_shape()["num_train_steps"]
  assert os.path.exists(tmp / "mine" / "eval" / f"test-{steps}-avg5.json")
  assert len(output("python generate.py translate").strip().splitlines()) == 1
  assert (
    json.loads(
      output("python train.py --config configs/wmt14.py:base --dry_run").strip().splitlines()[-1]
    )["num_params"]
    > 60e6
  )
  assert os.listdir(tmp / "sweep" / "base" / "checkpoints") == ["2"]
  assert os.path.exists(tmp / "sweep" / "table3_small.png")
  assert "| 2 | 1 | 1 |" in output("python -m transformer.tools.memory")
  assert os.path.isdir(tmp / "tfds" / "tatoeba_en_es")
  import ctranslate2

  assert ctranslate2.Translator(str(tmp / "mine-ct2")).model_is_loaded
  if compile_check.tpu_library_path() is not None:
    assert "TPU v5 lite" in output("python -m transformer.tools.compile_check")
  assert [
    json.loads(line)["label"] for line in (tmp / "bench" / "cpu.jsonl").read_text().splitlines()
  ][:2] == [
    "base",
    "base-unscanned",
  ]


def test_bench_cpu_sh_fails_when_a_run_fails(place):
  tmp, env = place
  result = subprocess.run(
    ["bash", "bench/cpu.sh"],
    cwd=REPO,
    capture_output=True,
    text=True,
    env={
      **env,
      "PYTHON": str(tmp / "bin" / "python-bench"),
      "OUT": str(tmp / "bench-failing"),
      "FAIL_LABEL": "big",
    },
    timeout=120,
  )
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
    "error: 1 runs of bench/cpu.sh failed (FAILED above)"
  )
  assert "big  FAILED (see the log above)" in result.stdout
