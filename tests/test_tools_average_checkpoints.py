"""Checkpoint averaging (`python -m transformer.tools.average_checkpoints`) on a tiny
trained run: the mean of the last k checkpoints as a new run directory, and one-line
errors that never touch existing checkpoints."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.helpers.processes import subprocess_env
from tests.helpers.tiny_run import REPO, TRAINED_RUN_STEPS
from transformer.config import ConfigError
from transformer.inference import checkpoints as inference_checkpoints
from transformer.tools import average_checkpoints
from transformer.training import checkpoints, state


def _params(workdir, config, **kwargs):
  params, step = inference_checkpoints.restore_params(workdir, state.setup(config), **kwargs)
  return jax.device_get(params), step


def test_averaging_gives_the_mean(trained_run, tmp_path):
  config, workdir = trained_run
  first, last = TRAINED_RUN_STEPS
  p_first, _ = _params(workdir, config, step=first)
  p_last, step = _params(workdir, config)
  assert step == last
  averaged, step = _params(workdir, config, average_last=2)
  assert step == last
  jax.tree.map(
    lambda a, x, y: np.testing.assert_allclose(a, (x + y) / 2, rtol=1e-6), averaged, p_first, p_last
  )
  same, _ = _params(workdir, config, average_last=1)
  jax.tree.map(np.testing.assert_array_equal, same, p_last)
  with pytest.raises(ConfigError, match="only 2 checkpoints"):
    _params(workdir, config, average_last=3)

  out = str(tmp_path / "avg")
  assert average_checkpoints.average_into(workdir, out, 2) == last
  written, _ = _params(out, checkpoints.load_run_config(out))
  jax.tree.map(np.testing.assert_array_equal, written, averaged)


def test_averaging_identical_checkpoints_returns_them(trained_run, tmp_path):
  config, workdir = trained_run
  p_last, last = _params(workdir, config)
  once = str(tmp_path / "once")
  average_checkpoints.average_into(workdir, once, 1)
  # A run whose two checkpoints hold the same parameters averages to exactly them.
  reader = inference_checkpoints.CheckpointReader(once, config.storage_timeout_s)
  params = reader.params(last, state.setup(config).params_target())
  iterator = reader.saved_iterator_state(last)
  reader.close()
  twice = checkpoints.Checkpointer(once, keep=5, async_save=False)
  twice.save(last + 1, {"step": np.int32(last + 1), "params": params}, iterator, config)
  twice.close()
  averaged, _ = _params(once, config, average_last=2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-7), averaged, p_last)


def _saved_tree(workdir, step) -> str:
  """The train state's tree as Orbax recorded it (the state item's metadata)."""
  with open(os.path.join(workdir, "checkpoints", str(step), "state", "_METADATA")) as f:
    return f.read()


def test_averaged_run_is_a_complete_workdir_to_serve(trained_run, tmp_path):
  """The output holds the run's config.json and vocab.model byte for byte and one
  checkpoint at the newest averaged step, with that checkpoint's step and data-iterator
  state and no optimizer state (a run to serve: the moments would be read for nothing);
  --step picks which checkpoints are averaged."""
  config, workdir = trained_run
  out = str(tmp_path / "avg")
  first = TRAINED_RUN_STEPS[0]
  assert average_checkpoints.average_into(workdir, out, 1, step=first) == first
  for name in ("config.json", "vocab.model"):
    with open(os.path.join(workdir, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
      assert a.read() == b.read(), name
  assert checkpoints.steps_on_disk(out) == [first]
  target = state.setup(config).params_target()
  readers = [inference_checkpoints.CheckpointReader(w, 60.0) for w in (workdir, out)]
  (original, original_iterator), (written, written_iterator) = [
    (jax.device_get(r.params(first, target)), r.saved_iterator_state(first)) for r in readers
  ]
  for reader in readers:
    reader.close()
  assert written_iterator == original_iterator
  jax.tree.map(np.testing.assert_array_equal, written, original)
  assert "opt_state" in _saved_tree(workdir, first)
  assert "opt_state" not in _saved_tree(out, first) and "params" in _saved_tree(out, first)


@pytest.mark.parametrize(
  "same",
  [lambda w: w, lambda w: w + "/", lambda w: f"{w}/../{os.path.basename(w)}"],
  ids=["as_is", "trailing_slash", "dot_dot"],
)
def test_output_equal_to_the_run_is_a_one_line_error(trained_run, same):
  """The run's own directory, however spelled, is refused before anything is written."""
  _, workdir = trained_run
  before = checkpoints.steps_on_disk(workdir)
  with pytest.raises(ConfigError) as error:
    average_checkpoints.average_into(workdir, same(workdir), 2)
  assert str(error.value) == (
    "--output_workdir must differ from --workdir (a run's own checkpoints are never overwritten)"
  )
  assert checkpoints.steps_on_disk(workdir) == before


def test_output_equal_to_a_relative_spelling_of_the_run_is_refused(trained_run, monkeypatch):
  _, workdir = trained_run
  monkeypatch.chdir(os.path.dirname(workdir))
  with pytest.raises(ConfigError, match="must differ from --workdir"):
    average_checkpoints.average_into(workdir, os.path.basename(workdir), 2)


def test_output_that_holds_checkpoints_is_a_one_line_error(trained_run, tmp_path):
  """An output that already holds a checkpoint is refused, and left as it was."""
  _, workdir = trained_run
  out = str(tmp_path / "avg")
  assert average_checkpoints.average_into(workdir, out, 2) == TRAINED_RUN_STEPS[-1]
  before = {
    p: os.path.getmtime(os.path.join(out, "checkpoints", p))
    for p in os.listdir(os.path.join(out, "checkpoints"))
  }
  with pytest.raises(ConfigError) as error:
    average_checkpoints.average_into(workdir, out, 1)
  assert str(error.value) == f"{out} already holds checkpoints"
  assert {
    p: os.path.getmtime(os.path.join(out, "checkpoints", p))
    for p in os.listdir(os.path.join(out, "checkpoints"))
  } == before


def test_an_empty_checkpoint_folder_from_a_failed_try_is_reused(trained_run, tmp_path):
  _, workdir = trained_run
  out = tmp_path / "avg"
  (out / "checkpoints").mkdir(parents=True)
  last = TRAINED_RUN_STEPS[-1]
  assert average_checkpoints.average_into(workdir, str(out), 2) == last
  assert checkpoints.steps_on_disk(str(out)) == [last]


def _average_checkpoints(*args):
  env = subprocess_env(devices=1)
  return subprocess.run(
    [sys.executable, "-m", "transformer.tools.average_checkpoints", *args],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )


def test_command_line_errors_are_one_line(tmp_path):
  """The command exits 1 with one `error:` line for missing flags, an output equal to
  the run, and an output that already holds checkpoints."""
  run, out = tmp_path / "run", tmp_path / "out"
  (out / "checkpoints" / "3").mkdir(parents=True)
  for args, message in [
    (["--workdir", str(run)], "error: --workdir and --output_workdir are required"),
    (
      ["--workdir", str(run), "--output_workdir", f"{run}/"],
      "error: --output_workdir must differ from --workdir (a run's own checkpoints are "
      "never overwritten)",
    ),
    (
      ["--workdir", str(run), "--output_workdir", str(out)],
      f"error: {out} already holds checkpoints",
    ),
  ]:
    result = _average_checkpoints(*args)
    assert result.returncode == 1, (args, result.stdout[-2000:])
    assert result.stderr.strip().splitlines()[-1] == message
