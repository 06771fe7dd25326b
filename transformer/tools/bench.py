"""Benchmark: compile time, training step, MFU, memory, beam search and input pipeline.

    python -m transformer.tools.bench --config configs/default.py
    python -m transformer.tools.bench --config configs/wmt14.py:base --batch_tokens 1024 --seq_len 64
    python -m transformer.tools.bench --config configs/wmt14.py:big --config.model.dtype=bfloat16 --json

One process measures, in order:
  peak            the device's peak FLOP/s: measured with a large f32 matmul on CPU (in
                  this run, so MFU is against what this machine does now), a table of
                  known bf16 peaks on GPU/TPU (a device kind not in it: no MFU);
  train_step      compile time, then the median time of `--steps` training steps after
                  `--warmup` steps, each synchronized with block_until_ready; target
                  tokens/s, model FLOP/s, MFU and HFU (FLOPs as transformer/training/flops.py
                  counts them: matmuls, 3x forward for training). The batch has no
                  padding, so MFU (real tokens) equals HFU (padded shape) here, unlike
                  in training; peak device memory where the backend reports it, and the
                  compiled step's temporary buffer size;
  beam_search     beam search (cache on, early stopping off) of `--decode_batch`
                  random sentences for `--decode_steps` steps, the median of
                  `--decode_repeats` runs after an untimed one: sentences/s, tokens/s;
  input_pipeline  batches of the config's dataset, tokenized and batched exactly as
                  training reads them: tokens/s (skipped when the dataset is not on disk).

The model and optimizer are the config's, on random weights and random full-length
batches of `--seq_len` source and target tokens: `--batch_tokens / --seq_len` rows,
rounded down to a multiple of the data-parallel devices (at least one row each), so every
shipped config runs with no flags. `--only beam_search` builds the parameters without
compiling a training step.
`--json` prints one JSON object per measurement (keys include name, tokens_per_sec, mfu,
step_time_s; mfu is null where there is none); docs/performance.md records the figures.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from transformer import cli
from transformer import config as config_lib
from transformer.config import BOS_ID, EOS_ID
from transformer.tools import decoding_speed
from transformer.training import flops, sharding, state, steps

_CONFIG = config_flags.DEFINE_config_file("config", config_lib.DEFAULT_CONFIG, "Config file.")
_BATCH_TOKENS = flags.DEFINE_integer(
    "batch_tokens", None, "Target tokens per training step (default: the config's "
    "tokens_per_batch); rows = batch_tokens / seq_len, rounded down to a multiple of the "
    "data-parallel devices.")
_SEQ_LEN = flags.DEFINE_integer(
    "seq_len", None, "Source and target length of the benchmark batch (default: max_len).")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed training steps (the median is reported).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed training steps after compiling.")
_DECODE_BATCH = flags.DEFINE_integer("decode_batch", 32, "Sentences per beam search.")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 64, "Output tokens per sentence.")
_DECODE_SOURCE_LEN = flags.DEFINE_integer("decode_source_len", 24, "Source tokens per sentence.")
_DECODE_REPEATS = flags.DEFINE_integer("decode_repeats", 3, "Timed beam searches after an "
                                       "untimed one (the median is reported).")
_PIPELINE_BATCHES = flags.DEFINE_integer("pipeline_batches", 50, "Input batches to time.")
_ONLY = flags.DEFINE_list("only", ["train_step", "beam_search", "input_pipeline"],
                          "Measurements to run (peak always runs).")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object per measurement.")
_LABEL = flags.DEFINE_string("label", "", "With --json: a 'label' key on every record, to tell "
                             "runs apart in one file.")


def benchmark_batch(config, rows: int, seq_len: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Random full-length sentence pairs, laid out as the config's batching lays them out."""
  rng = np.random.default_rng(seed)
  tokens = lambda: rng.integers(4, config.vocab_size, (rows, seq_len), dtype=np.int32)
  source, target = tokens(), tokens()
  source[:, -1] = target[:, -1] = EOS_ID
  batch = {"source": source, "target": target,
           "decoder_input": np.concatenate([np.full((rows, 1), BOS_ID, np.int32),
                                            target[:, :-1]], axis=1)}
  if config.batching == "packed":  # one sentence per row, but the model still reads ids
    ones = np.ones((rows, seq_len), np.int32)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)).copy()
    batch.update(source_segment_ids=ones, target_segment_ids=ones,
                 source_positions=positions, target_positions=positions.copy())
  if config.model.decoder_only:
    del batch["source"]
    batch = {k: v for k, v in batch.items() if not k.startswith("source")}
  return batch


def benchmark_rows(batch_tokens: int, seq_len: int, row_multiple: int) -> int:
  """Rows of `seq_len` tokens nearest below `batch_tokens` that divide over the
  data-parallel devices (`row_multiple`), and never fewer than one per device."""
  return max(row_multiple, batch_tokens // seq_len // row_multiple * row_multiple)


def measure_peak() -> dict[str, Any]:
  device = jax.devices()[0]
  peak = flops.total_peak_flops()
  if device.platform == "cpu":
    source = "measured f32 matmul"
  else:
    source = "bf16 table" if peak is not None else "device kind not in the bf16 table"
  return {"name": "peak", "device": device.device_kind, "num_devices": jax.device_count(),
          "peak_flops_per_sec": peak, "source": source}


def measure_train_step(config, rows: int, seq_len: int, peak: float | None, num_steps: int = 10,
                       warmup: int = 2):
  """Compiles and times the config's training step; returns (result, model, params)."""
  run = state.setup(config)
  train_state = run.init_state(jax.random.key(config.seed))
  host_batch = benchmark_batch(config, rows, seq_len)
  batch = sharding.global_batch(host_batch, run.mesh, run.rules)
  step_fn = steps.jit_train_step(run)

  start = time.perf_counter()
  compiled = step_fn.lower(train_state, batch).compile()
  compile_s = time.perf_counter() - start

  for _ in range(warmup):
    train_state, metrics = compiled(train_state, batch)
  jax.block_until_ready(train_state)
  times = []
  for _ in range(num_steps):
    start = time.perf_counter()
    train_state, metrics = compiled(train_state, batch)
    jax.block_until_ready((train_state, metrics))
    times.append(time.perf_counter() - start)
  if not np.isfinite(float(metrics["loss"])):
    raise RuntimeError(f"benchmark loss is {float(metrics['loss'])}")

  step_time = statistics.median(times)
  target_tokens = rows * seq_len
  source_len = 0 if config.model.decoder_only else seq_len
  step_flops = flops.training_flops(run.model.config, rows, source_len, seq_len)
  # Counted as training counts them: with no padding the two agree, which is the check
  # that MFU here is comparable with the training log's.
  counts = jax.device_get(flops.count_tokens(host_batch))
  real_flops = flops.real_training_flops(run.model.config, counts)
  result = {
      "name": "train_step", "rows": rows, "seq_len": seq_len,
      "compile_s": compile_s, "step_time_s": step_time,
      "step_time_min_s": min(times), "step_time_max_s": max(times),
      "tokens_per_sec": target_tokens / step_time,
      "flops_per_step": step_flops, "flops_per_sec": step_flops / step_time,
      "real_flops_per_step": real_flops,
      "mfu": flops.utilisation(real_flops, step_time, peak),
      "hfu": flops.utilisation(step_flops, step_time, peak),
      "padding_efficiency": float(counts["target_tokens"] / counts["target_slots"]),
      "num_params": run.num_params,
  }
  result.update(_memory(compiled))
  return result, run.model, train_state.params


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


def measure_beam_search(config, model, params) -> dict[str, Any]:
  rng = np.random.default_rng(1)
  source_len = min(_DECODE_SOURCE_LEN.value, config.max_len)
  source = rng.integers(4, config.vocab_size, (_DECODE_BATCH.value, source_len), dtype=np.int32)
  source[:, -1] = EOS_ID
  steps = max(_DECODE_STEPS.value, source_len + 1)
  r = decoding_speed.time_beam_search(model, params, jnp.asarray(source),
                                      beam_size=config.beam_size, steps=steps, use_cache=True,
                                      repeats=_DECODE_REPEATS.value)
  return {"name": "beam_search", "beam_size": config.beam_size,
          "sentences": _DECODE_BATCH.value, "steps": steps, "repeats": _DECODE_REPEATS.value,
          "compile_s": r["compile_s"],
          "step_time_s": r["run_s"] / steps, "sentences_per_sec": r["sentences_per_s"],
          "tokens_per_sec": r["tokens_per_s"], "mfu": None}


def measure_input_pipeline(config) -> dict[str, Any]:
  # Imported here: TensorFlow is only needed for this measurement.
  from transformer.data import sources
  from transformer.tools import input_speed
  source = sources.make_source(config)
  if isinstance(source, sources.TfdsSource) and not (
      source.builder.is_prepared() or source.name == "tatoeba_en_es"):
    return {"name": "input_pipeline", "skipped": f"{source.name} is not prepared on disk",
            "tokens_per_sec": None, "mfu": None, "step_time_s": None}
  r = input_speed.measure(config, _PIPELINE_BATCHES.value, source=source)
  return {"name": "input_pipeline", "batches": r["batches"],
          "step_time_s": r["seconds"] / r["batches"], "examples_per_sec": r["examples_per_sec"],
          "tokens_per_sec": r["tokens_per_sec"], "mfu": None}


def _fmt_bytes(n: int) -> str:
  return f"{n / 2**20:,.0f} MiB"


def _utilisation_text(result: dict[str, Any]) -> str:
  if result["mfu"] is None:
    return "MFU n/a"
  # Random full-length rows: nothing is padding, so MFU and HFU are one number.
  return (f"MFU {100 * result['mfu']:.1f}% (= HFU, "
          f"{100 * result['padding_efficiency']:.0f}% real tokens)")


def describe(result: dict[str, Any]) -> str:
  name = result["name"]
  if name == "peak":
    if result["peak_flops_per_sec"] is None:
      return (f"peak: unknown ({result['source']}, {result['num_devices']} x "
              f"{result['device']}): no MFU")
    return (f"peak: {result['peak_flops_per_sec'] / 1e9:,.1f} GFLOP/s ({result['source']}, "
            f"{result['num_devices']} x {result['device']})")
  if result.get("skipped"):
    return f"{name}: skipped, {result['skipped']}"
  if name == "train_step":
    memory = [f"{k.removesuffix('_bytes').replace('_', ' ')} {_fmt_bytes(v)}"
              for k, v in result.items() if k.endswith("_bytes")]
    return (f"train_step: {result['rows']} x {result['seq_len']} tokens, "
            f"compile {result['compile_s']:.1f} s, step {result['step_time_s'] * 1e3:,.1f} ms "
            f"(median), {result['tokens_per_sec']:,.0f} target tokens/s, "
            f"{result['flops_per_sec'] / 1e9:,.1f} GFLOP/s, {_utilisation_text(result)}"
            + (f", {', '.join(memory)}" if memory else ""))
  if name == "beam_search":
    return (f"beam_search: beam {result['beam_size']}, {result['sentences']} sentences x "
            f"{result['steps']} steps, compile {result['compile_s']:.1f} s, "
            f"{result['sentences_per_sec']:,.2f} sentences/s, "
            f"{result['tokens_per_sec']:,.0f} tokens/s")
  return (f"input_pipeline: {result['batches']} batches, "
          f"{result['examples_per_sec']:,.0f} examples/s, "
          f"{result['tokens_per_sec']:,.0f} tokens/s")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = _CONFIG.value
  config_lib.validate(config)
  seq_len = _SEQ_LEN.value or config.max_len
  batch_tokens = _BATCH_TOKENS.value or config.tokens_per_batch
  unknown = set(_ONLY.value) - {"train_step", "beam_search", "input_pipeline"}
  if unknown:
    raise app.UsageError(f"--only: unknown measurement(s) {sorted(unknown)}")
  multiple = sharding.batch_row_multiple(sharding.create_mesh(config),
                                         sharding.axis_rules(config))
  rows = benchmark_rows(batch_tokens, seq_len, multiple)
  if "beam_search" in _ONLY.value and config.model.decoder_only:
    raise app.UsageError("beam_search needs an encoder-decoder config; drop it from --only")

  def report(result):
    for key in ("tokens_per_sec", "mfu", "step_time_s"):  # every record has these keys
      result.setdefault(key, None)
    if _LABEL.value:
      result["label"] = _LABEL.value
    if _JSON.value:
      print(json.dumps(result), flush=True)
    else:
      print(describe(result), flush=True)

  peak = measure_peak()
  report(peak)
  params = model = None
  if "train_step" in _ONLY.value:
    result, model, params = measure_train_step(config, rows, seq_len,
                                               peak["peak_flops_per_sec"], _STEPS.value,
                                               _WARMUP.value)
    report(result)
  if "beam_search" in _ONLY.value:
    if params is None:  # random weights either way: no training step needed
      run = state.setup(config)
      model, params = run.model, run.init_state(jax.random.key(config.seed)).params
    report(measure_beam_search(config, model, params))
  if "input_pipeline" in _ONLY.value:
    report(measure_input_pipeline(config))


if __name__ == "__main__":
  cli.run(main)
