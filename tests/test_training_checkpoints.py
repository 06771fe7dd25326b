"""Checkpoints on disk: listing complete steps, saving and restoring state and iterator,
keeping the newest N, config compatibility, the run's config.json, and averaging."""

import json
import os

import jax
import jax.experimental.multihost_utils
import numpy as np
import pytest

from transformer import config as config_lib
from transformer.config import ConfigError
from transformer.inference import checkpoints as inference_checkpoints
from transformer.inference import sharding
from transformer.training import checkpoints, state


def tiny_config(**overrides):
  config = config_lib.base_config()
  config_lib.apply_overrides(
    config,
    {
      "vocab_size": 16,
      "max_len": 8,
      "model.num_layers": 1,
      "model.d_model": 8,
      "model.d_ff": 16,
      "model.num_heads": 2,
      "model.d_k": 4,
      "model.d_v": 4,
      "mesh.data": 2,
      "mesh.fsdp": 2,
      "mesh.tensor": 2,
      **overrides,
    },
  )
  return config


@pytest.fixture(scope="module")
def tiny():
  """(setup, initialized train state) of a tiny model sharded over a 2 x 2 x 2 mesh."""
  config = tiny_config()
  run = state.setup(config, sharding.create_mesh(config))
  return run, run.init_state(jax.random.key(0))


def with_params(run, train_state, step, seed):
  """The train state at `step` with parameters drawn from `seed`, placed as setup says."""
  rng = np.random.default_rng(seed)
  params = jax.tree.map(
    lambda x, s: jax.device_put(rng.normal(size=x.shape).astype(x.dtype), s),
    train_state.params,
    run.state_shardings.params,
  )
  return train_state.replace(
    step=jax.device_put(np.int32(step), run.state_shardings.step), params=params
  )


def save_all(workdir, run, states, keep=10, iterator_state=None):
  checkpointer = checkpoints.Checkpointer(workdir, keep=keep)
  for s in states:
    checkpointer.save(int(s.step), s, iterator_state or {"position": int(s.step)}, run.config)
  checkpointer.close()


# ----------------------------------------------------------------------------------
# steps_on_disk


def test_steps_on_disk_lists_complete_steps_in_numeric_order(tmp_path):
  """Torn saves (`<step>.orbax-checkpoint-tmp...`) and other names are not steps."""
  directory = tmp_path / "checkpoints"
  for name in (
    "10",
    "3",
    "200",
    "7.orbax-checkpoint-tmp",
    "8.orbax-checkpoint-tmp-1712",
    "latest",
    "1e3",
    "-4",
  ):
    (directory / name).mkdir(parents=True)
  (directory / "5").write_text("")  # a file, not a checkpoint folder
  assert checkpoints.steps_on_disk(str(tmp_path)) == [3, 10, 200]


def test_steps_on_disk_of_a_missing_directory_is_empty(tmp_path):
  assert checkpoints.steps_on_disk(str(tmp_path / "nowhere")) == []
  assert checkpoints.steps_on_disk(str(tmp_path)) == []  # workdir without checkpoints/


# ----------------------------------------------------------------------------------
# Checkpointer


def test_save_and_restore_round_trip_the_state_and_iterator(tmp_path, tiny):
  run, train_state = tiny
  saved = with_params(run, train_state, step=7, seed=1)
  iterator_state = {"epoch": 2, "position": 1234, "files": ["a.tsv", "b.tsv"]}
  save_all(str(tmp_path), run, [saved], iterator_state=iterator_state)
  assert checkpoints.steps_on_disk(str(tmp_path)) == [7]

  checkpointer = checkpoints.Checkpointer(str(tmp_path), keep=10)
  assert checkpointer.latest_step() == 7 and checkpointer.all_steps() == [7]
  restored, restored_iterator = checkpointer.restore(7, run.restore_target())
  assert restored_iterator == iterator_state
  assert int(restored.step) == 7
  assert jax.tree.structure(restored) == jax.tree.structure(saved)
  for got, want, s in zip(
    jax.tree.leaves(restored), jax.tree.leaves(saved), jax.tree.leaves(run.state_shardings)
  ):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding == s  # placed as the restore target says
  saved_config = checkpointer.saved_config(7)
  assert saved_config == json.loads(run.config.to_json())
  checkpointer.close()


def test_restore_into_another_model_is_a_checkpoint_error_naming_the_step(tmp_path, tiny):
  run, train_state = tiny
  save_all(str(tmp_path), run, [with_params(run, train_state, step=3, seed=0)])
  # Another parameter tree. (A tree of other shapes fails too, but leaves Orbax's read
  # coroutines to report their errors as unraisable at garbage collection.)
  other_config = tiny_config(**{"model.tie_embeddings": False})
  other = state.setup(other_config, sharding.create_mesh(other_config))
  checkpointer = checkpoints.Checkpointer(str(tmp_path), keep=10)
  with pytest.raises(checkpoints.CheckpointError) as info:
    checkpointer.restore(3, other.restore_target())
  checkpointer.close()
  message = str(info.value)
  assert message.startswith(
    f"checkpoint 3 in {checkpoints.checkpoint_dir(str(tmp_path))} "
    "cannot be loaded (a model other than this config's"
  )
  assert "\n" not in message


def test_a_stalled_read_is_a_timeout_naming_what_was_read(tmp_path, tiny):
  """Each read is bounded by timeout_s: the manager's start (it reads every checkpoint's
  metadata) and, once started, a checkpoint's config, data state and arrays."""
  from tests.helpers import fault_injection

  run, train_state = tiny
  save_all(str(tmp_path), run, [with_params(run, train_state, step=3, seed=0)])
  directory = checkpoints.checkpoint_dir(str(tmp_path))
  fault_injection.arm(slow_restore_s=3)
  try:
    with pytest.raises(checkpoints.CheckpointTimeout) as info:
      checkpoints.Checkpointer(str(tmp_path), keep=10, timeout_s=1)
    assert str(info.value).startswith(
      f"reading the checkpoints in {directory} did not finish within 1 s"
    ), info.value
    fault_injection.disarm()
    checkpointer = checkpoints.Checkpointer(str(tmp_path), keep=10, timeout_s=1)
    fault_injection.arm(slow_restore_s=3)
    for read in (
      checkpointer.saved_config,
      checkpointer.saved_iterator_state,
      lambda step: checkpointer.restore(step, run.restore_target()),
    ):
      with pytest.raises(checkpoints.CheckpointTimeout) as info:
        read(3)
      assert str(info.value).startswith(
        f"reading checkpoint 3 in {directory} did not finish within 1 s"
      ), info.value
  finally:
    fault_injection.disarm()
  assert checkpoints.steps_on_disk(str(tmp_path)) == [3]


def test_keeps_only_the_newest_checkpoints(tmp_path, tiny):
  run, train_state = tiny
  states = [with_params(run, train_state, step=s, seed=s) for s in (1, 2, 3, 4)]
  save_all(str(tmp_path), run, states, keep=2)
  assert checkpoints.steps_on_disk(str(tmp_path)) == [3, 4]
  assert sorted(os.listdir(checkpoints.checkpoint_dir(str(tmp_path)))) == ["3", "4"]


def test_checkpoint_dir_is_absolute_under_the_workdir(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert checkpoints.checkpoint_dir("run") == os.path.join(str(tmp_path), "run", "checkpoints")


def test_only_the_loop_gives_the_preemption_sync_a_count(tmp_path, tiny, monkeypatch):
  """JAX's sync keeps the last count it was given. Orbax's save used to give it the
  global step (here 1000) between two of the loop's counts since the start (here 3, 4),
  so a notice then was agreed at 1001 steps since the start. Saving must not ask it."""
  run, train_state = tiny
  counts = []

  def reached_preemption_sync_point(count):
    counts.append(count)
    return False

  monkeypatch.setattr(
    jax.experimental.multihost_utils, "reached_preemption_sync_point", reached_preemption_sync_point
  )
  checkpointer = checkpoints.Checkpointer(str(tmp_path), keep=10)
  assert not checkpointer.reached_preemption(3)
  checkpointer.save(1000, with_params(run, train_state, step=1000, seed=0), {}, run.config)
  checkpointer.wait()
  assert not checkpointer.reached_preemption(4)
  checkpointer.close()
  assert counts == [3, 4]
  assert checkpoints.steps_on_disk(str(tmp_path)) == [1000]


# ----------------------------------------------------------------------------------
# check_compatible and load_run_config


@pytest.mark.parametrize(
  "key,value",
  [
    ("model.d_model", 16),
    ("model.num_layers", 2),
    ("model.decoder_only", True),
    ("model.positional", "rope"),
    ("model.tie_embeddings", False),
    ("model.scan_layers", True),  # another parameter tree: a leading [layers] axis
    ("vocab_size", 32),
  ],
)
def test_check_compatible_names_the_architecture_key_that_differs(key, value):
  saved = json.loads(tiny_config().to_json())
  config = tiny_config(**{key: value})
  with pytest.raises(ConfigError) as info:
    checkpoints.check_compatible(saved, config)
  message = str(info.value)
  assert message.startswith(f"config.{key}: the checkpoint was trained with ")
  assert repr(value) in message and "\n" not in message


def test_check_compatible_accepts_other_training_settings_and_missing_keys():
  """Learning rate, dropout or dtype do not change the parameter tree; a key an older
  checkpoint did not save is not compared."""
  saved = json.loads(tiny_config().to_json())
  checkpoints.check_compatible(
    saved,
    tiny_config(
      **{"learning_rate_scale": 2.0, "model.dropout_rate": 0.3, "model.dtype": "bfloat16"}
    ),
  )
  del saved["model"]["norm"]
  checkpoints.check_compatible(saved, tiny_config(**{"model.norm": "pre"}))
  checkpoints.check_compatible({}, tiny_config())


def test_load_run_config_reads_config_json_over_the_defaults(tmp_path):
  written = tiny_config(**{"model.norm": "pre"})
  (tmp_path / "config.json").write_text(written.to_json())
  loaded = checkpoints.load_run_config(str(tmp_path))
  # JSON has no tuples: the axis rules come back as lists, which axis_rules accepts.
  assert json.loads(loaded.to_json()) == json.loads(written.to_json())
  assert sharding.axis_rules(loaded) == sharding.axis_rules(written)
  # A config.json of fewer keys (an older run) keeps the defaults of the others.
  (tmp_path / "config.json").write_text(json.dumps({"model": {"d_model": 16}}))
  partial = checkpoints.load_run_config(str(tmp_path))
  assert partial.model.d_model == 16
  assert partial.model.num_layers == config_lib.base_config().model.num_layers


def test_load_run_config_without_config_json(tmp_path):
  with pytest.raises(ConfigError, match=r"holds no trained run: .*config\.json is missing"):
    checkpoints.load_run_config(str(tmp_path))


def test_load_run_config_with_invalid_json(tmp_path):
  (tmp_path / "config.json").write_text('{"model": {"d_model": 16')
  with pytest.raises(ConfigError) as info:
    checkpoints.load_run_config(str(tmp_path))
  assert "config.json is not valid JSON" in str(info.value)
  assert "rerunning train.py" in str(info.value)


# ----------------------------------------------------------------------------------
# restore_params


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory, tiny):
  """A workdir with checkpoints at steps 10, 20, 30, each with other parameters."""
  run, train_state = tiny
  workdir = str(tmp_path_factory.mktemp("averaging"))
  states = [with_params(run, train_state, step=s, seed=s) for s in (10, 20, 30)]
  save_all(workdir, run, states)
  return workdir, {int(s.step): jax.device_get(s.params) for s in states}


def test_restore_params_averages_the_newest_k(three_checkpoints, tiny):
  run, _ = tiny
  workdir, saved = three_checkpoints
  averaged, step = inference_checkpoints.restore_params(workdir, run, average_last=2)
  assert step == 30
  expected = jax.tree.map(lambda a, b: np.mean([a, b], axis=0), saved[20], saved[30])
  jax.tree.map(
    lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7),
    jax.device_get(averaged),
    expected,
  )
  for got, s in zip(jax.tree.leaves(averaged), jax.tree.leaves(run.state_shardings.params)):
    assert got.sharding == s and got.dtype == np.float32


def test_restore_params_averages_up_to_a_chosen_step(three_checkpoints, tiny):
  run, _ = tiny
  workdir, saved = three_checkpoints
  averaged, step = inference_checkpoints.restore_params(workdir, run, step=20, average_last=2)
  assert step == 20
  expected = jax.tree.map(lambda a, b: np.mean([a, b], axis=0), saved[10], saved[20])
  jax.tree.map(
    lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7),
    jax.device_get(averaged),
    expected,
  )
  everything, _ = inference_checkpoints.restore_params(workdir, run, average_last=3)
  expected = jax.tree.map(lambda *xs: np.mean(xs, axis=0), *saved.values())
  jax.tree.map(
    lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7),
    jax.device_get(everything),
    expected,
  )


def test_restore_params_of_one_checkpoint_is_exact(three_checkpoints, tiny):
  run, _ = tiny
  workdir, saved = three_checkpoints
  params, step = inference_checkpoints.restore_params(workdir, run, step=10)
  assert step == 10
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), saved[10])
  newest, step = inference_checkpoints.restore_params(workdir, run)
  assert step == 30
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(newest), saved[30])


def test_restore_params_errors(three_checkpoints, tiny, tmp_path):
  run, _ = tiny
  workdir, _ = three_checkpoints
  with pytest.raises(ConfigError, match=r"no checkpoint at step 15 .*there are \[10, 20, 30\]"):
    inference_checkpoints.restore_params(workdir, run, step=15)
  with pytest.raises(ConfigError, match=r"--average_last 3: only 2 checkpoints up to step 20"):
    inference_checkpoints.restore_params(workdir, run, step=20, average_last=3)
  with pytest.raises(ConfigError, match="holds no checkpoint"):
    inference_checkpoints.restore_params(str(tmp_path), run)
  other_config = tiny_config(**{"model.d_ff": 32})
  other = state.setup(other_config, sharding.create_mesh(other_config))
  with pytest.raises(
    ConfigError,
    match=r"config\.model\.d_ff: the checkpoint was trained "
    r"with 16, the config says 32",
  ):
    inference_checkpoints.restore_params(workdir, other)
