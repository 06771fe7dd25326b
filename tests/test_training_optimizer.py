"""The paper's learning-rate schedule and Adam, with decoupled decay and clipping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer import config as config_lib
from transformer.training import optimizer as optimizer_lib
from transformer.training import state


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


def model_config(scan_layers, positional="learned", tie_embeddings=True):
  c = tiny_config()
  c.vocab_size, c.max_len = 64, 16
  c.model.num_layers, c.model.d_ff, c.model.num_heads, c.model.d_k, c.model.d_v = 2, 64, 4, 8, 8
  c.model.scan_layers, c.model.positional = scan_layers, positional
  c.model.tie_embeddings = tie_embeddings
  c.weight_decay = 0.1
  return c


def decay_by_name(params):
  """{'encoder/layer_0/ffn/wi/kernel': decayed?} with the layer index (or stack) dropped."""
  mask = optimizer_lib.weight_decay_mask(params)
  out = {}
  for path, decayed in jax.tree_util.tree_leaves_with_path(mask):
    keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
    keys = ["layer" if k.startswith("layer_") or k == "layers" else k for k in keys]
    out["/".join(keys)] = bool(decayed)
  return out


@pytest.mark.parametrize("positional,tie_embeddings", [("learned", True), ("sinusoidal", False)])
def test_decay_mask_is_by_name_and_the_same_with_stacked_layers(positional, tie_embeddings):
  by_mode = {}
  for scan_layers in (False, True):
    config = model_config(scan_layers, positional, tie_embeddings)
    params = state.setup(config).abstract_state.params
    by_mode[scan_layers] = decay_by_name(params)
    for name, decayed in by_mode[scan_layers].items():
      leaf = name.rsplit("/", 1)[-1]
      assert decayed == (leaf in ("kernel", "embedding")), name
  assert by_mode[False] == by_mode[True]
  names = by_mode[False]
  assert names["encoder/layer/ffn/wi/kernel"] and names["decoder/layer/self_attention/qkv/kernel"]
  assert not names["encoder/layer/ffn/wi/bias"]
  assert not names["decoder/layer/ffn_block/norm/scale"]
  assert not names["decoder/layer/ffn_block/norm/bias"]
  if positional == "learned":
    assert not names["encoder/input/position_embedding"]
    assert not names["decoder/input/position_embedding"]
  if tie_embeddings:
    assert names["shared_embedding/embedding"]
  else:
    assert names["source_embedding/embedding"] and names["decoder/output_projection/kernel"]


def test_decay_mask_refuses_a_parameter_it_has_no_rule_for():
  with pytest.raises(ValueError, match="no decay rule.*mystery"):
    optimizer_lib.weight_decay_mask({"block": {"mystery": jnp.ones((2, 2))}})


@pytest.mark.parametrize("scan_layers", [False, True])
def test_decay_with_zero_gradients_moves_only_decayed_parameters(scan_layers):
  config = model_config(scan_layers)
  run = state.setup(config)
  train_state = run.init_state(jax.random.key(0))
  zero_grads = jax.tree.map(jnp.zeros_like, train_state.params)
  updates, _ = run.optimizer.update(zero_grads, train_state.opt_state, train_state.params)
  lr = float(optimizer_lib.learning_rate_schedule(config)(0))
  moved = []
  for (path, update), param in zip(
    jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(train_state.params)
  ):
    if path[-1].key in ("kernel", "embedding"):
      np.testing.assert_allclose(
        update, -lr * 0.1 * np.asarray(param), rtol=1e-5, err_msg=jax.tree_util.keystr(path)
      )
      moved.append(path)
    else:
      np.testing.assert_array_equal(
        update, np.zeros_like(update), err_msg=jax.tree_util.keystr(path)
      )
  assert moved


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
      jax.tree.map(lambda x, norm=norm: x * min(1.0, 1.0 / norm), g), state_plain, params
    )
    np.testing.assert_allclose(got["w"], expected["w"], rtol=1e-5)
