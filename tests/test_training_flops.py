"""Model FLOPs against hand counts and the traced program, and device peaks."""

import math
import types

import jax
import jax.numpy as jnp
import pytest

from transformer import config as config_lib
from transformer.model import ModelConfig, Transformer
from transformer.training import describe, flops

# Sizes all different, so a swapped pair in a formula changes the count.
V, D, F, H, K, E, N = 40, 12, 20, 3, 4, 5, 2
S, T = 7, 9  # source and target lengths


def tiny(**overrides) -> ModelConfig:
  fields = dict(vocab_size=V, max_position=16, num_layers=N, d_model=D, d_ff=F, num_heads=H,
                d_k=K, d_v=E)
  return ModelConfig(**{**fields, **overrides})


def matmul(m, n, k):
  """FLOPs of an [m, k] @ [k, n] product: one multiply and one add per term."""
  return 2 * m * n * k


def hand_count(decoder_only=False, ffn_matrices=2):
  """The forward pass of one sentence pair, matmul by matmul, as the paper describes it."""
  def self_attention(length):
    return (matmul(length, H * K, D) * 2 + matmul(length, H * E, D)  # W_Q, W_K, W_V
            + H * matmul(length, length, K)  # Q K^T per head
            + H * matmul(length, E, length)  # softmax(.) V per head
            + matmul(length, D, H * E))  # W_O

  def ffn(length):
    return ffn_matrices * matmul(length, F, D)  # W_1 (and the SwiGLU gate), W_2 alike

  cross_attention = (matmul(T, H * K, D)  # queries from the decoder
                     + matmul(S, H * K, D) + matmul(S, H * E, D)  # keys, values: encoder output
                     + H * matmul(T, S, K) + H * matmul(T, E, S) + matmul(T, D, H * E))
  encoder_layer = self_attention(S) + ffn(S)
  decoder_layer = self_attention(T) + ffn(T) + (0 if decoder_only else cross_attention)
  output_projection = matmul(T, V, D)
  return (0 if decoder_only else N * encoder_layer) + N * decoder_layer + output_projection


def traced_matmul_flops(cfg: ModelConfig) -> int:
  """2 x multiply-adds of every dot_general in the model's forward program (batch 1)."""
  model = Transformer(cfg)
  source = None if cfg.decoder_only else jnp.ones((1, S), jnp.int32)
  decoder_input = jnp.ones((1, T), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), source, decoder_input))
  jaxpr = jax.make_jaxpr(lambda p: model.apply(p, source, decoder_input))(params).jaxpr
  return _count_dots(jaxpr)


def _count_dots(jaxpr) -> int:
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (lhs_contract, _), _ = eqn.params["dimension_numbers"]
      lhs_shape = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(
          lhs_shape[i] for i in lhs_contract)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          total += _count_dots(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          total += _count_dots(sub)
  return total


def test_forward_flops_equal_the_hand_count():
  assert flops.forward_flops(tiny(), S, T) == hand_count()


@pytest.mark.parametrize("overrides", [
    {}, {"decoder_only": True}, {"activation": "swiglu"}, {"tie_embeddings": False},
    {"positional": "rope", "norm": "pre"}, {"num_layers": 1, "d_k": 6, "d_v": 2}],
    ids=["paper", "decoder_only", "swiglu", "untied", "rope-pre", "one-layer"])
def test_forward_flops_equal_the_matmuls_of_the_traced_model(overrides):
  """Every dot_general XLA is given, counted from the program itself."""
  cfg = tiny(**overrides)
  assert flops.forward_flops(cfg, S, T) == traced_matmul_flops(cfg)


def test_decoder_only_drops_the_encoder_and_cross_attention():
  full, decoder_only = tiny(), tiny(decoder_only=True)
  assert flops.forward_flops(decoder_only, S, T) == hand_count(decoder_only=True)
  # What goes: N encoder layers over S tokens, and N cross-attentions.
  encoder = N * (4 * S * D * H * K + 2 * S * D * H * E + 2 * S * S * H * (K + E)
                 + 2 * S * H * E * D + 4 * S * D * F)
  cross = N * (2 * T * D * H * K + 2 * S * D * H * (K + E) + 2 * T * S * H * (K + E)
               + 2 * T * H * E * D)
  assert flops.forward_flops(full, S, T) - flops.forward_flops(decoder_only, S, T) == (
      encoder + cross)
  # The source length no longer matters.
  assert flops.forward_flops(decoder_only, 1, T) == flops.forward_flops(decoder_only, 50, T)


def test_swiglu_has_three_ffn_matrices():
  relu, swiglu = tiny(), tiny(activation="swiglu")
  assert flops.forward_flops(swiglu, S, T) == hand_count(ffn_matrices=3)
  # One more D x F matrix per FFN: in N encoder layers over S and N decoder layers over T.
  assert flops.forward_flops(swiglu, S, T) - flops.forward_flops(relu, S, T) == (
      N * (S + T) * 2 * D * F)
  assert flops.forward_flops(tiny(activation="gelu"), S, T) == flops.forward_flops(relu, S, T)


def test_training_is_three_forward_passes_per_sentence_pair():
  cfg = tiny()
  forward = flops.forward_flops(cfg, S, T)
  assert flops.training_flops(cfg, 1, S, T) == 3 * forward
  assert flops.training_flops(cfg, 5, S, T) == 3 * 5 * forward
  per_token = flops.training_flops_per_target_token(cfg, T)
  assert per_token == pytest.approx(3 * flops.forward_flops(cfg, T, T) / T)


def test_flops_match_the_papers_estimate():
  """6 x (non-embedding params + output projection) + 12 L d (S + 2T) per token pair."""
  config = config_lib.load_config("configs/wmt14.py:base")
  cfg = ModelConfig.from_config(config)
  seq = 256
  embedding = config.vocab_size * cfg.d_model
  non_embedding = describe.count_params(config) - embedding
  estimate = 6 * (non_embedding + embedding) + 12 * cfg.num_layers * cfg.d_model * 3 * seq
  exact = flops.training_flops_per_target_token(cfg, seq)
  assert abs(exact / estimate - 1) < 0.01


def test_device_peak_on_cpu_is_measured_once_and_positive():
  """The number is a measurement, so only its sign and its caching are pinned."""
  device = jax.devices()[0]
  assert device.platform == "cpu"
  peak = flops.device_peak_flops(device)
  assert math.isfinite(peak) and peak > 0
  assert flops.device_peak_flops() == peak  # measured once, then remembered
  # Fake CPU devices share the cores: the whole job's peak is the one measured peak.
  assert jax.device_count() == 8
  assert flops.total_peak_flops() == peak


def test_measure_matmul_peak_is_positive():
  assert flops.measure_matmul_peak(size=64, repeats=2) > 0


@pytest.mark.parametrize("kind,peak", [
    ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5p", 459e12), ("TPU v6e", 918e12),
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA A100-SXM4-40GB", 312e12)])
def test_accelerator_peaks_come_from_the_table(kind, peak):
  device = types.SimpleNamespace(device_kind=kind, platform="gpu")
  assert flops.device_peak_flops(device) == peak


def test_unknown_accelerator_has_no_peak():
  device = types.SimpleNamespace(device_kind="Mystery Accelerator 9000", platform="gpu")
  assert math.isnan(flops.device_peak_flops(device))
