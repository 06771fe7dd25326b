r"""Memory per device of the compiled training step, mesh by mesh.

    python -m transformer.tools.memory --config configs/wmt14.py:big
    ... --mesh 8,1,1 --mesh 2,2,2 --batch_tokens 8192 --seq_len 128 --propagation --json

Each `--mesh data,fsdp,tensor` (default: data=8, fsdp=8, tensor=8 and 2x2x2) builds the
config's model and optimizer with `transformer.training.state.setup` on that mesh,
lowers `transformer.training.steps.jit_train_step` on abstract arrays (nothing is
allocated, so the big model compiles for 8 fake devices on any CPU: the tool asks JAX
for as many CPU devices as the largest mesh needs; on a GPU or TPU host pass
JAX_PLATFORMS=cpu to measure there on the CPU) under the config's
rules (`sharding.activation_sharding`), and reads XLA's `memory_analysis()` of the
compiled step. All figures are bytes per device:

  state       parameters and Adam moments, from the state's shardings
  argument    what the step takes: the state plus the batch shard
  output      what it returns: the new state (donated, so it reuses the argument) and metrics
  temp        XLA's temporary buffers: activations kept for the backward pass, gradients,
              collectives' scratch; what activation sharding changes

Activations are constrained by `config.logical_axis_rules` (the model's `activation_*`
axes); `--propagation` also compiles each mesh with every activation axis UNCONSTRAINED,
leaving the activations' shardings to XLA's propagation from the parameters and the
batch, and adds that step's `temp` (temp_propagated).
The batch is `--batch_tokens / --seq_len` rows of `--seq_len` source and target tokens
(default: the config's tokens_per_batch over max_len, rounded down to whole row
shards on every mesh). Training counts tokens_per_batch in real tokens, so its padded
batches hold more slots than that: for a bucketed run pass --batch_tokens =
tokens_per_batch / the padding efficiency `input_speed` reports (docs/data.md).
docs/performance.md records the figures.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.sharding import PartitionSpec
from ml_collections import config_flags

from transformer import cli, versions
from transformer import config as config_lib
from transformer.inference import sharding
from transformer.training import state, steps

# Its docs/results records' version: bump when what it computes changes, not on a reformat.
RECORD_VERSION = 1

_FLAG_VALUES = cli.program_flags(__name__)  # absl's only when run as a program
_CONFIG = config_flags.DEFINE_config_file(
  "config", config_lib.DEFAULT_CONFIG, "Config file.", flag_values=_FLAG_VALUES
)
_MESH = flags.DEFINE_multi_string(
  "mesh",
  ["8,1,1", "1,8,1", "1,1,8", "2,2,2"],
  "Mesh sizes data,fsdp,tensor; repeat the flag for several meshes.",
  flag_values=_FLAG_VALUES,
)
_BATCH_TOKENS = flags.DEFINE_integer(
  "batch_tokens",
  None,
  "Target tokens per step (default: the config's tokens_per_batch, "
  "rounded down to whole row shards); rows = batch_tokens / seq_len.",
  flag_values=_FLAG_VALUES,
)
_SEQ_LEN = flags.DEFINE_integer(
  "seq_len",
  None,
  "Source and target length of the batch (default: max_len).",
  flag_values=_FLAG_VALUES,
)
_PROPAGATION = flags.DEFINE_bool(
  "propagation",
  False,
  "Also compile with the activation axes UNCONSTRAINED (XLA's "
  "propagation alone) and report that step's temporary bytes (temp_propagated).",
  flag_values=_FLAG_VALUES,
)
_JSON = flags.DEFINE_bool(
  "json", False, "Print one JSON object per mesh.", flag_values=_FLAG_VALUES
)


def parse_mesh(spec: str) -> tuple[int, int, int]:
  """'2,2,2' -> (data, fsdp, tensor)."""
  try:
    sizes = tuple(int(s) for s in spec.split(","))
  except ValueError:
    sizes = ()
  if len(sizes) != 3 or min(sizes) < 1:
    raise app.UsageError(f"--mesh {spec!r}: expected three positive sizes data,fsdp,tensor")
  return sizes


def mesh_config(config, sizes: tuple[int, int, int]):
  """A copy of the config on one slice with these mesh sizes."""
  config = copy.deepcopy(config)
  for axis, size in zip(config_lib.MESH_AXES, sizes):
    config.mesh[axis] = size
    config.mesh[f"dcn_{axis}"] = 1
  return config


def abstract_batch(config, rows: int, seq_len: int, batch_sharding) -> dict[str, Any]:
  """ShapeDtypeStructs of a batch with the keys the config's batching produces."""
  keys = ["source", "decoder_input", "target"]
  if config.batching == "packed":
    keys += ["source_segment_ids", "source_positions", "target_segment_ids", "target_positions"]
  if config.model.decoder_only:
    keys = [k for k in keys if not k.startswith("source")]
  return {
    k: jax.ShapeDtypeStruct((rows, seq_len), jnp.int32, sharding=batch_sharding) for k in keys
  }


def _shard_bytes(tree) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest
  shard, where a mesh axis splits a dimension unevenly)."""
  return sum(
    math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
  )


def lower_train_step(
  config,
  sizes: tuple[int, int, int] | None,
  rows: int,
  seq_len: int,
  constrained: bool = True,
  devices=None,
):
  """(setup, lowered train step) on the first data*fsdp*tensor devices.

  `constrained`: the activations as the config's rules place them; False leaves every
  activation axis UNCONSTRAINED, so XLA's propagation from the parameters and the batch
  decides, as it did before the model constrained its activations. `devices`: where to
  compile (default jax.devices(); compile_check passes a TPU slice's compile-only
  devices); with `sizes` None, all of them under the config's own mesh (dcn_* included).
  """
  if sizes is not None:
    config = mesh_config(config, sizes)
  devices = list(devices if devices is not None else jax.devices())
  if sizes is not None:
    devices = devices[: math.prod(sizes)]
  run = state.setup(config, sharding.create_mesh(config, devices))
  if not constrained:
    rules = tuple(
      (name, PartitionSpec.UNCONSTRAINED if name.startswith("activation_") else axes)
      for name, axes in run.rules
    )
    run = dataclasses.replace(run, model_setup=dataclasses.replace(run.model_setup, rules=rules))
  batch = abstract_batch(config, rows, seq_len, sharding.batch_sharding(run.mesh, run.rules))
  with sharding.activation_sharding(run.mesh, run.rules):
    return run, steps.jit_train_step(run).lower(run.restore_target(), batch)


def measure(
  config, sizes: tuple[int, int, int], rows: int, seq_len: int, propagation: bool = False
) -> dict[str, Any]:
  """One mesh's bytes per device (see the module docstring)."""
  run, lowered = lower_train_step(config, sizes, rows, seq_len)
  analysis = lowered.compile().memory_analysis()
  result = dict(zip(config_lib.MESH_AXES, sizes))
  result.update(
    rows=rows,
    seq_len=seq_len,
    state=_shard_bytes(run.restore_target()),
    argument=int(analysis.argument_size_in_bytes),
    output=int(analysis.output_size_in_bytes),
    alias=int(analysis.alias_size_in_bytes),
    temp=int(analysis.temp_size_in_bytes),
  )
  if propagation:
    _, lowered = lower_train_step(config, sizes, rows, seq_len, constrained=False)
    result["temp_propagated"] = int(lowered.compile().memory_analysis().temp_size_in_bytes)
  return result


def default_rows(config, meshes, seq_len: int, batch_tokens: int | None) -> int:
  """Rows of the batch, a multiple of the row shards on every mesh."""
  multiple = 1
  for sizes in meshes:
    sized = mesh_config(config, sizes)  # checks that the model splits over the mesh
    mesh = sharding.create_mesh(sized, jax.devices()[: math.prod(sizes)])
    multiple = math.lcm(multiple, sharding.batch_row_multiple(mesh, sharding.axis_rules(sized)))
  if batch_tokens is not None:
    if batch_tokens % seq_len or (batch_tokens // seq_len) % multiple:
      raise app.UsageError(
        f"--batch_tokens {batch_tokens} must be a multiple of "
        f"--seq_len {seq_len} times {multiple} (row shards)"
      )
    return batch_tokens // seq_len
  rows = config.tokens_per_batch // seq_len // multiple * multiple
  if rows == 0:
    raise app.UsageError(
      f"tokens_per_batch {config.tokens_per_batch} is less than one "
      f"row of {seq_len} tokens on each of {multiple} row shards"
    )
  return rows


def _mib(n: int) -> str:
  return f"{n / 2**20:,.1f}"


def table(results: list[dict[str, Any]]) -> str:
  """A Markdown table of the results, MiB per device."""
  columns = ["state", "argument", "output", "temp"]
  if any("temp_propagated" in r for r in results):
    columns.append("temp_propagated")
  header = "| data | fsdp | tensor | " + " | ".join(f"{c} (MiB)" for c in columns) + " |"
  lines = [header, "|" + "---|" * (3 + len(columns))]
  for r in results:
    cells = [str(r[a]) for a in config_lib.MESH_AXES]
    cells += [_mib(r[c]) if c in r else "" for c in columns]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def use_cpu_devices(count: int) -> None:
  """Asks JAX for `count` CPU devices (as XLA_FLAGS=--xla_force_host_platform_device_count
  does), so that the meshes compile on a machine with one. Only before JAX has started its
  backends (in tests it has, with 8) and where XLA_FLAGS sets no count of its own."""
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return
  # Backends already started (RuntimeError): their devices are what there is.
  with contextlib.suppress(RuntimeError):
    jax.config.update("jax_num_cpu_devices", count)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  meshes = [parse_mesh(spec) for spec in _MESH.value]
  use_cpu_devices(max(math.prod(sizes) for sizes in meshes))
  try:
    report(_CONFIG.value, meshes)
  except config_lib.ConfigError as e:
    sys.exit(f"error: {e}")


def report(config, meshes: list[tuple[int, int, int]]) -> None:
  """Measures every mesh and prints the table (or, with --json, one object per mesh)."""
  config_lib.validate(config)
  most = max(math.prod(sizes) for sizes in meshes)
  if most > jax.device_count():
    raise config_lib.ConfigError(
      f"--mesh needs {most} devices, {jax.device_count()} {jax.default_backend()} devices are "
      f"visible; JAX_PLATFORMS=cpu measures on {most} CPU devices"
    )
  seq_len = _SEQ_LEN.value or config.max_len
  rows = default_rows(config, meshes, seq_len, _BATCH_TOKENS.value)
  results = []
  for sizes in meshes:
    result = measure(config, sizes, rows, seq_len, _PROPAGATION.value)
    results.append(result)
    if _JSON.value:
      print(json.dumps({**result, "versions": versions.library_versions()}), flush=True)
  if not _JSON.value:
    print(f"train step, {rows} x {seq_len} tokens, MiB per device ({jax.devices()[0].platform}):")
    print(table(results))


if __name__ == "__main__":
  cli.run(main)
