"""The shared command-line layer: config paths from any directory, a quiet terminal."""

import logging
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.processes import subprocess_env
from tests.helpers.tiny_run import REPO, flag_overrides
from transformer import cli


def _record(path: str, level: int) -> logging.LogRecord:
  return logging.LogRecord("absl", level, path, 1, "message", None, None)


def test_filter_passes_project_info_and_every_warning():
  library = os.path.join(os.path.dirname(logging.__file__), "orbax_like.py")
  own = os.path.join(REPO, "transformer", "training", "loop.py")
  keep = cli.ProjectInfoFilter().filter
  assert keep(_record(own, logging.INFO))
  assert keep(_record(os.path.join(REPO, "train.py"), logging.INFO))
  assert not keep(_record(library, logging.INFO))
  assert not keep(_record(library, logging.DEBUG))
  assert keep(_record(library, logging.WARNING)) and keep(_record(library, logging.ERROR))
  # A library installed inside the repository (the .venv) is still a library.
  assert not keep(_record(os.path.join(REPO, ".venv", "lib", "orbax", "x.py"), logging.INFO))


@pytest.mark.parametrize(
  "spec,expected",
  [
    ("configs/wmt14.py:big,en-fr", os.path.join(REPO, "configs", "wmt14.py") + ":big,en-fr"),
    ("configs/default.py", os.path.join(REPO, "configs", "default.py")),
    ("configs/missing.py", "configs/missing.py"),  # left for config_flags to report
  ],
)
def test_config_flag_resolves_against_the_repository(tmp_path, monkeypatch, spec, expected):
  monkeypatch.chdir(tmp_path)
  assert cli.resolve_config_arg(["prog", "--config", spec])[2] == expected
  assert cli.resolve_config_arg(["prog", f"--config={spec}"])[1] == f"--config={expected}"


def test_a_file_in_the_working_directory_wins(tmp_path, monkeypatch):
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "default.py").write_text("")
  monkeypatch.chdir(tmp_path)
  assert cli.resolve_config_arg(["prog", "--config=configs/default.py"]) == [
    "prog",
    "--config=configs/default.py",
  ]


def _train(small_corpus, workdir, *extra):
  command = [
    sys.executable,
    os.path.join(REPO, "train.py"),
    "--config",
    "configs/default.py",
    "--workdir",
    workdir,
    *flag_overrides(small_corpus, num_train_steps=2, checkpoint_every_steps=2),
    *extra,
  ]
  env = subprocess_env(devices=1)
  result = subprocess.run(
    command, cwd=os.path.dirname(workdir), env=env, capture_output=True, text=True, timeout=600
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def test_training_shows_library_info_only_at_verbosity_1(small_corpus, tmp_path):
  """By default stderr has the project's INFO lines and none of Orbax's or tfds's; with
  --verbosity=1 theirs appear too. Run from outside the repository."""
  quiet = _train(small_corpus, str(tmp_path / "quiet")).stderr
  assert "loop.py" in quiet and "parameters" in quiet  # our own INFO: "N parameters"
  assert "computes in float32, attention kernel einsum" in quiet  # the default's, on CPU
  assert "checkpoint_manager.py" not in quiet and "CheckpointManager" not in quiet
  loud = _train(small_corpus, str(tmp_path / "loud"), "--verbosity=1").stderr
  assert "checkpoint_manager.py" in loud
  assert len(loud.splitlines()) > len(quiet.splitlines()) + 10


@pytest.mark.slow  # a process of its own: about 6 s
def test_a_command_imports_tensorflow_without_keras():
  """cli.run: TensorFlow's import skips Keras (and matplotlib's pyplot, which Keras
  loads), a second of every command's start; the pipeline's tf.data works as before."""
  code = (
    "import sys\nfrom transformer import cli\n"
    "def main(argv):\n"
    "  import tensorflow as tf\n"
    "  print(sorted({'keras', 'matplotlib.pyplot'} & set(sys.modules)),\n"
    "        [int(x) for x in tf.data.Dataset.range(3).as_numpy_iterator()])\n"
    "cli.run(main)\n"
  )
  env = subprocess_env(devices=1)
  env.pop("TF_USE_LEGACY_KERAS", None)
  result = subprocess.run(
    [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.split("\n")[0] == "[] [0, 1, 2]"


# TensorFlow's C++ start-up lines, as it prints them when nothing silences it.
TENSORFLOW_START_UP_LINES = (
  "oneDNN custom operations are on",
  "All log messages before absl::InitializeLog()",
  "cpu_feature_guard",
)


def _run_with_tensorflow_unquieted(args: list[str], cwd) -> tuple[object, str]:
  """Runs `python -X importtime ARGS` without the suite's TensorFlow variables: (the
  result, its stdout and stderr without the import-time lines). Asserts that the process
  did import TensorFlow, the case these tests are about."""
  env = subprocess_env(devices=1)
  for name in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS"):
    env.pop(name, None)
  result = subprocess.run(
    [sys.executable, "-X", "importtime", *args],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  imports = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
  assert "tensorflow" in {line.split("|")[-1].strip() for line in imports}
  output = result.stdout + "\n".join(
    line for line in result.stderr.splitlines() if not line.startswith("import time:")
  )
  return result, output


@pytest.mark.slow  # a process of its own that imports TensorFlow
def test_a_command_that_starts_tensorflow_prints_only_its_own_lines(tmp_path):
  """eval.py on a missing workdir imports the input pipeline, and so TensorFlow, before
  it stops: its output is the project's one error line, with none of TensorFlow's
  start-up lines (which the environment of the suite would hide: left out here)."""
  missing = str(tmp_path / "no_such_run")
  result, output = _run_with_tensorflow_unquieted(
    [os.path.join(REPO, "eval.py"), "--workdir", missing], cwd=tmp_path
  )
  assert result.returncode != 0
  assert output.strip() == f"error: --workdir {missing} does not exist"
  assert not [line for line in TENSORFLOW_START_UP_LINES if line in output]


@pytest.mark.slow  # processes of their own that import TensorFlow
@pytest.mark.parametrize("tool", ["input_speed", "compare_ctranslate2"])
def test_a_tool_that_imports_tensorflow_first_prints_none_of_its_start_up_lines(tool):
  """These tools import the input pipeline (and TensorFlow) as they load, before
  cli.run: `--help` shows their help and none of TensorFlow's start-up lines."""
  result, output = _run_with_tensorflow_unquieted(
    ["-m", f"transformer.tools.{tool}", "--help"], cwd=REPO
  )
  # absl's --help exits 1, argparse's 0: either way the tool's own help is shown.
  assert "--workdir" in result.stdout or "--config" in result.stdout, result.stderr[-2000:]
  assert not [line for line in TENSORFLOW_START_UP_LINES if line in output]


def test_a_config_files_own_error_is_one_line_without_its_traceback():
  """`--config configs/wmt14.py:huge`: get_config() raises, config_flags wraps that with
  its traceback; the user sees the flag and the config file's message."""
  from absl import flags
  from ml_collections import config_flags

  registry = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=registry)
  path = os.path.join(REPO, "configs/wmt14.py")
  with pytest.raises(flags.Error) as error:
    registry(["prog", f"--config={path}:huge"])
  assert cli.flag_error_line(error.value) == (
    f"error: flag --config={path}:huge: configs/wmt14.py: argument 'huge' must be "
    "base|big[,en-de|,en-fr]"
  )


def test_usage_texts_keep_their_backslash_continued_example_lines():
  """A module docstring is a command's --help; in a plain string literal a backslash at a
  line's end joins the next line into a run of spaces, so such docstrings are raw."""
  import ast
  import glob

  joined = []
  for path in glob.glob(os.path.join(REPO, "transformer", "**", "*.py"), recursive=True) + [
    os.path.join(REPO, name) for name in ("train.py", "eval.py", "generate.py")
  ]:
    with open(path, encoding="utf-8") as f:
      source = f.read()
    tree = ast.parse(source)
    if (
      tree.body
      and isinstance(tree.body[0], ast.Expr)
      and isinstance(tree.body[0].value, ast.Constant)
      and isinstance(tree.body[0].value.value, str)
    ):
      literal = ast.get_source_segment(source, tree.body[0].value)
      # An odd number of backslashes at a line's end: a continuation (an even one is text).
      if re.search(r"(?<!\\)(?:\\\\)*\\\n", literal) and not literal.startswith(("r", "R")):
        joined.append(os.path.relpath(path, REPO))
  assert joined == []
