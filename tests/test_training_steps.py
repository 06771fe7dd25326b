"""The label-smoothed loss and the sharded train step on several meshes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import config as config_lib
from transformer.training import sharding, state, steps


def tiny_config():
  c = config_lib.base_config()
  c.vocab_size = 64
  c.max_len = 16
  c.model.num_layers, c.model.d_model, c.model.d_ff = 2, 32, 64
  c.model.num_heads, c.model.d_k, c.model.d_v = 4, 8, 8
  c.warmup_steps = 10
  return c


def test_label_smoothed_loss_by_hand():
  logits = np.array([[[2.0, 0.5, -1.0, 0.0], [0.1, 0.2, 0.3, 0.4]]], np.float32)
  targets = np.array([[1, 0]], np.int32)  # the second position is padding
  eps, vocab = 0.1, 4
  log_p = logits[0, 0] - np.log(np.sum(np.exp(logits[0, 0])))
  q = np.full(vocab, eps / (vocab - 1))
  q[1] = 1 - eps
  expected_loss = -np.sum(q * log_p) + np.sum(q * np.log(q))  # KL(q || p)
  sums = steps.cross_entropy_sums(jnp.asarray(logits), jnp.asarray(targets), eps)
  assert float(sums["num_tokens"]) == 1.0
  assert float(sums["loss_sum"]) == pytest.approx(expected_loss, rel=1e-5)
  assert float(sums["ce_sum"]) == pytest.approx(-log_p[1], rel=1e-5)
  assert float(sums["correct_sum"]) == 0.0  # argmax is token 0, target is 1


def test_no_smoothing_is_plain_cross_entropy():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32)
  targets = jnp.asarray([[1, 2, 0], [3, 4, 5]], jnp.int32)
  sums = steps.cross_entropy_sums(logits, targets, 0.0)
  assert float(sums["loss_sum"]) == pytest.approx(float(sums["ce_sum"]))


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


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2), (1, 2, 4)])
def test_meshes_agree_with_one_device(mesh_shape):
  assert jax.device_count() == 8
  config = tiny_config()
  single_losses, single_params, _ = run_steps(config, jax.devices()[:1])
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_shape
  losses, params, train_state = run_steps(config, jax.devices())
  np.testing.assert_allclose(losses, single_losses, rtol=2e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               params, single_params)
  # Parameters really are split over the mesh as the logical rules say.
  embedding = train_state.params["shared_embedding"]["embedding"]
  assert embedding.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
  shard_shape = embedding.addressable_shards[0].data.shape
  assert shard_shape == (64 // mesh_shape[2], 32 // mesh_shape[1])


def test_training_reduces_loss_and_accumulation_matches_big_batch():
  config = tiny_config()
  config.model.dropout_rate = 0.0
  devices = jax.devices()[:1]
  losses, _, _ = run_steps(config, devices, num_steps=6)
  assert losses[-1] < losses[0]
  # Two accumulated half batches make one update with the full batch's mean gradient
  # (equal token counts per half here, so per-half means average to the full mean).
  batch = synthetic_batch(config)
  params_after = {}
  for accum in (1, 2):
    config.grad_accum_steps = accum
    run = state.setup(config, sharding.create_mesh(config, devices))
    train_state = run.init_state(jax.random.key(0))
    step = steps.jit_train_step(run)
    if accum == 1:
      train_state, _ = step(train_state, sharding.global_batch(batch, run.mesh, run.rules))
    else:
      for half in (slice(0, 4), slice(4, 8)):
        part = {k: v[half] for k, v in batch.items()}
        train_state, _ = step(train_state, sharding.global_batch(part, run.mesh, run.rules))
    params_after[accum] = jax.device_get(train_state.params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               params_after[1], params_after[2])


def test_forced_nan_makes_the_loss_nan_at_that_step():
  config = tiny_config()
  config.debug_nan_step = 2
  losses, _, _ = run_steps(config, jax.devices()[:1], num_steps=2)
  assert math.isfinite(losses[0]) and math.isnan(losses[1])


def test_bfloat16_compute_keeps_float32_parameters_and_adam_state():
  config = tiny_config()
  config.model.dtype = "bfloat16"
  losses, params, state = run_steps(config, jax.devices()[:1])
  assert all(math.isfinite(l) for l in losses)
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype("float32")}
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
  assert moments and {x.dtype for x in moments} == {np.dtype("float32")}


def test_dropout_prng_choice_changes_masks_not_determinism():
  devices = jax.devices()[:1]
  config = tiny_config()
  config.model.dropout_rate = 0.3
  threefry, _, _ = run_steps(config, devices)
  config.dropout_rng_impl = "unsafe_rbg"
  rbg, _, _ = run_steps(config, devices)
  rbg_again, _, _ = run_steps(config, devices)
  assert rbg == rbg_again  # the same (seed, step) draws the same masks
  assert rbg != threefry  # other bits, so other masks
  assert all(math.isfinite(x) for x in rbg)
  config.dropout_rng_impl = "mersenne"
  with pytest.raises(config_lib.ConfigError, match="config.dropout_rng_impl"):
    config_lib.validate(config)


def test_scanned_layers_train_on_a_sharded_mesh_like_one_device():
  config = tiny_config()
  config.model.scan_layers = True
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
  sharded, sharded_params, _ = run_steps(config, jax.devices()[:8])
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 1
  single, single_params, _ = run_steps(config, jax.devices()[:1])
  np.testing.assert_allclose(sharded, single, rtol=1e-5)
  kernel = sharded_params["decoder"]["layers"]["ffn"]["wi"]["kernel"]
  assert kernel.shape == (2, 32, 64)  # [layers, d_model, d_ff]
  np.testing.assert_allclose(kernel, single_params["decoder"]["layers"]["ffn"]["wi"]["kernel"],
                             rtol=1e-4, atol=1e-6)
