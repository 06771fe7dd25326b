"""The device mesh, and how the model's logical axes land on it.

The mesh has axes (data, fsdp, tensor). `config.mesh.{data,fsdp,tensor}` are the sizes
within a slice (-1 takes the devices left over); `config.mesh.dcn_*` multiply them across
slices of a multi-slice TPU pod, whose links are slower, so data parallelism usually
goes there. `config.logical_axis_rules` maps parameter and activation axis names
(`embed`, `heads`, `mlp`, `vocab`, `batch`, `activation_batch`, ...) onto mesh axes.

Parameters get their shardings from `logical_to_sharding`. Activations are constrained
inside the model (transformer/model/primitives.py: `constrain`), which takes effect only
while a function is traced under `activation_sharding(mesh, rules)`; `with_activation_sharding`
wraps a function to be jitted so that its every trace is.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from transformer.config import MESH_AXES, ConfigError, check_fits_mesh
from transformer.model.primitives import split_spec


def _resolve(sizes: Sequence[int], total: int, what: str) -> list[int]:
  sizes = list(sizes)
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if total % known:
      raise ConfigError(f"config.mesh: {what} sizes {sizes} do not divide {total} devices")
    sizes[sizes.index(-1)] = total // known
  if math.prod(sizes) != total:
    raise ConfigError(
      f"config.mesh: {what} sizes {dict(zip(MESH_AXES, sizes))} use {math.prod(sizes)} "
      f"devices but {total} are available"
    )
  return sizes


def mesh_shape(
  config: ml_collections.ConfigDict, num_devices: int, num_slices: int = 1
) -> tuple[list[int], list[int]]:
  """(in-slice sizes, across-slice sizes), each ordered as MESH_AXES."""
  m = config.mesh
  dcn = _resolve([m.dcn_data, m.dcn_fsdp, m.dcn_tensor], num_slices, "across-slice")
  ici = _resolve([m.data, m.fsdp, m.tensor], num_devices // num_slices, "in-slice")
  check_fits_mesh(config, {a: i * d for a, i, d in zip(MESH_AXES, ici, dcn)})
  return ici, dcn


def create_mesh(
  config: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None
) -> Mesh:
  devices = list(devices if devices is not None else jax.devices())
  num_slices = 1 + max(getattr(d, "slice_index", 0) for d in devices)
  ici, dcn = mesh_shape(config, len(devices), num_slices)
  # Splitting a physical axis (8 tensor shards on a 16x16 slice) is allowed in both: the
  # mesh sizes are the config's choice, and any that divide the slice must work.
  if num_slices > 1:
    device_array = mesh_utils.create_hybrid_device_mesh(
      ici, dcn, devices, allow_split_physical_axes=True
    )
  else:
    device_array = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
  return Mesh(device_array, MESH_AXES)


def axis_rules(config: ml_collections.ConfigDict) -> tuple[tuple[str, Any], ...]:
  """The config's rules as the hashable tuples flax expects."""
  rules = []
  for logical, physical in config.logical_axis_rules:
    if isinstance(physical, list):
      physical = tuple(physical)
    rules.append((logical, physical))
  return tuple(rules)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules) -> Iterator[None]:
  """While tracing in here, the model's activation constraints apply under `rules`.

  flax reads the rules from its context and needs a mesh in jax's; the abstract mesh is
  enough, and unlike `jax.set_mesh` it may be entered inside a function being jitted.
  Outside this context the constraints are no-ops and XLA propagates shardings alone.
  """
  with nn.logical_axis_rules(rules), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    yield


def with_activation_sharding(fn: Callable, mesh: Mesh, rules) -> Callable:
  """`fn` that runs (and so is traced) under `activation_sharding(mesh, rules)`.

  For the function handed to `jax.jit`: the context is then part of every trace, not of
  whoever happens to call the jitted function first (jit's cache does not key on
  flax's rules).
  """

  @functools.wraps(fn)
  def traced_under_rules(*args, **kwargs):
    with activation_sharding(mesh, rules):
      return fn(*args, **kwargs)

  return traced_under_rules


def logical_to_sharding(tree: Any, mesh: Mesh, rules) -> Any:
  """NamedShardings for a pytree (typically `jax.eval_shape` output) of boxed arrays.

  Leaves without logical names (steps, counters, RNG keys) are replicated.
  """
  specs = nn.get_partition_spec(tree)
  return nn.logical_to_mesh_sharding(specs, mesh, rules)


def split_over(sharding: NamedSharding, shape: Sequence[int], axis: str) -> NamedSharding:
  """`sharding` with one more split over the mesh axis `axis` (model/primitives.py:
  split_spec says which dimension)."""
  return NamedSharding(
    sharding.mesh, split_spec(sharding.spec, shape, dict(sharding.mesh.shape), axis)
  )


def batch_sharding(mesh: Mesh, rules, ndim: int = 2) -> NamedSharding:
  """Rows (the leading axis) split over the mesh axes the 'batch' rule names."""
  spec = nn.logical_to_mesh_axes(("batch",) + (None,) * (ndim - 1), rules)
  assert spec is not None  # None only for no names at all
  return NamedSharding(mesh, spec)


def batch_row_shards(mesh: Mesh, rules) -> int:
  """How many slices a batch's rows are split into (the mesh axes the 'batch' rule names)."""
  specs = nn.logical_to_mesh_axes(("batch",), rules)
  assert specs is not None  # None only for no names at all
  spec = specs[0]
  axes = spec if isinstance(spec, tuple) else (spec,) if spec else ()
  return math.prod(mesh.shape[a] for a in axes)


def rows_for_tokens(batch_tokens: int, seq_len: int, row_multiple: int) -> int:
  """Rows of `seq_len` tokens nearest below `batch_tokens` that divide over the
  data-parallel devices (`row_multiple`), and never fewer than one per device."""
  return max(row_multiple, batch_tokens // seq_len // row_multiple * row_multiple)


def batch_row_multiple(mesh: Mesh, rules) -> int:
  """Global batch rows must be a multiple of this to split evenly over devices and hosts."""
  return math.lcm(batch_row_shards(mesh, rules), jax.process_count())


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh, rules) -> dict:
  """This process's rows -> global jax.Arrays (rows of all processes, in process order)."""

  def to_global(local):
    local = np.asarray(local)
    global_shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
    sharding = batch_sharding(mesh, rules, local.ndim)
    return jax.make_array_from_process_local_data(sharding, local, global_shape)

  return {k: to_global(v) for k, v in local_batch.items()}


def global_batch_from_whole(whole_batch: dict[str, np.ndarray], mesh: Mesh, rules) -> dict:
  """A batch every process holds whole -> global jax.Arrays with the same row order.

  Each device gets exactly the rows its shard covers, whichever process owns it and
  wherever the mesh puts it: on a TPU pod the mesh follows the physical topology, so
  devices of one process need not hold one contiguous block of rows, and the process
  order of `global_batch` would not be the batch's order. Evaluation uses this, so that
  row r of every output is row r of the batch it was given.
  """

  def to_global(whole):
    whole = np.asarray(whole)
    sharding = batch_sharding(mesh, rules, whole.ndim)
    return jax.make_array_from_callback(whole.shape, sharding, lambda index: whole[index])

  return {k: to_global(v) for k, v in whole_batch.items()}


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())
