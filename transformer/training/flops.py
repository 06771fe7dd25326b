"""Model FLOPs and device peaks, for throughput, MFU and HFU.

FLOPs count the matrix multiplications the model does (2 per multiply-add), including
the output projection; the tied embedding lookup is free. Training is 3x the forward
pass (forward, and backward for activations and for weights).

Two counts, for two questions:

  padded (HFU)  what the step computes on its [B, S] / [B, T] arrays: every row at the
                full padded length, attention over all S or T keys for every position,
                padding included. Against the peak this is the hardware FLOPs
                utilisation: how busy the matmul units were (remat's recomputation is
                not added, so with remat on it is a lower bound).
  real (MFU)    what the model needs for the tokens it trained on: each real sentence
                pair (s source, t target tokens) costs `forward_flops(cfg, s, t)`, i.e.
                per-token matmuls for its s + t tokens only, and attention of each real
                query over the s or t real keys of its own sentence (not over a padded
                row, nor over the other sentences packed into it). This is the model
                FLOPs utilisation, comparable across batching schemes.

A pair's forward FLOPs split into per-token and attention parts (A = 2 N H (d_k + d_v),
the QK^T and AV products of one query over one key, over N layers):

  forward(s, t) = P_src * s + P_tgt * t + A * (s^2 + t^2 + s t)

with s^2 the encoder's self-attention, t^2 the decoder's and s t the cross-attention
(a decoder-only model has P_src = 0 and only A * t^2). Causal masking does not halve the
t^2 term: the model computes the whole score matrix, then masks it. So the real FLOPs
of a batch need only five sums over its sentence pairs: sum s, sum t, sum s^2, sum t^2
and sum s t (`count_tokens`, on device).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import socket
import time
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from transformer import storage
from transformer.config import PAD_ID
from transformer.model import ModelConfig

TRAINING_FLOPS_PER_FORWARD = 3


def _ffn_flops_per_token(cfg: ModelConfig) -> int:
  matrices = 3 if cfg.activation == "swiglu" else 2
  return 2 * matrices * cfg.d_model * cfg.d_ff


def _flop_terms(cfg: ModelConfig) -> tuple[int, int, int]:
  """(P_src, P_tgt, A) of the module docstring: forward FLOPs per source token, per
  target token, and per (query, key) pair of any attention."""
  d, h, k, e = cfg.d_model, cfg.num_heads, cfg.d_k, cfg.d_v
  self_proj = 2 * d * h * (2 * k + e) + 2 * h * e * d  # fused QKV, then W_O
  ffn = _ffn_flops_per_token(cfg)
  attention = cfg.num_layers * 2 * h * (k + e)  # QK^T and AV, per query per key
  per_target = cfg.num_layers * (self_proj + ffn) + 2 * d * cfg.vocab_size  # + output proj.
  if cfg.decoder_only:
    return 0, per_target, attention
  # Cross-attention: queries and W_O per target token; K/V projected once per source
  # token in every decoder layer.
  per_target += cfg.num_layers * (2 * d * h * k + 2 * h * e * d)
  per_source = cfg.num_layers * (self_proj + ffn + 2 * d * h * (k + e))
  return per_source, per_target, attention


def forward_flops(cfg: ModelConfig, source_len: int, target_len: int) -> int:
  """Forward FLOPs for one sentence pair of the given lengths (padded or real)."""
  per_source, per_target, attention = _flop_terms(cfg)
  if cfg.decoder_only:
    return per_target * target_len + attention * target_len**2
  return (
    per_source * source_len
    + per_target * target_len
    + attention * (source_len**2 + target_len**2 + source_len * target_len)
  )


def training_flops(cfg: ModelConfig, batch_size: int, source_len: int, target_len: int) -> int:
  """FLOPs of one training step on a [batch_size, source_len/target_len] batch, padding
  included: what the hardware computes (HFU)."""
  return TRAINING_FLOPS_PER_FORWARD * batch_size * forward_flops(cfg, source_len, target_len)


def training_flops_per_target_token(cfg: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per target token when source and target are both `seq_len` long."""
  return training_flops(cfg, 1, seq_len, seq_len) / seq_len


# --- Real tokens: what the model needs (MFU).

TOKEN_COUNT_KEYS = (
  "source_tokens",
  "target_tokens",
  "source_sq",
  "target_sq",
  "source_target",
  "source_slots",
  "target_slots",
)


def _segment_lengths(
  ids_BxL: jax.Array, segment_ids_BxL: jax.Array | None, width: int
) -> jax.Array:
  """Real tokens of each (row, segment id) as [B, width]; column 0 (padding) is zero.

  Without segment ids a row's real tokens are one segment, id 1 (length-bucketed rows).
  """
  real_BxL = ids_BxL != PAD_ID
  segments_BxL = real_BxL.astype(jnp.int32) if segment_ids_BxL is None else segment_ids_BxL
  segments_BxL = jnp.where(real_BxL, segments_BxL, 0)
  rows = jnp.arange(ids_BxL.shape[0])[:, None]
  lengths = jnp.zeros((ids_BxL.shape[0], width), jnp.float32)
  return lengths.at[rows, segments_BxL].add(1.0).at[:, 0].set(0.0)


def count_tokens(batch: Mapping[str, Any]) -> dict[str, jax.Array]:
  """The sums `real_training_flops` needs, over a batch's sentence pairs (jittable).

  Keys: source_tokens and target_tokens (sum s, sum t), source_sq and target_sq
  (sum s^2, sum t^2), source_target (sum s t, pairing a row's source and target
  segments by id, as packing writes them), and source_slots / target_slots (B S, B T:
  the padded shape). float32 scalars: exact to 2^24, past which a rounding of 1e-7 does
  not matter for a utilisation. A decoder-only batch has zeros for the source.

  The decoder side is counted on 'decoder_input' where the batch has it: the decoder
  runs over every token of it, while a decoder-only 'target' (lm_loss=target) zeroes
  the prompt, which has no loss but costs as much as the rest. Without it, on 'target'.
  """
  decoder_BxT = batch.get("decoder_input", batch["target"])
  rows, target_len = decoder_BxT.shape
  source_BxS = batch.get("source")
  source_len = 0 if source_BxS is None else source_BxS.shape[1]
  width = max(source_len, target_len) + 1  # segment ids count from 1 and fit in a row
  target_lengths = _segment_lengths(decoder_BxT, batch.get("target_segment_ids"), width)
  if source_BxS is None:
    source_lengths = jnp.zeros_like(target_lengths)
  else:
    source_lengths = _segment_lengths(source_BxS, batch.get("source_segment_ids"), width)
  return {
    "source_tokens": jnp.sum(source_lengths),
    "target_tokens": jnp.sum(target_lengths),
    "source_sq": jnp.sum(source_lengths**2),
    "target_sq": jnp.sum(target_lengths**2),
    "source_target": jnp.sum(source_lengths * target_lengths),
    "source_slots": jnp.float32(rows * source_len),
    "target_slots": jnp.float32(rows * target_len),
  }


def real_training_flops(cfg: ModelConfig, counts: dict[str, float]) -> float:
  """Training FLOPs the model needs for the real tokens of `counts` (`count_tokens`,
  summed over any number of batches): sum over pairs of 3 x forward_flops(s, t)."""
  per_source, per_target, attention = _flop_terms(cfg)
  c = {k: float(v) for k, v in counts.items()}  # float64: float32 would round the products
  forward = per_target * c["target_tokens"] + attention * c["target_sq"]
  if not cfg.decoder_only:
    forward += per_source * c["source_tokens"] + attention * (c["source_sq"] + c["source_target"])
  return TRAINING_FLOPS_PER_FORWARD * forward


# --- Device peaks.


# One TPU chip's datasheet figures, for the roofline of a program compiled for a slice
# (transformer/tools/compile_check.py) and for MFU on a TPU (_KNOWN_PEAKS below).
@dataclasses.dataclass(frozen=True)
class TpuChip:
  device_kind: str  # JAX's name of the chip (jax.devices()[0].device_kind)
  peak_flops: float  # dense bf16 FLOP/s
  hbm_bytes: float
  hbm_bytes_per_s: float
  ici_bytes_per_s: float  # inter-chip interconnect, one chip's total
  dcn_bytes_per_s: float  # data-centre network, one chip's share of its host's NIC
  source: str
  # Matrix units per chip and the side of each systolic array ("System architecture":
  # TensorCores per chip x MXUs per TensorCore). Each MXU does side^2 multiply-adds, 2
  # FLOPs each, a cycle, so they fix the clock at which the peak is reached.
  mxus: int
  mxu_side: int

  @property
  def clock_hz(self) -> float:
    """The TensorCore clock implied by the peak and the MXUs: the clock at which the
    compiler's `estimated_cycles` turn into seconds (transformer/tools/op_profile.py).
    v4 1.05 GHz, v5e 1.50, v5p 1.75, v6e 1.75."""
    return self.peak_flops / (self.mxus * self.mxu_side**2 * 2)


_GB, _GIB, _GBIT = 1e9, 2**30, 1e9 / 8
# Google Cloud TPU documentation, cloud.google.com/tpu/docs/<version> ("System
# architecture" tables: peak compute per chip, HBM capacity and bandwidth, ICI bandwidth
# per chip); DCN: the Compute Engine machine type's network bandwidth per VM (ct4p,
# ct5lp, ct5p, ct6e) over its chips. Bidirectional ICI totals, as the tables print them.
TPU_CHIPS = {
  "v4": TpuChip(
    "TPU v4",
    275e12,
    32 * _GIB,
    1228 * _GB,
    2400 * _GBIT,
    50 * _GBIT / 4,
    "cloud.google.com/tpu/docs/v4; ct4p-hightpu-4t: 50 Gbps per 4-chip VM; "
    "2 TensorCores x 4 MXUs of 128x128",
    8,
    128,
  ),
  "v5e": TpuChip(
    "TPU v5 lite",
    197e12,
    16 * _GIB,
    819 * _GB,
    1600 * _GBIT,
    100 * _GBIT / 4,
    "cloud.google.com/tpu/docs/v5e; ct5lp-hightpu-4t: 100 Gbps per 4-chip VM; "
    "1 TensorCore x 4 MXUs of 128x128",
    4,
    128,
  ),
  "v5p": TpuChip(
    "TPU v5",
    459e12,
    95 * _GB,
    2765 * _GB,
    4800 * _GBIT,
    200 * _GBIT / 4,
    "cloud.google.com/tpu/docs/v5p; ct5p-hightpu-4t: 200 Gbps per 4-chip VM; "
    "2 TensorCores x 4 MXUs of 128x128",
    8,
    128,
  ),
  "v6e": TpuChip(
    "TPU v6 lite",
    918e12,
    32 * _GB,
    1640 * _GB,
    3584 * _GBIT,
    200 * _GBIT / 8,
    "cloud.google.com/tpu/docs/v6e; ct6e-standard-8t: 200 Gbps per 8-chip VM; "
    "1 TensorCore x 4 MXUs of 256x256 (versions of the page have said 2 MXUs, which would "
    "put the clock at 3.5 GHz and libtpu's own estimate of a large bf16 matmul above peak)",
    4,
    256,
  ),
}

# Dense (no structured sparsity) bf16 tensor-core peak FLOP/s of one JAX device, keyed
# by the exact `jax.devices()[0].device_kind`: on GPU the CUDA device name (what
# nvidia-smi shows), on TPU JAX's name of the chip (v4 and later: one device per chip).
# Datasheets print sparse figures with an asterisk; these are half of those. A kind not
# listed gets no MFU rather than a neighbour's peak: substring matching once judged an
# L40S against the L4 (3x too much MFU) and an H100 PCIe against the SXM part.
# f32 runs are measured against the bf16 peak too, as large-scale codebases report it.
_KNOWN_PEAKS = {
  # NVIDIA H100 datasheet: SXM 1,979 / PCIe 1,513 / NVL 1,671 TFLOPS BF16 sparse.
  "NVIDIA H100 80GB HBM3": 989e12,  # SXM5
  "NVIDIA H100 PCIe": 756e12,
  "NVIDIA H100 NVL": 835e12,
  # NVIDIA H200 datasheet: SXM 1,979 / NVL 1,671 TFLOPS BF16 sparse.
  "NVIDIA H200": 989e12,  # SXM
  "NVIDIA H200 NVL": 835e12,
  # NVIDIA HGX B200: 36 PFLOPS FP16/BF16 sparse for 8 GPUs.
  "NVIDIA B200": 2250e12,
  # NVIDIA A100 datasheet: 312 TFLOPS BF16 dense, SXM and PCIe alike.
  "NVIDIA A100-SXM4-40GB": 312e12,
  "NVIDIA A100-SXM4-80GB": 312e12,
  "NVIDIA A100-PCIE-40GB": 312e12,
  "NVIDIA A100 80GB PCIe": 312e12,
  # NVIDIA L4 / L40 / L40S datasheets: 242 / 362.1 / 733 TFLOPS BF16 sparse.
  "NVIDIA L4": 121e12,
  "NVIDIA L40": 181e12,
  "NVIDIA L40S": 362e12,
  # NVIDIA A10 datasheet: 125 TFLOPS BF16 dense. (AWS's A10G is a different part.)
  "NVIDIA A10": 125e12,
  # TPUs: TPU_CHIPS above, under JAX's names, and the names other libtpu versions use.
  **{chip.device_kind: chip.peak_flops for chip in TPU_CHIPS.values()},
  "TPU v5e": TPU_CHIPS["v5e"].peak_flops,
  "TPU v5p": TPU_CHIPS["v5p"].peak_flops,
  "TPU v6e": TPU_CHIPS["v6e"].peak_flops,
  "TPU7x": 2307e12,  # Ironwood
}

_measured_cpu_peak: float | None = None
_host_count: int | None = None
_noted_unknown: set[str] = set()


def measure_matmul_peak(size: int = 2048, min_repeats: int = 5, min_seconds: float = 1.0) -> float:
  """FLOP/s of a large f32 matmul on the default device: the CPU's practical peak.

  The best of at least `min_repeats` runs spread over at least `min_seconds`: the first
  runs of a process are often slow (its thread pool and the CPU's clock still ramping
  up), and a peak read from them alone was seen 27% low, which put MFU above 100%.
  """
  a = jnp.ones((size, size), jnp.float32)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  best, runs, began = float("inf"), 0, time.perf_counter()
  while runs < min_repeats or time.perf_counter() - began < min_seconds:
    start = time.perf_counter()
    matmul(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
    runs += 1
  return 2 * size**3 / best


def cpu_peak_file() -> str:
  """Where this machine's measured CPU peak is kept: $XDG_CACHE_HOME (or ~/.cache)
  /transformer/cpu_peak.json, one entry per CPU model and core count."""
  cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(cache, "transformer", "cpu_peak.json")


def _machine_key() -> str:
  """'AMD EPYC 7B13 x2': the CPU model and the cores this process may use, and XLA_FLAGS."""
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      model = next(
        (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model
      )
  except OSError:
    pass
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  # XLA's flags change the compiled matmul (the test suite's turn optimisations off).
  xla_flags = os.environ.get("XLA_FLAGS", "")
  return f"{model} x{cores}" + (f" XLA_FLAGS={xla_flags}" if xla_flags else "")


def _kept_cpu_peak() -> float | None:
  try:
    kept = storage.read_json(cpu_peak_file())
    return float(kept[_machine_key()]["flops_per_s"])
  except (OSError, ValueError, KeyError, TypeError):
    return None


def _keep_cpu_peak(peak: float) -> None:
  """Writes the machine's peak to cpu_peak_file(); a machine that cannot write it
  measures again in its next process, as before."""
  path = cpu_peak_file()
  try:
    kept = storage.read_json(path) if os.path.exists(path) else {}
  except (OSError, ValueError):
    kept = {}
  kept[_machine_key()] = {"flops_per_s": peak, "measured": time.strftime("%Y-%m-%d")}
  try:
    storage.makedirs(os.path.dirname(path))
    storage.write_json(path, kept)
  except OSError as e:
    logging.warning("CPU peak not kept in %s: %s", path, storage.error_text(e))


def device_peak_flops(
  device: jax.Device | None = None, remeasure: bool = False, configured: float = 0.0
) -> float | None:
  """Peak FLOP/s of one device: `configured` when positive (config.peak_flops_per_device),
  else the table's entry for exactly this device kind, else on CPU the machine's measured
  peak; None (no MFU, and a one-time note saying why) for a kind not listed.

  The CPU's is measured once per machine and kept (`cpu_peak_file`): a peak measured at
  each start-up moves with whatever else the machine is running, and MFU with it (one
  run read 229, another 458 GFLOP/s, and an MFU of 122%). remeasure=True measures again
  and keeps the higher reading, for a run that computed faster than it. A table entry is
  a datasheet figure and stays as it is.
  """
  global _measured_cpu_peak
  if configured > 0:
    return configured
  device = device or jax.devices()[0]
  if device.device_kind in _KNOWN_PEAKS:
    return _KNOWN_PEAKS[device.device_kind]
  if device.platform == "cpu":
    if _measured_cpu_peak is None and not remeasure:
      _measured_cpu_peak = _kept_cpu_peak()
    if _measured_cpu_peak is None or remeasure:
      measured = measure_matmul_peak()
      if measured > (_measured_cpu_peak or 0.0):
        _measured_cpu_peak = measured
        _keep_cpu_peak(measured)
    return _measured_cpu_peak
  if device.device_kind not in _noted_unknown:
    _noted_unknown.add(device.device_kind)
    logging.warning(
      "MFU not reported: no peak FLOP/s is known for device kind %r. Set "
      "--config.peak_flops_per_device to its dense bf16 peak (from the vendor's "
      "datasheet), or add it under that exact name to _KNOWN_PEAKS in "
      "transformer/training/flops.py.",
      device.device_kind,
    )
  return None


def peak_source(configured: float = 0.0, device: jax.Device | None = None) -> str:
  """Which peak device_peak_flops uses, in words, for records and the start-up log."""
  device = device or jax.devices()[0]
  if configured > 0:
    return "config.peak_flops_per_device"
  if device.device_kind in _KNOWN_PEAKS:
    return "datasheet"
  if device.platform == "cpu":
    return f"f32 matmul measured on this machine, kept in {cpu_peak_file()}"
  return "device kind not in the bf16 table"


def host_count() -> int:
  """How many machines the job's processes run on: distinct host names, gathered from
  every process the first time (a collective: every process calls it then), then kept."""
  global _host_count
  if _host_count is None:
    if jax.process_count() == 1:
      _host_count = 1
    else:
      name = zlib.crc32(socket.gethostname().encode())
      names = multihost_utils.process_allgather(np.array(name, np.int64))
      _host_count = len(set(np.asarray(names).ravel().tolist()))
  return _host_count


def total_peak_flops(remeasure: bool = False, configured: float = 0.0) -> float | None:
  """Peak FLOP/s of all devices of the job (per device times the device count), or None;
  `configured`: one device's, as device_peak_flops takes it.

  On CPU a measured peak is one machine's: fake CPU devices
  (--xla_force_host_platform_device_count), and processes started on one machine, share
  its cores; processes on separate machines have their own, so the peak is that times
  the number of machines (`host_count`), as the FLOPs counted are the whole job's.
  """
  device = jax.devices()[0]
  peak = device_peak_flops(device, remeasure, configured)
  if peak is None:
    return None
  if device.platform == "cpu" and configured <= 0:
    return peak * host_count()
  return peak * jax.device_count()  # a configured peak is one device's, as its help says


def utilisation(step_flops: float, seconds: float, peak: float | None) -> float | None:
  """FLOPs done in `seconds` as a fraction of the peak; None when the peak is unknown.

  Above 1.0 the peak was read low (a CPU's measured at a slow moment): reports print
  that as such (`utilisation_text`), never as an MFU above 100%."""
  return None if peak is None else step_flops / seconds / peak


def utilisation_text(name: str, value: float | None) -> str:
  """'MFU 38.0%', 'MFU n/a' (no peak known), or for a value above 100% 'MFU n/a (above
  the peak: set config.peak_flops_per_device)'."""
  if value is None:
    return f"{name} n/a"
  if value > 1.0:
    return f"{name} n/a (above the peak: set config.peak_flops_per_device)"
  return f"{name} {100 * value:.1f}%"
