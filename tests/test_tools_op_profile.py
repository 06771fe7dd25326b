# ruff: noqa: E501  (PROGRAM's HLO lines are as long as libtpu prints them)
"""transformer/tools/op_profile.py: the compiler's per-op estimates, summed into a step.

The parsing and costing run on a small program written out here, whose every op's cost is
known; the chip's clock is checked against libtpu's own estimate of a large matmul, in a
process of its own (libtpu stays out of the test worker).
"""

import json
import subprocess
import sys

import pytest

from tests.helpers.processes import subprocess_env
from transformer.tools import compile_check, op_profile
from transformer.training import flops

V5E = flops.TPU_CHIPS["v5e"]

# A step as libtpu prints it, cut to what the profile reads: a scanned layer (a loop of
# 6 whose test is `i < 6`, with no known_trip_count, as TPU programs print it) holding a
# projection fused with an op whose own cycles must not count; a loss fusion; a gradient
# all-reduce over 4 chips; two Pallas kernels, one with its own cost estimate; a buffer
# allocation; an asynchronous copy; random bits, which libtpu gives no estimate.
PROGRAM = """HloModule jit_train_step

%fused_projection (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %inner = f32[8]{0} exponential(%p0), backend_config={"estimated_cycles":"999999"}
}

%add_reducer (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b), backend_config={"estimated_cycles":"777777"}
}

%all-reduce-scatter.1 (scatter_in: f32[1024,256]) -> f32[256,256] {
  %scatter_in = f32[1024,256]{1,0} parameter(0)
  %scatter_sum = f32[1024,256]{1,0} all-reduce(%scatter_in), replica_groups={{0,1,2,3}}, to_apply=%add_reducer
  ROOT %my_part = f32[256,256]{1,0} dynamic-slice(%scatter_sum), dynamic_slice_sizes={256,256}
}

%layer_body (body_arg: (s32[], f32[8])) -> (s32[], f32[8]) {
  %body_arg = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%body_arg), index=0
  %x = f32[8]{0} get-tuple-element(%body_arg), index=1
  %query = f32[8]{0:T(8)S(1)} fusion(%x), kind=kOutput, calls=%fused_projection, metadata={op_name="jit(train_step)/jvp(Transformer)/Transformer.encode/encoder/layers/layers/attention_block/self_attention/self_attention._self_qkv/qkv/dot_general" stack_frame_id=1}, backend_config={"flag_configs":[],"window_config":{"estimated_cycles":"1500","iteration_bounds":["1"]}}
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i, %one)
  ROOT %body_out = (s32[]{:T(128)}, f32[8]{0}) tuple(%next, %query)
}

%layer_test (test_arg: (s32[], f32[8])) -> pred[] {
  %test_arg = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %layers = s32[]{:T(128)} constant(6)
  %counter = s32[]{:T(128)} get-tuple-element(%test_arg), index=0
  ROOT %more = pred[]{:T(512)} compare(%counter, %layers), direction=LT, metadata={op_name="jit(train_step)/while/cond/lt"}
}

ENTRY %main (x: f32[8], w: f32[1024,256]) -> f32[1024,256] {
  %x_in = f32[8]{0} parameter(0)
  %w = f32[1024,256]{1,0} parameter(1)
  %zero = s32[]{:T(128)} constant(0)
  %init = (s32[]{:T(128)}, f32[8]{0}) tuple(%zero, %x_in)
  %scan = (s32[]{:T(128)}, f32[8]{0}) while(%init), condition=%layer_test, body=%layer_body, metadata={op_name="jit(train_step)/while"}
  %loss = f32[8]{0} fusion(%x_in), kind=kLoop, calls=%fused_projection, metadata={op_name="jit(train_step)/jvp(traced_under_rules)/loss/reduce_sum"}, backend_config={"window_config":{"estimated_cycles":"3000"}}
  %grads = f32[1024,256]{1,0} all-reduce(%w), replica_groups={{0,1,2,3}}, to_apply=%add_reducer
  %scattered = f32[256,256]{1,0} fusion(%w), kind=kCustom, calls=%all-reduce-scatter.1
  %flash = f32[1024,256]{1,0} custom-call(%grads), custom_call_target="tpu_custom_call", metadata={op_name="jit(train_step)/decoder/attention/pallas_call"}, backend_config={"custom_call_config":{"body":"eA==","cost_estimate":{"flops":"197000000000","transcendentals":"0","bytes_accessed":"1000","remote_bytes_transferred":"0"}}}
  %opaque = f32[1024,256]{1,0} custom-call(%flash), custom_call_target="tpu_custom_call", metadata={op_name="jit(train_step)/decoder/attention/pallas_call"}, backend_config={"custom_call_config":{"body":"eA=="}}
  %buffer = f32[1024,256]{1,0} custom-call(), custom_call_target="AllocateBuffer"
  %state64 = u64[2]{0} custom-call(%x_in, %x_in), custom_call_target="X64Combine"
  %q4 = bf16[2,4,256,64]{3,2,1,0} parameter(2)
  %k4 = bf16[2,4,512,64]{3,2,1,0} parameter(3)
  %flash_mha_bwd_dq_block_q_major_128.1 = bf16[2,4,256,64]{3,2,1,0} custom-call(%q4, %k4), custom_call_target="tpu_custom_call", metadata={op_name="jit(train_step)/decoder/self_attention._attend/shard_map/pallas_call"}, backend_config={"custom_call_config":{"body":"eA=="}}
  %rng_state = u32[2]{0} parameter(4)
  %bits = u32[1024,256]{1,0:S(1)} rng-bit-generator(%rng_state), algorithm=rng_default, metadata={op_name="jit(train_step)/jvp(Transformer)/Transformer.decode/decoder/layer_0/ffn_block/Dropout_0/jit(_bernoulli)/jit(_uniform)"}
  %few_bits = u32[2,128]{1,0} rng-bit-generator(%rng_state), algorithm=rng_default
  %to_vmem = (f32[1024,256]{1,0}, f32[1024,256]{1,0:S(1)}, u32[]) copy-start(%w)
  %in_vmem = f32[1024,256]{1,0:S(1)} copy-done(%to_vmem)
  %to_hbm = f32[1024,256]{1,0:T(8,128)} copy(%in_vmem)
  %within_vmem = f32[1024,256]{1,0:T(8,128)S(1)} copy(%in_vmem)
  ROOT %out = f32[1024,256]{1,0} add(%opaque, %in_vmem), metadata={op_name="jit(train_step)/optimizer/add"}, backend_config={"estimated_cycles":"250"}
}
"""

MIB = 1024 * 256 * 4  # bytes of f32[1024,256]


def _by_name(profile):
  return {c.op.name: c for c in profile.ops}


def test_a_loops_ops_count_by_its_test_and_fused_ops_count_once_as_their_fusion():
  assert op_profile.computation_runs(PROGRAM)["layer_body"] == 6
  ops = {op.name: op for op in op_profile.parse(PROGRAM)}
  assert "inner" not in ops and "sum" not in ops  # inside a fusion / a reducer
  assert (ops["query"].runs, ops["query"].cycles) == (6, 1500)
  assert (ops["loss"].runs, ops["loss"].cycles) == (1, 3000)
  assert ops["flash"].cost_estimate["flops"] == 197e9
  assert ops["opaque"].cost_estimate is None
  assert ops["opaque"].operand_bytes == ops["opaque"].result_bytes == MIB
  # A reduce-scatter, as TPU writes it: an all-reduce inside a fusion, counted as one.
  assert "my_part" not in ops and ops["scattered"].cycles is None
  assert ops["scatter_sum"].collective == "reduce-scatter"
  assert ops["scatter_sum"].sent_bytes == pytest.approx(0.75 * MIB)
  totals = op_profile.collectives(PROGRAM, [0, 0, 0, 0])
  assert totals["reduce-scatter"]["count"] == 1 and totals["all-reduce"]["count"] == 1


def test_every_op_is_costed_as_the_docstring_says():
  result = op_profile.profile(op_profile.parse(PROGRAM), V5E)
  ops = _by_name(result)
  clock = V5E.clock_hz
  assert clock == pytest.approx(1.503e9, rel=1e-3)  # 197 TFLOP/s over 4 MXUs of 128x128
  assert ops["query"].seconds == pytest.approx(6 * 1500 / clock)
  assert ops["loss"].seconds == pytest.approx(3000 / clock)
  assert ops["out"].seconds == pytest.approx(250 / clock)
  # Ring all-reduce over 4 chips: each sends 2 x 3/4 of the gradients, over ICI.
  assert ops["grads"].seconds == pytest.approx(2 * 0.75 * MIB / V5E.ici_bytes_per_s)
  # A kernel with its own estimate: the slower of its FLOPs at peak and its bytes.
  assert ops["flash"].seconds == pytest.approx(197e9 / V5E.peak_flops)
  assert "cost estimate" in ops["flash"].costed_by
  # One without: its bytes in and out at HBM bandwidth, flagged as leaving compute out.
  assert ops["opaque"].seconds == pytest.approx(2 * MIB / V5E.hbm_bytes_per_s)
  assert "NO cost estimate" in ops["opaque"].costed_by
  # A flash kernel without one: the slower of its FLOPs by formula, 6 per query-key
  # pair and d_k for dQ, and its bytes.
  dq = ops["flash_mha_bwd_dq_block_q_major_128.1"]
  assert dq.op.operand_dims == ((2, 4, 256, 64), (2, 4, 512, 64))
  assert op_profile.kernel_flops(dq.op) == 6 * 2 * 4 * 256 * 512 * 64
  assert dq.seconds == pytest.approx(6 * 2 * 4 * 256 * 512 * 64 / V5E.peak_flops)
  assert "formula" in dq.costed_by
  # Bookkeeping and the DMA copy take no time; the copy is counted.
  assert not {"buffer", "state64", "to_vmem", "in_vmem", "scan", "init", "next"} & set(ops)
  assert not {"scattered", "q4"} & set(ops)
  assert (result.async_copies, result.async_copy_bytes) == (1, MIB)
  assert result.step_s == pytest.approx(sum(c.seconds for c in result.ops))
  assert ops["scatter_sum"].seconds == pytest.approx(0.75 * MIB / V5E.ici_bytes_per_s)
  assert result.collectives_s == pytest.approx(ops["grads"].seconds + ops["scatter_sum"].seconds)
  assert [c.op.name for c in result.ops] == sorted(ops, key=lambda n: -ops[n].seconds)


def test_work_without_an_estimate_is_listed_and_left_out_of_the_step():
  result = op_profile.profile(op_profile.parse(PROGRAM), V5E)
  # The random bits do work and carry no estimate; a result under a MiB (scalars, loop
  # counters, a few bits) is not listed, nor is bookkeeping, an async copy's halves, or
  # the fusion around a reduce-scatter, which its collective costs.
  assert [op.name for op in result.uncosted] == ["bits", "within_vmem"]
  assert "bits" not in _by_name(result)
  summary = op_profile.summary(result, model_flops=1e9, peak_flops=V5E.peak_flops)
  assert summary["uncosted"] == [
    {"opcode": "rng-bit-generator", "part": "dropout", "count": 1, "result_bytes": MIB},
    {"opcode": "copy", "part": "copies", "count": 1, "result_bytes": MIB},
  ]
  # A copy without an estimate that writes HBM is timed by those bytes at its bandwidth.
  to_hbm = _by_name(result)["to_hbm"]
  assert to_hbm.seconds == pytest.approx(MIB / V5E.hbm_bytes_per_s)
  assert "HBM bandwidth" in to_hbm.costed_by
  line = compile_check.profile_lines(
    {
      **summary,
      "predicted": "p",
      "clock_source": "s",
      "tokens_per_s": 1.0,
      "tokens_per_s_per_chip": 1.0,
    }
  )[-1]
  assert line.startswith("  not timed") and "1 rng-bit-generator (dropout, 1 MB); 1 copy" in line


# An asynchronous all-gather over 8 chips as libtpu runs it: a start fusion, a
# continuation fused with a matmul that runs beside some of its steps, and a done, each
# holding a copy of the same collective (one channel; the continuations name the steps).
_ASYNC_GATHER = """HloModule jit_train_step

%gather_start (s0: f32[256,512]) -> (f32[256,512], f32[2048,512], s32[2]) {
  %s0 = f32[256,512]{1,0} parameter(0)
  %g0 = f32[2048,512]{1,0} all-gather(%s0), channel_id=458, replica_groups=[1,8]<=[8], dimensions={0}, backend_config={"async_collective_fusion_config":{"flag_start":"-1","flag_end":"-1"}}
  %state0 = s32[2]{0} constant({0, 0})
  ROOT %t0 = (f32[256,512]{1,0}, f32[2048,512]{1,0}, s32[2]{0}) tuple(%s0, %g0, %state0)
}

%gather_beside_matmul (s1: f32[256,512], x: bf16[3072,2048], y: f32[3072,512]) -> (f32[2048,512], f32[2048,512]) {
  %s1 = f32[256,512]{1,0} parameter(0)
  %x = bf16[3072,2048]{1,0} parameter(1)
  %y = f32[3072,512]{1,0} parameter(2)
  %wgrad = f32[2048,512]{1,0} convolution(%x, %y), dim_labels=bf_io->bf
  %g1 = f32[2048,512]{1,0} all-gather(%s1), channel_id=458, replica_groups=[1,8]<=[8], dimensions={0}, backend_config={"async_collective_fusion_config":{"flag_start":"2","flag_end":"8"}}
  ROOT %t1 = (f32[2048,512]{1,0}, f32[2048,512]{1,0}) tuple(%wgrad, %g1)
}

%gather_done (s2: f32[256,512]) -> f32[2048,512] {
  %s2 = f32[256,512]{1,0} parameter(0)
  ROOT %g2 = f32[2048,512]{1,0} all-gather(%s2), channel_id=458, replica_groups=[1,8]<=[8], dimensions={0}, backend_config={"async_collective_fusion_config":{"flag_start":"2","flag_end":"8"}}
}

ENTRY %main (shard: f32[256,512], hidden: bf16[3072,2048], grad: f32[3072,512]) -> f32[2048,512] {
  %shard = f32[256,512]{1,0} parameter(0)
  %hidden = bf16[3072,2048]{1,0} parameter(1)
  %grad = f32[3072,512]{1,0} parameter(2)
  %async-collective-start.19 = (f32[256,512]{1,0}, f32[2048,512]{1,0}, s32[2]{0}) fusion(%shard), kind=kCustom, calls=%gather_start
  %started = f32[256,512]{1,0} get-tuple-element(%async-collective-start.19), index=0
  %fusion.3606 = (f32[2048,512]{1,0}, f32[2048,512]{1,0}) fusion(%started, %hidden, %grad), kind=kOutput, calls=%gather_beside_matmul, metadata={op_name="jit(train_step)/transpose(jvp(Transformer))/Transformer.encode/encoder/layer_4/ffn_block/ffn/wo/dot_general"}, backend_config={"window_config":{"estimated_cycles":"49664"}}
  ROOT %async-collective-done.19 = f32[2048,512]{1,0} fusion(%started), kind=kCustom, calls=%gather_done
}
"""


def test_an_asynchronous_collective_counts_once_and_its_continuations_compute_by_cycles():
  ops = op_profile.parse(_ASYNC_GATHER, [0] * 8)
  gathers = [op for op in ops if op.collective is not None]
  assert [op.name for op in gathers] == ["g0"]  # the start's copy; the others are it again
  gathered = 2048 * 512 * 4
  assert gathers[0].sent_bytes == pytest.approx(gathered * 7 / 8)
  result = op_profile.profile(ops, V5E)
  assert result.collectives_s == pytest.approx(gathered * 7 / 8 / V5E.ici_bytes_per_s)
  beside = _by_name(result)["fusion.3606"]
  assert (beside.part, beside.seconds) == ("FFN", pytest.approx(49664 / V5E.clock_hz))
  assert result.step_s == pytest.approx(result.collectives_s + beside.seconds)
  assert op_profile.collectives(_ASYNC_GATHER, [0] * 8)["all-gather"]["count"] == 1
  assert not result.uncosted  # the start and the done are the collective's


# A scatter-add offloaded to a SparseCore as libtpu prints it for v5p: an async call whose
# callee runs on the "sparsecore" thread and calls a second, which holds the scatter
# fusion, whose estimated cycles are the largest int64 (no estimate); beside it, on the
# TensorCore, a fusion with a real estimate and one more with the same no-estimate value.
_SPARSECORE_SCATTER = """HloModule jit_train_step

%scatter_body (b0: f32[257], b1: s32[256], b2: f32[256]) -> f32[257] {
  %b0 = f32[257]{0} parameter(0)
  %b1 = s32[256]{0} parameter(1)
  %b2 = f32[256]{0} parameter(2)
  ROOT %scattered = f32[257]{0} scatter(%b0, %b1, %b2), update_window_dims={}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1
}

%offloaded_inner (i0: f32[257], i1: s32[256], i2: f32[256]) -> f32[257] {
  %i0 = f32[257]{0} parameter(0)
  %i1 = s32[256]{0} parameter(1)
  %i2 = f32[256]{0} parameter(2)
  ROOT %scatter_offload_custom_fusion.8 = f32[257]{0:T(512)} fusion(%i0, %i1, %i2), kind=kCustom, calls=%scatter_body, metadata={op_name="jit(train_step)/scatter-add"}, backend_config={"window_config":{"estimated_cycles":"9223372036854775807"}}
}

%offloaded (o0: f32[257], o1: s32[256], o2: f32[256]) -> f32[257] {
  %o0 = f32[257]{0} parameter(0)
  %o1 = s32[256]{0} parameter(1)
  %o2 = f32[256]{0} parameter(2)
  %copy.3613 = f32[257]{0} copy(%o0), backend_config={"estimated_cycles":"1245"}
  %inner-start = ((f32[257]{0}, s32[256]{0}, f32[256]{0}), f32[257]{0}, u32[]) call-start(%copy.3613, %o1, %o2), to_apply=%offloaded_inner
  ROOT %inner-done = f32[257]{0} call-done(%inner-start)
}

ENTRY %main (acc: f32[257], ids: s32[256], upd: f32[256], x: f32[8]) -> f32[257] {
  %acc = f32[257]{0} parameter(0)
  %ids = s32[256]{0} parameter(1)
  %upd = f32[256]{0} parameter(2)
  %x = f32[8]{0} parameter(3)
  %on_core = f32[8]{0} add(%x, %x), metadata={op_name="jit(train_step)/optimizer/add"}, backend_config={"estimated_cycles":"3000"}
  %unknown = f32[8]{0} multiply(%x, %x), backend_config={"estimated_cycles":"9223372036854775807"}
  %scatter_offload_async_start = ((f32[257]{0}, s32[256]{0}, f32[256]{0}), f32[257]{0}) call-start(%acc, %ids, %upd), async_execution_thread="sparsecore", to_apply=%offloaded, metadata={op_name="jit(train_step)/scatter-add"}
  ROOT %scatter_offload_async_done = f32[257]{0} call-done(%scatter_offload_async_start)
}
"""


def test_ops_on_a_sparsecore_are_counted_not_timed_and_no_estimate_is_not_a_time():
  ops = {op.name: op for op in op_profile.parse(_SPARSECORE_SCATTER)}
  # The called computation and what it calls run on the SparseCore; the entry does not.
  on_sparsecore = {name for name, op in ops.items() if op.sparsecore}
  assert {"copy.3613", "scatter_offload_custom_fusion.8", "inner-start"} <= on_sparsecore
  assert not {"on_core", "unknown", "scatter_offload_async_start"} & on_sparsecore
  assert "scattered" not in ops  # inside the fusion
  # libtpu's largest int64 is no estimate, on either core.
  assert ops["scatter_offload_custom_fusion.8"].cycles is None
  assert ops["unknown"].cycles is None
  result = op_profile.profile(list(ops.values()), flops.TPU_CHIPS["v5p"])
  assert [c.op.name for c in result.ops] == ["on_core"]
  assert result.step_s == pytest.approx(3000 / flops.TPU_CHIPS["v5p"].clock_hz)
  assert result.sparsecore_ops == 2  # the copy and the scatter: call halves do no work
  summary = op_profile.summary(result, model_flops=1e9, peak_flops=V5E.peak_flops)
  assert summary["sparsecore_ops"] == 2
  line = compile_check.profile_lines(
    {**summary, "predicted": "p", "tokens_per_s": 1.0, "tokens_per_s_per_chip": 1.0}
  )[-1]
  assert line.startswith("  sparsecore  2 ops")


def test_the_summary_names_parts_kernels_and_the_mfu_it_implies():
  result = op_profile.profile(op_profile.parse(PROGRAM), V5E)
  summary = op_profile.summary(result, model_flops=1e9, peak_flops=V5E.peak_flops, top=3)
  assert summary["step_s"] == pytest.approx(result.step_s)
  assert summary["mfu"] == pytest.approx(1e9 / result.step_s / V5E.peak_flops)
  parts = summary["by_part_s"]
  assert parts["projections"] == pytest.approx(_by_name(result)["query"].seconds)
  assert parts["loss"] == pytest.approx(3000 / V5E.clock_hz)
  assert parts["optimizer"] == pytest.approx(250 / V5E.clock_hz)
  assert set(parts) == {
    "projections",
    "loss",
    "optimizer",
    "collectives",
    "attention core",
    "copies",
  }
  assert set(parts) <= set(op_profile.CATEGORIES)
  assert len(summary["top_ops"]) == 3 and summary["top_ops"][0]["name"] == "flash"
  kernels = {k["name"]: k for k in summary["custom_calls"]}
  # The allocation is not a kernel.
  assert set(kernels) == {"flash", "opaque", "flash_mha_bwd_dq_block_q_major_128.1"}
  assert "NO cost estimate" in kernels["opaque"]["costed_by"]
  json.dumps(summary)  # goes into the report as it is


_ENC = "jit(train_step)/jvp(Transformer)/Transformer.encode/encoder/layers/layers/"
_DEC = "jit(train_step)/transpose(jvp(Transformer))/Transformer.decode/decoder/"


@pytest.mark.parametrize(
  "op_name, part",
  [
    (
      _ENC + "attention_block/self_attention/self_attention._self_qkv/qkv/dot_general",
      "projections",
    ),
    (
      _DEC
      + "layers/layers/cross_attention_block/cross_attention/cross_attention._cross_qkv/kv/dot_general",
      "projections",
    ),
    (_DEC + "layers/layers/cross_attention_block/cross_attention/out/dot_general", "projections"),
    (
      _ENC + "attention_block/self_attention/self_attention._attend/bhls,bshe->blhe/dot_general",
      "attention core",
    ),
    (
      _DEC + "layers/layers/self_attention_block/self_attention/self_attention._attend/exp",
      "attention core",
    ),
    (_ENC + "attention_block/norm/reduce_sum", "layer norm"),
    (_ENC + "attention_block/Dropout_0/jit(_bernoulli)/threefry2x32", "dropout"),
    (_ENC + "ffn_block/ffn/wi/dot_general", "FFN"),
    (_ENC + "ffn_block/ffn/relu/max", "FFN"),
    (_DEC + "shared_embedding.attend/nd,vd->nv/dot_general", "logits"),
    ("jit(train_step)/jvp(loss)/jit(take_along_axis)/gather", "loss"),
    ("jit(train_step)/transpose(jvp(loss))/exp", "loss"),
    (
      "jit(train_step)/jvp(Transformer)/Transformer.encode/encoder/while/body/"
      "jit(dynamic_index_in_dim)/dynamic_slice",
      "layer loop",
    ),
    ("jit(train_step)/optimizer/mul", "optimizer"),
    (_DEC + "input/shared_embedding/_take/gather", "embedding"),
    ("jit(train_step)/convert_element_type", "other"),
  ],
)
def test_ops_are_put_in_their_model_part_by_source_path(op_name, part):
  op = op_profile.Op("fusion.1", "fusion", "main", 1, 10, op_name, 4, 4)
  assert op_profile.part_of(op) == part


needs_libtpu = pytest.mark.skipif(
  compile_check.tpu_library_path() is None,
  reason="libtpu is not installed: `make test` installs it into .venv/libtpu on Linux "
  "x86-64 only (its one wheel)",
)

# A large bf16 matmul, once and as a loop of 3, compiled for one chip of each kind: the
# compiler's cycles at TpuChip.clock_hz must put the matmul near, and never above, the
# chip's peak; the loop's matmul must run 3 times (its test read from the text).
_CALIBRATE = """
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from transformer.tools import compile_check, op_profile
N = 4096
out = {}
for name in sys.argv[1:]:
  tpu_slice = compile_check.parse_slice(name)
  device = compile_check.slice_devices(tpu_slice)[0]
  a = jax.ShapeDtypeStruct((N, N), jnp.bfloat16, sharding=SingleDeviceSharding(device))
  def looped(x, y):
    return jax.lax.fori_loop(0, 3, lambda i, z: (z @ y).astype(jnp.bfloat16), x)
  for fn_name, fn in (("once", lambda x, y: x @ y), ("looped", looped)):
    compiled = jax.jit(fn).lower(a, a).compile()
    result = op_profile.profile(op_profile.parse(compiled.as_text()), tpu_slice.chip)
    matmul = result.ops[0]  # the longest op
    out[f"{name} {fn_name}"] = [matmul.op.runs, matmul.seconds, result.step_s]
print(json.dumps(out))
"""


@needs_libtpu
def test_each_chips_clock_puts_libtpus_estimate_of_a_large_matmul_near_its_peak():
  names = ["v5e-1", "v4-8", "v5p-8", "v6e-1"]
  result = subprocess.run(
    [sys.executable, "-c", _CALIBRATE, *names],
    capture_output=True,
    text=True,
    env=subprocess_env(1),
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  measured = json.loads(result.stdout.strip().splitlines()[-1])
  for name in names:
    chip = compile_check.parse_slice(name).chip
    runs, matmul_s, step_s = measured[f"{name} once"]
    assert runs == 1 and matmul_s == step_s
    utilization = 2 * 4096**3 / step_s / chip.peak_flops
    # Seen with libtpu 0.0.42.1 at 8192: v5e 0.88, v4 0.93, v5p 0.90, v6e 0.71.
    assert 0.5 < utilization <= 1.0, (name, utilization)
    # In the loop the same matmul runs 3 times, beside a copy of the carry each time (the
    # compiler tiles it a little differently there: v4 13% slower per run).
    runs, looped_s, looped_step_s = measured[f"{name} looped"]
    assert runs == 3 and looped_s == pytest.approx(3 * matmul_s, rel=0.25)
    assert looped_step_s > looped_s
