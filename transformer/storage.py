"""Every file the project reads or writes goes through here: local disk or gs://... alike.

Paths are `etils.epath.Path`, the layer Orbax itself uses. A local path becomes absolute;
a URL (gs://bucket/run) is kept as it is: `os.path.abspath("gs://b/run")` would turn it
into the local folder `<cwd>/gs:/b/run`. With TensorFlow installed (a dependency),
epath reaches gs:// through `tf.io.gfile`, the same client tfds and the vocabulary
cache use, so one set of credentials and one client serve every file of a run.

Cloud storage has no appends and no atomic rename, so writers here only ever write
whole objects: `write_text` replaces a file in one upload (on local disk, through a
temporary file and a rename), and `AppendLog` cuts a bucket's log into numbered chunk
objects, so that adding a line never uploads the lines before it again.
"""

from __future__ import annotations

import json
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from etils import epath

from transformer.messages import first_line


def is_remote(path: str | os.PathLike) -> bool:
  """True for a URL such as gs://bucket/run (any scheme://), False for a local path."""
  return "://" in os.fspath(path)


def as_path(path: str | os.PathLike) -> epath.Path:
  """The epath.Path of a user's path: local ones absolute, URLs untouched."""
  text = os.fspath(path)
  if not is_remote(text):
    text = os.path.abspath(os.path.expanduser(text))
  return epath.Path(text)


def join(path: str | os.PathLike, *parts: str) -> str:
  """`path/part/...` as a string, for a URL as for a local path."""
  return os.fspath(as_path(path).joinpath(*parts))


def error_text(e: BaseException) -> str:
  """One line for an I/O error from any backend (OSError or tf.errors.*)."""
  if isinstance(e, OSError) and e.strerror:
    return e.strerror
  if isinstance(e, OSError):
    return first_line(e)
  return first_line(e, with_type=True)


def exists(path: str | os.PathLike) -> bool:
  return as_path(path).exists()


def is_dir(path: str | os.PathLike) -> bool:
  return as_path(path).is_dir()


def _check_bucket(path: epath.Path) -> None:
  """OSError if the bucket of a URL does not exist (or cannot be seen with these
  credentials). TensorFlow's GCS client, asked to create folders in a missing bucket,
  retries forever instead of failing: a mistyped bucket would hang a whole pod."""
  text = os.fspath(path)
  scheme, _, rest = text.partition("://")
  bucket = f"{scheme}://{rest.split('/')[0]}"
  if not epath.Path(bucket).exists():
    raise FileNotFoundError(
      f"bucket {bucket} does not exist or cannot be read with these credentials"
    )


def makedirs(path: str | os.PathLike) -> None:
  folder = as_path(path)
  if is_remote(folder):
    _check_bucket(folder)
  folder.mkdir(parents=True, exist_ok=True)


def read_text(path: str | os.PathLike) -> str:
  return as_path(path).read_text(encoding="utf-8")


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
  """Writes the whole file so that a reader (or a kill) never sees half of it.

  On cloud storage an object appears only once its upload completes. On local disk the
  bytes go to a temporary file first, which is renamed over the old one.
  """
  target = as_path(path)
  if is_remote(target):
    target.write_bytes(data)
    return
  temporary = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex}")
  try:
    temporary.write_bytes(data)
    os.replace(temporary, target)
  except BaseException:  # a full disk, or a SIGTERM's exception: no half file left behind
    temporary.unlink(missing_ok=True)
    raise


def write_text(path: str | os.PathLike, text: str) -> None:
  """`write_bytes` of UTF-8 text."""
  write_bytes(path, text.encode("utf-8"))


def write_lines(path: str | os.PathLike, lines: Iterable[str]) -> None:
  """One line per item (newlines inside an item become spaces), written whole."""
  write_text(path, "".join(line.replace("\n", " ") + "\n" for line in lines))


def read_json(path: str | os.PathLike) -> Any:
  return json.loads(read_text(path))


def write_json(path: str | os.PathLike, value: Any) -> None:
  write_text(path, json.dumps(value, indent=2) + "\n")


def copy(source: str | os.PathLike, destination: str | os.PathLike) -> None:
  as_path(source).copy(as_path(destination), overwrite=True)


def check_writable(directory: str | os.PathLike) -> None:
  """Creates `directory` and writes and deletes a probe file in it; OSError if it cannot.

  Run before anything slow, so that a mistyped bucket or a read-only disk fails in a
  second, not after the first compile or at the first checkpoint.
  """
  folder = as_path(directory)
  probe = folder / f".write_probe_{uuid.uuid4().hex}"  # unique across hosts sharing a bucket
  try:
    makedirs(folder)
    probe.write_text("")
    probe.unlink()
  except Exception as e:  # pylint: disable=broad-except  (tf.errors.* are not OSError)
    raise OSError(error_text(e)) from None


class StorageTimeout(RuntimeError):
  """A write or read that did not finish within its time limit: the message names the
  object.

  The thread that was writing may still be blocked in the storage client, so whoever
  catches this should end the process without waiting for it (train.py does)."""


def timeout_message(what: str, seconds: float, doing: str = "writing") -> str:
  return (
    f"{doing} {what} did not finish within {seconds:g} s (config.storage_timeout_s): "
    "the storage stalled; rerun the same command to resume from the newest "
    "complete checkpoint"
  )


def call_within(
  seconds: float, call: Callable[[], Any], name: str = "storage-call"
) -> tuple[bool, Any]:
  """(True, `call()`'s value) if it returned within `seconds` (its error is re-raised
  here), or (False, None) if it is still running then. It runs on a helper thread named
  `name`, which a stalled client may keep blocked: it is left behind, and whoever acts on
  the False ends the process."""
  outcome: list = []

  def run():
    try:
      outcome.append((True, call()))
    except BaseException as e:  # pylint: disable=broad-except  (re-raised below)
      outcome.append((False, e))

  thread = threading.Thread(target=run, name=name, daemon=True)
  thread.start()
  thread.join(max(seconds, 0.0))
  if not outcome:
    return False, None
  ok, value = outcome[0]
  if not ok:
    raise value
  return True, value


def read_within(seconds: float, what: str, call: Callable[[], Any]) -> Any:
  """`call()`'s value (or its error), or StorageTimeout naming `what` if it has not
  returned after `seconds` (`call_within`)."""
  done, value = call_within(seconds, call, name="storage-read")
  if not done:
    raise StorageTimeout(timeout_message(what, seconds, doing="reading"))
  return value


# A bucket's log is cut into objects of about this size: a flush re-uploads at most one
# of them, so the cost of a line does not grow with the log, and a reader fetches
# (log size / 64 KiB) objects.
LOG_CHUNK_BYTES = 64 * 1024


def _chunk_pattern(path: epath.Path) -> re.Pattern:
  stem, suffix = os.path.splitext(path.name)
  return re.compile(re.escape(stem) + r"-(\d+)" + re.escape(suffix))


def log_chunks(path: str | os.PathLike) -> list[epath.Path]:
  """The chunk objects of the log at `path` (metrics.jsonl: metrics-000000.jsonl, ...),
  in order."""
  log_path = as_path(path)
  if not log_path.parent.exists():
    return []
  stem, suffix = os.path.splitext(log_path.name)
  pattern = _chunk_pattern(log_path)
  numbered = [
    (int(m.group(1)), p)
    for p in log_path.parent.glob(f"{stem}-*{suffix}")
    if (m := pattern.fullmatch(p.name))
  ]
  return [p for _, p in sorted(numbered)]


def read_log_lines(path: str | os.PathLike) -> list[str]:
  """Every line of the log `AppendLog(path)` writes, in order, whatever its layout: the
  file `path` itself (local disk, or a run written before logs were chunked), then its
  chunk objects (a bucket). [] if there is neither."""
  text = read_text(path) if exists(path) else ""
  for chunk in log_chunks(path):
    text += chunk.read_text(encoding="utf-8")
  return text.splitlines()


class AppendLog:
  """A text file that grows by lines (metrics.jsonl, a sweep's log), on disk or in a bucket.

  Lines are buffered until `flush`. On local disk they are appended to the file. Cloud
  objects cannot be appended to, so in a bucket the lines go to numbered chunk objects
  beside `path` (metrics.jsonl: metrics-000000.jsonl, metrics-000001.jsonl, ...): a
  flush rewrites only the newest chunk, which is closed once it holds LOG_CHUNK_BYTES.
  A flush therefore uploads at most about LOG_CHUNK_BYTES, however long the log. A log
  opened again (a resumed run) continues after what is there. `read_log_lines` reads
  either layout back as one stream.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = as_path(path)
    self._pending: list[str] = []
    self._remote = is_remote(self.path)
    if self._remote:
      stem, suffix = os.path.splitext(self.path.name)
      self._chunk_name = lambda index: f"{stem}-{index:06d}{suffix}"
      existing = log_chunks(self.path)
      self._chunk_index = 0
      if existing:
        newest = _chunk_pattern(self.path).fullmatch(existing[-1].name)
        assert newest is not None  # log_chunks lists only names the pattern matches
        self._chunk_index = int(newest.group(1)) + 1
      self._chunk_text = ""
    elif self.path.exists():
      with open(self.path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
          f.write(b"\n")  # a line torn by a kill: keep later lines whole

  def write_line(self, line: str) -> None:
    self._pending.append(line.replace("\n", " ") + "\n")

  def object_name(self) -> str:
    """What the next flush writes: the file, or the bucket's newest chunk."""
    if not self._remote:
      return os.fspath(self.path)
    return os.fspath(self.path.parent / self._chunk_name(self._chunk_index))

  def flush(self) -> None:
    if not self._pending:
      return
    new = "".join(self._pending)
    if self._remote:
      text = self._chunk_text + new
      write_text(self.object_name(), text)
      if len(text.encode("utf-8")) >= LOG_CHUNK_BYTES:
        self._chunk_index, self._chunk_text = self._chunk_index + 1, ""
      else:
        self._chunk_text = text
    else:
      with open(self.path, "a", encoding="utf-8") as f:
        f.write(new)
    self._pending = []
