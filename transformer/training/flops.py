"""Model FLOPs and device peaks, for throughput and MFU (model FLOPs utilization).

FLOPs count the matrix multiplications the model really does (2 per multiply-add),
including the output projection and the attention score and value products over the
full (masked) length; the tied embedding lookup is free. Training is 3x the forward
pass (forward, and backward for activations and for weights).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from transformer.model import ModelConfig

TRAINING_FLOPS_PER_FORWARD = 3


def _ffn_flops_per_token(cfg: ModelConfig) -> int:
  matrices = 3 if cfg.activation == "swiglu" else 2
  return 2 * matrices * cfg.d_model * cfg.d_ff


def forward_flops(cfg: ModelConfig, source_len: int, target_len: int) -> int:
  """Forward FLOPs for one sentence pair of the given (padded) lengths."""
  d, h, k, e = cfg.d_model, cfg.num_heads, cfg.d_k, cfg.d_v
  self_proj = 2 * d * h * (2 * k + e) + 2 * h * e * d  # fused QKV, then W_O
  ffn = _ffn_flops_per_token(cfg)
  total = 0
  if not cfg.decoder_only:
    scores_enc = 2 * source_len * h * (k + e)  # QK^T and AV, per query token
    total += cfg.num_layers * source_len * (self_proj + scores_enc + ffn)
  scores_self = 2 * target_len * h * (k + e)
  per_target = self_proj + scores_self + ffn
  if not cfg.decoder_only:
    cross_q_out = 2 * d * h * k + 2 * h * e * d
    per_target += cross_q_out + 2 * source_len * h * (k + e)
    # Cross-attention K/V are projected once per source token in every decoder layer.
    total += cfg.num_layers * source_len * 2 * d * h * (k + e)
  total += cfg.num_layers * target_len * per_target
  total += target_len * 2 * d * cfg.vocab_size  # pre-softmax projection
  return total


def training_flops(cfg: ModelConfig, batch_size: int, source_len: int, target_len: int) -> int:
  """FLOPs of one training step on a [batch_size, source_len/target_len] batch."""
  return TRAINING_FLOPS_PER_FORWARD * batch_size * forward_flops(cfg, source_len, target_len)


def training_flops_per_target_token(cfg: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per target token when source and target are both `seq_len` long."""
  return training_flops(cfg, 1, seq_len, seq_len) / seq_len


# Dense bf16 peak FLOP/s per device (f32 peaks are lower: MFU in f32 is measured against
# the bf16 peak unless noted, as large-scale codebases report it).
_KNOWN_PEAKS = {
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,
    "tpu v6 lite": 918e12,
    "tpu v6e": 918e12,
    "tpu7x": 2307e12,
    "h200": 989e12,
    "h100": 989e12,
    "a100": 312e12,
    "v100": 125e12,
    "l4": 121e12,
    "a10g": 125e12,
}

_measured_cpu_peak: float | None = None


def measure_matmul_peak(size: int = 2048, repeats: int = 5) -> float:
  """FLOP/s of a large f32 matmul on the default device: the CPU's practical peak."""
  a = jnp.ones((size, size), jnp.float32)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best


def device_peak_flops(device: jax.Device | None = None) -> float:
  """Peak FLOP/s of one device: a known table for accelerators, measured for CPU."""
  global _measured_cpu_peak
  device = device or jax.devices()[0]
  kind = device.device_kind.lower()
  for name, peak in _KNOWN_PEAKS.items():
    if name in kind:
      return peak
  if device.platform == "cpu":
    if _measured_cpu_peak is None:
      _measured_cpu_peak = measure_matmul_peak()
    return _measured_cpu_peak
  return float("nan")


def total_peak_flops() -> float:
  """Peak FLOP/s of all devices of the job: per device times the device count.

  Fake CPU devices (--xla_force_host_platform_device_count) share the same cores, so on
  CPU the one measured peak is the whole machine's.
  """
  device = jax.devices()[0]
  peak = device_peak_flops(device)
  return peak if device.platform == "cpu" else peak * jax.device_count()
