"""Multi-host start-up on JAX's own runtime (`jax.distributed`): TPU slices, SLURM, or flags.

Every process runs the same command. On a Cloud TPU VM slice (GCE or GKE) and under SLURM,
JAX finds the coordinator, the process count and this process's id by itself; elsewhere
pass `--coordinator_address=HOST:PORT --num_processes=N --process_id=I`.

Which start a process makes (`how_to_start`, `--distributed`):
- auto (the default): the flags above if given; a SLURM job step of several tasks; any
  Cloud TPU VM, where JAX's own detection (`jax.distributed.initialize()` with no
  arguments) reads the slice's workers from GCE's metadata server, or from GKE's
  TPU_WORKER_HOSTNAMES. A TPU VM whose slice JAX cannot find (no metadata server, as on
  a TPU VM not made by `gcloud compute tpus`) runs as one process, with a warning.
  Nothing else starts it: a laptop, one SLURM task (the final `eval.py` of a job), a GPU
  box.
- on: JAX's detection must find a cluster (or the flags must name one), else one line.
- off: never.

Under SLURM a process drives one GPU, as JAX does by default there: a node with G GPUs
runs G tasks (`srun --ntasks-per-node=G --gpus-per-node=G`, docs/clusters.md), and task
SLURM_LOCALID drives that GPU of its node. A layout that would leave GPUs idle stops with
one line before anything starts.
"""

import contextlib
import os
import signal
import sys
from collections.abc import Iterator

import jax
import jax.experimental.multihost_utils
from absl import flags, logging

from transformer.messages import first_line

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_enum(
    "distributed",
    "auto",
    ["auto", "on", "off"],
    "Start jax.distributed: auto = with --coordinator_address, in a SLURM job step of "
    "several tasks, or on a Cloud TPU VM (JAX finds the slice's workers); on = JAX's "
    "detection must find a cluster; off = never.",
  )
  flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0.")
  flags.DEFINE_integer("num_processes", None, "Number of processes in the job.")
  flags.DEFINE_integer("process_id", None, "This process's index, 0 .. num_processes-1.")
  flags.DEFINE_integer(
    "distributed_init_timeout_s", 300, "Seconds to wait for every process to join."
  )
  flags.DEFINE_integer(
    "heartbeat_timeout_s",
    100,
    "Seconds without a heartbeat before a process is declared dead and "
    "the others stop with an error instead of hanging.",
  )


def on_cloud_tpu_vm() -> bool:
  """JAX's own answer, made as `import jax` ran: TPU chips on this machine's PCI bus and
  libtpu installed (or JAX_FORCE_TPU_INIT set). JAX's TPU cluster detection (GCE and GKE)
  asks exactly this flag first, so reading it here agrees with JAX by construction; it
  lives in a private module, and tests/test_inference_distributed.py fails if a JAX
  upgrade moves it."""
  from jax._src import cloud_tpu_init

  return bool(cloud_tpu_init.running_in_cloud_tpu_vm)


# How a process joins its job (how_to_start's answers), as the first log line names them.
FLAGS_START = "--coordinator_address"
SLURM_START = "SLURM"
TPU_START = "Cloud TPU VM"
DETECTED_START = "--distributed=on"


def how_to_start(mode: str, explicit: bool, environ, on_tpu_vm: bool) -> str | None:
  """Which `jax.distributed.initialize` this process makes, or None for none.

  mode: --distributed; explicit: --coordinator_address was given; environ: the process's
  environment; on_tpu_vm: `on_cloud_tpu_vm()`. FLAGS_START passes the flags, the others
  leave every argument to JAX's detection (SLURM's variables; a TPU slice's metadata
  server or GKE's variables)."""
  if mode == "off":
    return None
  if explicit:
    return FLAGS_START
  if int(environ.get("SLURM_NTASKS", "1")) > 1:
    return SLURM_START
  if on_tpu_vm:
    return TPU_START
  return DETECTED_START if mode == "on" else None


_SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int | None:
  """SLURM's compressed task counts ('8(x3),4': 8 on nodes 0-2, 4 on node 3) at node_id."""
  counts: list[int] = []
  for entry in tasks_per_node.split(","):
    count, _, repeat = entry.partition("(x")
    try:
      counts += [int(count)] * int(repeat.rstrip(")") or 1)
    except ValueError:
      return None
  return counts[node_id] if node_id < len(counts) else None


def slurm_local_device_ids(environ) -> list[int] | None:
  """The GPU numbers this SLURM task drives (as CUDA numbers them in this process), or
  None outside a SLURM job step. Raises ValueError where the layout leaves GPUs idle.

  A task that sees every GPU of its node drives GPU SLURM_LOCALID (JAX's own default);
  one that SLURM bound to a single GPU (`srun --gpus-per-task=1`, or
  `srun --gpu-bind=...`) sees it as 0.
  """
  if not all(name in environ for name in _SLURM_VARIABLES + ("SLURM_LOCALID",)):
    return None
  local_id = int(environ["SLURM_LOCALID"])
  gpus = [g for g in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
  if len(gpus) == 1:
    return [0]
  tasks_per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
  tasks = _tasks_on_node(tasks_per_node or "", int(environ.get("SLURM_NODEID", "0")))
  if gpus and (local_id >= len(gpus) or (tasks is not None and tasks < len(gpus))):
    runs = f"{tasks} tasks" if tasks is not None else f"task {local_id}"
    raise ValueError(
      f"SLURM runs {runs} on a node with {len(gpus)} GPUs (CUDA_VISIBLE_DEVICES="
      f"{','.join(gpus)}), and each process drives one GPU: run one task per GPU "
      f"(srun --ntasks-per-node={len(gpus)} --gpus-per-node={len(gpus)})"
    )
  return [local_id]


def initialize_from_flags() -> None:
  """Starts jax.distributed as --distributed and the cluster say (`how_to_start`), or
  leaves this process alone; a start that fails is one line on stderr and exit 1."""
  start = how_to_start(
    FLAGS.distributed,
    FLAGS.coordinator_address is not None,
    os.environ,
    on_cloud_tpu_vm(),
  )
  if start is None:
    return
  # CPU processes (tests, or CPU-only clusters) need a collectives backend.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # A process that stops sending heartbeats for heartbeat_timeout_s is declared dead, and
  # the coordination service then terminates every other process ("Terminating process
  # because the JAX distributed service detected fatal errors ... stopped sending
  # heartbeats"): a job with a dead host ends instead of waiting in a collective forever.
  # A coordinator that cannot be reached ends the same way after initialization_timeout.
  try:
    local_device_ids = slurm_local_device_ids(os.environ) if start == SLURM_START else None
  except ValueError as e:
    exit_with_error(e, force=True)
  try:
    jax.distributed.initialize(
      coordinator_address=FLAGS.coordinator_address,
      num_processes=FLAGS.num_processes,
      process_id=FLAGS.process_id,
      local_device_ids=local_device_ids,
      initialization_timeout=FLAGS.distributed_init_timeout_s,
      heartbeat_timeout_seconds=FLAGS.heartbeat_timeout_s,
    )
  except (RuntimeError, ValueError, TypeError, OSError) as e:
    # OSError: the metadata server's requests (requests' errors are OSErrors).
    if start == TPU_START and FLAGS.distributed == "auto" and not jax.distributed.is_initialized():
      logging.warning(
        "jax.distributed: JAX found no TPU slice around this TPU VM (%s); running as one "
        "process (--distributed=on makes this an error)",
        first_line(e),
      )
      return
    given = (
      f"--coordinator_address={FLAGS.coordinator_address}, --process_id={FLAGS.process_id}, "
      f"--num_processes={FLAGS.num_processes}"
    )
    exit_with_error(
      f"cannot start jax.distributed ({given if start == FLAGS_START else start}): {first_line(e)}",
      force=True,
    )
  _report_started(start)


def _report_started(start: str) -> None:
  """What a started process settles and says once it is connected."""
  if jax.process_count() > 1 and jax.default_backend() == "cpu":
    # JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR) handed CPU processes
    # the executables another process had written, and their first gloo collective then
    # waited for peers that never joined it (a 4-process job resumed from a checkpoint
    # failed so every time; the same job without the cache ran).
    jax.config.update("jax_enable_compilation_cache", False)
  # The first line to read on a new slice or cluster (docs/clusters.md): every host must
  # say the same process count and global devices, and its own index.
  logging.info(
    "jax.distributed (%s): process %d of %d, %d local / %d global devices (%s)",
    start,
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
    jax.devices()[0].device_kind,
  )


# The exit status of eval.py or generate.py stopped by a notice (`Stopped`): a shell's for
# a process that SIGTERM ended, so a cluster script tells it from a failure (and requeues).
NOTICE_EXIT_CODE = 143


def exit_with_error(error, force: bool = False) -> None:
  """Prints `error: ...` as one line on stderr and exits 1 (NOTICE_EXIT_CODE for `Stopped`).

  With several processes the exit skips Python's shutdown (os._exit): the normal exit runs
  jax.distributed's shutdown barrier, which waits for every process, so after another
  process died it would sit there until the heartbeat timeout and then abort with pages
  of logs. Exiting at once also closes this process's connections, so the others' next
  collective fails at once instead of waiting. `force`: exit so even before JAX knows
  the process count (a failed jax.distributed.initialize), or when a thread may never
  return (a write stalled in a storage client).
  """
  message = str(error).strip().replace("\n", " ")
  several = force or (jax.distributed.is_initialized() and jax.process_count() > 1)
  if several and isinstance(error, jax.errors.JaxRuntimeError):
    message = (
      "a collective operation with the other processes failed; another process "
      "has probably died (rerun every process with the same command to resume "
      f"from the newest checkpoint): {first_line(error)}"
    )
  print(f"error: {message}", file=sys.stderr, flush=True)  # once: no log line besides it
  code = NOTICE_EXIT_CODE if isinstance(error, Stopped) else 1
  if several:
    logging.flush()
    sys.stdout.flush()
    os._exit(code)
  sys.exit(code)


class Stopped(RuntimeError):
  """A preemption notice (SIGTERM) ended a job that has nothing to save; nothing written."""


class StopBetweenBatches:
  """SIGTERM, a scheduler's preemption notice, ends eval.py or generate.py with one line
  (`Stopped`) and nothing written: their outputs are written once, at the end.

  One process: a Python handler raises `Stopped` at once, as Ctrl-C would. Several:
  jax.distributed's own handler takes SIGTERM (a Python one would replace it), and a
  host that stopped alone would leave the others waiting in a collective, so every
  process calls `after_batch` after each batch it searched, and all stop after the same
  batch: the one JAX's preemption sync agrees on (the most batches any host had counted
  when the notice came, plus one; a notice before the first batch stops the job after
  it). These commands run no training loop, so the count of batches is the only one the
  sync is given in the process.
  """

  def __init__(self, several_processes: bool):
    self.batches = 0
    self._several_processes = several_processes
    self._previous = None
    if not several_processes:
      self._previous = signal.signal(signal.SIGTERM, self._stop_now)

  def _stop_now(self, signum, frame):
    raise Stopped(self._message())

  def _message(self) -> str:
    return (
      f"stopped by SIGTERM (a preemption notice) after {self.batches} batches; "
      "nothing was written: rerun the same command"
    )

  def after_batch(self) -> None:
    """Raises `Stopped` where the processes agreed to stop; call it on every process."""
    self.batches += 1
    sync = jax.experimental.multihost_utils.reached_preemption_sync_point
    if self._several_processes and sync(self.batches):
      raise Stopped(self._message())

  def restore(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


@contextlib.contextmanager
def stop_between_batches() -> Iterator[StopBetweenBatches]:
  """`StopBetweenBatches` for this job (several processes or one), for as long as it runs."""
  stop = StopBetweenBatches(several_processes=jax.process_count() > 1)
  try:
    yield stop
  finally:
    stop.restore()
