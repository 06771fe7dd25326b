"""The TPU compiler's own prediction of a step, op by op: a profile before the first run.

After optimization, libtpu writes the estimate of its cost model into each op it
schedules on the TensorCore: `"estimated_cycles"` in the op's backend_config, in the
compiled program's text (`compiled.as_text()`). Summed over the ops that run (a loop's
body times its trip count) and divided by the chip's clock, that is the compiler's own
prediction of the step's compute time. It is a better predictor than a roofline on XLA's
whole-program "bytes accessed", which counts operands that live in the chip's on-chip
memory, re-reads inside fusions and background HBM-VMEM copies as if each were HBM
traffic (docs/performance.md, "Which prediction to trust").

    ops = parse(compiled.as_text())
    result = profile(ops, chip)          # Profile: seconds per op, per model part, in all

What each kind of op costs here:
- an op with `estimated_cycles`: those cycles at the chip's clock (TpuChip.clock_hz);
- a collective (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute):
  the bytes one chip sends under a ring algorithm over ICI's bandwidth, as if not hidden
  behind compute (a scanned model's gradients are reduced after its layer loop). One that
  libtpu runs asynchronously, as a start fusion, continuations fused with other work and
  a done, each holding a copy of it, counts once, at its start; the continuations' own
  work is costed by their cycles;
- a Pallas kernel (custom call "tpu_custom_call"): the roofline of its own cost estimate
  (FLOPs at peak or bytes at HBM bandwidth, the slower) when it carries one; otherwise
  only its operands' and results' bytes at HBM bandwidth, which leaves its compute out.
  Either way it is listed in `Profile.custom_calls` with how it was costed: the compiler
  gives such kernels no cycles of its own;
- bookkeeping (parameters, tuples, bitcasts, buffer allocations, loop control) and
  asynchronous DMA copies between HBM and on-chip memory (copy-start/-done, which run
  beside the TensorCore): nothing. The number and bytes of those copies are reported;
- an op on a SparseCore (v4's and v5p's, which run the computations of an async call
  marked `async_execution_thread="sparsecore"` beside the TensorCore; XLA offloads small
  scatter-adds there): nothing, and their number is reported. libtpu writes the largest
  int64 as their estimated cycles, which is read, like that value anywhere, as no
  estimate;
- a copy that libtpu gives no estimate (one between VMEM and HBM, as the gathered
  parameters' are): its bytes on the HBM side at HBM bandwidth;
- any other op that libtpu gives no estimate: nothing, and it is listed
  (`Profile.uncosted`, the report's "uncosted") with its count and bytes, so that a
  reader knows what the step time leaves out. In the WMT steps these are the dropout
  masks' random bits under rbg (rng-bit-generator, written to on-chip memory), the
  embedding lookups' gradient (a scatter) and copies within VMEM.

Every op is put in one model part by the source path JAX records in its `op_name`
metadata (flax names each module on it): attention core, projections, FFN, logits, loss,
optimizer, dropout (its random bits and masks), layer norm, embedding, collectives, copies,
other.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from typing import Any

import numpy as np

from transformer.training import flops

# --- The program's text: arrays, computations, instructions.

DTYPE_BYTES = {
  "pred": 1,
  "s4": 1,
  "u4": 1,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "bf16": 2,
  "f16": 2,
  "s16": 2,
  "u16": 2,
  "f32": 4,
  "s32": 4,
  "u32": 4,
  "f64": 8,
  "s64": 8,
  "u64": 8,
  "c64": 8,
  "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")  # dtype, dims, layout
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>\S+) .*\{\s*$")
_INSTRUCTION = re.compile(
  r"^\s*(?P<root>ROOT )?%(?P<name>[^\s=]+) = (?P<type>.*?) (?P<opcode>[a-z][a-z0-9\-]*)\("
)
_CALLED = re.compile(r"(?:body|condition|calls|to_apply|branch_computations)=\{?([^,}]*)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
# libtpu writes the largest int64 where its cost model has no estimate (the fusions it
# runs on a SparseCore carry it): no estimate, not 5e9 seconds.
_UNKNOWN_CYCLES = 2**63 - 1
# An async call whose callee runs on a SparseCore (v4's and v5p's, beside the
# TensorCore): XLA offloads small scatters there, such as a scatter-add's.
_SPARSECORE_CALL = re.compile(r'async_execution_thread="sparsecore"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_COST_ESTIMATE = re.compile(r'"cost_estimate":(\{[^{}]*\})')
_OPERANDS = re.compile(r"%([^\s,()]+)")
# libtpu runs an asynchronous collective as a chain of fusions that each hold a copy of
# the whole collective: a start (flags -1), then continuations, each running some of its
# steps beside other work (a matmul's fusion, say, whose cycles are that matmul's), and a
# done. A continuation's copy names steps (a flag_start of 0 or more): it is the same
# collective as its start's, whose channel it shares, and is not counted again.
_ASYNC_CONTINUATION = re.compile(r'"async_collective_fusion_config":\{"flag_start":"(?!-1")')


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...], str]]:
  """(dtype, shape, layout) of each array in an HLO type: 'bf16[8,1024]{1,0}' or a tuple
  of them."""
  return [
    (dtype, tuple(int(d) for d in dims.split(",") if d), layout)
    for dtype, dims, layout in _ARRAY.findall(type_text)
    if dtype in DTYPE_BYTES
  ]


def array_dims(type_text: str) -> list[tuple[int, ...]]:
  """The shape of each array in an HLO type."""
  return [dims for _, dims, _ in _arrays(type_text)]


def array_bytes(type_text: str) -> list[int]:
  """Bytes of each array in an HLO type."""
  return [math.prod(dims) * DTYPE_BYTES[dtype] for dtype, dims, _ in _arrays(type_text)]


def hbm_bytes(type_text: str) -> int:
  """Bytes of the arrays in an HLO type that live in HBM: those whose layout does not
  put them in memory space 1 (`S(1)`, TPU's on-chip VMEM)."""
  return sum(
    math.prod(dims) * DTYPE_BYTES[dtype]
    for dtype, dims, layout in _arrays(type_text)
    if "S(1)" not in layout
  )


_CONSTANT = re.compile(r"^\s*%(?P<name>[^\s=]+) = s32\[\]\S* constant\((?P<value>-?\d+)\)")
_LOOP_TEST = re.compile(
  r"^\s*ROOT %\S+ = pred\[\]\S* compare\(%(?P<a>[^\s,]+), %(?P<b>[^\s,)]+)\), "
  r"direction=(?P<direction>LT|LE|GT|GE)"
)


def _loop_trip_counts(hlo_text: str) -> dict[str, int]:
  """{condition computation: trip count} of the program's counted loops.

  TPU's compiled programs drop XLA's `known_trip_count`; what stays is the loop's test:
  the condition's ROOT compares the counter with a constant, `counter < N` (`<= N - 1`),
  the counter starting at 0, as XLA writes a scan. A loop without such a test is missing
  here, and counts once."""
  trips: dict[str, int] = {}
  current: str | None = None
  constants: dict[str, int] = {}
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current, constants = match.group("name"), {}
      continue
    constant = _CONSTANT.match(line)
    if constant:
      constants[constant.group("name")] = int(constant.group("value"))
      continue
    test = _LOOP_TEST.match(line)
    if test and current is not None:
      direction = test.group("direction")
      if direction in ("LT", "LE") and test.group("b") in constants:
        trips[current] = constants[test.group("b")] + (direction == "LE")
      elif direction in ("GT", "GE") and test.group("a") in constants:
        trips[current] = constants[test.group("a")] + (direction == "GE")
  return trips


def loop_trip_count(line: str, trips: dict[str, int]) -> int | None:
  """A while instruction's trip count: XLA's known_trip_count where the text keeps it,
  else its condition's test (_loop_trip_counts); None when neither tells."""
  known = _TRIP_COUNT.search(line)
  if known:
    return int(known.group(1))
  condition = re.search(r"condition=%([^\s,]+)", line)
  return trips.get(condition.group(1)) if condition else None


def called_computations(line: str) -> list[str]:
  """The computations an instruction calls: a loop's body and condition, a fusion's or
  a call's callee, a reducer, a conditional's branches."""
  return [
    name.strip().lstrip("%")
    for called in _CALLED.findall(line)
    for name in called.split(",")
    if name.strip().lstrip("%")
  ]


def computation_runs(hlo_text: str) -> dict[str, int]:
  """How many times each computation runs per step: a while loop's body and condition
  its trip count times (scanned layers), everything else once per caller."""
  trips = _loop_trip_counts(hlo_text)
  callers: dict[str, list[tuple[str, int]]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group("name")
      if line.startswith("ENTRY"):
        entry = current
      continue
    if current is None:
      continue
    times = (loop_trip_count(line, trips) or 1) if " while(" in line else 1
    for name in called_computations(line):
      callers.setdefault(name, []).append((current, times))
  counts: dict[str, int] = {}

  def count(name: str, seen: frozenset = frozenset()) -> int:
    if name == entry:
      return 1
    if name not in counts:
      counts[name] = sum(
        times * count(caller, seen | {name})
        for caller, times in callers.get(name, [])
        if caller not in seen
      )
    return counts[name]

  return {name: count(name) for name in callers} | ({entry: 1} if entry else {})


def replica_groups(line: str, num_devices: int) -> list[list[int]]:
  """The device groups of a collective instruction, in any of the forms XLA prints:
  "mesh['axis_0'=2,'axis_1'=2], device_ids=([2,2]T(1,0)) {'axis_0'}" (the devices laid out
  on named axes, grouped along those in braces), '[2,4]<=[4,2]T(1,0)' (an iota, maybe
  transposed), '{{0,1},{2,3}}', a permute's source_target_pairs; all devices when empty."""
  named = re.search(
    r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
    r" \{([^}]*)\}",
    line,
  )
  if named:
    axes = [(name, int(size)) for name, size in re.findall(r"'(\w+)'=(\d+)", named.group(1))]
    ids = np.arange(math.prod(size for _, size in axes))
    if named.group(2):
      ids = ids.reshape([int(n) for n in named.group(2).split(",")])
      if named.group(3):
        ids = ids.transpose([int(n) for n in named.group(3).split(",")])
    ids = ids.reshape([size for _, size in axes])
    grouped = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in named.group(4)]
    ids = np.moveaxis(ids, grouped, list(range(len(axes) - len(grouped), len(axes))))
    return ids.reshape(-1, math.prod(axes[i][1] for i in grouped)).tolist()
  iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if iota:
    shape = [int(n) for n in iota.group(1).split(",")]
    ids = np.arange(math.prod(shape)).reshape([int(n) for n in iota.group(2).split(",")])
    if iota.group(3):
      ids = ids.transpose([int(n) for n in iota.group(3).split(",")])
    return ids.reshape(shape[0], -1).tolist()
  explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
  if explicit and explicit.group(1):
    return [
      [int(n) for n in g.split(",") if n] for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))
    ]
  pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
  if pairs:
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
  return [list(range(num_devices))]


def _collective_sent(op: str, computation: str, sizes: list[int], line: str, n: int):
  """(op as counted, bytes one chip sends) under a ring algorithm over a group of n."""
  # An async start's tuple holds its operand and result; a combined op's, all of them.
  result = max(sizes) if "-start(" in line else sum(sizes)
  if op == "all-reduce" and computation.startswith("all-reduce-scatter"):
    # TPU writes a reduce-scatter as this fusion: an all-reduce, then each chip's slice.
    return "reduce-scatter", result * (n - 1) / n
  return op, {
    "all-gather": result * (n - 1) / n,
    "reduce-scatter": result * (n - 1),
    "all-reduce": 2 * result * (n - 1) / n,
    "all-to-all": result * (n - 1) / n,
    "collective-permute": result,
  }[op]


# --- Ops.


@dataclasses.dataclass(frozen=True)
class Op:
  """One instruction of the compiled program, as the profile sees it."""

  name: str  # "fusion.24"
  opcode: str  # "fusion", "convolution", "custom-call", "all-reduce-start", ...
  computation: str  # the computation it sits in
  runs: int  # times it runs per step: its loops' trip counts multiplied
  cycles: int | None  # libtpu's estimated_cycles for one run; None where it gives none
  op_name: str  # JAX's source path: "jit(train_step)/.../encoder/layers/attention/..."
  result_bytes: int
  operand_bytes: int
  custom_call_target: str | None = None
  cost_estimate: dict[str, float] | None = None  # a Pallas kernel's own, when it has one
  operand_dims: tuple[tuple[int, ...], ...] = ()  # a custom call's operands' shapes
  collective: str | None = None  # "all-reduce", ... for a collective
  sent_bytes: float = 0.0  # what one chip sends per run (ring model), a collective's
  across_slices: bool = False  # a collective whose groups span slices (DCN)
  wraps_collective: bool = False  # a fusion around a collective, which is costed instead
  hbm_bytes: int = 0  # a copy's bytes read or written in HBM (not VMEM)
  sparsecore: bool = False  # runs on a SparseCore, beside the TensorCore


def _program_index(
  lines: list[str],
) -> tuple[set[str], dict[str, str], set[str], set[str]]:
  """(the computations that run inside an op, each instruction's result type, the
  computations that hold a collective, the computations that run on a SparseCore). A
  fusion's body or an op's reducer does not run as ops of its own: the fusion (the
  reduce) is the op, and carries the cycles."""
  inside: set[str] = set()
  result_types: dict[str, str] = {}
  with_collective: set[str] = set()
  callees: dict[str, set[str]] = collections.defaultdict(set)
  sparsecore: set[str] = set()
  computation = ""
  for line in lines:
    match = _COMPUTATION.match(line)
    if match:
      computation = match.group("name")
      continue
    instruction = _INSTRUCTION.match(line)
    if not instruction:
      continue
    opcode = instruction.group("opcode")
    if opcode.removesuffix("-start") in COLLECTIVES:
      with_collective.add(computation)
    result_types[instruction.group("name")] = instruction.group("type")
    callees[computation].update(called_computations(line))
    if _SPARSECORE_CALL.search(line):
      sparsecore.update(called_computations(line))
    if opcode in ("while", "conditional", "call") or opcode.endswith("-start"):
      continue  # their bodies, branches and callees run as ops of their own
    for fused in re.finditer(r"(?:calls|to_apply)=%([^\s,}]+)", line):
      inside.add(fused.group(1))
  # What a SparseCore's computation calls runs there too.
  pending = list(sparsecore)
  while pending:
    for callee in callees[pending.pop()] - sparsecore:
      sparsecore.add(callee)
      pending.append(callee)
  return inside, result_types, with_collective, sparsecore


def parse(hlo_text: str, device_slices: list[int] | None = None) -> list[Op]:
  """Every instruction of the executed computations (not those inside a fusion or a
  reducer), with how often it runs. `device_slices[i]`: the slice of the program's
  device i, which decides whether a collective goes over DCN (default: one slice)."""
  runs = computation_runs(hlo_text)
  lines = hlo_text.splitlines()
  inside, result_types, with_collective, sparsecore = _program_index(lines)
  result_bytes = {name: sum(array_bytes(t)) for name, t in result_types.items()}
  ops: list[Op] = []
  current = ""
  num_devices = len(device_slices) if device_slices else 1
  for line in lines:
    match = _COMPUTATION.match(line)
    if match:
      current = match.group("name")
      continue
    instruction = _INSTRUCTION.match(line)
    if not instruction:
      continue
    opcode = instruction.group("opcode")
    base = opcode.removesuffix("-start")
    if current in inside and base not in COLLECTIVES:
      # (A collective inside a fusion is still one: TPU writes a reduce-scatter as an
      # "all-reduce-scatter" fusion around an all-reduce.)
      continue
    if base in COLLECTIVES and _ASYNC_CONTINUATION.search(line):
      continue  # counted at its start
    cycles = _CYCLES.search(line)
    op_name = _OP_NAME.search(line)
    target = _TARGET.search(line)
    estimate = _COST_ESTIMATE.search(line)
    operands_text = line[instruction.end() :].split(")", 1)[0]
    operands = _OPERANDS.findall(operands_text)
    collective, sent, across = None, 0.0, False
    if base in COLLECTIVES and not opcode.endswith("-done"):
      sizes = array_bytes(instruction.group("type"))
      groups = replica_groups(line, num_devices)
      n = max(len(g) for g in groups)
      collective, sent = _collective_sent(base, current, sizes, line, n)
      if device_slices:
        across = any(
          len({device_slices[i] for i in g if i < len(device_slices)}) > 1 for g in groups
        )
    ops.append(
      Op(
        name=instruction.group("name"),
        opcode=opcode,
        computation=current,
        runs=runs.get(current, 1),
        cycles=(
          int(cycles.group(1)) if cycles and int(cycles.group(1)) != _UNKNOWN_CYCLES else None
        ),
        op_name=op_name.group(1) if op_name else "",
        result_bytes=result_bytes[instruction.group("name")],
        operand_bytes=sum(result_bytes.get(name, 0) for name in operands),
        custom_call_target=target.group(1) if target else None,
        cost_estimate=(
          {k: float(v) for k, v in json.loads(estimate.group(1)).items()} if estimate else None
        ),
        operand_dims=tuple(
          dims for name in operands for dims in array_dims(result_types.get(name, ""))
        )
        if opcode == "custom-call"
        else (),
        collective=collective,
        sent_bytes=sent,
        across_slices=across,
        hbm_bytes=(
          hbm_bytes(instruction.group("type"))
          + sum(hbm_bytes(result_types.get(name, "")) for name in operands)
        )
        if opcode == "copy"
        else 0,
        wraps_collective=any(
          called.group(1) in with_collective for called in re.finditer(r"calls=%([^\s,}]+)", line)
        ),
        sparsecore=current in sparsecore,
      )
    )
  return ops


def collectives(hlo_text: str, device_slices: list[int]) -> dict[str, dict[str, float]]:
  """{op: {count, ici_bytes, dcn_bytes}} of a compiled program, per chip per step.

  Bytes are what one chip sends under a ring algorithm over its group of n: an
  all-gather's result (n-1)/n, a reduce-scatter's (n-1) times its result, an all-reduce's
  2 (n-1)/n, an all-to-all's (n-1)/n, a permute's whole. A group whose devices sit on
  several slices (`device_slices[i]`: the slice of the program's device i) goes over DCN.
  """
  return collective_totals(parse(hlo_text, device_slices))


def collective_totals(ops: list[Op]) -> dict[str, dict[str, float]]:
  """collectives() of ops already parsed."""
  out = {op: {"count": 0, "ici_bytes": 0.0, "dcn_bytes": 0.0} for op in COLLECTIVES}
  for op in ops:
    if op.collective is None or op.runs == 0 or not op.result_bytes:
      continue
    out[op.collective]["count"] += op.runs
    out[op.collective]["dcn_bytes" if op.across_slices else "ici_bytes"] += op.runs * op.sent_bytes
  return out


# --- Model parts.

CATEGORIES = (
  "attention core",
  "projections",
  "FFN",
  "logits",
  "loss",
  "optimizer",
  "dropout",
  "layer norm",
  "embedding",
  "layer loop",
  "collectives",
  "copies",
  "other",
)

# The first rule whose pattern an op's source path matches names its part. flax puts each
# module's name and method on the path ("encoder/layers/layers/attention_block/
# self_attention/self_attention._attend/..."); the train step names its "loss" and
# "optimizer" scopes (transformer/training/steps.py; under differentiation JAX writes
# "jvp(loss)"). "layer loop": a scanned stack slicing each layer's parameters out of the
# stack and its saved activations into it. Order matters: a sublayer's norm and dropout
# sit under its "attention_block".
_PART_RULES: tuple[tuple[str, re.Pattern], ...] = (
  ("dropout", re.compile(r"dropout|threefry|random_bits|bernoulli|rng_bit_generator")),
  ("optimizer", re.compile(r"[/(]optimizer\b")),
  ("loss", re.compile(r"[/(]loss\b")),
  ("layer loop", re.compile(r"while/body/(jit\()?dynamic_(update_)?(index_in_dim|slice)")),
  ("logits", re.compile(r"\.attend\b|output_projection|logits")),
  ("layer norm", re.compile(r"/(final_)?norm\b|layer_?norm")),
  ("projections", re.compile(r"_qkv\b|/(qkv|kv|query|key|value)\b|_attention/out\b")),
  ("attention core", re.compile(r"attention|_attend\b")),
  ("FFN", re.compile(r"/ffn\b|/mlp\b")),
  ("embedding", re.compile(r"embedding|/input\b|position")),
)


def part_of(op: Op) -> str:
  """The model part an op belongs to (CATEGORIES)."""
  if op.collective is not None:
    return "collectives"
  if op.opcode in ("copy", "copy-start", "copy-done") or op.name.startswith("copy"):
    return "copies"
  path = op.op_name.lower()
  if "/" not in path:
    # Made by the compiler, not traced from the model (a loop's zero-filled buffers,
    # cloned broadcasts): inside a loop they belong to its stepping, elsewhere to nothing.
    return "layer loop" if op.runs > 1 else "other"
  for part, pattern in _PART_RULES:
    if pattern.search(path):
      return part
  return "other"


# --- The profile.

# Custom calls that do no work of their own: the compiler's buffer bookkeeping, and
# X64Combine, which makes a random bit generator's 64-bit state of two 32-bit words.
BOOKKEEPING_CALLS = frozenset(
  {
    "AllocateBuffer",
    "ConcatBitcast",
    "Sharding",
    "SPMDFullToShardShape",
    "SPMDShardToFullShape",
    "X64Combine",
  }
)
PALLAS_KERNEL = "tpu_custom_call"


@dataclasses.dataclass(frozen=True)
class CostedOp:
  op: Op
  part: str
  seconds: float  # per step: one run's time times its runs
  costed_by: str  # "estimated cycles", "ring model", "kernel's cost estimate", ...


@dataclasses.dataclass(frozen=True)
class Profile:
  """The predicted step, op by op, on one chip."""

  clock_hz: float
  ops: list[CostedOp]  # every op with a time, longest first
  async_copies: int  # DMA copies between HBM and on-chip memory, per step (not timed)
  async_copy_bytes: int
  uncosted: tuple[Op, ...] = ()  # ops that do work but carry no estimate (not timed)
  sparsecore_ops: int = 0  # ops run on a SparseCore, beside the TensorCore, per step

  @property
  def step_s(self) -> float:
    return sum(c.seconds for c in self.ops)

  @property
  def compute_s(self) -> float:
    """The ops on the TensorCore (all but collectives)."""
    return sum(c.seconds for c in self.ops if c.part != "collectives")

  @property
  def collectives_s(self) -> float:
    return sum(c.seconds for c in self.ops if c.part == "collectives")

  def by_part(self) -> dict[str, float]:
    """Seconds per model part, longest first."""
    totals: dict[str, float] = collections.defaultdict(float)
    for c in self.ops:
      totals[c.part] += c.seconds
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))

  def custom_calls(self) -> list[CostedOp]:
    return [c for c in self.ops if c.op.opcode == "custom-call"]


def _seconds(op: Op, chip: flops.TpuChip) -> tuple[float, str] | None:
  """One run's seconds and how they were costed; None for ops that cost nothing here."""
  if op.sparsecore:
    return None  # beside the TensorCore, like a DMA copy: counted, not timed
  if op.cycles is not None:
    return op.cycles / chip.clock_hz, "estimated cycles"
  if op.collective is not None:
    bandwidth = chip.dcn_bytes_per_s if op.across_slices else chip.ici_bytes_per_s
    return op.sent_bytes / bandwidth, "ring model, not hidden behind compute"
  if op.opcode == "copy" and op.hbm_bytes:
    return op.hbm_bytes / chip.hbm_bytes_per_s, "no estimate: its bytes in HBM at HBM bandwidth"
  if op.opcode == "custom-call" and op.custom_call_target not in BOOKKEEPING_CALLS:
    if op.cost_estimate is not None:
      return (
        max(
          op.cost_estimate.get("flops", 0.0) / chip.peak_flops,
          op.cost_estimate.get("bytes_accessed", 0.0) / chip.hbm_bytes_per_s,
        ),
        "kernel's own cost estimate (roofline of its FLOPs and bytes)",
      )
    bytes_s = (op.operand_bytes + op.result_bytes) / chip.hbm_bytes_per_s
    formula = kernel_flops(op)
    if formula is not None:
      return (
        max(formula / chip.peak_flops, bytes_s),
        "no cost estimate: FLOPs by the kernel's formula (every tile) and its operands' "
        "and results' bytes, the slower at peak",
      )
    return bytes_s, "NO cost estimate: its operands' and results' bytes only, compute not counted"
  return None


# Pallas FlashAttention's kernels (jax.experimental.pallas.ops.tpu.flash_attention), by
# the name JAX gives their custom calls: the matmuls per query-key pair and d_k, each
# 2 FLOPs per multiply-add. Forward: Q K^T and P V (4). Backward for dK and dV: Q K^T
# again, dO V^T, P^T dO and dS^T Q (8); for dQ: Q K^T, dO V^T and dS K (6).
_KERNEL_MATMUL_FLOPS = (
  (re.compile(r"^flash_mha_bwd_dkv"), 8),
  (re.compile(r"^flash_mha_bwd_dq"), 6),
  (re.compile(r"^flash_attention"), 4),
)


def kernel_flops(op: Op) -> float | None:
  """A known kernel's FLOPs from its operands, or None. The flash kernels' first two
  4-d operands are Q [B, H, L, K] and K [B, H, S, K]. Every tile is counted: a causal
  kernel skips the tiles above the diagonal, nearly half at long lengths, so this is
  an upper bound there."""
  for pattern, per_pair in _KERNEL_MATMUL_FLOPS:
    if pattern.match(op.name):
      q_and_k = [dims for dims in op.operand_dims if len(dims) == 4][:2]
      if len(q_and_k) < 2:
        return None
      (batch, heads, length, d_k), (_, _, source_len, _) = q_and_k
      return float(per_pair * batch * heads * length * source_len * d_k)
  return None


# Ops that only name, pass or wait for data another op makes, and loop control: no work
# of their own. An async op's halves (-start, -done: DMA copies and slices between HBM and
# on-chip memory, a collective's) are costed, where they are, by the collective.
_NO_WORK = frozenset(
  {
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "constant",
    "after-all",
    "partition-id",
    "replica-id",
    "while",
    "conditional",
    "call",
    "opt-barrier",
    "add-dependency",
  }
)
# Smaller results than this (loop counters, scalars of index arithmetic) are not listed.
UNCOSTED_MIN_BYTES = 1 << 20


def _is_uncosted(op: Op) -> bool:
  """An op that does work (a result of at least UNCOSTED_MIN_BYTES) and that libtpu gave
  no estimate: rng-bit-generator (the dropout masks' bits with rbg), a scatter fusion
  (the embedding lookups' gradient), some copies. The profile leaves it out of the step
  time and lists it, rather than guess its cost."""
  return (
    op.cycles is None
    and op.collective is None
    and not op.wraps_collective
    and op.opcode not in _NO_WORK
    and not op.opcode.endswith(("-start", "-done"))
    and op.opcode != "custom-call"  # costed or bookkeeping: _seconds decides
    and op.result_bytes >= UNCOSTED_MIN_BYTES
  )


def profile(ops: list[Op], chip: flops.TpuChip) -> Profile:
  """Each op's predicted seconds per step on `chip`, the async copies' count and the ops
  that do work without an estimate."""
  costed, copies, copy_bytes, uncosted, sparsecore_ops = [], 0, 0, [], 0
  for op in ops:
    if op.opcode == "copy-start":
      copies += op.runs
      copy_bytes += op.runs * op.operand_bytes  # its result tuple also holds the copy
    if op.sparsecore:
      if op.opcode not in _NO_WORK and not op.opcode.endswith(("-start", "-done")):
        sparsecore_ops += op.runs
      continue
    one = _seconds(op, chip)
    if one is None or op.runs == 0:
      if one is None and op.runs and _is_uncosted(op):
        uncosted.append(op)
      continue
    seconds, how = one
    costed.append(CostedOp(op, part_of(op), seconds * op.runs, how))
  costed.sort(key=lambda c: -c.seconds)
  return Profile(chip.clock_hz, costed, copies, copy_bytes, tuple(uncosted), sparsecore_ops)


def uncosted_totals(result: Profile) -> list[dict[str, Any]]:
  """The ops without an estimate, per opcode and model part, most bytes first:
  [{opcode, part, count, result_bytes}], per step."""
  totals: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
  for op in result.uncosted:
    entry = totals[(op.opcode, part_of(op))]
    entry[0] += op.runs
    entry[1] += op.runs * op.result_bytes
  rows = [
    {"opcode": opcode, "part": part, "count": count, "result_bytes": size}
    for (opcode, part), (count, size) in totals.items()
  ]
  return sorted(rows, key=lambda r: -r["result_bytes"])


def uncosted_text(entries: list[dict[str, Any]]) -> str:
  """uncosted_totals' entries as one phrase: '32 rng-bit-generator (dropout, 1,611 MB); ...'."""
  return "; ".join(
    f"{u['count']} {u['opcode']} ({u['part']}, {u['result_bytes'] / 1e6:,.0f} MB)" for u in entries
  )


def summary(
  result: Profile, model_flops: float, peak_flops: float, top: int = 10
) -> dict[str, Any]:
  """The profile as the report's JSON: step time, MFU, parts, top ops, custom calls."""
  step_s = result.step_s
  return {
    "step_s": step_s,
    "compute_s": result.compute_s,
    "collectives_s": result.collectives_s,
    "mfu": model_flops / step_s / peak_flops if step_s else 0.0,
    "clock_hz": result.clock_hz,
    "by_part_s": result.by_part(),
    "top_ops": [
      {
        "name": c.op.name,
        "part": c.part,
        "seconds": c.seconds,
        "runs": c.op.runs,
        "op_name": c.op.op_name,
        "costed_by": c.costed_by,
      }
      for c in result.ops[:top]
    ],
    "custom_calls": [
      {
        "name": c.op.name,
        "target": c.op.custom_call_target,
        "op_name": c.op.op_name,
        "seconds": c.seconds,
        "costed_by": c.costed_by,
      }
      for c in result.custom_calls()
    ],
    "async_copies": result.async_copies,
    "async_copy_bytes": result.async_copy_bytes,
    "sparsecore_ops": result.sparsecore_ops,
    "uncosted": uncosted_totals(result),
  }
