"""Know before you launch: compile the training step for a named TPU slice, on a CPU.

    python -m transformer.tools.compile_check --config configs/wmt14.py:big --topology v5e-256
    ... --num_slices 2 --mesh 1,16,16 --batch_tokens 65536 --seq_len 256 --json
    ... --search_mesh   (instead of --mesh: the mesh with the shortest step that fits)

Compiles the same train step `train.py` runs (`transformer.tools.memory.lower_train_step`:
`state.setup`, the config's logical axis rules and activation constraints, the
gradient-accumulation step when grad_accum_steps > 1) for compile-only devices of the
slice, made by libtpu's compiler on this machine; nothing runs and no TPU is needed. The
batch is the batching plan's longest shape, rows of max_len holding tokens_per_batch as
if every slot were a real token, in whole row shards and whole rows per host (a
bucketed run whose rows are partly padding plans more rows: pass `--batch_tokens` =
tokens_per_batch / its padding efficiency, docs/data.md). It prints, per chip, every
figure PREDICTED BY XLA'S TPU COMPILER, none of them measured:

  memory      state (parameters and Adam moments), arguments, temporaries, and their
              total against the chip's HBM ("fits, 61% of 16 GiB"); a program too large
              for the chip is one line naming what it needs, what is available and the
              largest buffers
  step        THE PREDICTION TO TRUST: the compiler's own per-op estimates of the program
              that runs (`estimated_cycles` of each op, a loop's body times its trip
              count, at the chip's clock), collectives by a ring model over ICI (an
              asynchronous one once, at its start), copies without an estimate by
              their HBM bytes, Pallas kernels by their own cost
              estimate (or flagged where they have none), ops on a SparseCore (v4,
              v5p) counted, not timed; the MFU and target tokens per second it implies
              (transformer/tools/op_profile.py). Across slices it leaves out the
              gradients' all-reduce over DCN, which the program does not show: read
              the roofline's DCN time beside it
  parts       that step's time by model part (attention core, projections, FFN, logits,
              loss, optimizer, dropout, layer norm, embedding, the layer loop's slicing,
              collectives, copies), and the top ops; "not timed": the ops that do work
              with no estimate from the compiler (the dropout's rbg bits, scatters),
              left out of the step, with their count and bytes
  cost        XLA's FLOPs and "bytes accessed" per step. XLA's cost analysis counts a
              loop's body once, so for a config with model.scan_layers these come from
              the step compiled unrolled at 1 and at 2 layers, extrapolated to N
  flops check those FLOPs against training/flops.py's formula (the one behind the MFU
              printed during training): they agree within 5%, or the report says by how
              much they differ
  collectives all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute
              in the compiled program: counts, and bytes each chip sends (ring model),
              over ICI. Across slices libtpu writes Megascale custom calls instead,
              so DCN traffic is estimated: the gradients all-reduced over the slices
  roofline    the step time if the slowest of compute (FLOPs / peak), XLA's bytes over
              HBM bandwidth, ICI and DCN transfers hid all the others, and its MFU. Kept
              as a column, not a bound: XLA's bytes count arrays that live on chip,
              re-reads inside fusions and background copies as HBM traffic
              (docs/performance.md, "Which prediction to trust"). The chips' figures
              and their sources are training/flops.py's TPU_CHIPS
  remat       how many "[SPMD] Involuntary full rematerialization" warnings the
              partitioner gave: each is a tensor gathered whole on every chip

`--search_mesh` compiles a small search of in-slice meshes instead of one (each tensor
size up to the number of heads, the other chips all data or all fsdp; a mesh the config
or the batch cannot use is refused without compiling) and reports the one with the
shortest predicted step (the per-op profile's) that fits, after a line per candidate.
Across slices that step has no DCN time: check the chosen mesh's roofline DCN.

`--decode_batch N` also compiles beam search for N sentences: its prefill (the encoder
and the first token) and one step of its loop at the longest cache, with memory per chip
and the roofline time per generated token.

libtpu is found at $TPU_LIBRARY_PATH, else under the environment's libtpu/ folder (where
`make test` installs it: .venv/libtpu), else as an installed `libtpu` package (a TPU VM's
`make install LOCK=requirements/lock-tpu.txt`). Its own log lines are kept off the
terminal.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from absl import app, flags
from ml_collections import config_flags

from transformer import cli, versions
from transformer import config as config_lib
from transformer.inference import sharding
from transformer.model import ModelConfig
from transformer.tools import memory, op_profile
from transformer.training import flops

# Its docs/results records' version: bump when what it computes changes, not on a reformat.
RECORD_VERSION = 1

_FLAG_VALUES = cli.program_flags(__name__)  # absl's only when run as a program
_CONFIG = config_flags.DEFINE_config_file(
  "config", config_lib.DEFAULT_CONFIG, "Config file.", flag_values=_FLAG_VALUES
)
_TOPOLOGY = flags.DEFINE_string(
  "topology",
  "v5e-8",
  "TPU slice: v4-8 ... v4-4096, v5e-1 ... v5e-256, v5p-8 ..., "
  "v6e-1 ... v6e-256 (cores for v4 and v5p, chips for v5e and v6e).",
  flag_values=_FLAG_VALUES,
)
_NUM_SLICES = flags.DEFINE_integer(
  "num_slices",
  1,
  "Slices joined by DCN (multi-slice); the config's mesh.dcn_* split "
  "them, or data parallelism when those are all 1.",
  flag_values=_FLAG_VALUES,
)
_MESH = flags.DEFINE_string(
  "mesh",
  None,
  "In-slice mesh sizes data,fsdp,tensor (default: the config's mesh).",
  flag_values=_FLAG_VALUES,
)
_BATCH_TOKENS = flags.DEFINE_integer(
  "batch_tokens",
  None,
  "Tokens (padded slots) per step; default: the config's "
  "tokens_per_batch in full rows, rounded down to a multiple of the row shards and hosts.",
  flag_values=_FLAG_VALUES,
)
_SEQ_LEN = flags.DEFINE_integer(
  "seq_len",
  None,
  "Source and target length of the batch (default: max_len).",
  flag_values=_FLAG_VALUES,
)
_SEARCH_MESH = flags.DEFINE_bool(
  "search_mesh",
  False,
  "Compile each in-slice mesh of a small search (every tensor size up to the heads, the "
  "rest all data or all fsdp) and report the one with the shortest predicted step that "
  "fits; each candidate's outcome goes to stderr as it compiles.",
  flag_values=_FLAG_VALUES,
)
_DECODE_BATCH = flags.DEFINE_integer(
  "decode_batch",
  0,
  "Also compile beam search's prefill and one-token step for this many sentences "
  "(config.beam_size beams each): memory per chip and time per generated token.",
  flag_values=_FLAG_VALUES,
)
_JSON = flags.DEFINE_bool(
  "json",
  False,
  "Print the report as one JSON object (fits false, or an error: a batch that does not "
  "split over the mesh, rather than exiting 1).",
  flag_values=_FLAG_VALUES,
)

PREDICTED = "predicted by XLA's TPU compiler (libtpu), not measured"

# --- Slices. Google Cloud TPU documentation, cloud.google.com/tpu/docs/<version>
# ("Supported configurations"): the accelerator type's number counts TensorCores for v4
# and v5p (two per chip, run as one "megacore" device) and chips for v5e and v6e; the ICI
# topology is the chips' shape (a 3D torus for v4 and v5p, 2D for v5e and v6e). Hosts
# hold 4 chips, but single-host v5e-8 and v6e-8 hold 8 and v5e-1 / v6e-1 one.


@dataclasses.dataclass(frozen=True)
class Slice:
  name: str  # "v5e-256"
  chip: flops.TpuChip
  topology: str  # libtpu's topology name, "v5e:16x16"
  chip_config: str  # libtpu's chip config: "megacore" fuses a v4 / v5p chip's two cores
  chips_per_host: tuple[int, int, int]  # the host's block of chips in the ICI shape

  @property
  def chips(self) -> int:
    return math.prod(int(n) for n in self.topology.split(":")[1].split("x"))

  @property
  def hosts(self) -> int:
    return self.chips // math.prod(self.chips_per_host)


def _shapes_3d() -> dict[int, str]:
  """v4 / v5p chips -> ICI shape: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ..."""
  shapes, shape = {4: "2x2x1", 8: "2x2x2"}, [2, 2, 2]
  while math.prod(shape) < 8960:
    shape[shape.index(min(shape))] *= 2
    shape.sort()
    shapes[math.prod(shape)] = "x".join(map(str, shape))
  return shapes


_SHAPES_2D = {
  1: "1x1",
  4: "2x2",
  8: "2x4",
  16: "4x4",
  32: "4x8",
  64: "8x8",
  128: "8x16",
  256: "16x16",
}


def tpu_slices() -> dict[str, Slice]:
  """Every slice name this tool knows -> its Slice."""
  slices = {}
  for version in ("v4", "v5p"):
    for chips, shape in _shapes_3d().items():
      if version == "v4" and chips > 2048:
        continue
      slices[f"{version}-{2 * chips}"] = Slice(
        f"{version}-{2 * chips}",
        flops.TPU_CHIPS[version],
        f"{version}:{shape}",
        "megacore",
        (2, 2, 1),
      )
  for version in ("v5e", "v6e"):
    for chips, shape in _SHAPES_2D.items():
      per_host = {1: (1, 1, 1), 8: (2, 4, 1)}.get(chips, (2, 2, 1))
      slices[f"{version}-{chips}"] = Slice(
        f"{version}-{chips}", flops.TPU_CHIPS[version], f"{version}:{shape}", "default", per_host
      )
  return slices


def parse_slice(name: str) -> Slice:
  slices = tpu_slices()
  if name not in slices:
    version = name.split("-")[0]
    same = [n for n in slices if n.split("-")[0] == version]
    known = ", ".join(same) if same else "v4-8 ... v4-4096, v5e-1 ... v5e-256, v5p-8 ..., v6e-1 ..."
    raise app.UsageError(f"--topology {name!r}: not a known TPU slice; known: {known}")
  return slices[name]


# --- libtpu: kept out of every other process (it is found only here).


def tpu_library_path() -> str | None:
  """libtpu.so: $TPU_LIBRARY_PATH, the environment's libtpu/ folder, or the package."""
  candidates = [
    os.environ.get("TPU_LIBRARY_PATH", ""),
    os.path.join(sys.prefix, "libtpu", "libtpu", "libtpu.so"),
  ]
  for path in candidates:
    if path and os.path.isfile(path):
      return path
  try:
    import libtpu  # type: ignore[import-not-found]  # a TPU VM's installed package
  except ImportError:
    return None
  return libtpu.get_library_path()


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
  """Everything written to file descriptor 2 meanwhile (libtpu and XLA log from C++,
  past Python's sys.stderr), as lines in the yielded list once the block ends."""
  lines: list[str] = []
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode="w+b") as capture:
    os.dup2(capture.fileno(), 2)
    try:
      yield lines
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      capture.seek(0)
      lines.extend(capture.read().decode(errors="replace").splitlines())


def slice_devices(tpu_slice: Slice, num_slices: int = 1) -> list:
  """Compile-only devices of the slice (times num_slices), made by libtpu on this host."""
  from jax.experimental import topologies

  jax.devices()  # this machine's backend first: loading libtpu later adds no TPU backend
  path = tpu_library_path()
  if path is None:
    raise app.UsageError(
      "libtpu is not installed: `make test` puts it in .venv/libtpu (Linux x86-64), or "
      "pip install --target .venv/libtpu libtpu==<the version requirements/lock-tpu.txt "
      "pins>, or set TPU_LIBRARY_PATH"
    )
  previous = os.environ.get("TPU_LIBRARY_PATH")
  os.environ["TPU_LIBRARY_PATH"] = path
  # libtpu takes /tmp/libtpu_lockfile to own a host's TPU; compiling needs none, and
  # several checks (a sweep's, the tests') may run at once.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  options: dict[str, Any] = {"chips_per_host_bounds": list(tpu_slice.chips_per_host)}
  if num_slices > 1:
    options["num_slices"] = num_slices
  try:
    with captured_stderr():
      topology = topologies.get_topology_desc(
        topology_name=tpu_slice.topology,
        platform="tpu",
        chip_config_name=tpu_slice.chip_config,
        **options,
      )
  finally:
    if previous is None:
      os.environ.pop("TPU_LIBRARY_PATH", None)
    else:
      os.environ["TPU_LIBRARY_PATH"] = previous
  return list(topology.devices)


# --- The compiled program's text (HLO parsing, trip counts, collectives and the per-op
# profile): transformer/tools/op_profile.py.

COLLECTIVES = op_profile.COLLECTIVES
collectives = op_profile.collectives
replica_groups = op_profile.replica_groups


# --- Compiling, and the report.


class OutOfMemory(Exception):
  """The program does not fit the chip's HBM; the message is the one line to print."""


_MLIR_TENSOR = re.compile(r"tensor<((?:\d+x)+)([a-z]+\d*)>")
_MLIR_BYTES = {
  "i1": 1,
  "i8": 1,
  "ui8": 1,
  "bf16": 2,
  "f16": 2,
  "i16": 2,
  "f32": 4,
  "i32": 4,
  "ui32": 4,
  "f64": 8,
  "i64": 8,
}


def largest_arrays(lowered, count: int = 3) -> list[str]:
  """The largest arrays of the program before partitioning ('f32[64,256,37000] 2.3 GiB'):
  global shapes, of which each chip holds its shard, or all where XLA gathers one whole."""
  sizes = {}
  for dims, dtype in set(_MLIR_TENSOR.findall(lowered.as_text())):
    shape = [int(d) for d in dims.rstrip("x").split("x")]
    sizes[f"{dtype}[{','.join(map(str, shape))}]"] = math.prod(shape) * _MLIR_BYTES.get(dtype, 4)
  ranked = sorted(sizes.items(), key=lambda item: -item[1])[:count]
  return [f"{shape} {_gib(size)}" for shape, size in ranked]


def _oom_line(error: Exception, tpu_slice: Slice, lowered) -> str:
  """One line from libtpu's RESOURCE_EXHAUSTED error: what the program needs, what the
  chip has, and the program's largest arrays."""
  text = str(error)
  match = re.search(
    r"required for ([^(]*)\(([\d.]+\w?)\) exceeds available HBM \(([\d.]+\w?)\)", text
  )
  if match:
    what = f"needs {match.group(2)} of HBM for {match.group(1).strip()}, {match.group(3)} available"
  else:
    what = text.strip().splitlines()[0][:300]
  return (
    f"does not fit: {what} on each {tpu_slice.chip.device_kind} chip; largest arrays "
    f"(whole, before sharding): {', '.join(largest_arrays(lowered))} ({PREDICTED})"
  )


def _compile(lowered, tpu_slice: Slice):
  """(compiled, compiler log lines); OutOfMemory with its one line."""
  with captured_stderr() as log:
    try:
      compiled = lowered.compile()
    except Exception as e:  # jax's XlaRuntimeError
      if "RESOURCE_EXHAUSTED" in str(e) or "exceeds available HBM" in str(e):
        raise OutOfMemory(_oom_line(e, tpu_slice, lowered)) from None
      raise
  return compiled, log


def _cost(compiled) -> dict[str, float]:
  cost = compiled.cost_analysis()
  if isinstance(cost, list):  # older jax: one dict per program
    cost = cost[0]
  return {"flops": float(cost.get("flops", 0.0)), "bytes": float(cost.get("bytes accessed", 0.0))}


def prepare_config(config, mesh: str | None, num_slices: int):
  """A copy with the in-slice mesh, across slices the config's dcn_* (data parallelism
  where they are all 1), and an "auto" dtype or attention kernel resolved for TPU, not
  for this machine."""
  config = copy.deepcopy(config)
  config.model.update(config_lib.resolve_auto(config.model, "tpu"))
  if mesh is not None:
    for axis, size in zip(config_lib.MESH_AXES, memory.parse_mesh(mesh)):
      config.mesh[axis] = size
  dcn = [config.mesh[f"dcn_{a}"] for a in config_lib.MESH_AXES]
  if num_slices > 1 and all(d == 1 for d in dcn):
    config.mesh.dcn_data = num_slices
  if num_slices == 1:
    for axis in config_lib.MESH_AXES:
      config.mesh[f"dcn_{axis}"] = 1
  config_lib.validate(config)
  return config


def batch_rows(config, mesh, hosts: int, seq_len: int, batch_tokens: int | None) -> int:
  """Rows of the compiled batch: whole row shards on the mesh and whole rows per host."""
  shards = sharding.batch_row_shards(mesh, sharding.axis_rules(config))
  multiple = math.lcm(shards, hosts)
  tokens = batch_tokens if batch_tokens is not None else config.tokens_per_batch
  rows = tokens // seq_len // multiple * multiple
  if rows == 0:
    # Every host feeds whole rows and every row shard holds whole rows: a batch is a
    # multiple of both. Past the host count, fewer row shards no longer help.
    fix = (
      "try a mesh with fewer data x fsdp devices (--mesh, e.g. more tensor) or a larger batch"
      if shards >= hosts
      else f"this slice needs a batch of at least {multiple * seq_len} tokens (--batch_tokens)"
    )
    raise config_lib.ConfigError(
      f"tokens_per_batch: {tokens} tokens make {tokens // seq_len} rows of {seq_len}, fewer "
      f"than the {multiple} a batch must be a multiple of ({shards} row shards on mesh "
      f"{dict(mesh.shape)}, {hosts} hosts); {fix}"
    )
  return rows


def check(
  config,
  tpu_slice: Slice,
  num_slices: int = 1,
  mesh: str | None = None,
  batch_tokens: int | None = None,
  seq_len: int | None = None,
) -> dict[str, Any]:
  """Compiles the train step for the slice; the report as a dict (see the docstring).

  A program too large for the chip returns {"fits": False, "oom": line, ...} rather
  than raising; bad input raises ConfigError or UsageError before anything compiles.
  """
  config = prepare_config(config, mesh, num_slices)
  seq_len = seq_len or config.max_len
  devices = slice_devices(tpu_slice, num_slices)
  mesh_ = sharding.create_mesh(config, devices)
  hosts = tpu_slice.hosts * num_slices
  rows = batch_rows(config, mesh_, hosts, seq_len, batch_tokens)
  chips = len(devices)
  chip = tpu_slice.chip
  report: dict[str, Any] = {
    "topology": tpu_slice.name,
    "num_slices": num_slices,
    "chips": chips,
    "device_kind": chip.device_kind,
    "mesh": {a: int(mesh_.shape[a]) for a in config_lib.MESH_AXES},
    "dcn_mesh": {a: int(config.mesh[f"dcn_{a}"]) for a in config_lib.MESH_AXES},
    "rows": rows,
    "seq_len": seq_len,
    "grad_accum_steps": int(config.grad_accum_steps),
    "scan_layers": bool(config.model.scan_layers),
    "predicted": PREDICTED,
    "libtpu": _libtpu_version(),
  }
  began = time.perf_counter()
  run, lowered = memory.lower_train_step(config, None, rows, seq_len, devices=devices)
  try:
    compiled, log = _compile(lowered, tpu_slice)
  except OutOfMemory as e:
    report.update(
      fits=False, oom=str(e), hbm=chip.hbm_bytes, compile_s=round(time.perf_counter() - began, 1)
    )
    return report
  report.update(_memory(compiled, run, chip, log))
  cost, report["cost_from"] = _step_cost(compiled, config, tpu_slice, rows, seq_len, devices)
  report["compile_s"] = round(time.perf_counter() - began, 1)
  report.update(cost)
  # Collectives and the per-op profile come from the program that runs (a scanned
  # config's loop counted by its trip count), not from a copy compiled for the cost.
  slice_of = [getattr(d, "slice_index", 0) for d in mesh_.devices.flat]
  ops = op_profile.parse(compiled.as_text(), slice_of)
  report["collectives"] = op_profile.collective_totals(ops)
  report.update(roofline(report, config, chip))
  report["profile"] = predicted_profile(ops, report, chip)
  return report


def _memory(compiled, run, chip: flops.TpuChip, log: list[str]) -> dict[str, Any]:
  """Bytes per chip of the compiled step, whether they fit, and the partitioner's
  involuntary rematerializations."""
  analysis = compiled.memory_analysis()
  total = (
    int(analysis.argument_size_in_bytes)
    + int(analysis.output_size_in_bytes)
    - int(analysis.alias_size_in_bytes)
    + int(analysis.temp_size_in_bytes)
  )
  return dict(
    fits=total <= chip.hbm_bytes,
    hbm=chip.hbm_bytes,
    total=total,
    params=_shard_bytes(run.restore_target().params),
    state=_shard_bytes(run.restore_target()),
    argument=int(analysis.argument_size_in_bytes),
    output=int(analysis.output_size_in_bytes),
    alias=int(analysis.alias_size_in_bytes),
    temp=int(analysis.temp_size_in_bytes),
    involuntary_remat=sum("Involuntary full rematerialization" in line for line in log),
  )


def _step_cost(compiled, config, tpu_slice: Slice, rows: int, seq_len: int, devices) -> tuple:
  """(XLA's {flops, bytes} of the step, where they come from).

  XLA's cost analysis counts a loop's body once, so a scanned config's N layers are costed
  from the same step unrolled at 1 and at 2 layers: cost(N) = cost(1) + (N - 1) x
  (cost(2) - cost(1)). Two small compiles stand in for the unrolled N-layer one, which
  for Transformer-base took 37 minutes on a 2-core CPU; docs/performance.md compares the
  two once."""
  layers = config.model.num_layers
  if not config.model.scan_layers:
    return _cost(compiled), "the step"
  points = {}
  for n in (1, 2) if layers > 1 else (1,):
    unrolled = copy.deepcopy(config)
    unrolled.model.scan_layers = False
    unrolled.model.num_layers = n
    _, lowered = memory.lower_train_step(unrolled, None, rows, seq_len, devices=devices)
    try:
      points[n] = _cost(_compile(lowered, tpu_slice)[0])
    except OutOfMemory:  # unrolled, it keeps more live: count the scanned step's loop once
      return _cost(compiled), "the scanned step, which XLA counts one layer of (an undercount)"
  if layers == 1:
    return points[1], "the step with its layer unrolled"
  return (
    {k: points[1][k] + (layers - 1) * (points[2][k] - points[1][k]) for k in points[1]},
    f"the step unrolled at 1 and 2 layers, extrapolated to {layers}",
  )


PROFILE_PREDICTED = (
  "the compiler's own per-op estimates (estimated_cycles) at the chip's clock, collectives "
  "by a ring model, not measured"
)


def predicted_profile(ops: list, report: dict[str, Any], chip: flops.TpuChip) -> dict[str, Any]:
  """The per-op profile's step time, MFU and throughput, its parts and top ops."""
  result = op_profile.profile(ops, chip)
  summary = op_profile.summary(result, report["formula_flops"], chip.peak_flops)
  tokens_per_s = report["rows"] * report["seq_len"] / summary["step_s"]
  return {
    "predicted": PROFILE_PREDICTED,
    "clock_source": chip.source,
    **summary,
    "mfu": min(summary["mfu"], 1.0),
    "tokens_per_s_per_chip": tokens_per_s / report["chips"],
    "tokens_per_s": tokens_per_s,
  }


def candidate_meshes(config, chips: int) -> list[str]:
  """The in-slice meshes "data,fsdp,tensor" that --search_mesh compiles: each tensor size
  up to the number of heads (what tensor parallelism splits), with the other chips all
  data or all fsdp. A mix of the two lies between them: it all-reduces fewer gradient
  bytes than data alone and all-gathers fewer parameter bytes than fsdp alone, but pays
  for both, and holds more state per chip than fsdp alone."""
  meshes = []
  for tensor in range(1, min(chips, config.model.num_heads) + 1):
    if chips % tensor == 0:
      rest = chips // tensor
      meshes += [f"{rest},1,{tensor}"] + ([f"1,{rest},{tensor}"] if rest > 1 else [])
  return meshes


_SEARCH_FIELDS = ("fits", "rows", "total", "hbm", "step_s", "bound", "mfu", "oom", "error")


def _predicted_step_s(report: dict[str, Any]) -> float:
  """The step time a mesh is ranked by: the per-op profile's."""
  return report["profile"]["step_s"]


def search_mesh(
  config,
  tpu_slice: Slice,
  num_slices: int = 1,
  batch_tokens: int | None = None,
  seq_len: int | None = None,
) -> dict[str, Any]:
  """check() on each of candidate_meshes(): the report of the one with the shortest
  predicted step (the per-op profile's) that fits, with "searched_mesh" (its
  "data,fsdp,tensor") and "search" (each candidate's mesh and outcome). A mesh the config
  or the batch cannot use is refused in a line, without compiling. When none fits,
  {"fits": False, "error": ...}."""
  tried, best, best_mesh = [], None, None
  for mesh in candidate_meshes(config, tpu_slice.chips):
    try:
      report = check(config, tpu_slice, num_slices, mesh, batch_tokens, seq_len)
    except config_lib.ConfigError as e:
      report = {"fits": False, "error": str(e)}
    tried.append({"mesh": mesh, **{k: report[k] for k in _SEARCH_FIELDS if k in report}})
    if "profile" in report:
      tried[-1].update(
        profile_step_s=report["profile"]["step_s"], profile_mfu=report["profile"]["mfu"]
      )
    outcome = (
      f"{_predicted_step_s(report) * 1e3:,.2f} ms per-op, {fits_line(report)}"
      if report["fits"]
      else report.get("oom") or report["error"]
    )
    print(f"mesh {mesh}: {outcome}", file=sys.stderr, flush=True)
    if report["fits"] and (best is None or _predicted_step_s(report) < _predicted_step_s(best)):
      best, best_mesh = report, mesh
  if best is None:
    last = tried[-1]  # the most tensor parallelism: the fewest row shards
    return {
      "topology": tpu_slice.name,
      "num_slices": num_slices,
      "fits": False,
      "error": f"none of the {len(tried)} meshes searched fits (each one's reason is in "
      f"the search); the last, {last['mesh']}: {last.get('oom') or last['error']}",
      "search": tried,
      "predicted": PREDICTED,
    }
  return {**best, "searched_mesh": best_mesh, "search": tried}


def _shard_bytes(tree) -> int:
  """Bytes one chip holds of a tree of ShapeDtypeStructs with shardings."""
  return sum(
    math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
  )


def _libtpu_version() -> str | None:
  path = tpu_library_path()
  if path is None:
    return None
  match = re.search(
    r"libtpu-([\w.]+)\.dist-info", " ".join(os.listdir(os.path.dirname(os.path.dirname(path))))
  )
  return match.group(1) if match else None


def roofline(report: dict[str, Any], config, chip: flops.TpuChip) -> dict[str, Any]:
  """Step time from the cost and the chip's datasheet, MFU, tokens/s and the FLOPs check."""
  coll = report["collectives"]
  dcn_bytes = sum(c["dcn_bytes"] for c in coll.values())
  slices = report["num_slices"]
  if slices > 1 and not dcn_bytes:
    # Across slices libtpu compiles Megascale collectives (custom calls), which the HLO
    # text does not show as collectives: estimate them as the gradients' all-reduce over
    # the slices, as data parallelism across slices (dcn_data) needs, ring model.
    dcn_bytes = 2 * (slices - 1) / slices * report["params"]
    report["dcn_estimated"] = "gradients all-reduced across slices, from the parameters per chip"
  times = {
    "compute": report["flops"] / chip.peak_flops,
    "hbm": report["bytes"] / chip.hbm_bytes_per_s,
    "ici": sum(c["ici_bytes"] for c in coll.values()) / chip.ici_bytes_per_s,
    "dcn": dcn_bytes / chip.dcn_bytes_per_s,
  }
  step_s = max(times.values())
  model = ModelConfig.from_config(config)
  rows, seq_len, chips = report["rows"], report["seq_len"], report["chips"]
  formula = flops.training_flops(model, rows, seq_len, seq_len) / chips
  tokens_per_s = rows * seq_len / step_s
  return {
    "formula_flops": formula,
    "flops_vs_formula": report["flops"] / formula - 1,
    "roofline_s": {k: v for k, v in times.items()},
    "step_s": step_s,
    "bound": max(times, key=lambda k: times[k]),
    "mfu": min(formula / step_s / chip.peak_flops, 1.0),
    "tokens_per_s_per_chip": tokens_per_s / chips,
    "tokens_per_s": tokens_per_s,
    "update_s": step_s * config.grad_accum_steps,
  }


def _gib(n: float) -> str:
  return f"{n / 2**30:.2f} GiB"


def fits_line(report: dict[str, Any]) -> str:
  """'fits, 61% of 16 GiB' or the one OOM line."""
  if "oom" in report:
    return report["oom"]
  share = report["total"] / report["hbm"]
  verdict = "fits" if report["fits"] else "does not fit"
  return f"{verdict}, {share:.0%} of {report['hbm'] / 2**30:.0f} GiB"


def _flops_verdict(difference: float) -> str:
  if abs(difference) <= 0.05:
    return "agrees within 5%"
  if difference > 0:  # layer norms, softmax, the optimizer: small next to the matmuls
    return (
      "XLA counts more than 5% above it: element-wise work the formula leaves out, or work "
      "repeated on the chips of a mesh axis that splits only part of it (tensor)"
    )
  return "XLA counts more than 5% below it: a loop's body counted once"


def text(report: dict[str, Any]) -> str:
  """The report for a terminal."""
  slices = f"{report['num_slices']} x " if report["num_slices"] > 1 else ""
  lines = [
    f"train step on {slices}{report['topology']} ({report['chips']} x {report['device_kind']}),"
    f" mesh {report['mesh']}"
    + (f", across slices {report['dcn_mesh']}" if report["num_slices"] > 1 else "")
    + f", batch {report['rows']} x {report['seq_len']} tokens",
    f"every figure is {PREDICTED}; per chip:",
  ]
  if "oom" in report:
    return "\n".join(lines + ["  " + report["oom"]])
  c = report["collectives"]
  lines += [
    f"  memory      {fits_line(report)}: state {_gib(report['state'])} (parameters "
    f"{_gib(report['params'])}), arguments {_gib(report['argument'])}, temporaries "
    f"{_gib(report['temp'])}, total {_gib(report['total'])}",
    f"  cost        {report['flops']:.3g} FLOPs, {report['bytes']:.3g} bytes of HBM traffic"
    + f", from {report.get('cost_from', 'the step')}",
    f"  flops check {report['flops_vs_formula']:+.1%} against training/flops.py's "
    f"{report['formula_flops']:.3g} (" + _flops_verdict(report["flops_vs_formula"]) + ")",
    "  collectives "
    + (
      ", ".join(
        f"{op} x{v['count']} ({(v['ici_bytes'] + v['dcn_bytes']) / 2**20:,.1f} MiB"
        + (f", {v['dcn_bytes'] / 2**20:,.1f} over DCN" if v["dcn_bytes"] else "")
        + ")"
        for op, v in c.items()
        if v["count"]
      )
      or "none"
    ),
    *(
      [f"  dcn         estimated: {report['dcn_estimated']} (not read from the program)"]
      if "dcn_estimated" in report
      else []
    ),
    *profile_lines(report["profile"]),
    "  roofline    "
    + ", ".join(f"{k} {v * 1e3:,.2f} ms" for k, v in report["roofline_s"].items())
    + f": {report['step_s'] * 1e3:,.2f} ms, {report['bound']}-bound, MFU {report['mfu']:.1%} "
    "(XLA's bytes count on-chip arrays and re-reads as HBM traffic: not a bound)",
    f"  remat       {report['involuntary_remat']} involuntary full rematerializations",
  ]
  return "\n".join(lines)


def profile_lines(profile: dict[str, Any], top: int = 5) -> list[str]:
  """The per-op profile's lines of the terminal report."""
  parts = ", ".join(
    f"{part} {seconds * 1e3:,.2f}" for part, seconds in profile["by_part_s"].items() if seconds
  )
  lines = [
    f"  step        {profile['step_s'] * 1e3:,.2f} ms (ops {profile['compute_s'] * 1e3:,.2f}, "
    f"collectives {profile['collectives_s'] * 1e3:,.2f}), MFU {profile['mfu']:.1%}; "
    f"{profile['tokens_per_s_per_chip']:,.0f} target tokens/s per chip, "
    f"{profile['tokens_per_s']:,.0f} for the slice ({profile['predicted']}, clock "
    f"{profile['clock_hz'] / 1e9:.2f} GHz)",
    f"  parts (ms)  {parts}",
    "  top ops     "
    + "; ".join(
      f"{o['name']} {o['part']} {o['seconds'] * 1e3:,.2f} ms x{o['runs']}"
      for o in profile["top_ops"][:top]
    ),
  ]
  for kernel in profile["custom_calls"]:
    lines.append(
      f"  kernel      {kernel['name']} ({kernel['op_name']}): {kernel['seconds'] * 1e3:,.3f} ms, "
      f"costed by {kernel['costed_by']}"
    )
  if profile.get("uncosted"):
    lines.append(
      "  not timed   (no estimate from the compiler) "
      + op_profile.uncosted_text(profile["uncosted"])
    )
  if profile.get("sparsecore_ops"):
    lines.append(
      f"  sparsecore  {profile['sparsecore_ops']} ops offloaded to the SparseCores, beside "
      "the TensorCore: not timed"
    )
  return lines


def search_text(report: dict[str, Any]) -> str:
  """--search_mesh's candidates, one line each, and the one chosen."""
  lines = [f"meshes searched (data,fsdp,tensor in each slice), {PREDICTED}:"]
  for t in report["search"]:
    outcome = (
      f"{t['profile_step_s'] * 1e3:,.2f} ms per-op, MFU {t['profile_mfu']:.1%}, "
      f"{t['total'] / t['hbm']:.0%} of HBM"
      if t["fits"]
      else (t.get("oom") or t["error"])
    )
    lines.append(f"  {t['mesh']:>12}  {outcome}")
  lines.append(f"shortest step that fits: --mesh {report['searched_mesh']}")
  return "\n".join(lines)


def check_decoding(
  config, tpu_slice: Slice, batch: int, num_slices: int = 1, mesh: str | None = None
) -> dict[str, Any]:
  """Beam search's prefill (the encoder, and the decoder's first token for `batch`
  sentences, repeated for the beams) and one token of its loop (batch x beam rows
  through a cache of max_len + max_decode_extra_len slots, the longest it grows to, then
  the beams' reordering), compiled for the slice: memory per chip and the roofline time
  of each; the step's is the time per generated token."""
  from jax.sharding import NamedSharding, PartitionSpec

  from transformer.config import BOS_ID
  from transformer.model import incremental

  config = prepare_config(config, mesh, num_slices)
  devices = slice_devices(tpu_slice, num_slices)
  mesh_ = sharding.create_mesh(config, devices)
  from transformer.training import state as state_lib

  run = state_lib.setup(config, mesh_)
  multiple = math.lcm(sharding.batch_row_shards(mesh_, run.rules), tpu_slice.hosts * num_slices)
  if batch % multiple:
    raise config_lib.ConfigError(
      f"--decode_batch {batch}: must be a multiple of {multiple} (the row shards and hosts)"
    )
  beams, seq_len = config.beam_size, config.max_len
  cache_len = config.max_len + config.max_decode_extra_len
  params = run.restore_target().params
  rows = sharding.batch_sharding(mesh_, run.rules)

  def prefill(params, source_BxS):
    model, params = incremental.of(run.model).prepare(params)
    prompt_Bx1 = jnp.full((source_BxS.shape[0], 1), BOS_ID, jnp.int32)
    first = model.prefill(params, prompt_Bx1, cache_len=cache_len, source_BxS=source_BxS)
    return model.repeat_rows(first.state, beams), first.logits_BxV

  def step(params, decoder_state, tokens_N, parent_N):
    model, params = incremental.of(run.model).prepare(params)
    logits_NxLxV, decoder_state = model.feed(params, decoder_state, tokens_N[:, None])
    return model.reorder_rows(decoder_state, parent_N), logits_NxLxV[:, 0]

  report: dict[str, Any] = {"batch": batch, "beam_size": beams, "cache_len": cache_len}
  source = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=rows)
  with sharding.activation_sharding(mesh_, run.rules):
    lowered = jax.jit(prefill).lower(params, source)
  try:
    compiled, _ = _compile(lowered, tpu_slice)
  except OutOfMemory as e:
    return {**report, "fits": False, "oom": str(e)}
  report["prefill"] = _predicted_program(compiled, tpu_slice, mesh_)
  decoder_state = jax.tree.map(
    lambda shape, where: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=where),
    jax.eval_shape(prefill, params, source)[0],
    compiled.output_shardings[0],
  )
  tokens = jax.ShapeDtypeStruct(
    (batch * beams,), jnp.int32, sharding=NamedSharding(mesh_, PartitionSpec(rows.spec[0]))
  )
  with sharding.activation_sharding(mesh_, run.rules):
    lowered = jax.jit(step, donate_argnums=1).lower(params, decoder_state, tokens, tokens)
  try:
    compiled, _ = _compile(lowered, tpu_slice)
  except OutOfMemory as e:
    return {**report, "fits": False, "oom": str(e)}
  report["step"] = _predicted_program(compiled, tpu_slice, mesh_)
  report["fits"] = report["prefill"]["fits"] and report["step"]["fits"]
  report["tokens_per_s"] = batch / report["step"]["step_s"]  # one token per sentence a step
  return report


def _predicted_program(compiled, tpu_slice: Slice, mesh_) -> dict[str, Any]:
  """Memory per chip, cost, collectives and roofline time of one compiled program."""
  analysis = compiled.memory_analysis()
  total = (
    int(analysis.argument_size_in_bytes)
    + int(analysis.output_size_in_bytes)
    - int(analysis.alias_size_in_bytes)
    + int(analysis.temp_size_in_bytes)
  )
  chip = tpu_slice.chip
  out: dict[str, Any] = {
    "total": total,
    "temp": int(analysis.temp_size_in_bytes),
    "hbm": chip.hbm_bytes,
    "fits": total <= chip.hbm_bytes,
    **_cost(compiled),
  }
  coll = collectives(compiled.as_text(), [getattr(d, "slice_index", 0) for d in mesh_.devices.flat])
  times = {
    "compute": out["flops"] / chip.peak_flops,
    "hbm": out["bytes"] / chip.hbm_bytes_per_s,
    "ici": sum(c["ici_bytes"] for c in coll.values()) / chip.ici_bytes_per_s,
    "dcn": sum(c["dcn_bytes"] for c in coll.values()) / chip.dcn_bytes_per_s,
  }
  out.update(step_s=max(times.values()), bound=max(times, key=lambda k: times[k]))
  return out


def decoding_text(report: dict[str, Any]) -> str:
  head = (
    f"beam search, {report['batch']} sentences x beam {report['beam_size']}, "
    f"cache of {report['cache_len']} slots, per chip ({PREDICTED}):"
  )
  if "oom" in report:
    return head + "\n  " + report["oom"]
  lines = [head]
  for name in ("prefill", "step"):
    r = report[name]
    lines.append(
      f"  {name:<7} {'fits' if r['fits'] else 'does not fit'}, {r['total'] / r['hbm']:.0%} of "
      f"{r['hbm'] / 2**30:.0f} GiB; {r['flops']:.3g} FLOPs, {r['bytes']:.3g} bytes; "
      f"roofline {r['step_s'] * 1e3:,.3f} ms ({r['bound']}-bound)"
    )
  lines.append(
    f"  {report['step']['step_s'] * 1e3:,.3f} ms per generated token, "
    f"{report['tokens_per_s']:,.0f} tokens/s for the slice"
  )
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  tpu_slice = parse_slice(_TOPOLOGY.value)
  if _NUM_SLICES.value < 1:
    raise app.UsageError(f"--num_slices {_NUM_SLICES.value}: must be at least 1")
  if _SEARCH_MESH.value and _MESH.value is not None:
    raise app.UsageError("--search_mesh chooses the mesh: drop --mesh")
  mesh = _MESH.value
  try:
    if _SEARCH_MESH.value:
      report = search_mesh(
        _CONFIG.value, tpu_slice, _NUM_SLICES.value, _BATCH_TOKENS.value, _SEQ_LEN.value
      )
      mesh = report.get("searched_mesh")
    else:
      report = check(
        _CONFIG.value, tpu_slice, _NUM_SLICES.value, mesh, _BATCH_TOKENS.value, _SEQ_LEN.value
      )
  except config_lib.ConfigError as e:
    if not _JSON.value:
      sys.exit(f"error: {e}")
    # A record of the slice on which the config cannot run, for the docs' tables.
    report = {
      "topology": tpu_slice.name,
      "num_slices": _NUM_SLICES.value,
      "fits": False,
      "error": str(e),
      "predicted": PREDICTED,
    }
  if "error" in report and not _JSON.value:
    sys.exit(f"error: {report['error']}")
  if _DECODE_BATCH.value and "error" not in report:
    try:
      report["decoding"] = check_decoding(
        _CONFIG.value, tpu_slice, _DECODE_BATCH.value, _NUM_SLICES.value, mesh
      )
    except config_lib.ConfigError as e:
      sys.exit(f"error: {e}")
  if _JSON.value:  # the object says whether it fits; exit 0 so that it is recorded
    print(json.dumps({**report, "versions": versions.library_versions()}))
    return
  if "searched_mesh" in report:
    print(search_text(report))
  print(text(report))
  if "decoding" in report:
    print(decoding_text(report["decoding"]))
  if not report["fits"]:
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)
