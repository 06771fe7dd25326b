"""bench's peak: the device's peak FLOP/s, against which the other measurements' MFU is.

Measured with a large f32 matmul on CPU (in this run, so MFU is against what this machine
does now); a table of known bf16 peaks on GPU/TPU (a device kind not in it: no MFU). The
record also says whether freed host memory stays in the process.
"""

from __future__ import annotations

from typing import Any

import jax

from transformer import host_memory
from transformer.training import flops


def measure(config) -> dict[str, Any]:
  device = jax.devices()[0]
  peak = flops.total_peak_flops(configured=config.peak_flops_per_device)
  source = flops.peak_source(config.peak_flops_per_device, device)
  return {
    "name": "peak",
    "device": device.device_kind,
    "num_devices": jax.device_count(),
    "peak_flops_per_sec": peak,
    "source": source,
    # Whether freed host memory stays in the process (transformer/host_memory.py):
    # on CPU it moves the step time (docs/performance.md), so every figure says which.
    "host_memory_retained": host_memory.retained(),
  }


def describe(result: dict[str, Any]) -> str:
  memory = (
    "freed host memory retained"
    if result["host_memory_retained"]
    else "freed host memory returned to the OS"
  )
  if result["peak_flops_per_sec"] is None:
    return (
      f"peak: unknown ({result['source']}, {result['num_devices']} x "
      f"{result['device']}): no MFU; {memory}"
    )
  return (
    f"peak: {result['peak_flops_per_sec'] / 1e9:,.1f} GFLOP/s ({result['source']}, "
    f"{result['num_devices']} x {result['device']}); {memory}"
  )
