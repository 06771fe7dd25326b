"""Every file the project reads or writes goes through here: local disk or gs://... alike.

Paths are `etils.epath.Path`, the layer Orbax itself uses. A local path becomes absolute;
a URL (gs://bucket/run) is kept as it is: `os.path.abspath("gs://b/run")` would turn it
into the local folder `<cwd>/gs:/b/run`. With TensorFlow installed (a dependency),
epath reaches gs:// through `tf.io.gfile`, the same client tfds and the vocabulary
cache use, so one set of credentials and one client serve every file of a run.

Cloud storage has no appends and no atomic rename, so writers here only ever write
whole objects: `write_text` replaces a file in one upload (on local disk, through a
temporary file and a rename), and `AppendLog` rewrites its whole file at each flush.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, Iterable

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
    raise FileNotFoundError(f"bucket {bucket} does not exist or cannot be read with "
                            "these credentials")


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
  temporary.write_bytes(data)
  os.replace(temporary, target)


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


class AppendLog:
  """A text file that grows by lines (metrics.jsonl, a sweep's log), on disk or in a bucket.

  Lines are buffered and the file is rewritten whole at `flush`, because cloud objects
  cannot be appended to. The lines already in the file when it is opened are kept, so a
  resumed run continues the same file. Rewriting costs O(file size) per flush; callers
  flush at log steps, not per line.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = as_path(path)
    self._text = self.path.read_text(encoding="utf-8") if self.path.exists() else ""
    if self._text and not self._text.endswith("\n"):
      self._text += "\n"  # a line torn by a kill on local disk: keep later lines whole
    self._dirty = False

  def write_line(self, line: str) -> None:
    self._text += line.rstrip("\n") + "\n"
    self._dirty = True

  def flush(self) -> None:
    if self._dirty:
      write_text(self.path, self._text)
      self._dirty = False
