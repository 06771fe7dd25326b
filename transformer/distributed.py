"""Multi-host start-up on JAX's own runtime (`jax.distributed`): TPU pods, SLURM, or flags.

Every process runs the same command. On a TPU pod or under SLURM, JAX finds the
coordinator, the process count and this process's id by itself; elsewhere pass
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I`.
"""

import os

import jax
from absl import flags, logging

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_enum("distributed", "auto", ["auto", "on", "off"],
                    "Start jax.distributed: auto = when flags or a TPU pod / SLURM job "
                    "with several processes are detected.")
  flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0.")
  flags.DEFINE_integer("num_processes", None, "Number of processes in the job.")
  flags.DEFINE_integer("process_id", None, "This process's index, 0 .. num_processes-1.")
  flags.DEFINE_integer("distributed_init_timeout_s", 300,
                       "Seconds to wait for every process to join.")
  flags.DEFINE_integer("heartbeat_timeout_s", 100,
                       "Seconds without a heartbeat before a process is declared dead and "
                       "the others stop with an error instead of hanging.")


def _detected_multiprocess() -> bool:
  if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
    return True
  # TPU VMs list every worker of the pod slice.
  return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


def initialize_from_flags() -> None:
  explicit = FLAGS.coordinator_address is not None
  mode = FLAGS.distributed
  if mode == "off" or (mode == "auto" and not explicit and not _detected_multiprocess()):
    return
  # CPU processes (tests, or CPU-only clusters) need a collectives backend.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=FLAGS.coordinator_address,
      num_processes=FLAGS.num_processes,
      process_id=FLAGS.process_id,
      initialization_timeout=FLAGS.distributed_init_timeout_s,
      heartbeat_timeout_seconds=FLAGS.heartbeat_timeout_s)
  logging.info("jax.distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
