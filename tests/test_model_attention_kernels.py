"""transformer/model/attention_kernels.py: every kernel computes the einsum path's
attention, forward and gradient, with padding, packed segments and the causal mask.

The tests over every kernel take each one the registry says can run here: on this
platform, or on a CPU inside its `cpu_interpreter` (tpu_flash, Pallas FlashAttention,
runs in Pallas's TPU interpret mode, which executes the kernel's own program on the CPU,
tile by tile). A new entry in KERNELS is tested by them as it is. Padding queries have
no defined output (no loss reads one), so outputs and losses are compared at real
positions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.model_helpers import (
  D_K,
  packed_batch,
  random_params,
  random_tokens,
  run,
  tiny_config,
)
from transformer import config as config_lib
from transformer.inference import sharding
from transformer.model import Transformer, attention_kernels, incremental
from transformer.model.attention_kernels import (
  DEFAULT,
  KERNELS,
  AttentionMask,
  Kernel,
  einsum_attention,
  kernel_for,
  softmax_attention,
)
from transformer.model.primitives import current_platform


def test_every_kernel_a_config_may_name_is_implemented():
  assert set(KERNELS) == set(config_lib.ATTENTION_KERNELS)
  assert all(name == kernel.name for name, kernel in KERNELS.items())
  assert KERNELS[config_lib.model_config().attention_kernel] is DEFAULT


def test_a_kernel_lends_the_default_kernels_forms_it_lacks():
  """Where a record has no weights' or decoding form, the default kernel's stands in,
  whichever kernel DEFAULT is."""
  for kernel in KERNELS.values():
    assert kernel.decode_or_default() is (kernel.decode or DEFAULT.decode)
    assert kernel.attend_with_weights_or_default() is (
      kernel.attend_with_weights or DEFAULT.attend_with_weights
    )
  assert DEFAULT.decode is not None and DEFAULT.attend_with_weights is not None


def _where_it_runs(kernel: Kernel) -> contextlib.AbstractContextManager:
  """The context the kernel runs in here (its CPU interpreter on a CPU that is not one of
  its platforms), or skip: the registry says it cannot run on this machine."""
  platform = current_platform()
  if platform in kernel.platforms:
    return contextlib.nullcontext()
  if platform == "cpu" and kernel.cpu_interpreter is not None:
    return kernel.cpu_interpreter()
  pytest.skip(f"{kernel.name} runs on {', '.join(kernel.platforms)}, not {platform}")


def _in_float32(kernel: Kernel) -> Kernel:
  if kernel.dtypes is not None and "float32" not in kernel.dtypes:
    pytest.skip(f"{kernel.name} computes in {', '.join(kernel.dtypes)} only")
  return kernel


# Every kernel but the default, the reference the others are held to.
OTHER_KERNELS = [name for name in KERNELS if name != DEFAULT.name]


def _segments(length: int, rng) -> np.ndarray:
  """int32 [2, length]: row 0 packs two segments and ends in two padding slots, row 1
  is one segment padded from a random point on."""
  ids = np.ones((2, length), np.int32)
  ids[0, length // 2 :] = 2
  ids[0, -2:] = 0
  ids[1, rng.integers(length // 2, length) :] = 0
  return ids


def _attention_case(length, source_len, causal, heads, d_k, dtype):
  """(q, k, v, query segment ids, mask, loss) for [2, length] queries against [2,
  source_len] keys of packed and padded rows. loss(kernel, q, k, v) weighs the kernel's
  output at the real query positions by fixed random weights, in float32."""
  rng = np.random.default_rng(length + causal)
  q, k, v = (
    jnp.asarray(rng.normal(size=(2, n, heads, d_k)), dtype)
    for n in (length, source_len, source_len)
  )
  q_ids = _segments(length, rng)
  kv_ids = q_ids if causal else _segments(source_len, rng)
  mask = AttentionMask(jnp.asarray(q_ids), jnp.asarray(kv_ids), causal=causal)
  real_BxLx1x1 = jnp.asarray(q_ids != 0)[:, :, None, None]
  weights = jnp.asarray(rng.normal(size=(2, length, heads, d_k)), jnp.float32)

  def loss(kernel, q, k, v):
    out = kernel(q, k, v, mask).astype(jnp.float32)
    return jnp.sum(jnp.where(real_BxLx1x1, out, 0.0) * weights)

  return q, k, v, q_ids, mask, loss


def _weights_written_out(q, k, v, mask):
  """einsum_attention forming the weights, as attention maps and dropout need them."""
  return einsum_attention(q, k, v, mask, on_weights=lambda weights: weights.astype(v.dtype))


@pytest.mark.parametrize(
  "length, source_len, causal", [(6, 7, False), (6, 6, True)], ids=["cross", "causal"]
)
def test_einsum_kernel_matches_the_written_out_weights_forward_and_gradient(
  length, source_len, causal
):
  """The einsum kernel (the softmax's denominator from a ones column of V, the weights
  recomputed in the backward pass from the max and sum) against jax.nn.softmax's
  weights, at every position: padding queries too, whose weights are uniform and whose
  gradient must not reach Q or K through the masked scores."""
  q, k, v, _, mask, _ = _attention_case(length, source_len, causal, 2, 8, jnp.float32)
  weights = jnp.asarray(np.random.default_rng(1).normal(size=(2, length, 2, 8)), jnp.float32)

  def loss(kernel, q, k, v):
    return jnp.sum(kernel(q, k, v, mask) * weights)

  assert DEFAULT.attend is softmax_attention
  np.testing.assert_allclose(
    jax.jit(softmax_attention)(q, k, v, mask), _weights_written_out(q, k, v, mask), atol=1e-5
  )
  got = jax.jit(jax.grad(functools.partial(loss, softmax_attention), (0, 1, 2)))(q, k, v)
  want = jax.grad(functools.partial(loss, _weights_written_out), (0, 1, 2))(q, k, v)
  for name, got_grad, want_grad in zip("qkv", got, want):
    np.testing.assert_allclose(got_grad, want_grad, atol=1e-5, err_msg=f"d loss / d {name}")
  # The mask matters: without the segment ids, attention crosses the packed pairs.
  unpacked = AttentionMask(jnp.ones_like(mask.q_segment_ids_BxL), mask.kv_segment_ids_BxS, causal)
  assert not np.allclose(softmax_attention(q, k, v, unpacked), softmax_attention(q, k, v, mask))


@pytest.mark.parametrize("decoder_only", [False, True], ids=["encoder_decoder", "decoder_only"])
def test_einsum_model_with_the_ones_column_matches_the_weights_written_out(decoder_only):
  """The whole model, training's way (V projected with its ones column), against the
  same model asked for its attention maps, which forms the weights: logits and every
  parameter's gradient, over packed pairs with padding."""
  cfg = tiny_config(decoder_only=decoder_only, num_layers=1)
  params = random_params(cfg)
  batch = packed_batch(decoder_only)

  def loss(mutable, params):
    logits = run(cfg, params, **batch, mutable=mutable)
    logits = logits[0] if mutable else logits
    return jnp.sum(logits**2), logits

  (_, logits), grads = jax.value_and_grad(functools.partial(loss, False), has_aux=True)(params)
  (_, want_logits), want_grads = jax.value_and_grad(
    functools.partial(loss, ["intermediates"]), has_aux=True
  )(params)
  # 1e-5 relative as well as absolute: the gradients of sum(logits**2) reach tens, where
  # f32 sums taken in another order differ by more than 1e-5 absolute on some machines.
  np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(grads, want_grads, rtol=1e-5, atol=1e-5)


def _forms(kernel: Kernel):
  """Each of the kernel's forms as attend(q, k, v, mask): V's ones column appended for
  attend_with_ones, the weights cast to V's dtype for attend_with_weights."""
  forms = {"attend": kernel.attend}
  if kernel.attend_with_ones is not None:
    ones = lambda v: jnp.ones(v.shape[:-1] + (1,), v.dtype)
    forms["attend_with_ones"] = lambda q, k, v, mask: kernel.attend_with_ones(
      q, k, jnp.concatenate([v, ones(v)], axis=-1), mask
    )
  if kernel.attend_with_weights is not None:
    forms["attend_with_weights"] = lambda q, k, v, mask: kernel.attend_with_weights(
      q, k, v, mask, lambda weights: weights.astype(v.dtype)
    )
  return forms


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize(
  "length, source_len, causal",
  [(6, 7, False), (6, 6, True), (136, 136, True)],
  ids=["cross-short", "causal-short", "causal-two-tiles"],
)
def test_every_kernel_matches_einsum_forward_and_gradient(name, length, source_len, causal):
  """Every form of every kernel against the weights written out, at the real positions,
  to 1e-5 in float32. Lengths that are not a multiple of 8 or of a tiled kernel's tiles
  (padded inside), and one that spans two 128-row tiles of queries and of keys."""
  kernel = _in_float32(KERNELS[name])
  q, k, v, q_ids, mask, loss = _attention_case(length, source_len, causal, 2, 16, jnp.float32)
  real = q_ids != 0
  want = np.asarray(_weights_written_out(q, k, v, mask))[real]
  want_grads = jax.grad(functools.partial(loss, _weights_written_out), (0, 1, 2))(q, k, v)
  for form, attend in _forms(kernel).items():
    with _where_it_runs(kernel):
      got = jax.jit(attend)(q, k, v, mask)
      got_grads = jax.jit(jax.grad(functools.partial(loss, attend), (0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(np.asarray(got)[real], want, atol=1e-5, err_msg=form)
    for grad_of, got_grad, want_grad in zip("qkv", got_grads, want_grads):
      np.testing.assert_allclose(got_grad, want_grad, atol=1e-5, err_msg=f"{form} d/d{grad_of}")
  # The mask matters: without the segment ids, attention crosses the packed pairs.
  unpacked = AttentionMask(jnp.ones_like(mask.q_segment_ids_BxL), mask.kv_segment_ids_BxS, causal)
  assert not np.allclose(np.asarray(_weights_written_out(q, k, v, unpacked))[real], want)


def _real_loss(cfg, batch, params):
  """Sum of squared logits at the real target positions."""
  logits_BxTxV = run(cfg, params, **batch)
  real_BxTx1 = (batch["target_segment_ids"] != 0)[:, :, None]
  return jnp.sum(jnp.where(real_BxTx1, logits_BxTxV, 0.0) ** 2)


@pytest.mark.parametrize("name", OTHER_KERNELS)
@pytest.mark.parametrize("decoder_only", [False, True], ids=["encoder_decoder", "decoder_only"])
def test_every_kernel_runs_the_model_as_einsum(name, decoder_only):
  """The whole model: encoder self-attention, causal decoder self-attention and
  cross-attention over packed pairs with padding, logits and every parameter's gradient;
  and asking for attention maps, which a kernel without the weights' form lends from
  the default kernel."""
  einsum = tiny_config(decoder_only=decoder_only, d_v=D_K, num_layers=1)
  other = dataclasses.replace(einsum, attention_kernel=_in_float32(KERNELS[name]).name)
  params = random_params(einsum)
  batch = packed_batch(decoder_only)
  real = np.asarray(batch["target_segment_ids"] != 0)
  with _where_it_runs(KERNELS[name]):
    logits = jax.jit(lambda p: run(other, p, **batch))(params)
    grads = jax.jit(jax.grad(functools.partial(_real_loss, other, batch)))(params)
    _, maps = run(other, params, **batch, mutable=["intermediates"])
  np.testing.assert_allclose(
    np.asarray(logits)[real], np.asarray(run(einsum, params, **batch))[real], atol=1e-5
  )
  chex.assert_trees_all_close(
    grads, jax.grad(functools.partial(_real_loss, einsum, batch))(params), atol=1e-5
  )
  assert "attention_weights" in maps["intermediates"]["decoder"]["layer_0"]["self_attention"]


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("decoder_only", [False, True], ids=["encoder_decoder", "decoder_only"])
def test_every_kernel_decodes_as_the_forward_pass(name, decoder_only):
  """Prefill and two calls feeding tokens (one, then two per row) give the forward
  pass's logits at those positions: with the kernel's own `decode`, or the default
  kernel's where its record has none."""
  kernel = _in_float32(KERNELS[name])
  cfg = tiny_config(decoder_only=decoder_only, d_v=D_K, num_layers=1, attention_kernel=name)
  params = random_params(cfg)
  prompt_BxP = random_tokens(5, (2, 3)).at[:, 0].set(config_lib.BOS_ID)
  fed_BxL = random_tokens(6, (2, 3))
  source_BxS = None if decoder_only else random_tokens(7, (2, 5))
  model, prepared = incremental.of(Transformer(cfg)).prepare(params)
  with _where_it_runs(kernel):
    prefilled = model.prefill(prepared, prompt_BxP, cache_len=8, source_BxS=source_BxS)
    first_Bx1xV, state = model.feed(prepared, prefilled.state, fed_BxL[:, :1])
    rest_Bx2xV, _ = model.feed(prepared, state, fed_BxL[:, 1:])
    want_BxTxV = run(cfg, params, source_BxS, jnp.concatenate([prompt_BxP, fed_BxL], axis=1))
  np.testing.assert_allclose(prefilled.logits_BxV, want_BxTxV[:, 2], atol=1e-5)
  np.testing.assert_allclose(first_Bx1xV[:, 0], want_BxTxV[:, 3], atol=1e-5)
  np.testing.assert_allclose(rest_Bx2xV, want_BxTxV[:, 4:], atol=1e-5)


@pytest.mark.parametrize(
  "name, overrides, problem",
  [
    ("xla", {"d_v": D_K + 2}, "xla needs d_k == d_v, got 4 and 6; use einsum"),
    (
      "tpu_flash",
      {"d_v": D_K, "attention_dropout_rate": 0.1},
      "tpu_flash has no attention dropout",
    ),
    ("cudnn", {"d_v": D_K}, "cudnn computes in bfloat16 only, not float32"),
    ("splash", {}, "'splash' is not one of einsum, xla, cudnn, tpu_flash"),
  ],
  ids=["d_k_not_d_v", "attention_dropout", "dtype", "unknown"],
)
def test_a_kernel_that_cannot_serve_the_model_is_refused_naming_the_key(name, overrides, problem):
  cfg = tiny_config(attention_kernel=name, **overrides)
  with pytest.raises(config_lib.ConfigError, match="config.model.attention_kernel: ") as error:
    kernel_for(cfg)
  assert problem in str(error.value)
  # The model is refused as it is built, before anything runs.
  with pytest.raises(config_lib.ConfigError, match="attention_kernel"):
    random_params(cfg)
  assert kernel_for(tiny_config(**overrides)) is DEFAULT  # einsum serves every model


@pytest.mark.parametrize("d_k", [64, 128, 256])
@pytest.mark.parametrize("attention_dropout_rate", [0.0, 0.1])
def test_auto_picks_only_a_kernel_that_can_serve_the_model(d_k, attention_dropout_rate):
  """resolve_auto (config/policy.py, below the model) names cudnn by its measured speed; the
  kernel it picks must be one whose record accepts the model."""
  model = config_lib.model_config()
  model.update(dtype="auto", attention_kernel="auto", d_k=d_k, d_v=d_k)
  model.attention_dropout_rate = attention_dropout_rate
  for platform in config_lib.PLATFORMS:
    resolved = config_lib.resolve_auto(model, platform)
    cfg = tiny_config(d_k=d_k, d_v=d_k, attention_dropout_rate=attention_dropout_rate, **resolved)
    assert platform in kernel_for(cfg).platforms


def test_tpu_flash_runs_per_device_on_a_mesh(monkeypatch):
  """Under the activation sharding of a data x tensor mesh, the kernel runs in shard_map
  on each device's rows and heads (a custom call XLA would otherwise gather whole),
  lengths whole, and computes what the einsum path computes on one device."""
  seen_shapes = []
  one_device = attention_kernels.tpu_flash_on_one_device

  def recording(q, k, v, q_ids, kv_ids, causal):
    seen_shapes.append((q.shape, q_ids.shape))
    return one_device(q, k, v, q_ids, kv_ids, causal)

  monkeypatch.setattr(attention_kernels, "tpu_flash_on_one_device", recording)
  einsum = tiny_config(d_v=D_K, num_layers=1)
  flash = tiny_config(d_v=D_K, num_layers=1, attention_kernel="tpu_flash")
  params = random_params(einsum)
  batch = packed_batch(decoder_only=False)
  mesh = jax.sharding.Mesh(np.reshape(jax.devices()[:4], (2, 1, 2)), config_lib.MESH_AXES)
  on_mesh = jax.device_put((params, batch), jax.sharding.NamedSharding(mesh, jax.P()))
  with (
    sharding.activation_sharding(mesh, config_lib.logical_axis_rules()),
    _where_it_runs(KERNELS["tpu_flash"]),
  ):
    logits = jax.jit(lambda p, b: run(flash, p, **b))(*on_mesh)
  # [B, L, H, K] = [2, 6 or 7, 2, 4]: a row and a head per device, lengths whole.
  assert sorted(seen_shapes) == [((1, 6, 1, 4), (1, 6))] * 2 + [((1, 7, 1, 4), (1, 7))]
  real = np.asarray(batch["target_segment_ids"] != 0)
  np.testing.assert_allclose(
    np.asarray(logits)[real], np.asarray(run(einsum, params, **batch))[real], atol=1e-5
  )


def _nvidia_gpu():
  """The first NVIDIA GPU, or skip: cuDNN's kernel runs on nothing else. bench/gpu.sh
  runs these tests on one (`JAX_PLATFORMS=cuda,cpu`)."""
  gpus = [d for d in jax.devices() if "nvidia" in d.device_kind.lower()]
  if not gpus:
    pytest.skip("cuDNN's flash attention needs an NVIDIA GPU (bench/gpu.sh runs this)")
  return gpus[0]


def _close_in_bf16(got, want, what: str) -> None:
  """Equal to bf16 rounding: within 2% of the largest magnitude (bf16 keeps 8 bits,
  0.4%; the two kernels round the weights and sum in different orders)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  scale = float(np.abs(want).max())
  assert float(np.abs(got - want).max()) <= 2e-2 * scale, what


@pytest.mark.parametrize(
  "length, source_len, causal",
  [(64, 96, False), (128, 128, True)],
  ids=["cross", "causal"],
)
def test_cudnn_kernel_matches_einsum_on_an_nvidia_gpu(length, source_len, causal):
  """bf16 (cuDNN takes 16-bit inputs only), padding and packed segments, forward and
  gradient. Every output is finite, padding rows too: they flow on through the layers,
  and a NaN there would reach the weights' gradients (x^T g with g = 0 is NaN)."""
  gpu = _nvidia_gpu()
  with jax.default_device(gpu):
    q, k, v, q_ids, mask, loss = _attention_case(length, source_len, causal, 4, 64, jnp.bfloat16)
    cudnn = KERNELS["cudnn"].attend
    got = jax.jit(cudnn)(q, k, v, mask)
    want = jax.jit(einsum_attention)(q, k, v, mask)
    got_grads = jax.jit(jax.grad(functools.partial(loss, cudnn), (0, 1, 2)))(q, k, v)
    want_grads = jax.jit(jax.grad(functools.partial(loss, einsum_attention), (0, 1, 2)))(q, k, v)
  assert got.dtype == jnp.bfloat16
  assert np.isfinite(np.asarray(got, np.float32)).all()
  real = q_ids != 0
  _close_in_bf16(np.asarray(got, np.float32)[real], np.asarray(want, np.float32)[real], "out")
  for name, g, w in zip("qkv", got_grads, want_grads):
    assert np.isfinite(np.asarray(g, np.float32)).all(), f"d loss / d {name}"
    _close_in_bf16(g, w, f"d loss / d {name}")


def test_cudnn_model_matches_einsum_on_an_nvidia_gpu():
  """The whole model in bf16 on packed pairs with padding: logits at real positions and
  every parameter's gradient, all finite."""
  gpu = _nvidia_gpu()
  einsum = tiny_config(d_k=16, d_v=16, num_layers=1, dtype=jnp.bfloat16)
  cudnn = dataclasses.replace(einsum, attention_kernel="cudnn")
  with jax.default_device(gpu):
    params = random_params(einsum)
    # cuDNN's backward pass with a mask needs even lengths: pad the helper's 7 and 6 to 8.
    batch = {
      key: jnp.pad(value, ((0, 0), (0, 8 - value.shape[1])))
      for key, value in packed_batch(decoder_only=False).items()
    }
    got = jax.jit(lambda p: run(cudnn, p, **batch))(params)
    want = jax.jit(lambda p: run(einsum, p, **batch))(params)
    got_grads = jax.jit(jax.grad(functools.partial(_real_loss, cudnn, batch)))(params)
    want_grads = jax.jit(jax.grad(functools.partial(_real_loss, einsum, batch)))(params)
  real = np.asarray(batch["target_segment_ids"] != 0)
  _close_in_bf16(np.asarray(got)[real], np.asarray(want)[real], "logits")
  for path, g in jax.tree_util.tree_leaves_with_path(got_grads):
    w = want_grads
    for key in path:
      w = w[key.key]
    assert np.isfinite(np.asarray(g)).all(), jax.tree_util.keystr(path)
    _close_in_bf16(g, w, jax.tree_util.keystr(path))
