"""The fused pre-softmax projection and loss (config.loss_chunk_len > 0) against the
unfused logits and cross-entropy: the same sums and the same gradients, in float32."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.train_steps import assert_trees_close, run_steps, synthetic_batch, tiny_config
from transformer.inference import sharding
from transformer.model import loss
from transformer.training import state, steps


def _inputs(weight_is_VxD, seed=0, batch=3, length=7, d_model=16, vocab=50):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(size=(batch, length, d_model)), jnp.float32)
  shape = (vocab, d_model) if weight_is_VxD else (d_model, vocab)
  weight = jnp.asarray(rng.normal(size=shape) / 2, jnp.float32)
  targets = rng.integers(1, vocab, (batch, length)).astype(np.int32)
  targets[0, 4:] = 0  # padding
  targets[2, 1] = 0  # and a padded position inside a packed row's gap
  return hidden, weight, jnp.asarray(targets)


def _unfused(hidden, weight, weight_is_VxD, targets, eps):
  spec = "btd,vd->btv" if weight_is_VxD else "btd,dv->btv"
  logits = jnp.einsum(spec, hidden, weight, preferred_element_type=jnp.float32)
  return loss.cross_entropy_sums(logits, targets, eps)


@pytest.mark.parametrize("weight_is_VxD", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
# 3 does not divide 7; 7 and 16 are one chunk (the logits kept for the backward pass).
@pytest.mark.parametrize("chunk_len", [1, 3, 7, 16])
def test_fused_sums_and_gradients_equal_the_unfused(weight_is_VxD, eps, chunk_len):
  hidden, weight, targets = _inputs(weight_is_VxD)
  fused = functools.partial(
    loss.fused_cross_entropy_sums,
    weight_is_VxD=weight_is_VxD,
    targets_BxT=targets,
    label_smoothing=eps,
    chunk_len=chunk_len,
  )
  unfused = functools.partial(_unfused, weight_is_VxD=weight_is_VxD, targets=targets, eps=eps)
  got, want = fused(hidden, weight), unfused(hidden, weight)
  assert set(got) == set(want)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
  assert float(got["num_tokens"]) == float(np.sum(np.asarray(targets) != 0))

  def loss_sum(fn):
    # A cotangent other than 1, as training's mean loss gives: the backward pass scales.
    return jax.grad(lambda h, w: 2.5 * fn(h, w)["loss_sum"], argnums=(0, 1))(hidden, weight)

  (got_hidden, got_weight), (want_hidden, want_weight) = loss_sum(fused), loss_sum(unfused)
  np.testing.assert_allclose(got_hidden, want_hidden, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_weight, want_weight, rtol=1e-5, atol=1e-6)
  # Padding positions get no gradient.
  assert not np.any(np.asarray(got_hidden)[0, 4:])


def test_a_metric_is_not_differentiated_through_the_fused_loss():
  """Only loss_sum carries a gradient; the metrics' cotangents are dropped (training
  never differentiates them), so a scaled loss scales the gradient exactly."""
  hidden, weight, targets = _inputs(True)

  def objective(h, scale):
    sums = loss.fused_cross_entropy_sums(h, weight, True, targets, 0.1, 3)
    return scale * sums["loss_sum"] + sums["ce_sum"] + sums["correct_sum"]

  one = jax.grad(objective)(hidden, 1.0)
  three = jax.grad(objective)(hidden, 3.0)
  np.testing.assert_allclose(three, 3 * one, rtol=1e-6, atol=1e-7)


def _loss_and_grads(config, batch):
  run = state.setup(config, sharding.create_mesh(config, jax.devices()[:1]))
  params = run.init_state(jax.random.key(0)).params
  fn = functools.partial(
    steps.loss_fn,
    model=run.model,
    label_smoothing=config.label_smoothing,
    loss_chunk_len=config.loss_chunk_len,
  )
  (loss, sums), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(
    params, batch, jax.random.key(1)
  )
  return float(loss), jax.device_get(sums), jax.device_get(grads)


# 5 does not divide the 12 positions (a loop of chunks); 64 holds them all (one chunk,
# the logits kept for the backward pass: the WMT configs' form).
@pytest.mark.parametrize("chunk_len", [5, 64])
@pytest.mark.parametrize("tie_embeddings", [True, False], ids=["tied", "untied"])
def test_the_train_steps_loss_and_gradients_are_unchanged_by_fusing(tie_embeddings, chunk_len):
  """Through the whole model, dropout on (the same masks both ways): every parameter's
  gradient within 1e-5 of the unfused step's, in float32."""
  config = tiny_config()
  config.model.tie_embeddings = tie_embeddings
  batch = synthetic_batch(config, rows=4, length=12)
  want_loss, want_sums, want_grads = _loss_and_grads(config, batch)
  config.loss_chunk_len = chunk_len
  got_loss, got_sums, got_grads = _loss_and_grads(config, batch)
  assert got_loss == pytest.approx(want_loss, rel=1e-5)
  for name in want_sums:
    np.testing.assert_allclose(got_sums[name], want_sums[name], rtol=1e-5, err_msg=name)
  assert_trees_close(got_grads, want_grads, rtol=1e-5)


@pytest.mark.parametrize("chunk_len", [4, 1024], ids=["chunks", "one_chunk"])
def test_fused_on_a_mesh_trains_as_unfused_on_one_device(chunk_len):
  """Data, fsdp and tensor parallel (the vocabulary split over tensor inside the chunk
  loop, or in the one chunk): two steps match the unfused single-device run."""
  config = tiny_config()
  want_losses, want_params, _ = run_steps(config, jax.devices()[:1])
  config.loss_chunk_len = chunk_len
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
  losses, params, _ = run_steps(config, jax.devices())
  np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, want_params
  )


@pytest.mark.parametrize("chunk_len", [5, 64], ids=["chunks", "one_chunk"])
def test_fused_in_bfloat16_trains_as_unfused_to_bf16_rounding(chunk_len):
  """The accelerator precision (bf16 activations, float32 parameters and loss) runs on
  this CPU too, and the fused loss matches the unfused one to bf16's rounding: the two
  round in different places, so about 1% of a gradient's largest entry, where a wrong
  term would be of its size."""
  config = tiny_config()
  config.model.dtype = "bfloat16"
  batch = synthetic_batch(config, rows=4, length=12)
  want_loss, _, want_grads = _loss_and_grads(config, batch)
  config.loss_chunk_len = chunk_len
  got_loss, _, got_grads = _loss_and_grads(config, batch)
  assert got_loss == pytest.approx(want_loss, rel=1e-3)
  for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
    assert got.dtype == want.dtype
    scale = float(np.max(np.abs(np.asarray(want, np.float32))))
    np.testing.assert_allclose(
      np.asarray(got, np.float32), np.asarray(want, np.float32), atol=0.05 * scale
    )
