"""What JAX's own cluster detection reads, wrapped once (it lives in private modules).

`transformer.inference.distributed.on_cloud_tpu_vm` reads the flag JAX sets as `import
jax` runs on a Cloud TPU VM; the TPU cluster classes bound the same flag when JAX
imported them. A JAX upgrade that moves or renames it must fail a test, not let every
host of a slice train alone.
"""

from jax._src import cloud_tpu_init
from jax._src.clusters import cloud_tpu_cluster


def cloud_tpu_vm_flags() -> tuple[object, object]:
  """(the flag cloud_tpu_init set, the one JAX's TPU cluster detection reads)."""
  return cloud_tpu_init.running_in_cloud_tpu_vm, cloud_tpu_cluster.running_in_cloud_tpu_vm
