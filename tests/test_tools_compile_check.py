"""transformer/tools/compile_check.py: the train step compiled for a TPU slice, on this CPU.

libtpu compiles it (`make test` installs it into .venv/libtpu on Linux x86-64); where it
is not installed these tests skip and say why. Each command runs in a process of its own,
so that libtpu is never loaded into the test worker.
"""

import collections
import json
import subprocess
import sys

import pytest

from tests.helpers.processes import subprocess_env
from transformer.tools import compile_check

needs_libtpu = pytest.mark.skipif(
  compile_check.tpu_library_path() is None,
  reason="libtpu is not installed: `make test` installs it into .venv/libtpu on Linux "
  "x86-64 only (its one wheel)",
)

# One layer per stack (the tests that need a scan of several say so), scanned as the WMT
# configs are: the FLOPs check must see through the loop (XLA's cost analysis counts a
# loop's body once).
TINY = [
  "--config=configs/default.py",
  "--config.model.num_layers=1",
  "--config.model.d_model=128",
  "--config.model.d_ff=512",
  "--config.model.num_heads=4",
  "--config.model.d_k=32",
  "--config.model.d_v=32",
  "--config.vocab_size=1024",
  "--config.max_len=32",
  "--config.tokens_per_batch=512",
  "--config.eval_batch_size=8",
  "--topology=v5e-4",
  "--mesh=2,2,1",
]


def _run(*args, base=TINY):
  return subprocess.run(
    [sys.executable, "-m", "transformer.tools.compile_check", *base, *args],
    capture_output=True,
    text=True,
    env=subprocess_env(1),
    timeout=600,
  )


@needs_libtpu
@pytest.mark.slow
def test_a_tiny_config_compiled_for_a_4_chip_slice_reports_every_figure():
  result = _run(
    "--config.model.scan_layers=True", "--config.model.num_layers=3", "--json", "--decode_batch=8"
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert "TPU_WORKER_HOSTNAMES" not in result.stderr  # libtpu's log stays off the terminal
  report = json.loads(result.stdout)
  assert report["predicted"] == compile_check.PREDICTED
  assert (report["topology"], report["chips"], report["device_kind"]) == ("v5e-4", 4, "TPU v5 lite")
  assert report["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1}
  assert (report["rows"], report["seq_len"]) == (16, 32)  # 512 tokens in rows of 32
  # Memory per chip: the state (parameters and 2 Adam moments, f32) split over fsdp=2 is
  # about 3x the parameters; the total is what XLA adds up, within the chip's 16 GiB.
  assert 2.5 * report["params"] < report["state"] < 3.5 * report["params"]
  assert report["argument"] >= report["state"]
  assert report["total"] == (
    report["argument"] + report["output"] - report["alias"] + report["temp"]
  )
  assert report["fits"] and report["total"] < report["hbm"] == 16 * 2**30
  assert report["involuntary_remat"] == 0
  # The FLOPs check: XLA's count of the unrolled step against training/flops.py's.
  assert report["formula_flops"] > 0
  assert abs(report["flops_vs_formula"]) < 0.05, report["flops_vs_formula"]
  assert report["bytes"] > 0
  assert report["cost_from"] == "the step unrolled at 1 and 2 layers, extrapolated to 3"
  # fsdp=2 gathers parameters and scatters gradients; one slice: nothing over DCN.
  collectives = report["collectives"]
  assert collectives["all-gather"]["count"] > 0 and collectives["all-gather"]["ici_bytes"] > 0
  assert collectives["reduce-scatter"]["count"] + collectives["all-reduce"]["count"] > 0
  assert all(c["dcn_bytes"] == 0 for c in collectives.values())
  # The per-op profile: the compiler's cycles of the program that runs (its layer loop
  # counted 3 times), every model part of a training step in it.
  profile = report["profile"]
  assert profile["step_s"] == pytest.approx(profile["compute_s"] + profile["collectives_s"])
  assert profile["collectives_s"] > 0 and profile["clock_hz"] == pytest.approx(1.503e9, rel=1e-3)
  assert (
    profile["mfu"] == pytest.approx(report["formula_flops"] / profile["step_s"] / 197e12)
    and 0 < profile["mfu"] < 1
  )
  assert profile["tokens_per_s"] == pytest.approx(16 * 32 / profile["step_s"])
  parts = profile["by_part_s"]
  for part in ("attention core", "projections", "FFN", "logits", "loss", "optimizer"):
    assert parts.get(part, 0) > 0, (part, parts)
  assert sum(parts.values()) == pytest.approx(profile["step_s"])
  # The longest ops run once a step or once per layer (read from the loop's test).
  runs = {o["runs"] for o in profile["top_ops"]}
  assert 3 in runs and runs <= {1, 3}, profile["top_ops"]
  assert profile["custom_calls"] == []  # the einsum attention: no kernels to flag
  # The roofline: the slowest of its terms, and everything derived from it.
  roof = report["roofline_s"]
  assert roof["compute"] == pytest.approx(report["flops"] / 197e12)
  assert report["step_s"] == max(roof.values()) and report["bound"] in roof
  assert report["tokens_per_s"] == pytest.approx(16 * 32 / report["step_s"])
  assert report["tokens_per_s_per_chip"] == pytest.approx(report["tokens_per_s"] / 4)
  assert report["mfu"] == pytest.approx(report["formula_flops"] / report["step_s"] / 197e12)
  assert 0 < report["mfu"] <= 1
  # Beam search on the slice: 8 sentences x 4 beams through a cache of 32 + 50 slots.
  decoding = report["decoding"]
  assert (decoding["batch"], decoding["beam_size"], decoding["cache_len"]) == (8, 4, 82)
  for program in ("prefill", "step"):
    assert decoding[program]["fits"] and 0 < decoding[program]["total"] < 2**30
    assert decoding[program]["flops"] > 0 and decoding[program]["step_s"] > 0
  assert decoding["tokens_per_s"] == pytest.approx(8 / decoding["step"]["step_s"])
  assert "ms per generated token" in compile_check.decoding_text(decoding)
  # The terminal's report names every figure as a prediction.
  text = compile_check.text(report)
  assert "predicted by XLA's TPU compiler" in text
  assert "fits, 0% of 16 GiB" in text and "MFU" in text and "all-gather x" in text
  assert "the compiler's own per-op estimates" in text and "top ops" in text
  # The cost extrapolated from 1 and 2 layers, cost(1) + 2 (cost(2) - cost(1)), against
  # the 3-layer step compiled unrolled whole, as compile_check costed it before (a
  # compile that took Transformer-base 37 minutes).
  unrolled = _run("--config.model.scan_layers=False", "--config.model.num_layers=3", "--json")
  assert unrolled.returncode == 0, unrolled.stderr[-2000:]
  unrolled = json.loads(unrolled.stdout)
  assert unrolled["cost_from"] == "the step"
  assert report["flops"] == pytest.approx(unrolled["flops"], rel=0.01)
  assert report["bytes"] == pytest.approx(unrolled["bytes"], rel=0.10)


@needs_libtpu
@pytest.mark.slow
def test_an_oversized_batch_is_one_line_naming_needed_and_available_memory():
  result = _run(f"--batch_tokens={2**27}")
  assert result.returncode == 1
  verdict = result.stdout.strip().splitlines()[-1]
  assert verdict.lstrip().startswith("does not fit: needs ")
  assert "15.75G available on each TPU v5 lite chip" in verdict
  # The largest array: the [rows, 32, 1024] logits, 2^27 / 32 rows of them.
  assert f"f32[{2**27 // 32},32,1024] 512.00 GiB" in verdict
  assert "predicted by XLA's TPU compiler" in verdict
  assert "Traceback" not in result.stderr


def test_slice_names_map_to_their_topologies():
  slices = compile_check.tpu_slices()
  assert slices["v4-8"].topology == "v4:2x2x1" and slices["v4-8"].chip_config == "megacore"
  assert slices["v4-32"].chips == 16 and slices["v4-32"].hosts == 4
  assert slices["v5p-128"].topology == "v5p:4x4x4"
  assert slices["v5e-256"].topology == "v5e:16x16" and slices["v5e-256"].hosts == 64
  assert slices["v5e-8"].hosts == 1 and slices["v6e-1"].chips == 1
  assert "v4-4096" in slices and "v4-8192" not in slices
  with pytest.raises(Exception, match="not a known TPU slice; known: v5e-1, v5e-4, v5e-8, v5e-16"):
    compile_check.parse_slice("v5e-15")


@needs_libtpu
def test_the_tpu_flash_kernel_compiles_per_device_and_every_kernel_is_costed_and_flagged():
  """The Pallas FlashAttention kernel in the step compiled for v5e-4 on a data x tensor
  mesh: a forward kernel per attention (encoder, decoder self, cross) with its own cost
  estimate, and two backward kernels each (dK/dV, dQ), which carry none and are costed
  by formula; all run inside the layer loop, per device (shard_map), and the attention
  core's time is theirs."""
  mesh = [a for a in TINY if not a.startswith("--mesh")] + ["--mesh=2,1,2"]
  result = _run(
    "--config.model.attention_kernel=tpu_flash",
    "--config.model.scan_layers=True",
    "--json",
    base=mesh,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  profile = json.loads(result.stdout)["profile"]
  kernels = profile["custom_calls"]
  assert len(kernels) == 9, [k["name"] for k in kernels]
  assert all(
    k["target"] == "tpu_custom_call" and "part.attention_core/shard_map" in k["op_name"]
    for k in kernels
  )
  costed_by = collections.Counter(
    "own"
    if "own cost estimate" in k["costed_by"]
    else "formula"
    if "formula" in k["costed_by"]
    else k["costed_by"]
    for k in kernels
  )
  assert costed_by == {"own": 3, "formula": 6}, costed_by
  for place in ("Transformer.encode/", "self_attention_block/", "cross_attention_block/"):
    assert sum(place in k["op_name"] for k in kernels) == 3, place
  assert profile["by_part_s"]["attention core"] >= sum(k["seconds"] for k in kernels) > 0


def test_collectives_are_counted_per_loop_trip_and_split_by_slice():
  # A scanned loop of 6 trips holding an all-gather over 2 devices of one slice, and an
  # all-reduce of 2 bf16 arrays at the top level over devices on two slices.
  hlo = "\n".join(
    [
      "%body.1 (p: f32[8]) -> f32[8] {",
      "  %all-gather.1 = f32[8,1024]{1,0} all-gather(%p), replica_groups=[2,2]<=[4]",
      "}",
      "ENTRY %main.2 (a: f32[8]) -> f32[8] {",
      "  %while.1 = f32[8] while(%a), condition=%cond.1, body=%body.1,"
      ' backend_config={"known_trip_count":{"n":"6"}}',
      "  %all-reduce.1 = (bf16[512]{0}, bf16[512]{0}) all-reduce(%x, %y),"
      " replica_groups={{0,2},{1,3}}",
      "}",
    ]
  )
  counted = compile_check.collectives(hlo, device_slices=[0, 0, 1, 1])
  assert counted["all-gather"] == {"count": 6, "ici_bytes": 6 * 8 * 1024 * 4 / 2, "dcn_bytes": 0.0}
  assert counted["all-reduce"] == {"count": 1, "ici_bytes": 0.0, "dcn_bytes": 2 * 2048 / 2}


def _tiny_sweep(tmp_path):
  """A sweep of the tiny config: row 'fits', and 'two_rows', whose 2 rows of 32 do not
  split over v5e-4's 4 chips."""
  overrides = dict(arg.removeprefix("--config.").split("=") for arg in TINY if "config." in arg)
  sweep_file = tmp_path / "tiny.py"
  sweep_file.write_text(
    "from transformer.sweeps import Row\n"
    "BASE_CONFIG = 'configs/default.py'\n"
    f"BASE_OVERRIDES = {{k: int(v) for k, v in {overrides!r}.items()}}\n"
    "def get_sweep():\n"
    "  return [Row('fits', {}), Row('two_rows', {'tokens_per_batch': 64})]\n"
  )
  return sweep_file


@needs_libtpu
@pytest.mark.slow
def test_a_sweeps_check_as_json_is_each_rows_report_with_its_row(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "transformer.sweeps",
      "--sweep",
      str(_tiny_sweep(tmp_path)),
      "--compile_check",
      "v5e-4",
      "--json",
    ],
    capture_output=True,
    text=True,
    env=subprocess_env(1),
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  fits, two_rows = [json.loads(line) for line in result.stdout.splitlines()]
  assert (fits["row"], fits["overrides"], fits["topology"]) == ("fits", {}, "v5e-4")
  assert fits["fits"] and fits["step_s"] > 0 and fits["predicted"] == compile_check.PREDICTED
  assert fits["num_train_steps"] > 0
  assert (two_rows["row"], two_rows["overrides"]) == ("two_rows", {"tokens_per_batch": 64})
  assert not two_rows["fits"] and "64 tokens make 2 rows of 32" in two_rows["error"]


@needs_libtpu
@pytest.mark.slow
def test_launch_tpu_checks_every_row_and_writes_no_script_for_one_that_cannot_run(tmp_path):
  sweep_file = _tiny_sweep(tmp_path)
  workdir = tmp_path / "runs"
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "transformer.sweeps",
      "--sweep",
      str(sweep_file),
      "--workdir",
      str(workdir),
      "--launch",
      "tpu",
      "--compile_check",
      "v5e-4",
      "--config.data_dir=gs://bucket/tfds",
    ],  # the prepared data every worker reads
    capture_output=True,
    text=True,
    env=subprocess_env(1),
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  # The table: each row with its changes, parameters, bytes, verdict, step time and MFU.
  table = result.stderr
  assert "Train step of each row on v5e-4" in table and "predicted by XLA's TPU compiler" in table
  fits_row = next(line for line in table.splitlines() if line.startswith("| fits |"))
  assert "| (base) |" in fits_row and "yes, 0% of 16 GiB" in fits_row and " ms |" in fits_row
  # 64 tokens are 2 rows of 32, which do not split over the 4 chips' data axis.
  assert "two_rows: no script, it does not fit v5e-4: tokens_per_batch: 64 tokens" in table
  scripts = result.stdout.split()
  assert any(path.endswith("fits.sh") for path in scripts)
  assert not any("two_rows" in path for path in scripts)


@needs_libtpu
@pytest.mark.slow
def test_two_slices_with_a_mesh_that_splits_a_physical_axis_compile():
  """2 x v5e-16 (4x4 chips each) with 8 data shards per slice: 8 is no product of the
  slice's axes (4, 4), so the hybrid mesh must split one, as the one-slice mesh does."""
  result = _run(
    "--topology=v5e-16",
    "--num_slices=2",
    "--mesh=8,1,2",
    "--json",
    "--config.eval_batch_size=16",
    "--decode_batch=16",
  )
  assert result.returncode == 0, result.stderr[-2000:]
  report = json.loads(result.stdout)
  assert (report["chips"], report["mesh"]) == (32, {"data": 16, "fsdp": 1, "tensor": 2})
  assert report["dcn_mesh"]["data"] == 2 and report["fits"]


@needs_libtpu
@pytest.mark.slow
def test_the_mesh_search_refuses_what_cannot_run_and_picks_the_shortest_step_that_fits():
  """v5e-4, 4 heads: five candidate meshes. A vocabulary of 1026 does not split 4 ways
  and a batch of 2 rows not over 4 row shards, so only 2,1,2 and 1,2,2 compile."""
  tiny_without_mesh = [a for a in TINY if not a.startswith("--mesh")]
  result = _run(
    "--search_mesh",
    "--json",
    "--config.vocab_size=1026",
    "--config.tokens_per_batch=64",
    base=tiny_without_mesh,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  report = json.loads(result.stdout)
  tried = {t["mesh"]: t for t in report["search"]}
  assert list(tried) == ["4,1,1", "1,4,1", "2,1,2", "1,2,2", "1,1,4"]
  assert "fewer than the 4 a batch must be a multiple of" in tried["4,1,1"]["error"]
  assert "fewer than the 4" in tried["1,4,1"]["error"]
  assert "vocab_size: 1026" in tried["1,1,4"]["error"]
  compiled = {m: t for m, t in tried.items() if "error" not in t}
  assert set(compiled) == {"2,1,2", "1,2,2"} and all(t["fits"] for t in compiled.values())
  # Ranked by the per-op profile's step, not the roofline's.
  best = min(compiled, key=lambda m: compiled[m]["profile_step_s"])
  assert report["searched_mesh"] == best
  data, fsdp, tensor = map(int, best.split(","))
  assert report["mesh"] == {"data": data, "fsdp": fsdp, "tensor": tensor}
  assert report["profile"]["step_s"] == compiled[best]["profile_step_s"] and report["rows"] == 2
  # A line per candidate as it is decided, on stderr (stdout stays one JSON object).
  for mesh in tried:
    assert f"mesh {mesh}: " in result.stderr
  assert compile_check.search_text(report).endswith(f"shortest step that fits: --mesh {best}")


def test_the_mesh_search_and_a_mesh_are_one_choice():
  result = _run("--search_mesh")
  assert result.returncode != 0
  assert "--search_mesh chooses the mesh: drop --mesh" in result.stderr
  assert "Traceback" not in result.stderr


@needs_libtpu
def test_a_batch_with_fewer_rows_than_hosts_names_the_hosts_and_the_batch_it_needs():
  """2 x v5e-16 is 8 hosts; mesh 2,1,8 has 4 row shards; 6 rows of 32 split over neither
  the hosts nor their multiple 8, and fewer row shards cannot help."""
  result = _run(
    "--topology=v5e-16",
    "--num_slices=2",
    "--mesh=2,1,8",
    "--config.model.num_heads=8",
    "--config.model.d_k=16",
    "--config.model.d_v=16",
    "--config.tokens_per_batch=192",
  )
  assert result.returncode == 1
  lines = result.stderr.strip().splitlines()
  assert lines[-1] == (
    "error: tokens_per_batch: 192 tokens make 6 rows of 32, fewer than the 8 a batch must be "
    "a multiple of (4 row shards on mesh {'data': 4, 'fsdp': 1, 'tensor': 8}, 8 hosts); this "
    "slice needs a batch of at least 256 tokens (--batch_tokens)"
  ), lines[-3:]


@needs_libtpu
def test_a_search_where_no_mesh_can_run_is_one_line_with_the_last_reason():
  tiny_without_mesh = [a for a in TINY if not a.startswith("--mesh")]
  # One row of 32 splits over no mesh with row shards; 1026 tokens not over 4 chips.
  result = _run(
    "--search_mesh",
    "--config.tokens_per_batch=32",
    "--config.vocab_size=1026",
    base=tiny_without_mesh,
  )
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith(
    "error: none of the 5 meshes searched fits (each one's reason is in "
    "the search); the last, 1,1,4: config.vocab_size: 1026 does not split"
  )
  assert result.stderr.count("fewer than the") == 4  # a line per refused candidate
  assert "Traceback" not in result.stderr


def test_an_auto_precision_and_kernel_are_resolved_for_tpu_not_for_this_machine(monkeypatch):
  from transformer import config as config_lib

  config = config_lib.load_config("configs/wmt14.py:base")
  platforms = []
  resolve = config_lib.resolve_auto
  monkeypatch.setattr(
    config_lib,
    "resolve_auto",
    lambda model, platform: platforms.append(platform) or resolve(model, platform),
  )
  prepared = compile_check.prepare_config(config, None, 1)
  assert platforms == ["tpu"]
  assert (prepared.model.dtype, prepared.model.attention_kernel) == ("float32", "einsum")
  assert config.model.dtype == "auto"  # the caller's config is left as it was
