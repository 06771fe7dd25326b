"""The device mesh from config.mesh, the logical axis rules, and global batches."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from transformer import config as config_lib
from transformer.config import ConfigError
from transformer.inference import sharding


def mesh_config(data=-1, fsdp=1, tensor=1, **dcn):
  config = config_lib.base_config()
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = data, fsdp, tensor
  for key, value in dcn.items():
    config.mesh[key] = value
  return config


@pytest.mark.parametrize(
  "sizes,expected",
  [
    ((-1, 1, 1), [8, 1, 1]),
    ((-1, 2, 1), [4, 2, 1]),
    ((2, -1, 2), [2, 2, 2]),
    ((1, 2, -1), [1, 2, 4]),
    ((2, 2, 2), [2, 2, 2]),
  ],
)
def test_mesh_shape_fills_the_minus_one_axis(sizes, expected):
  """-1 takes the devices the other axes leave; one slice means across-slice sizes of 1."""
  ici, dcn = sharding.mesh_shape(mesh_config(*sizes), 8)
  assert ici == expected
  assert dcn == [1, 1, 1]


def test_mesh_shape_splits_devices_across_slices():
  """dcn_data=-1 takes the slices; the in-slice sizes then share one slice's devices."""
  ici, dcn = sharding.mesh_shape(mesh_config(-1, 2, 1, dcn_data=-1), 16, num_slices=2)
  assert dcn == [2, 1, 1]
  assert ici == [4, 2, 1]


def test_mesh_shape_minus_one_that_does_not_divide_names_the_sizes():
  """fsdp=3 leaves no whole number of devices for data over 8 devices."""
  with pytest.raises(
    ConfigError,
    match=r"config\.mesh: in-slice sizes \[-1, 3, 1\] do not "
    r"divide 8 devices",
  ):
    sharding.mesh_shape(mesh_config(-1, 3, 1), 8)


def test_mesh_shape_wrong_product_says_how_many_devices():
  """Fixed sizes must use exactly the available devices; the message names both counts."""
  with pytest.raises(ConfigError) as info:
    sharding.mesh_shape(mesh_config(2, 2, 1), 8)
  message = str(info.value)
  assert message.startswith("config.mesh: in-slice sizes")
  assert "{'data': 2, 'fsdp': 2, 'tensor': 1}" in message
  assert "use 4 devices but 8 are available" in message
  assert "\n" not in message


def test_mesh_shape_across_slices_is_checked_too():
  with pytest.raises(ConfigError, match="across-slice"):
    sharding.mesh_shape(mesh_config(-1, 1, 1, dcn_fsdp=3), 8, num_slices=2)


def test_mesh_shape_rejects_a_model_that_does_not_split():
  """The resolved sizes are checked against the model: 8001 tokens do not split 8 ways."""
  config = mesh_config(1, 1, -1)
  config.vocab_size = 8001  # the 'vocab' rule puts the vocabulary on 'tensor'
  with pytest.raises(
    ConfigError,
    match=r"config\.vocab_size: 8001 does not split evenly "
    r"over mesh\.tensor=8",
  ):
    sharding.mesh_shape(config, 8)


@pytest.mark.parametrize("sizes", [(8, 1, 1), (2, 2, 2), (1, 2, 4)])
def test_create_mesh_has_the_configured_axis_sizes(sizes):
  mesh = sharding.create_mesh(mesh_config(*sizes))
  assert mesh.axis_names == config_lib.MESH_AXES
  assert dict(mesh.shape) == dict(zip(config_lib.MESH_AXES, sizes))
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


def test_create_mesh_over_given_devices():
  """A device subset (as tests pass for one-device runs) resolves -1 against its size."""
  devices = jax.devices()[:2]
  mesh = sharding.create_mesh(mesh_config(-1, 1, 1), devices)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 1}
  assert {d.id for d in mesh.devices.flat} == {d.id for d in devices}


def test_axis_rules_are_hashable_tuples_in_order():
  """Lists (as JSON or a sweep writes them) become tuples, so flax can hash the rules."""
  config = config_lib.base_config()
  config.logical_axis_rules = [("batch", ["data", "fsdp"]), ("embed", "fsdp"), ("kv", None)]
  rules = sharding.axis_rules(config)
  assert rules == (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("kv", None))
  hash(rules)
  default = sharding.axis_rules(config_lib.base_config())
  assert [r[0] for r in default] == [r[0] for r in config_lib.base_config().logical_axis_rules]
  assert dict(default)["batch"] == ("data", "fsdp")


def test_batch_sharding_splits_rows_over_the_batch_axes():
  config = mesh_config(2, 2, 2)
  mesh, rules = sharding.create_mesh(config), sharding.axis_rules(config)
  two_d = sharding.batch_sharding(mesh, rules)
  assert isinstance(two_d, NamedSharding) and two_d.mesh == mesh
  assert two_d.spec == PartitionSpec(("data", "fsdp"), None)
  assert sharding.batch_sharding(mesh, rules, ndim=3).spec == PartitionSpec(
    ("data", "fsdp"), None, None
  )
  # 8 rows over data x fsdp = 4 row shards of 2 rows, each on tensor=2 devices.
  assert two_d.shard_shape((8, 5)) == (2, 5)


@pytest.mark.parametrize(
  "sizes,batch_rule,multiple",
  [
    ((2, 2, 2), ("data", "fsdp"), 4),
    ((8, 1, 1), ("data", "fsdp"), 8),
    ((1, 1, 8), ("data", "fsdp"), 1),
    ((2, 4, 1), "data", 2),
    ((2, 4, 1), None, 1),
  ],
)
def test_batch_row_multiple_is_the_devices_rows_are_split_over(sizes, batch_rule, multiple):
  """The product of the mesh axes the 'batch' rule names (tensor never splits rows)."""
  config = mesh_config(*sizes)
  config.logical_axis_rules = [("batch", batch_rule)] + [
    r for r in config.logical_axis_rules if r[0] != "batch"
  ]
  mesh, rules = sharding.create_mesh(config), sharding.axis_rules(config)
  assert sharding.batch_row_multiple(mesh, rules) == multiple


def test_global_batch_on_one_process_keeps_the_rows_and_splits_them():
  config = mesh_config(2, 2, 2)
  mesh, rules = sharding.create_mesh(config), sharding.axis_rules(config)
  local = {
    "source": np.arange(8 * 6, dtype=np.int32).reshape(8, 6),
    "weights": np.arange(8 * 3 * 2, dtype=np.float32).reshape(8, 3, 2),
  }
  batch = sharding.global_batch(local, mesh, rules)
  assert set(batch) == {"source", "weights"}
  for key, array in batch.items():
    assert isinstance(array, jax.Array)
    assert array.shape == local[key].shape and array.dtype == local[key].dtype
    np.testing.assert_array_equal(np.asarray(array), local[key])
    assert array.sharding == sharding.batch_sharding(mesh, rules, local[key].ndim)
    for shard in array.addressable_shards:
      assert shard.data.shape[0] == 2
      np.testing.assert_array_equal(np.asarray(shard.data), local[key][shard.index])


def test_replicated_puts_the_whole_array_on_every_device():
  mesh = sharding.create_mesh(mesh_config(2, 2, 2))
  replicated = sharding.replicated(mesh)
  assert replicated.spec == PartitionSpec() and replicated.mesh == mesh
  array = jax.device_put(np.arange(6.0).reshape(2, 3), replicated)
  assert array.is_fully_replicated
  assert len(array.addressable_shards) == 8
  assert all(s.data.shape == (2, 3) for s in array.addressable_shards)
