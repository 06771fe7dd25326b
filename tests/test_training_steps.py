"""The label-smoothed loss and the sharded train step on several meshes."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.helpers import fault_injection
from tests.helpers.train_steps import assert_trees_close, run_steps, synthetic_batch, tiny_config
from transformer import config as config_lib
from transformer.inference import sharding
from transformer.model import loss
from transformer.training import optimizer as optimizer_lib
from transformer.training import state, steps


def test_label_smoothed_loss_by_hand():
  logits = np.array([[[2.0, 0.5, -1.0, 0.0], [0.1, 0.2, 0.3, 0.4]]], np.float32)
  targets = np.array([[1, 0]], np.int32)  # the second position is padding
  eps, vocab = 0.1, 4
  log_p = logits[0, 0] - np.log(np.sum(np.exp(logits[0, 0])))
  q = np.full(vocab, eps / (vocab - 1))
  q[1] = 1 - eps
  expected_loss = -np.sum(q * log_p) + np.sum(q * np.log(q))  # KL(q || p)
  sums = loss.cross_entropy_sums(jnp.asarray(logits), jnp.asarray(targets), eps)
  assert float(sums["num_tokens"]) == 1.0
  assert float(sums["loss_sum"]) == pytest.approx(expected_loss, rel=1e-5)
  assert float(sums["ce_sum"]) == pytest.approx(-log_p[1], rel=1e-5)
  assert float(sums["correct_sum"]) == 0.0  # argmax is token 0, target is 1


def test_no_smoothing_is_plain_cross_entropy():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32)
  targets = jnp.asarray([[1, 2, 0], [3, 4, 5]], jnp.int32)
  sums = loss.cross_entropy_sums(logits, targets, 0.0)
  assert float(sums["loss_sum"]) == pytest.approx(float(sums["ce_sum"]))


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_loss_gradient_in_closed_form_is_autodiffs(eps):
  """The written-out gradient of the smoothed loss against autodiff of the textbook form
  (KL to the smoothed one-hot through log_softmax), padding weighted out."""
  rng = np.random.default_rng(1)
  logits = jnp.asarray(3 * rng.normal(size=(2, 5, 11)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 11, (2, 5)), jnp.int32)  # zeros are padding

  def textbook(logits):
    log_p = jax.nn.log_softmax(logits, axis=-1)
    q = jnp.where(jax.nn.one_hot(targets, 11) > 0, 1 - eps, eps / 10)
    kl = jnp.sum(q * (jnp.log(jnp.maximum(q, 1e-30)) - log_p), axis=-1)
    return jnp.sum(kl * (targets != 0))

  ours = lambda logits: loss.cross_entropy_sums(logits, targets, eps)["loss_sum"]
  np.testing.assert_allclose(ours(logits), textbook(logits), rtol=1e-5)
  np.testing.assert_allclose(
    jax.grad(ours)(logits), jax.grad(textbook)(logits), rtol=1e-5, atol=1e-6
  )
  # Accuracy: the target's logit is the largest.
  correct = jnp.sum((jnp.argmax(logits, -1) == targets) * (targets != 0))
  assert float(loss.cross_entropy_sums(logits, targets, eps)["correct_sum"]) == float(correct)


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2), (1, 2, 4)])
def test_meshes_agree_with_one_device(mesh_shape):
  assert jax.device_count() == 8
  config = tiny_config()
  single_losses, single_params, _ = run_steps(config, jax.devices()[:1])
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_shape
  losses, params, train_state = run_steps(config, jax.devices())
  np.testing.assert_allclose(losses, single_losses, rtol=2e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, single_params
  )
  # Parameters really are split over the mesh as the logical rules say.
  embedding = train_state.params["shared_embedding"]["embedding"]
  assert embedding.sharding.is_equivalent_to(
    jax.sharding.NamedSharding(
      embedding.sharding.mesh, jax.sharding.PartitionSpec("tensor", "fsdp")
    ),
    embedding.ndim,
  )
  shard_shape = embedding.addressable_shards[0].data.shape
  assert shard_shape == (64 // mesh_shape[2], 32 // mesh_shape[1])


@pytest.mark.slow  # four sharded steps compiled on 8 devices per case
@pytest.mark.parametrize(
  "mesh_shape, grad_accum_steps, scan_layers",
  # All data parallel with scanned layers: each layer's gradient is also split inside
  # the layer loop (model/transformer.py: _split_layer_grads), microbatch by microbatch.
  [((4, 2, 1), 1, False), ((2, 2, 2), 2, False), ((8, 1, 1), 2, True)],
)
def test_an_optimizer_state_split_over_data_trains_as_a_replicated_one(
  mesh_shape, grad_accum_steps, scan_layers
):
  config = tiny_config()
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_shape
  config.grad_accum_steps = grad_accum_steps
  config.model.scan_layers = scan_layers
  losses, params, _ = run_steps(config, jax.devices())
  config.shard_optimizer_state = True
  split_losses, split_params, train_state = run_steps(config, jax.devices())
  # The same arithmetic, summed in another order (a reduce-scatter, not an all-reduce).
  np.testing.assert_allclose(split_losses, losses, rtol=1e-5)
  assert_trees_close(split_params, params, rtol=1e-5)
  # The parameters keep their shardings; every per-parameter array of the optimizer's
  # state is also split over data: each device holds 1/data of it.
  data = mesh_shape[0]
  embedding = train_state.params["shared_embedding"]["embedding"]
  assert embedding.sharding.is_equivalent_to(
    jax.sharding.NamedSharding(
      embedding.sharding.mesh, jax.sharding.PartitionSpec("tensor", "fsdp")
    ),
    embedding.ndim,
  )
  moments = [
    leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(train_state.opt_state)
    if "shared_embedding" in jax.tree_util.keystr(path)
  ]
  # Adam's mu and nu, and with accumulation the summed gradient.
  assert len(moments) == (2 if grad_accum_steps == 1 else 3)
  for moment in moments:
    assert "data" in jax.tree.leaves(tuple(moment.sharding.spec))
    local = moment.addressable_shards[0].data.size
    assert local * data * mesh_shape[1] * mesh_shape[2] == moment.size


def test_split_over_takes_the_largest_whole_dimension_the_axis_divides():
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2, 1), ("data", "fsdp", "tensor"))
  P = jax.sharding.PartitionSpec

  def split(spec, shape):
    return sharding.split_over(jax.sharding.NamedSharding(mesh, spec), shape, "data").spec

  assert split(P(None, "fsdp"), (6, 512, 64)) == P(None, ("fsdp", "data"), None)  # 256 a device
  assert split(P("fsdp", None), (64, 128)) == P("fsdp", "data")
  assert split(P("fsdp", None), (512, 128)) == P(("fsdp", "data"), None)
  assert split(P("tensor", "fsdp"), (64, 32)) == P(("tensor", "data"), "fsdp")
  assert split(P(None, None), (8, 4)) == P("data", None)
  assert split(P(None, "fsdp"), (6, 2)) == P(None, "fsdp")  # neither divides by 4
  assert split(P(), ()) == P()  # a scalar stays replicated
  assert split(P(None), (6,)) == P(None)  # nothing divides
  assert split(P(("data", "fsdp")), (64,)) == P(("data", "fsdp"))  # already split over data


def unequal_microbatches(batch, count=4):
  """`count` row slices of `batch`, padded to clearly unequal real-token counts."""
  parts = []
  rows = len(batch["target"]) // count
  for i in range(count):
    part = {k: v[i * rows : (i + 1) * rows].copy() for k, v in batch.items()}
    keep = 2 + 3 * i  # real target tokens per row: 2, 5, 8, 11 (of 12)
    part["target"][:, keep:] = 0
    part["target"][:, keep - 1] = config_lib.EOS_ID
    part["decoder_input"][:, keep:] = 0
    parts.append(part)
  return parts


def recording_optimizer():
  """Identity updates; its state keeps the last gradient it was handed."""
  return optax.GradientTransformation(
    lambda params: {"last_grads": jax.tree.map(jnp.zeros_like, params)},
    lambda grads, _, params=None: (jax.tree.map(jnp.zeros_like, grads), {"last_grads": grads}),
  )


def gradient_handed_to_optimizer(config, optimizer, batches, inner_state):
  """Runs train_step over `batches` with `optimizer`; returns what its inner part saw."""
  run = state.setup(config, sharding.create_mesh(config, jax.devices()[:1]))
  params = run.init_state(jax.random.key(0)).params
  train_state = state.TrainState(
    step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
  )
  step = jax.jit(
    functools.partial(steps.train_step, model=run.model, optimizer=optimizer, config=config)
  )
  for batch in batches:
    train_state, _ = step(train_state, batch)
  return jax.device_get(inner_state(train_state.opt_state)["last_grads"])


def test_accumulation_weighs_microbatches_by_tokens_like_one_big_batch():
  config = tiny_config()
  config.model.dropout_rate = 0.0
  microbatches = unequal_microbatches(synthetic_batch(config))
  assert len({int((m["target"] != 0).sum()) for m in microbatches}) == 4
  big_batch = {k: np.concatenate([m[k] for m in microbatches]) for k in microbatches[0]}
  big = gradient_handed_to_optimizer(config, recording_optimizer(), [big_batch], lambda s: s)
  config.grad_accum_steps = 4
  accumulated = gradient_handed_to_optimizer(
    config,
    optimizer_lib.accumulate_by_tokens(recording_optimizer(), 4),
    microbatches,
    lambda s: s.inner_state,
  )
  assert_trees_close(accumulated, big, rtol=1e-6)
  # Averaging the microbatch means (optax.MultiSteps, the old behaviour) is far off here.
  config.grad_accum_steps = 1
  mean_of_means = gradient_handed_to_optimizer(
    config, optax.MultiSteps(recording_optimizer(), 4), microbatches, lambda s: s.inner_opt_state
  )
  with pytest.raises(AssertionError, match="relative error"):
    assert_trees_close(mean_of_means, big, rtol=1e-2)


def test_training_reduces_loss_and_accumulation_matches_big_batch():
  config = tiny_config()
  config.model.dropout_rate = 0.0
  devices = jax.devices()[:1]
  losses, _, _ = run_steps(config, devices, num_steps=6)
  assert losses[-1] < losses[0]
  # Two Adam updates, each from four accumulated microbatches with unequal token counts,
  # land where two updates on the big batches do; warmup counts updates, not microbatches.
  batches = [synthetic_batch(config, seed=s) for s in (0, 1)]
  params_after, lrs = {}, {}
  for accum in (1, 4):
    config.grad_accum_steps = accum
    run = state.setup(config, sharding.create_mesh(config, devices))
    train_state = run.init_state(jax.random.key(0))
    step = steps.jit_train_step(run)
    lrs[accum] = []
    for batch in batches:
      microbatches = unequal_microbatches(batch)
      if accum == 1:
        microbatches = [{k: np.concatenate([m[k] for m in microbatches]) for k in microbatches[0]}]
      for part in microbatches:
        train_state, metrics = step(train_state, sharding.global_batch(part, run.mesh, run.rules))
        lrs[accum].append(float(metrics["lr"]))
    assert int(train_state.step) == 2 * accum
    params_after[accum] = jax.device_get(train_state.params)
  assert lrs[4] == [lr for lr in lrs[1] for _ in range(4)]
  # Elementwise, Adam's first steps are about lr * gradient / |gradient|: an entry near 0
  # magnifies float32 rounding of the summation order, so the strict 1e-6 check is on the
  # gradient (above); here 1e-5 is 1e-3 of a step (lr is about 1e-2).
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
    params_after[4],
    params_after[1],
  )


def test_a_divergence_injected_at_a_step_makes_that_steps_loss_nan(monkeypatch):
  fault_injection.diverge_at_step(monkeypatch, 2)
  losses, params, _ = run_steps(tiny_config(), jax.devices()[:1], num_steps=2)
  assert math.isfinite(losses[0]) and math.isnan(losses[1])
  assert all(np.isnan(x).all() for x in jax.tree.leaves(params))


def test_bfloat16_compute_keeps_float32_parameters_and_adam_state():
  config = tiny_config()
  config.model.dtype = "bfloat16"
  losses, params, state = run_steps(config, jax.devices()[:1])
  assert all(math.isfinite(loss) for loss in losses)
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype("float32")}
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
  assert moments and {x.dtype for x in moments} == {np.dtype("float32")}


def test_dropout_prng_choice_changes_masks_not_determinism():
  """rbg, the WMT configs' choice: the same (seed, step) on the same mesh draws the same
  masks. Under a mesh each device draws its own part (model/primitives.py: keep_mask),
  so another mesh draws other masks."""
  devices = jax.devices()[:1]
  config = tiny_config()
  config.model.dropout_rate = 0.3
  threefry, _, _ = run_steps(config, devices)
  config.dropout_rng_impl = "rbg"
  rbg, _, _ = run_steps(config, devices)
  assert rbg != threefry  # other bits, so other masks
  assert all(math.isfinite(x) for x in rbg)
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
  sharded, _, _ = run_steps(config, jax.devices()[:8])
  assert sharded != rbg  # each device's part from its own key
  assert run_steps(config, jax.devices()[:8])[0] == sharded  # but deterministic
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
  np.testing.assert_allclose(
    kernel, single_params["decoder"]["layers"]["ffn"]["wi"]["kernel"], rtol=1e-4, atol=1e-6
  )
