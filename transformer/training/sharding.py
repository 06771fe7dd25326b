"""The device mesh, and how the model's logical axes land on it.

The mesh has axes (data, fsdp, tensor). `config.mesh.{data,fsdp,tensor}` are the sizes
within a slice (-1 takes the devices left over); `config.mesh.dcn_*` multiply them across
slices of a multi-slice TPU pod, whose links are slower, so data parallelism usually
goes there. `config.logical_axis_rules` maps parameter and activation axis names
(`embed`, `heads`, `mlp`, `vocab`, `batch`, ...) onto mesh axes.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from transformer.config import MESH_AXES, ConfigError, check_fits_mesh


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
        f"devices but {total} are available")
  return sizes


def mesh_shape(config: ml_collections.ConfigDict, num_devices: int,
               num_slices: int = 1) -> tuple[list[int], list[int]]:
  """(in-slice sizes, across-slice sizes), each ordered as MESH_AXES."""
  m = config.mesh
  dcn = _resolve([m.dcn_data, m.dcn_fsdp, m.dcn_tensor], num_slices, "across-slice")
  ici = _resolve([m.data, m.fsdp, m.tensor], num_devices // num_slices, "in-slice")
  check_fits_mesh(config, {a: i * d for a, i, d in zip(MESH_AXES, ici, dcn)})
  return ici, dcn


def create_mesh(config: ml_collections.ConfigDict,
                devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(devices if devices is not None else jax.devices())
  num_slices = 1 + max(getattr(d, "slice_index", 0) for d in devices)
  ici, dcn = mesh_shape(config, len(devices), num_slices)
  if num_slices > 1:
    device_array = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
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


def logical_to_sharding(tree: Any, mesh: Mesh, rules) -> Any:
  """NamedShardings for a pytree (typically `jax.eval_shape` output) of boxed arrays.

  Leaves without logical names (steps, counters, RNG keys) are replicated.
  """
  specs = nn.get_partition_spec(tree)
  return nn.logical_to_mesh_sharding(specs, mesh, rules)


def batch_sharding(mesh: Mesh, rules, ndim: int = 2) -> NamedSharding:
  """Rows (the leading axis) split over the mesh axes the 'batch' rule names."""
  spec = nn.logical_to_mesh_axes(("batch",) + (None,) * (ndim - 1), rules)
  return NamedSharding(mesh, spec)


def batch_row_multiple(mesh: Mesh, rules) -> int:
  """Global batch rows must be a multiple of this to split evenly over devices and hosts."""
  spec = nn.logical_to_mesh_axes(("batch",), rules)[0]
  axes = spec if isinstance(spec, tuple) else (spec,) if spec else ()
  devices_per_row_shard = math.prod(mesh.shape[a] for a in axes)
  return math.lcm(devices_per_row_shard, jax.process_count())


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh, rules) -> dict:
  """This process's rows -> global jax.Arrays (rows of all processes, in process order)."""
  def to_global(local):
    local = np.asarray(local)
    global_shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
    sharding = batch_sharding(mesh, rules, local.ndim)
    return jax.make_array_from_process_local_data(sharding, local, global_shape)
  return {k: to_global(v) for k, v in local_batch.items()}


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())
