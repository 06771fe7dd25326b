r"""Benchmark: compile time, training step, MFU, memory, beam search and input pipeline.

    python -m transformer.tools.bench --config configs/default.py
    python -m transformer.tools.bench --config configs/wmt14.py:base \
        --batch_tokens 1024 --seq_len 64
    python -m transformer.tools.bench --config configs/wmt14.py:big \
        --config.model.dtype=bfloat16 --json

One process measures, in this order, each measurement in its own module of
transformer/tools/bench/, whose docstring says what it measures and how:
  peak            the device's peak FLOP/s, against which MFU is (peak.py);
  train_step      compile time, the median of `--steps` training steps after `--warmup`,
                  target tokens/s, MFU and HFU, memory (train_step.py);
  beam_search     beam search of `--decode_batch` random sentences for `--decode_steps`
                  steps, the median of `--decode_repeats` runs (beam_search.py);
  input_pipeline  `--pipeline_batches` batches of the config's dataset, read as training
                  reads them: tokens/s (input_pipeline.py; skipped when the dataset is not
                  on disk);
  train_loop      only when named in --only: train.py's training loop against the bare
                  step on the same batches, `--loop_steps` steps each in windows of
                  `--loop_window` (train_loop.py);
  speculative     only when named in --only, on trained runs: `--workdir` (the target,
                  trained with --config) and `--draft_workdir` (the draft): speculative
                  against greedy decoding of the first `--speculative_sentences` test
                  sentences at each of `--speculative_batch_sizes`, with `--draft_len`
                  draft tokens per target pass (speculative.py):

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

import json
from typing import Any

import jax
from absl import app, flags
from ml_collections import config_flags

from transformer import cli, versions
from transformer import config as config_lib
from transformer.inference import sharding
from transformer.tools import bench
from transformer.tools.bench import (
  beam_search,
  input_pipeline,
  peak,
  speculative,
  train_loop,
  train_step,
)
from transformer.training import state

# Its docs/results records' version: bump when what it computes changes, not on a reformat.
RECORD_VERSION = 1

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


def _check_flags(config) -> None:
  """app.UsageError, in one line, for flags the chosen measurements cannot run with:
  before any model is built or compiled."""
  unknown = set(_ONLY.value) - (set(bench.MEASUREMENTS) - {"peak"})
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
    print(bench.describe(result), flush=True)


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

  peak_result = peak.measure(config)
  _report(peak_result)
  params = model = None
  if "train_step" in _ONLY.value:
    result, model, params = train_step.measure(
      config, rows, seq_len, peak_result["peak_flops_per_sec"], _STEPS.value, _WARMUP.value
    )
    _report(result)
  if "beam_search" in _ONLY.value:
    if params is None:  # random weights either way: no training step needed
      run = state.setup(config)
      model, params = run.model, run.init_state(jax.random.key(config.seed)).params
    _report(
      beam_search.measure(
        config,
        model,
        params,
        sentences=_DECODE_BATCH.value,
        steps=_DECODE_STEPS.value,
        source_len=_DECODE_SOURCE_LEN.value,
        repeats=_DECODE_REPEATS.value,
      )
    )
  if "input_pipeline" in _ONLY.value:
    _report(input_pipeline.measure(config, _PIPELINE_BATCHES.value))
  if "train_loop" in _ONLY.value:
    _report(train_loop.measure(config, _LOOP_STEPS.value, _LOOP_WINDOW.value))
  if "speculative" in _ONLY.value:
    for result in speculative.measure(
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
