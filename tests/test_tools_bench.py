"""`python -m transformer.tools.bench` at a tiny size: every measurement runs and is consistent.

Timings themselves are not asserted (they depend on the machine); docs/performance.md
records them.
"""

import json
import math
import os
import statistics
import subprocess
import sys

import jax
import numpy as np

from tests.helpers.processes import subprocess_env
from tests.helpers.tiny_run import REPO, flag_overrides, make_config
from transformer import versions
from transformer.inference import checkpoints as inference_checkpoints
from transformer.inference import sharding
from transformer.model import ModelConfig
from transformer.training import flops

ROWS, SEQ_LEN = 4, 24


def _env():
  return subprocess_env(devices=2)  # rows split over 2 devices


def run_bench(small_corpus, *args):
  """Runs the benchmark from outside the repository: `--config configs/default.py` is
  found relative to the repository when the working directory has no such file."""
  command = [
    sys.executable,
    "-m",
    "transformer.tools.bench",
    "--config",
    "configs/default.py",
    *flag_overrides(small_corpus),
    *args,
  ]
  outside = os.path.dirname(small_corpus[0])
  assert not os.path.exists(os.path.join(outside, "configs"))
  return subprocess.run(
    command, cwd=outside, env=_env(), capture_output=True, text=True, timeout=600
  )


def test_bench_json_reports_every_measurement(small_corpus):
  result = run_bench(
    small_corpus,
    "--json",
    f"--batch_tokens={ROWS * SEQ_LEN}",
    f"--seq_len={SEQ_LEN}",
    "--steps=2",
    "--warmup=1",
    "--decode_batch=2",
    "--decode_steps=30",
    "--decode_repeats=1",
    "--pipeline_batches=3",
  )
  assert result.returncode == 0, result.stderr[-3000:]
  records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
  assert [r["name"] for r in records] == ["peak", "train_step", "beam_search", "input_pipeline"]
  for r in records:
    assert {"name", "tokens_per_sec", "mfu", "step_time_s"} <= r.keys()
    assert r["versions"] == versions.library_versions()

  peak, train, beam, pipeline = records
  # The suite's configs fix the peak (tests/helpers/tiny_run.py): the one the records use.
  assert peak["num_devices"] == 2 and peak["source"] == "config.peak_flops_per_device"
  # It is one device's: the job's peak is that times its 2 devices.
  assert peak["peak_flops_per_sec"] == 2 * make_config(small_corpus).peak_flops_per_device
  assert peak["host_memory_retained"] is True  # on by default (transformer/host_memory.py)
  assert (train["rows"], train["seq_len"]) == (ROWS, SEQ_LEN)
  model_config = ModelConfig.from_config(make_config(small_corpus))
  assert train["flops_per_step"] == flops.training_flops(model_config, ROWS, SEQ_LEN, SEQ_LEN)
  assert math.isclose(train["tokens_per_sec"], ROWS * SEQ_LEN / train["step_time_s"])
  assert math.isclose(
    train["hfu"], train["flops_per_step"] / train["step_time_s"] / peak["peak_flops_per_sec"]
  )
  # Random full-length rows: no padding, so the real-token count is the padded one.
  assert train["padding_efficiency"] == 1.0
  assert math.isclose(train["real_flops_per_step"], train["flops_per_step"])
  assert math.isclose(train["mfu"], train["hfu"])
  assert train["step_time_min_s"] <= train["step_time_s"] <= train["step_time_max_s"]
  assert train["compile_s"] > 0 and train["num_params"] > 0
  assert train["host_page_faults_per_step"] >= 0 and train["host_kernel_s_per_step"] >= 0
  assert beam["steps"] == 30 and beam["sentences"] == 2
  assert math.isclose(beam["tokens_per_sec"], beam["sentences_per_sec"] * beam["steps"])
  assert pipeline["batches"] == 3 and pipeline["tokens_per_sec"] > 0


def test_rows_fit_the_mesh_whatever_the_token_budget():
  assert sharding.rows_for_tokens(25_000, 256, 1) == 97  # configs/wmt14.py: 25,000 / 256 rows
  assert sharding.rows_for_tokens(25_000, 256, 8) == 96
  assert sharding.rows_for_tokens(3 * SEQ_LEN, SEQ_LEN, 2) == 2  # rounded down to the devices
  assert sharding.rows_for_tokens(SEQ_LEN // 2, SEQ_LEN, 4) == 4  # never below one row each


def test_beam_search_alone_needs_no_training_batch_flags(small_corpus):
  # 3 rows do not split over the 2 devices, and no training step is compiled anyway.
  result = run_bench(
    small_corpus,
    "--json",
    f"--batch_tokens={3 * SEQ_LEN}",
    f"--seq_len={SEQ_LEN}",
    "--only=beam_search",
    "--decode_batch=2",
    "--decode_repeats=2",
    "--decode_steps=30",
  )
  assert result.returncode == 0, result.stderr[-3000:]
  records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
  assert [r["name"] for r in records] == ["peak", "beam_search"]
  assert records[1]["sentences"] == 2 and records[1]["repeats"] == 2
  assert records[1]["sentences_per_sec"] > 0


def test_train_loop_against_the_bare_step_on_the_same_batches(small_corpus):
  """Bare, loop, bare over 6 steps in windows of 2: each pass's first window (it
  compiles) is dropped, and the loop's figures are its own logged windows."""
  result = run_bench(
    small_corpus, "--json", "--only=train_loop", "--loop_steps=6", "--loop_window=2"
  )
  assert result.returncode == 0, result.stderr[-3000:]
  records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
  assert [r["name"] for r in records] == ["peak", "train_loop"]  # progress lines: stderr
  loop = records[1]
  assert (loop["steps"], loop["window"]) == (6, 2)
  assert len(loop["loop_window_steps_per_sec"]) == 2  # windows 2 and 3 of the loop
  assert len(loop["bare_window_steps_per_sec"]) == 4  # windows 2 and 3 of each bare pass
  assert math.isclose(
    loop["loop_steps_per_sec"], statistics.median(loop["loop_window_steps_per_sec"])
  )
  assert math.isclose(
    loop["bare_steps_per_sec"], statistics.median(loop["bare_window_steps_per_sec"])
  )
  assert math.isclose(loop["efficiency"], loop["loop_steps_per_sec"] / loop["bare_steps_per_sec"])
  assert 0 < loop["real_target_tokens_per_step"] <= make_config(small_corpus).tokens_per_batch
  assert 0 < loop["mfu"] < 1
  assert "step 6/6" in result.stderr


def test_train_loop_flags_are_checked_before_any_work(small_corpus):
  result = run_bench(small_corpus, "--only=train_loop", "--loop_steps=5", "--loop_window=2")
  assert result.returncode != 0
  assert "--loop_steps 5 must be at least two windows of --loop_window 2" in result.stderr
  assert "peak:" not in result.stdout


def test_bench_human_readable_lines(small_corpus):
  result = run_bench(
    small_corpus,
    f"--batch_tokens={ROWS * SEQ_LEN}",
    f"--seq_len={SEQ_LEN}",
    "--steps=1",
    "--warmup=0",
    "--only=train_step",
  )
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.strip().splitlines()
  assert lines[0].startswith("peak: ") and "GFLOP/s" in lines[0]
  assert lines[0].endswith("; freed host memory retained")
  assert lines[1].startswith(f"train_step: {ROWS} x {SEQ_LEN} tokens")
  assert "% (= HFU, 100% real tokens)" in lines[1] and ", MFU " in lines[1]


def test_bench_lines_for_a_device_with_no_known_peak():
  """An unknown device kind: no peak, no MFU, said in words rather than as a number."""
  code = """if True:
    from transformer.tools import bench
    print(bench.describe({"name": "peak", "peak_flops_per_sec": None, "num_devices": 1,
                          "device": "Mystery 9000", "source": "device kind not in the bf16 table",
                          "host_memory_retained": False}))
    print(bench.describe({"name": "train_step", "rows": 4, "seq_len": 8, "compile_s": 1.0,
                          "step_time_s": 0.5, "tokens_per_sec": 64.0, "flops_per_sec": 2e9,
                          "mfu": None, "hfu": None, "padding_efficiency": 1.0}))"""
  result = subprocess.run(
    [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0, result.stderr[-3000:]
  peak, train = result.stdout.strip().splitlines()
  assert peak == (
    "peak: unknown (device kind not in the bf16 table, 1 x Mystery 9000): "
    "no MFU; freed host memory returned to the OS"
  )
  assert train.endswith("2.0 GFLOP/s, MFU n/a")


def test_speculative_on_two_tiny_runs(small_corpus, trained_run, tmp_path):
  """Greedy against speculative greedy decoding of test sentences, two batches of 4, on
  the tiny trained run and a shallow draft trained on its frozen encoder: identical
  tokens, consistent counts; the draft's frozen parts are the target's, unchanged."""
  from transformer.training import checkpoints, loop, state

  _, target_workdir = trained_run
  draft_workdir = str(tmp_path / "draft")
  loop.train_and_evaluate(
    make_config(
      small_corpus,
      num_train_steps=2,
      max_decode_extra_len=5,
      **{"draft.num_layers": 1, "draft.target_workdir": target_workdir, "draft.shortlist_size": 40},
    ),
    draft_workdir,
  )
  draft_config = checkpoints.load_run_config(draft_workdir)
  assert draft_config.vocab_from == target_workdir and len(draft_config.draft.shortlist) == 40
  params = {
    workdir: inference_checkpoints.restore_params(
      workdir, state.setup(checkpoints.load_run_config(workdir))
    )[0]
    for workdir in (target_workdir, draft_workdir)
  }
  for part in ("encoder", "shared_embedding"):
    for target_leaf, draft_leaf in zip(
      jax.tree.leaves(params[target_workdir][part]), jax.tree.leaves(params[draft_workdir][part])
    ):
      np.testing.assert_array_equal(target_leaf, draft_leaf)
  result = run_bench(
    small_corpus,
    "--json",
    "--only=speculative",
    "--workdir",
    target_workdir,
    "--draft_workdir",
    draft_workdir,
    "--draft_len=3",
    "--speculative_sentences=6",
    "--speculative_batch_sizes=4",
    "--config.max_decode_extra_len=5",
  )
  assert result.returncode == 0, result.stderr[-3000:]
  records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
  assert [r["name"] for r in records] == ["peak", "speculative"]
  spec = records[1]
  # 6 sentences in 4 rows: two batches, the second half full; two prefills.
  assert (spec["sentences"], spec["batch_size"], spec["draft_len"]) == (6, 4, 3)
  assert spec["draft_kind"] == "ShallowDraft"
  assert 0 <= spec["accepted"] <= spec["proposed"] and spec["target_calls"] > 0
  assert math.isclose(spec["acceptance_rate"], spec["accepted"] / spec["proposed"])
  # Every row of a batch (4) per batched pass: k + 1 each, plus the prefill's share.
  assert 1 <= spec["tokens_per_target_call"] <= 3 + 1 + 1  # per sentence: k + 1, + the first
  # Each pass gives every unfinished row at least one token: never more passes than greedy.
  assert spec["target_passes_speculative"] == spec["target_calls"] + 2
  assert spec["target_passes_speculative"] <= spec["target_passes_greedy"]
  assert math.isclose(
    spec["target_pass_reduction"], spec["target_passes_greedy"] / spec["target_passes_speculative"]
  )
  # The draft holds the target's embedding and encoder and one decoder layer: here, as
  # many as the one-layer target.
  assert spec["draft_params"] == spec["target_params"]
  assert math.isclose(spec["speedup"], spec["greedy_s"] / spec["speculative_s"])
  assert math.isclose(spec["greedy_ms_per_sentence"], 1e3 * spec["greedy_s"] / 6)
  assert math.isclose(spec["draft_cost_ratio"], spec["draft_pass_s"] / spec["target_pass_s"])
  a, k, c = spec["acceptance_rate"], 3, spec["draft_cost_ratio"]
  assert math.isclose(spec["expected_speedup"], (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1)))


def test_speculative_without_runs_is_a_one_line_usage_error(small_corpus):
  result = run_bench(small_corpus, "--only=speculative", "--draft_workdir=somewhere")
  assert result.returncode != 0
  assert "--only speculative needs --workdir (the target run) and --draft_workdir" in (
    result.stderr
  )
  assert "Traceback" not in result.stderr
