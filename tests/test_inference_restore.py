"""The layer below training (transformer/inference): a trained run's parameters restored alone,
from checkpoints as training writes them today, averaged one checkpoint at a time; and
the tool that measures what that saves (tools/restore_memory.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.helpers.processes import subprocess_env
from tests.helpers.tiny_run import REPO, TRAINED_RUN_STEPS
from transformer import inference
from transformer.config import ConfigError
from transformer.inference import checkpoints as inference_checkpoints
from transformer.training import checkpoints, state


def _whole_state(workdir, config, step):
  """The train state as training restores it to resume (parameters and Adam moments)."""
  reader = checkpoints.Checkpointer(workdir, keep=10**6, async_save=False)
  restored, _ = reader.restore(step, state.setup(config).restore_target())
  reader.close()
  return jax.device_get(restored)


def test_restore_reads_the_parameters_training_wrote_and_nothing_else(trained_run):
  """run.restore on a run trained by today's code: the parameters of the newest
  checkpoint, equal to those of the whole state, with the run's vocabulary and step; a
  config given must match the checkpoint's architecture."""
  config, workdir = trained_run
  first, last = TRAINED_RUN_STEPS
  restored = inference.restore(workdir)
  assert restored.step == last
  assert restored.tokenizer.vocab_size == config.vocab_size
  assert restored.setup.num_params == sum(x.size for x in jax.tree.leaves(restored.params))
  whole = _whole_state(workdir, config, last)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.params), whole.params)
  # Placed as the model set-up says, on its mesh.
  shardings = jax.tree.map(lambda x: x.sharding, restored.params)
  assert jax.tree.all(
    jax.tree.map(lambda a, b: a.is_equivalent_to(b, 2), shardings, restored.setup.param_shardings)
  )
  other = config.copy_and_resolve_references()
  other.model.d_ff = 2 * config.model.d_ff
  with pytest.raises(ConfigError, match=r"^config.model.d_ff: the checkpoint was trained with"):
    inference.restore(workdir, config=other)


def test_averaging_reads_parameters_alone_one_part_of_one_checkpoint_at_a_time(
  trained_run, monkeypatch
):
  """The mean of the last two checkpoints, read part by part (the embedding, the encoder,
  the decoder), each read holding parameters only (no optimizer state in the target),
  the first checkpoint's part summed into before the second's is read."""
  config, workdir = trained_run
  first, last = TRAINED_RUN_STEPS
  parts = set(state.setup(config).abstract_state.params)
  reads, first_reads = [], []
  original = inference_checkpoints.CheckpointReader.params

  def params(self, step, target):
    (part,) = target  # one part of the parameters at a time: nothing else
    out = original(self, step, target)
    reads.append((part, step))
    if step == first:
      first_reads.append(out)
    return out

  monkeypatch.setattr(inference_checkpoints.CheckpointReader, "params", params)
  averaged = jax.device_get(inference.restore(workdir, average_last=2).params)
  assert {part for part, _ in reads} == parts and len(reads) == 2 * len(parts)
  assert all(
    reads[i][1] == first and reads[i + 1] == (reads[i][0], last) for i in range(0, len(reads), 2)
  )
  expected = jax.tree.map(
    lambda a, b: (a + b) / 2,
    _whole_state(workdir, config, first).params,
    _whole_state(workdir, config, last).params,
  )
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), averaged, expected)
  # The first checkpoint's arrays became the running sums, donated to the additions.
  assert all(x.is_deleted() for x in jax.tree.leaves(first_reads))


@pytest.mark.slow  # three processes that import JAX and write checkpoints
def test_restore_memory_measures_both_ways_on_the_same_checkpoints():
  """The measuring tool restores the same mean both ways, each in its own process, and
  says what each held; the figures themselves are the machine's (docs/performance.md)."""
  result = subprocess.run(
    [sys.executable, "-m", "transformer.tools.restore_memory", "--config",
     "configs/default.py", "--config.model.num_layers=1", "--average_last=2", "--json"],
    cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-3000:]
  records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
  assert [r["way"] for r in records] == ["params_only", "full_state"]
  for r in records:
    assert r["average_last"] == 2 and r["restore_s"] > 0
    assert r["params_bytes"] == 4 * r["num_params"]  # float32
    assert 2.9 < r["state_bytes"] / r["params_bytes"] < 3.1  # parameters and two moments
    assert r["peak_rss_bytes"] >= r["held_by_restore_bytes"] > 0
    assert len(r["save_s"]) == 2 and min(r["save_s"]) > 0  # each checkpoint's whole write


def test_fresh_parameters_of_the_model_set_up_are_trainings(trained_run):
  """ModelSetup.init_params (serving a model with random weights, as the multi-host
  evaluation test does) gives what training starts from for the same key, placed as the
  parameters' shardings say."""
  config, _ = trained_run
  training = state.setup(config)
  fresh = training.model_setup.init_params(jax.random.key(3))
  jax.tree.map(
    np.testing.assert_array_equal,
    jax.device_get(fresh),
    jax.device_get(training.init_state(jax.random.key(3)).params),
  )
  other = jax.device_get(training.model_setup.init_params(jax.random.key(4)))
  assert any(
    not np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(jax.device_get(fresh)))
  )
