"""A tiny config, a synthetic batch and a few sharded train steps, shared by the tests of
the train step and of the fused loss."""

import jax
import numpy as np

from transformer import config as config_lib
from transformer.inference import sharding
from transformer.training import state, steps


def tiny_config():
  c = config_lib.base_config()
  c.vocab_size = 64
  c.max_len = 16
  c.model.num_layers, c.model.d_model, c.model.d_ff = 2, 32, 64
  c.model.num_heads, c.model.d_k, c.model.d_v = 4, 8, 8
  c.warmup_steps = 10
  return c


def synthetic_batch(config, rows=8, length=12, seed=0):
  rng = np.random.default_rng(seed)
  target = rng.integers(4, config.vocab_size, (rows, length)).astype(np.int32)
  target[:, -3:] = 0  # padding
  target[np.arange(rows), length - 4] = config_lib.EOS_ID
  decoder_input = np.concatenate([np.full((rows, 1), config_lib.BOS_ID), target[:, :-1]], 1)
  decoder_input = np.where(target == 0, 0, decoder_input).astype(np.int32)
  source = rng.integers(4, config.vocab_size, (rows, length)).astype(np.int32)
  source[: rows // 2, -5:] = 0
  return {"source": source, "decoder_input": decoder_input, "target": target}


def run_steps(config, devices, num_steps=2):
  run = state.setup(config, sharding.create_mesh(config, devices))
  train_state = run.init_state(jax.random.key(0))
  step = steps.jit_train_step(run)
  losses = []
  for i in range(num_steps):
    batch = sharding.global_batch(synthetic_batch(config, seed=i), run.mesh, run.rules)
    train_state, metrics = step(train_state, batch)
    losses.append(float(metrics["loss"]))
  return losses, jax.device_get(train_state.params), train_state


def assert_trees_close(got, want, rtol):
  """Per parameter, |got - want| / |want| in the global (Frobenius) norm."""
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    error = np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)
    assert error <= rtol, f"{jax.tree_util.keystr(path)}: relative error {error:.2e}"
