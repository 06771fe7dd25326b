r"""Benchmark: compile time, training step, MFU, memory, beam search and input pipeline.

    python -m transformer.tools.bench --config configs/default.py
    python -m transformer.tools.bench --config configs/wmt14.py:base \
        --batch_tokens 1024 --seq_len 64
    python -m transformer.tools.bench --config configs/wmt14.py:big \
        --config.model.dtype=bfloat16 --json

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
                  training reads them: tokens/s (skipped when the dataset is not on disk);
  train_loop      only when named in --only: train.py's training loop (input pipeline,
                  metrics, progress lines, final checkpoint; no validation) on the
                  config's own data against the bare step on the same batches, in one
                  process, bare-loop-bare, `--loop_steps` steps each in windows of
                  `--loop_window`: steps/s of each and the loop's share of the bare
                  step's speed (what the loop itself costs);
  speculative     only when named in --only, on trained runs: `--workdir` (the target,
                  trained with --config) and `--draft_workdir` (the draft, e.g.
                  configs/default.py:shallow_draft). The first `--speculative_sentences`
                  sentences of the test split, in order, at each of
                  `--speculative_batch_sizes` (default 1 and 32: one sentence at a time,
                  what a user translating a line waits for, and batched throughput),
                  decoded by cached greedy decoding (decoding.Greedy) and by
                  speculative greedy decoding with `--draft_len` draft tokens per target
                  pass, alternating which of the two goes first on each batch, after an
                  untimed pass that compiles every batch shape. The tokens must be
                  identical. Reports ms per sentence of each, the speed-up, the acceptance
                  rate a, the measured cost c of a draft pass relative to a target pass
                  at that batch (and of the (k + 1)-token check), and the speed-up
                  (1 - a^(k+1)) / ((1 - a)(k c + 1)) they predict:

    python -m transformer.tools.bench --config configs/default.py --only speculative \
        --workdir workdirs/spec_target --draft_workdir workdirs/spec_shallow --draft_len 4

The model and optimizer are the config's, on random weights and random full-length
batches of `--seq_len` source and target tokens: `--batch_tokens / --seq_len` rows,
rounded down to a multiple of the data-parallel devices (at least one row each), so every
shipped config runs with no flags. `--only beam_search` builds the parameters without
compiling a training step.
`--json` prints one JSON object per measurement (keys include name, tokens_per_sec, mfu,
step_time_s; mfu is null where there is none); docs/performance.md records the figures.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from transformer import cli, host_memory, versions
from transformer import config as config_lib
from transformer.config import BOS_ID, EOS_ID
from transformer.model import decoding, incremental
from transformer.model.decoding import speculative as speculative_lib
from transformer.tools import decoding_speed
from transformer.training import flops, reporting, sharding, state, steps

_FLAG_VALUES = cli.program_flags(__name__)  # absl's only when run as a program
_CONFIG = config_flags.DEFINE_config_file(
  "config", config_lib.DEFAULT_CONFIG, "Config file.", flag_values=_FLAG_VALUES
)
_BATCH_TOKENS = flags.DEFINE_integer(
  "batch_tokens",
  None,
  "Target tokens per training step (default: the config's "
  "tokens_per_batch); rows = batch_tokens / seq_len, rounded down to a multiple of the "
  "data-parallel devices.",
  flag_values=_FLAG_VALUES,
)
_SEQ_LEN = flags.DEFINE_integer(
  "seq_len",
  None,
  "Source and target length of the benchmark batch (default: max_len).",
  flag_values=_FLAG_VALUES,
)
_STEPS = flags.DEFINE_integer(
  "steps", 10, "Timed training steps (the median is reported).", flag_values=_FLAG_VALUES
)
_WARMUP = flags.DEFINE_integer(
  "warmup", 2, "Untimed training steps after compiling.", flag_values=_FLAG_VALUES
)
_DECODE_BATCH = flags.DEFINE_integer(
  "decode_batch", 32, "Sentences per beam search.", flag_values=_FLAG_VALUES
)
_DECODE_STEPS = flags.DEFINE_integer(
  "decode_steps", 64, "Output tokens per sentence.", flag_values=_FLAG_VALUES
)
_DECODE_SOURCE_LEN = flags.DEFINE_integer(
  "decode_source_len", 24, "Source tokens per sentence.", flag_values=_FLAG_VALUES
)
_DECODE_REPEATS = flags.DEFINE_integer(
  "decode_repeats",
  3,
  "Timed beam searches after an untimed one (the median is reported).",
  flag_values=_FLAG_VALUES,
)
_PIPELINE_BATCHES = flags.DEFINE_integer(
  "pipeline_batches", 50, "Input batches to time.", flag_values=_FLAG_VALUES
)
_LOOP_STEPS = flags.DEFINE_integer(
  "loop_steps",
  150,
  "--only train_loop: training steps of each pass (a multiple of --loop_window).",
  flag_values=_FLAG_VALUES,
)
_LOOP_WINDOW = flags.DEFINE_integer(
  "loop_window",
  25,
  "--only train_loop: steps per timed window (the loop's log_every_steps).",
  flag_values=_FLAG_VALUES,
)
_ONLY = flags.DEFINE_list(
  "only",
  ["train_step", "beam_search", "input_pipeline"],
  "Measurements to run (peak always runs).",
  flag_values=_FLAG_VALUES,
)
_WORKDIR = flags.DEFINE_string(
  "workdir",
  None,
  "--only speculative: the trained target "
  "run (its checkpoints and vocab.model; --config is its config).",
  flag_values=_FLAG_VALUES,
)
_DRAFT_WORKDIR = flags.DEFINE_string(
  "draft_workdir",
  None,
  "--only speculative: the trained draft run (its own config.json is used).",
  flag_values=_FLAG_VALUES,
)
_DRAFT_LEN = flags.DEFINE_integer(
  "draft_len", 4, "--only speculative: draft tokens per target pass (k).", flag_values=_FLAG_VALUES
)
_SPECULATIVE_SENTENCES = flags.DEFINE_integer(
  "speculative_sentences",
  256,
  "--only speculative: the first N sentences of the test split.",
  flag_values=_FLAG_VALUES,
)
_SPECULATIVE_BATCH_SIZES = flags.DEFINE_list(
  "speculative_batch_sizes",
  ["1", "32"],
  "--only speculative: sentences per batch, each "
  "measured in turn (1: the latency of one sentence at a time).",
  flag_values=_FLAG_VALUES,
)
_JSON = flags.DEFINE_bool(
  "json", False, "Print one JSON object per measurement.", flag_values=_FLAG_VALUES
)
_LABEL = flags.DEFINE_string(
  "label",
  "",
  "With --json: a 'label' key on every record, to tell runs apart in one file.",
  flag_values=_FLAG_VALUES,
)


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


def measure_peak(config) -> dict[str, Any]:
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
    # on CPU it moves the step time by 12-16%, so every figure says which it had.
    "host_memory_retained": host_memory.retained(),
  }


def measure_train_step(
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
    # The host's side of a step: pages first touched (a CPU step whose buffers are
    # mapped afresh faults in every one of them; transformer/host_memory.py) and the
    # kernel time, per timed step, over all of the process's threads.
    "host_page_faults_per_step": (usage_after.ru_minflt - usage_before.ru_minflt) / num_steps,
    "host_kernel_s_per_step": (usage_after.ru_stime - usage_before.ru_stime) / num_steps,
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
  r = decoding_speed.time_beam_search(
    model,
    params,
    jnp.asarray(source),
    beam_size=config.beam_size,
    steps=steps,
    use_cache=True,
    repeats=_DECODE_REPEATS.value,
  )
  return {
    "name": "beam_search",
    "beam_size": config.beam_size,
    "sentences": _DECODE_BATCH.value,
    "steps": steps,
    "repeats": _DECODE_REPEATS.value,
    "compile_s": r["compile_s"],
    "step_time_s": r["run_s"] / steps,
    "sentences_per_sec": r["sentences_per_s"],
    "tokens_per_sec": r["tokens_per_s"],
    "mfu": None,
  }


def measure_input_pipeline(config) -> dict[str, Any]:
  # Imported here: TensorFlow is only needed for this measurement.
  from transformer.data import sources
  from transformer.tools import input_speed

  source = sources.make_source(config)
  if isinstance(source, sources.TfdsSource) and not (
    source.builder.is_prepared() or source.name == "tatoeba_en_es"
  ):
    return {
      "name": "input_pipeline",
      "skipped": f"{source.name} is not prepared on disk",
      "tokens_per_sec": None,
      "mfu": None,
      "step_time_s": None,
    }
  r = input_speed.measure(config, _PIPELINE_BATCHES.value, source=source)
  return {
    "name": "input_pipeline",
    "batches": r["batches"],
    "step_time_s": r["seconds"] / r["batches"],
    "examples_per_sec": r["examples_per_sec"],
    "tokens_per_sec": r["tokens_per_sec"],
    "mfu": None,
  }


def measure_train_loop(config, num_steps: int, window: int) -> dict[str, Any]:
  """train.py's loop against the bare step, on the same batches of the config's own data.

  Three passes over the first `num_steps` batches, in one process: the bare step (the
  batches built and put on the devices beforehand, the step dispatched back to back and
  synchronized at the end of every `window` steps), then the training loop as train.py
  runs it (input pipeline on its thread, metrics, progress lines every `window` steps
  and the final checkpoint, in a temporary workdir; no validation), then the bare step
  again, so drift of the machine's speed during the loop shows in the bare figures on
  both sides. The first window of each pass (which compiles) is left out; medians of
  the rest. Steps per second compare like with like: the passes train on the same
  batches.
  """
  from transformer.training import loop

  config = config.copy_and_resolve_references()
  config.num_train_steps = num_steps // config.grad_accum_steps
  config.log_every_steps = window
  config.eval_every_steps = 0
  config.checkpoint_every_steps = 0
  config.checkpoint_every_minutes = 0.0
  with tempfile.TemporaryDirectory(prefix="bench_train_loop_") as workdir:
    with contextlib.redirect_stdout(sys.stderr):  # its progress lines; stdout is the report's
      run = loop.TrainingRun(config, workdir, validation=None)
      try:
        # The loop's own iterator, read ahead and rewound: the bare passes get its batches.
        start = run.train_iter.get_state()
        host_batches = list(itertools.islice(run.train_iter, num_steps))
        run.train_iter.set_state(start)
        batches = [sharding.global_batch(b, run.setup.mesh, run.setup.rules) for b in host_batches]
        bare_step = steps.jit_train_step(run.setup)
        bare_state = run.setup.init_state(jax.random.key(config.seed))
        bare_before, bare_state = _bare_windows(bare_step, bare_state, batches, window)
        run.train()
        bare_after, _ = _bare_windows(bare_step, bare_state, batches, window)
      finally:
        run.close()
    loop_records = reporting.read_metrics(workdir, kind="train")[1:]
  loop_windows = [r["steps_per_sec"] for r in loop_records]
  bare_windows = [window / seconds for seconds in bare_before + bare_after]
  loop_steps_per_sec = statistics.median(loop_windows)
  bare_steps_per_sec = statistics.median(bare_windows)
  loop_tokens_per_sec = statistics.median(r["tokens_per_sec"] for r in loop_records)
  target_tokens = sum(float(flops.count_tokens(b)["target_tokens"]) for b in host_batches)
  return {
    "name": "train_loop",
    "steps": num_steps,
    "window": window,
    "loop_steps_per_sec": loop_steps_per_sec,
    "bare_steps_per_sec": bare_steps_per_sec,
    "efficiency": loop_steps_per_sec / bare_steps_per_sec,
    "loop_window_steps_per_sec": loop_windows,
    "bare_window_steps_per_sec": bare_windows,
    "loop_tokens_per_sec": loop_tokens_per_sec,
    "tokens_per_sec": loop_tokens_per_sec,
    "real_target_tokens_per_step": target_tokens / num_steps,
    "step_time_s": 1.0 / bare_steps_per_sec,
    "mfu": (
      statistics.median(r["mfu"] for r in loop_records)
      if all("mfu" in r for r in loop_records)
      else None
    ),
  }


def _bare_windows(step_fn, train_state, batches: list, window: int) -> tuple[list, Any]:
  """Seconds of each window of `window` steps after the first, over all batches."""
  times = []
  for start in range(0, len(batches) - window + 1, window):
    began = time.perf_counter()
    for batch in batches[start : start + window]:
      train_state, metrics = step_fn(train_state, batch)
    jax.block_until_ready((train_state, metrics))
    times.append(time.perf_counter() - began)
  return times[1:], train_state


def _count(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def _timed(decode, source) -> tuple[Any, float]:
  """(decode(source), its wall seconds), synchronized."""
  start = time.perf_counter()
  out = jax.block_until_ready(decode(source))
  return out, time.perf_counter() - start


@functools.partial(jax.jit, static_argnames=("model", "calls"))
def _cached_passes(model, params, state, tokens_BxL, position, *, calls: int):
  """`calls` cached passes of L tokens per row, each written at `position` (a scalar, as
  greedy decoding writes, or one per row [B], as speculative decoding does), each fed
  the argmax of the last, so none can be skipped."""

  def body(_, carry):
    state, tokens_BxL = carry
    logits_BxLxV, state = model.feed(params, state, tokens_BxL, position)
    return state, jnp.argmax(logits_BxLxV, axis=-1).astype(jnp.int32)

  return jax.lax.fori_loop(0, calls, body, (state, tokens_BxL))[1]


def _pass_costs(
  target, draft, source_BxS, draft_len: int, extra: int, calls: int = 32, repeats: int = 5
) -> dict[str, float]:
  """Seconds per cached pass at this batch, medians of `repeats` interleaved runs of
  `calls` passes: the target's one-token pass as greedy decoding makes it, the draft's
  one-token pass and the target's (k + 1)-token check as speculative decoding makes them."""
  batch = source_BxS.shape[0]
  bos_Bx1 = jnp.full((batch, 1), BOS_ID, jnp.int32)
  cache_len = source_BxS.shape[1] + extra + draft_len + 1
  row_position_B = jnp.ones((batch,), jnp.int32)  # speculative decoding's, one per row
  prefill = jax.jit(incremental.IncrementalModel.prefill, static_argnames=("self", "cache_len"))
  target_model, target_params = incremental.of(target.model).prepare(target.params)
  draft_model, draft_params = incremental.of(draft.model).prepare(draft.params)
  encoded_BxSxD = prefill(
    target_model, target_params, bos_Bx1, cache_len=cache_len, source_BxS=source_BxS
  ).encoded_BxSxD
  shared = encoded_BxSxD if decoding.reads_target_encoding(draft.model) else None
  runs = {}
  for name, model, params, tokens in (
    ("target", target_model, target_params, 1),
    ("draft", draft_model, draft_params, 1),
    ("check", target_model, target_params, draft_len + 1),
  ):
    state = prefill(
      model,
      params,
      bos_Bx1,
      cache_len=cache_len,
      source_BxS=source_BxS,
      encoded_BxSxD=shared if name == "draft" else None,
    ).state
    position = jnp.array(1, jnp.int32) if name == "target" else row_position_B
    state = model.set_positions(state, position)  # the loop carries its kind
    tokens_BxL = jnp.full((batch, tokens), 5, jnp.int32)
    runs[name] = functools.partial(
      _cached_passes, model, params, state, tokens_BxL, position, calls=calls
    )
    jax.block_until_ready(runs[name]())  # compiles
  seconds: dict[str, list[float]] = {name: [] for name in runs}
  for _ in range(repeats):
    for name, run in runs.items():
      seconds[name].append(_timed(lambda _, run=run: run(), None)[1] / calls)
  return {name: statistics.median(times) for name, times in seconds.items()}


def measure_speculative(
  config,
  workdir: str,
  draft_workdir: str,
  draft_len: int,
  num_sentences: int,
  batch_sizes: list[int],
) -> list[dict[str, Any]]:
  """Cached greedy against speculative greedy decoding of the test split's first
  sentences, on the restored target and draft, at each batch size (see the module
  docstring): one record per batch size."""
  # Imported here: restoring runs needs the evaluation and checkpoint code only.
  from transformer import data
  from transformer.evaluation import translate

  # Restored as eval.py --draft_workdir restores them: the vocabularies are checked to be
  # identical and the draft is placed on the target's mesh before anything compiles.
  target = translate.Translator(
    config,
    workdir,
    draft_workdir=draft_workdir,
    settings=translate.SearchSettings(kind="greedy", draft_len=draft_len),
  )
  lines = [source for source, _ in data.load_raw_pairs(config, "test")[:num_sentences]]
  if not lines:
    raise config_lib.ConfigError(f"config.dataset: {config.dataset} has no test sentences")
  row_shards = sharding.batch_row_shards(target.mesh, target.rules)
  if any(rows % row_shards for rows in batch_sizes):
    raise config_lib.ConfigError(
      f"--speculative_batch_sizes: each must split over the "
      f"{row_shards} devices a batch's rows are spread over"
    )
  results = []
  with sharding.activation_sharding(target.mesh, target.rules):
    for rows in batch_sizes:
      sources = []
      for start in range(0, len(lines), rows):  # as eval.py batches: in order, padded rows
        ids = target.tokenizer.encode_for_model(lines[start : start + rows], config.max_len)
        sources.append(
          sharding.global_batch_from_whole(
            {"source": data.pad_batch(ids, rows=rows)}, target.mesh, target.rules
          )["source"]
        )
      results.append(_compare_at_batch(config, target, sources, len(lines), draft_len))
  return results


def _identical_outputs(outputs: dict[str, list[Any]], num_lines: int) -> tuple[int, int]:
  """(tokens generated, greedy's target passes) over the batches, once speculative
  decoding is checked to give greedy's tokens on every sentence."""
  # Only the last batch has fill rows: the first num_lines rows hold the sentences.
  differ, generated, greedy_passes = 0, 0, 0
  for b, (plain, spec) in enumerate(zip(outputs["greedy"], outputs["speculative"])):
    rows = np.asarray(plain).shape[0]
    real = np.arange(rows) < num_lines - b * rows
    fast = np.asarray(spec.tokens_BxO)
    differ += int(np.sum(np.any(np.asarray(plain) != fast, axis=1) & real))
    generated += int(np.sum((fast != config_lib.PAD_ID) & real[:, None]))
    # Greedy decoding runs one target pass per token until every row (fill rows too)
    # is done: as many passes as the batch's longest output.
    greedy_passes += int(np.max(np.sum(np.asarray(plain) != config_lib.PAD_ID, axis=1)))
  if differ:
    raise RuntimeError(
      f"speculative greedy decoding differs from greedy decoding on "
      f"{differ} of {num_lines} sentences at batch {rows}"
    )
  return generated, greedy_passes


def _alternating_timings(
  decoders: dict[str, Callable[[Any], Any]], sources: list
) -> tuple[dict[str, float], dict[str, float], dict[str, list[Any]]]:
  """(untimed first pass's seconds, timed seconds, outputs on the host) of each decoder
  over the same batches. The first pass compiles every batch shape; then the decoders
  take turns going first on each batch, so a change in the machine's load falls on all."""
  compile_s = {
    name: sum(_timed(decode, source)[1] for source in sources) for name, decode in decoders.items()
  }
  seconds = {name: 0.0 for name in decoders}
  outputs: dict[str, list[Any]] = {name: [] for name in decoders}
  names = list(decoders)
  for b, source in enumerate(sources):
    for name in names if b % 2 == 0 else names[::-1]:
      out, elapsed = _timed(decoders[name], source)
      seconds[name] += elapsed
      outputs[name].append(jax.device_get(out))
  return compile_s, seconds, outputs


def _compare_at_batch(
  config, target, sources: list, num_lines: int, draft_len: int
) -> dict[str, Any]:
  """Greedy and speculative decoding of the same batches, alternating which goes first
  on each batch (so a change in the machine's load falls on both), after an untimed
  pass that compiles every batch shape."""
  draft, extra, rows = target.draft, config.max_decode_extra_len, sources[0].shape[0]
  assert draft is not None  # a draft_workdir always gives the translator one
  prompts = lambda source: decoding.translation_prompts(source, extra, False)
  decoders = {
    "greedy": lambda source: (
      decoding.decode(target.model, target.params, prompts(source), decoding.Greedy()).tokens_BxO
    ),
    "speculative": lambda source: decoding.decode(
      target.model,
      target.params,
      prompts(source),
      decoding.Speculative(draft.model, draft_len),
      draft_params=draft.params,
    ),
  }
  compile_s, seconds, outputs = _alternating_timings(decoders, sources)
  generated, greedy_passes = _identical_outputs(outputs, num_lines)
  spec_out = outputs["speculative"]
  proposed = sum(int(o.proposed) for o in spec_out)
  accepted = sum(int(o.accepted) for o in spec_out)
  target_calls = sum(int(o.calls) for o in spec_out)
  acceptance = accepted / max(proposed, 1)
  passes = _pass_costs(target, draft, sources[0], draft_len, extra)
  draft_cost = passes["draft"] / passes["target"]
  greedy_s, spec_s = seconds["greedy"], seconds["speculative"]
  return {
    "name": "speculative",
    "sentences": num_lines,
    "batch_size": rows,
    "draft_len": draft_len,
    "target_params": _count(target.params),
    "draft_params": _count(draft.params),
    "draft_kind": type(draft.model).__name__,
    "acceptance_rate": acceptance,
    "proposed": proposed,
    "accepted": accepted,
    "target_calls": target_calls,
    # Whole-batch passes of the target, the first token's included (speculative: the
    # prefill, uncounted in target_calls; greedy: its first step). Their ratio is what
    # speculation saves in target passes; the speed-up is what it saves in time.
    "target_passes_greedy": greedy_passes,
    "target_passes_speculative": target_calls + len(sources),
    "target_pass_reduction": greedy_passes / (target_calls + len(sources)),
    # As decoding.Generation and eval.py count it: tokens per sentence per target pass
    # (at most k + 1, plus the first token, which the uncounted prefill yields).
    "tokens_per_target_call": sum(
      int(np.sum(np.asarray(o.tokens_BxO) != config_lib.PAD_ID)) for o in spec_out
    )
    / max(sum(int(o.row_calls) for o in spec_out), 1),
    "generated_tokens": generated,
    # The untimed first passes: compiling every batch shape, plus one run.
    "greedy_compile_s": compile_s["greedy"],
    "speculative_compile_s": compile_s["speculative"],
    "greedy_s": greedy_s,
    "speculative_s": spec_s,
    "greedy_ms_per_sentence": 1e3 * greedy_s / num_lines,
    "speculative_ms_per_sentence": 1e3 * spec_s / num_lines,
    "greedy_sentences_per_sec": num_lines / greedy_s,
    "speculative_sentences_per_sec": num_lines / spec_s,
    "speedup": greedy_s / spec_s,
    # Seconds per cached pass at this batch (_pass_costs): c, the draft's one-token
    # pass over the target's, and the (k + 1)-token check over a one-token pass.
    "target_pass_s": passes["target"],
    "draft_pass_s": passes["draft"],
    "check_pass_s": passes["check"],
    "draft_cost_ratio": draft_cost,
    "check_cost_ratio": passes["check"] / passes["target"],
    "expected_speedup": speculative_lib.expected_speedup(acceptance, draft_len, draft_cost),
    "tokens_per_sec": generated / spec_s,
    "step_time_s": spec_s / max(target_calls, 1),
    "mfu": None,
  }


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
  name = result["name"]
  if name == "peak":
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
  if result.get("skipped"):
    return f"{name}: skipped, {result['skipped']}"
  if name == "train_step":
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
  if name == "beam_search":
    return (
      f"beam_search: beam {result['beam_size']}, {result['sentences']} sentences x "
      f"{result['steps']} steps, compile {result['compile_s']:.1f} s, "
      f"{result['sentences_per_sec']:,.2f} sentences/s, "
      f"{result['tokens_per_sec']:,.0f} tokens/s"
    )
  if name == "speculative":
    return (
      f"speculative: {result['sentences']} test sentences at batch "
      f"{result['batch_size']}, k={result['draft_len']}, acceptance "
      f"{100 * result['acceptance_rate']:.1f}%, "
      f"{result['tokens_per_target_call']:.2f} tokens per sentence per target call, "
      f"{result['target_pass_reduction']:.2f}x fewer target passes; greedy "
      f"{result['greedy_ms_per_sentence']:,.2f} ms/sentence, speculative "
      f"{result['speculative_ms_per_sentence']:,.2f} ms/sentence (identical tokens), "
      f"speed-up {result['speedup']:.2f}x; pass cost: draft/target c = "
      f"{result['draft_cost_ratio']:.2f}, (k + 1)-token check/target "
      f"{result['check_cost_ratio']:.2f}; expected (1 - a^(k+1)) / ((1 - a)(k c + 1)) "
      f"= {result['expected_speedup']:.2f}x"
    )
  if name == "train_loop":
    return (
      f"train_loop: {result['steps']} steps in windows of {result['window']}, "
      f"loop {result['loop_steps_per_sec']:.2f} steps/s "
      f"({result['loop_tokens_per_sec']:,.0f} real target tokens/s), bare step on the "
      f"same batches {result['bare_steps_per_sec']:.2f} steps/s: the loop runs at "
      f"{100 * result['efficiency']:.1f}% of the bare step"
    )
  return (
    f"input_pipeline: {result['batches']} batches, "
    f"{result['examples_per_sec']:,.0f} examples/s, "
    f"{result['tokens_per_sec']:,.0f} tokens/s"
  )


_MEASUREMENTS = ("train_step", "beam_search", "input_pipeline", "speculative", "train_loop")


def _check_flags(config) -> None:
  """app.UsageError, in one line, for flags the chosen measurements cannot run with:
  before any model is built or compiled."""
  unknown = set(_ONLY.value) - set(_MEASUREMENTS)
  if unknown:
    raise app.UsageError(f"--only: unknown measurement(s) {sorted(unknown)}")
  if "speculative" in _ONLY.value:
    if not (_WORKDIR.value and _DRAFT_WORKDIR.value):
      raise app.UsageError(
        "--only speculative needs --workdir (the target run) and --draft_workdir (the draft run)"
      )
    if config.model.decoder_only:  # greedy_decode, the baseline, reads a source
      raise app.UsageError("speculative needs an encoder-decoder config; drop it from --only")
    if _DRAFT_LEN.value < 1 or _SPECULATIVE_SENTENCES.value < 1:
      raise app.UsageError("--draft_len and --speculative_sentences must be at least 1")
    if not all(b.isdigit() and int(b) >= 1 for b in _SPECULATIVE_BATCH_SIZES.value):
      raise app.UsageError(
        f"--speculative_batch_sizes: {','.join(_SPECULATIVE_BATCH_SIZES.value)}"
        " must be positive integers"
      )
  if "train_loop" in _ONLY.value and (
    _LOOP_WINDOW.value < 1
    or _LOOP_STEPS.value % _LOOP_WINDOW.value
    or _LOOP_STEPS.value < 2 * _LOOP_WINDOW.value
    or _LOOP_STEPS.value % config.grad_accum_steps
  ):
    raise app.UsageError(
      f"--loop_steps {_LOOP_STEPS.value} must be at least two windows "
      f"of --loop_window {_LOOP_WINDOW.value} and a multiple of it (and "
      f"of grad_accum_steps {config.grad_accum_steps})"
    )
  if "beam_search" in _ONLY.value and config.model.decoder_only:
    raise app.UsageError("beam_search needs an encoder-decoder config; drop it from --only")


def _report(result: dict[str, Any]) -> None:
  """Prints one measurement: a JSON line (--json) or a sentence."""
  for key in ("tokens_per_sec", "mfu", "step_time_s"):  # every record has these keys
    result.setdefault(key, None)
  if _LABEL.value:
    result["label"] = _LABEL.value
  result["versions"] = versions.library_versions()
  if _JSON.value:
    print(json.dumps(result), flush=True)
  else:
    print(describe(result), flush=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = _CONFIG.value
  config_lib.validate(config)
  _check_flags(config)
  seq_len = _SEQ_LEN.value or config.max_len
  batch_tokens = _BATCH_TOKENS.value or config.tokens_per_batch
  multiple = sharding.batch_row_multiple(sharding.create_mesh(config), sharding.axis_rules(config))
  rows = sharding.rows_for_tokens(batch_tokens, seq_len, multiple)

  peak = measure_peak(config)
  _report(peak)
  params = model = None
  if "train_step" in _ONLY.value:
    result, model, params = measure_train_step(
      config, rows, seq_len, peak["peak_flops_per_sec"], _STEPS.value, _WARMUP.value
    )
    _report(result)
  if "beam_search" in _ONLY.value:
    if params is None:  # random weights either way: no training step needed
      run = state.setup(config)
      model, params = run.model, run.init_state(jax.random.key(config.seed)).params
    _report(measure_beam_search(config, model, params))
  if "input_pipeline" in _ONLY.value:
    _report(measure_input_pipeline(config))
  if "train_loop" in _ONLY.value:
    _report(measure_train_loop(config, _LOOP_STEPS.value, _LOOP_WINDOW.value))
  if "speculative" in _ONLY.value:
    for result in measure_speculative(
      config,
      _WORKDIR.value,
      _DRAFT_WORKDIR.value,
      _DRAFT_LEN.value,
      _SPECULATIVE_SENTENCES.value,
      [int(b) for b in _SPECULATIVE_BATCH_SIZES.value],
    ):
      _report(result)


if __name__ == "__main__":
  cli.run(main)
