"""Shared entry-point plumbing for train.py, eval.py, generate.py and the package's
commands.

`run(main)` is absl's `app.run` with five additions:
  - the process keeps freed host memory where JAX computes on the CPU (host_memory.py),
    set before anything starts a JAX backend, and TensorFlow skips loading Keras and
    prints none of its C++ start-up lines;
  - a bad `--config.KEY=VALUE` override is reported in one line naming it;
  - `--config FILE[:ARG]` is found relative to the working directory or, failing that,
    to the repository, so every command works from any directory;
  - a quiet terminal: INFO lines come from this project only; libraries (Orbax, tfds,
    JAX) show their warnings and errors, except Orbax's tracebacks of a failed save,
    which the project reports in one line. `--verbosity=1` shows everything;
  - a stalled read or write (storage.StorageTimeout) that the command let through ends
    it in one line, at once (`exit_with_error`), as the commands' own handlers do.
"""

import logging
import os
import sys
from typing import NoReturn

from absl import app, flags
from absl import logging as absl_logging

from transformer import host_memory

UsageError = app.UsageError

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_DIR = os.path.dirname(_PACKAGE_DIR)
_ENTRY_POINTS = tuple(
  os.path.join(_REPO_DIR, name) for name in ("train.py", "eval.py", "generate.py")
)


def is_project_file(path: str) -> bool:
  """True for this package's modules and the entry points, not for installed libraries."""
  path = os.path.abspath(path)
  return path.startswith(_PACKAGE_DIR + os.sep) or path in _ENTRY_POINTS


# Orbax's log records of a failed asynchronous save (a stalled or full storage), each
# with its traceback: from the thread of a write that failed, from the thread that waited
# for the writes, and again from `wait_until_finished`. training/checkpoints.py raises
# the same failure, which the commands print in one line, so a user whose bucket stalls
# is not shown 40 lines of Orbax's traceback first. (module, function) of each;
# `--verbosity=1` shows them.
_ORBAX_SAVE_FAILURE_RECORDS = {
  ("future", "run"),
  ("async_checkpointer", "_thread_func"),
  ("checkpoint_manager", "wait_until_finished"),
}


def is_orbax_save_failure(record: logging.LogRecord) -> bool:
  return (
    record.levelno >= logging.ERROR
    and f"{os.sep}orbax{os.sep}" in record.pathname
    and (record.module, record.funcName) in _ORBAX_SAVE_FAILURE_RECORDS
  )


class ProjectInfoFilter(logging.Filter):
  """Passes warnings and errors from anywhere, and INFO (and below) from this project;
  not Orbax's records of a failed save, which the project reports in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    if is_orbax_save_failure(record):
      return False
    return record.levelno >= logging.WARNING or is_project_file(record.pathname)


def quiet_library_logs() -> None:
  """Applies ProjectInfoFilter to absl's handler, which prints every Python log record."""
  if (flags.FLAGS["verbosity"].value or 0) >= 1:
    return
  handler = absl_logging.get_absl_handler()
  if not any(isinstance(f, ProjectInfoFilter) for f in handler.filters):
    handler.addFilter(ProjectInfoFilter())


def resolve_config_arg(argv: list[str]) -> list[str]:
  """`--config FILE[:ARG]` with FILE made absolute where only the repository has it."""
  from transformer import config as config_lib  # light: ml_collections only

  def resolved(spec: str) -> str:
    path, colon, arg = spec.partition(":")
    if not path or os.path.isfile(path):
      return spec
    try:
      return config_lib.resolve_config_file(path) + colon + arg
    except config_lib.ConfigError:
      return spec  # left for config_flags to report

  out = list(argv)
  for i, arg in enumerate(out):
    if arg.startswith("--config="):
      out[i] = "--config=" + resolved(arg[len("--config=") :])
    elif arg == "--config" and i + 1 < len(out):
      out[i + 1] = resolved(out[i + 1])
  return out


def flag_error_line(error: flags.Error) -> str:
  """absl's flag error as one line. A config file's own error (`--config FILE:huge` that
  get_config() rejects) arrives wrapped by config_flags with its traceback: the flag and
  the exception's message are what the user needs."""
  message = str(error).strip()
  if "Traceback (most recent call last)" not in message:
    return f"error: {message} (pass --helpfull to see the flags)"
  flag = message.split(": Error whilst parsing config file", 1)[0]
  raised = message.splitlines()[-1]  # "ValueError: configs/wmt14.py: argument ..."
  return f"error: {flag}: {raised.partition(': ')[2] or raised}"


def _parse_flags(argv):
  """absl's parser, with bad `--config.KEY=VALUE` overrides reported in one line."""
  argv = resolve_config_arg(argv)
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:  # one line: the last line of stderr is what scripts show
    sys.exit(flag_error_line(e))
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    while e.args and isinstance(e.args[0], BaseException):  # KeyError inside AttributeError
      e = e.args[0]
    message = (
      str(e.args[0] if e.args else e).replace("\\n", " ").replace("\n", " ").replace("\\", "")
    )
    overrides = [a for a in argv[1:] if a.startswith("--config.")]
    # Name the override the message is about: its last key part quoted in it ('num_heds'),
    # else appearing in it, else all of them.
    leaf = {a: a.split("=")[0].rsplit(".", 1)[-1] for a in overrides}
    bad = (
      [a for a in overrides if f"'{leaf[a]}'" in message]
      or [a for a in overrides if leaf[a] in message]
      or overrides
    )
    where = f" {' '.join(bad)}" if bad else ""
    sys.exit(f"error: bad config override{where}: {message}")


def program_flags(module_name: str) -> flags.FlagValues:
  """Where a module that is both a command and a library defines its flags: absl's
  registry when it runs as a program (`module_name` is "__main__"), else a registry of
  its own that is never parsed. Imported by tests or other tools, two such modules
  defining --config or --workdir would otherwise clash in one process."""
  return flags.FLAGS if module_name == "__main__" else flags.FlagValues()


def quiet_tensorflow_start() -> None:
  """Environment defaults that TensorFlow reads as it is imported (a user's own settings
  win); a command sets them before its imports load TensorFlow."""
  # TensorFlow (the input pipeline, gs:// files) loads Keras 3 as it is imported, and
  # Keras loads matplotlib's pyplot: about 1 s of every command's start, for a library
  # nothing here uses. Told to use the legacy tf_keras package instead, which is not
  # installed, TensorFlow skips that import (tf.keras is then unavailable).
  os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
  # TensorFlow only reads, shuffles and groups text here (and writes TensorBoard files),
  # and its C++ start-up lines would open every command's output, twice: "oneDNN custom
  # operations are on" (oneDNN speeds up float math, which no TensorFlow op here does,
  # so turning it off changes no result) and the absl::InitializeLog() notice that comes
  # with any early line. TensorFlow's other C++ INFO lines go too; its warnings and
  # errors still show.
  os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


def is_storage_timeout(error: BaseException) -> bool:
  """True for a storage.StorageTimeout (a checkpoint's CheckpointTimeout too), without
  importing storage: a process that never loaded it cannot have raised one."""
  storage = sys.modules.get("transformer.storage")
  return storage is not None and isinstance(error, storage.StorageTimeout)


def exit_with_error(error: BaseException) -> NoReturn:
  """Ends a command with `error: ...` as one line on stderr and exit code 1. After a
  StorageTimeout the exit is immediate (os._exit): the stalled read or write is still
  blocked in a storage client, on a thread that a normal exit would join (Orbax's own
  worker threads are joined as the interpreter ends), so the command would wait as long
  as the storage stalls. (Commands that run on several processes end through
  inference.distributed.exit_with_error, which also skips jax.distributed's shutdown.)"""
  message = str(error).strip().replace("\n", " ")
  print(f"error: {message}", file=sys.stderr, flush=True)
  if is_storage_timeout(error):
    absl_logging.flush()
    sys.stdout.flush()
    os._exit(1)
  sys.exit(1)


def run(main) -> None:
  # Process-wide settings belong to the command, not to an import of the package, and
  # go before JAX starts a backend and its threads (host_memory.py).
  host_memory.retain_freed_memory()
  quiet_tensorflow_start()

  def quiet_main(argv):
    quiet_library_logs()
    try:
      return main(argv)
    except RuntimeError as e:
      # A stalled read or write that the command did not report itself still ends in one
      # line, at once, rather than in a traceback and a wait for the stalled thread.
      if not is_storage_timeout(e):
        raise
      exit_with_error(e)

  app.run(quiet_main, flags_parser=_parse_flags)
