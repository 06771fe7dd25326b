"""bench's train_step: compile time, step time, MFU and memory of the config's training step.

Compiles the step, then times `num_steps` steps after `warmup` untimed ones, each
synchronized with block_until_ready: the median, target tokens/s, model FLOP/s, MFU and
HFU (FLOPs as transformer/training/flops.py counts them: matmuls, 3x forward for
training). The batch is random full-length rows with no padding, so MFU (real tokens)
equals HFU (padded shape) here, unlike in training. Also the peak device memory where
the backend reports it (the peak resident memory on CPU), the compiled step's temporary
buffers, and the host's page faults and kernel time per step.
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any

import jax
import numpy as np

from transformer.config import BOS_ID, EOS_ID
from transformer.inference import sharding
from transformer.training import flops, state, steps


def benchmark_batch(config, rows: int, seq_len: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Random full-length sentence pairs, laid out as the config's batching lays them out."""
  rng = np.random.default_rng(seed)
  tokens = lambda: rng.integers(4, config.vocab_size, (rows, seq_len), dtype=np.int32)
  source, target = tokens(), tokens()
  source[:, -1] = target[:, -1] = EOS_ID
  batch = {
    "source": source,
    "target": target,
    "decoder_input": np.concatenate([np.full((rows, 1), BOS_ID, np.int32), target[:, :-1]], axis=1),
  }
  if config.batching == "packed":  # one sentence per row, but the model still reads ids
    ones = np.ones((rows, seq_len), np.int32)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)).copy()
    batch.update(
      source_segment_ids=ones,
      target_segment_ids=ones,
      source_positions=positions,
      target_positions=positions.copy(),
    )
  if config.model.decoder_only:
    del batch["source"]
    batch = {k: v for k, v in batch.items() if not k.startswith("source")}
  return batch


def measure(
  config, rows: int, seq_len: int, peak: float | None, num_steps: int = 10, warmup: int = 2
):
  """Compiles and times the config's training step; returns (result, model, params)."""
  run = state.setup(config)
  train_state = run.init_state(jax.random.key(config.seed))
  host_batch = benchmark_batch(config, rows, seq_len)
  batch = sharding.global_batch(host_batch, run.mesh, run.rules)
  step_fn = steps.jit_train_step(run)

  start = time.perf_counter()
  compiled = step_fn.lower(train_state, batch).compile()
  compile_s = time.perf_counter() - start

  train_state, times, host = _timed_steps(compiled, train_state, batch, num_steps, warmup)

  step_time = statistics.median(times)
  target_tokens = rows * seq_len
  source_len = 0 if config.model.decoder_only else seq_len
  step_flops = flops.training_flops(run.model.config, rows, source_len, seq_len)
  # Counted as training counts them: with no padding the two agree, which is the check
  # that MFU here is comparable with the training log's.
  counts = jax.device_get(flops.count_tokens(host_batch))
  real_flops = flops.real_training_flops(run.model.config, counts)
  result = {
    "name": "train_step",
    "rows": rows,
    "seq_len": seq_len,
    "compile_s": compile_s,
    "step_time_s": step_time,
    "step_time_min_s": min(times),
    "step_time_max_s": max(times),
    "tokens_per_sec": target_tokens / step_time,
    "flops_per_step": step_flops,
    "flops_per_sec": step_flops / step_time,
    "real_flops_per_step": real_flops,
    "mfu": flops.utilisation(real_flops, step_time, peak),
    "hfu": flops.utilisation(step_flops, step_time, peak),
    "padding_efficiency": float(counts["target_tokens"] / counts["target_slots"]),
    "num_params": run.num_params,
    # As run here: an "auto" of the config resolved for this platform.
    "dtype": run.model.config.dtype.name,
    "attention_kernel": run.model.config.attention_kernel,
    **host,
  }
  result.update(_memory(compiled))
  return result, run.model, train_state.params


def _timed_steps(
  compiled, train_state, batch, num_steps: int, warmup: int
) -> tuple[Any, list[float], dict[str, float]]:
  """(the state after them, seconds of each of `num_steps` steps after `warmup` untimed
  ones, the host's side of a timed step); RuntimeError if the loss is not finite."""
  for _ in range(warmup):
    train_state, metrics = compiled(train_state, batch)
  jax.block_until_ready(train_state)
  times = []
  usage_before = resource.getrusage(resource.RUSAGE_SELF)
  for _ in range(num_steps):
    start = time.perf_counter()
    train_state, metrics = compiled(train_state, batch)
    jax.block_until_ready((train_state, metrics))
    times.append(time.perf_counter() - start)
  usage_after = resource.getrusage(resource.RUSAGE_SELF)
  if not np.isfinite(float(metrics["loss"])):
    raise RuntimeError(f"benchmark loss is {float(metrics['loss'])}")
  # The host's side of a step: pages first touched (a CPU step whose buffers are mapped
  # afresh faults in every one of them; transformer/host_memory.py) and the kernel time,
  # per timed step, over all of the process's threads.
  host = {
    "host_page_faults_per_step": (usage_after.ru_minflt - usage_before.ru_minflt) / num_steps,
    "host_kernel_s_per_step": (usage_after.ru_stime - usage_before.ru_stime) / num_steps,
  }
  return train_state, times, host


def _memory(compiled) -> dict[str, Any]:
  """Peak device memory (GPU/TPU report it) and the compiled step's temporary buffers."""
  out: dict[str, Any] = {}
  stats = jax.devices()[0].memory_stats()
  if stats and "peak_bytes_in_use" in stats:
    out["peak_memory_bytes"] = stats["peak_bytes_in_use"]
  else:  # CPU: the process's peak resident memory stands in
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  try:
    analysis = compiled.memory_analysis()
    out["step_temp_bytes"] = int(analysis.temp_size_in_bytes)
  except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
    pass
  return out


def _fmt_bytes(n: int) -> str:
  return f"{n / 2**20:,.0f} MiB"


def _utilisation_text(result: dict[str, Any]) -> str:
  if result["mfu"] is None or result["mfu"] > 1.0:
    return flops.utilisation_text("MFU", result["mfu"])
  # Random full-length rows: nothing is padding, so MFU and HFU are one number.
  return (
    f"MFU {100 * result['mfu']:.1f}% (= HFU, {100 * result['padding_efficiency']:.0f}% real tokens)"
  )


def describe(result: dict[str, Any]) -> str:
  memory_sizes = [
    f"{k.removesuffix('_bytes').replace('_', ' ')} {_fmt_bytes(v)}"
    for k, v in result.items()
    if k.endswith("_bytes")
  ]
  return (
    f"train_step: {result['rows']} x {result['seq_len']} tokens, "
    f"compile {result['compile_s']:.1f} s, step {result['step_time_s'] * 1e3:,.1f} ms "
    f"(median), {result['tokens_per_sec']:,.0f} target tokens/s, "
    f"{result['flops_per_sec'] / 1e9:,.1f} GFLOP/s, {_utilisation_text(result)}"
    + (f", {', '.join(memory_sizes)}" if memory_sizes else "")
  )
