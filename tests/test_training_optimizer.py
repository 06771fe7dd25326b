"""The paper's learning-rate schedule and Adam, with decoupled decay and clipping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer import config as config_lib
from transformer.training import optimizer as optimizer_lib


def tiny_config():
  c = config_lib.base_config()
  c.model.d_model = 32
  c.warmup_steps = 10
  return c


@pytest.mark.parametrize("step", [1, 4000, 100000])
def test_schedule_equals_the_papers_formula(step):
  config = config_lib.base_config()
  config.model.d_model, config.warmup_steps = 512, 4000
  expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
  # Optax counts updates from 0: update number `step` sees count step - 1.
  got = float(optimizer_lib.learning_rate_schedule(config)(step - 1))
  assert got == pytest.approx(expected, rel=1e-6)


def test_schedule_peaks_at_warmup():
  config = config_lib.base_config()
  schedule = optimizer_lib.learning_rate_schedule(config)
  values = [float(schedule(s - 1)) for s in (3999, 4000, 4001)]
  assert values[1] > values[0] and values[1] > values[2]
  assert values[1] == pytest.approx(7.0e-4, rel=0.01)  # PAPER.md: peak about 7.0e-4 (base)


def test_weight_decay_is_decoupled_and_skips_vectors():
  config = tiny_config()
  config.weight_decay = 0.1
  optimizer = optimizer_lib.make_optimizer(config)
  params = {"kernel": jnp.ones((3, 4)), "bias": jnp.ones((4,))}
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = optimizer.update(zero_grads, optimizer.init(params), params)
  lr = float(optimizer_lib.learning_rate_schedule(config)(0))
  np.testing.assert_allclose(updates["kernel"], -lr * 0.1 * np.ones((3, 4)), rtol=1e-6)
  np.testing.assert_array_equal(updates["bias"], np.zeros(4))


def test_gradient_clipping_clips_before_adam():
  config = tiny_config()
  config.grad_clip_norm = 1.0
  clipped_adam = optimizer_lib.make_optimizer(config)
  config.grad_clip_norm = 0.0
  plain_adam = optimizer_lib.make_optimizer(config)
  params = {"w": jnp.zeros(3)}
  grads = [{"w": jnp.array([30.0, -40.0, 0.0])}, {"w": jnp.array([0.3, 0.1, -0.2])}]
  state_clipped, state_plain = clipped_adam.init(params), plain_adam.init(params)
  for g in grads:
    got, state_clipped = clipped_adam.update(g, state_clipped, params)
    norm = float(optax.tree_utils.tree_norm(g))
    expected, state_plain = plain_adam.update(
        jax.tree.map(lambda x: x * min(1.0, 1.0 / norm), g), state_plain, params)
    np.testing.assert_allclose(got["w"], expected["w"], rtol=1e-5)
