"""Tab-separated sentence pairs, and the rule that splits them into train/validation/test.

A TSV line is `source<TAB>target[<TAB>anything]`. Bad lines are skipped and counted, never
repaired: a line with no tab, an empty side or bytes that are not UTF-8 would otherwise
shift columns or smuggle mojibake into the vocabulary, and a line over MAX_LINE_BYTES
is no sentence pair (a missing newline, a binary file) and would only be tokenized to be
dropped. A file that cannot be read, or has no usable line, is a one-line ConfigError.

Splitting hashes the SOURCE sentence (for the bundled corpus: the English one), so every
translation of one sentence lands in one split and no test sentence is seen in training.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import hashlib
import io

import tensorflow as tf
from absl import logging

from transformer.config import ConfigError

SPLITS = ("train", "validation", "test")
HELDOUT_PAIRS = 2000  # about this many pairs each in validation and test
MAX_HELDOUT_FRACTION = 0.05  # small corpora keep at least 90% for training
MAX_LINE_BYTES = 1 << 20  # longer lines are skipped and counted


@dataclasses.dataclass
class TsvContents:
  """The usable lines of a TSV, in file order."""

  pairs: list[tuple[str, str]]
  extras: list[str]  # the third column ("" if absent), e.g. the corpus attribution
  line_numbers: list[int]  # 1-based, for stable example keys
  skipped: collections.Counter  # reason -> count


def read_tsv(path: str) -> TsvContents:
  """Reads `path` (plain or .gz). Raises ConfigError (one line) if nothing is usable."""
  if not tf.io.gfile.exists(path):
    raise ConfigError(f"TSV file not found: {path}")
  try:
    with tf.io.gfile.GFile(path, "rb") as f:
      data = f.read()
    if path.endswith(".gz"):
      data = gzip.GzipFile(fileobj=io.BytesIO(data)).read()
  except (tf.errors.OpError, OSError, EOFError) as e:  # a directory, no permission, bad gzip
    reason = e.message if isinstance(e, tf.errors.OpError) else str(e)
    raise ConfigError(f"TSV file cannot be read: {path}: {reason}") from None
  if not data.strip():
    raise ConfigError(f"TSV file is empty: {path}")

  contents = TsvContents([], [], [], collections.Counter())
  for line_number, raw in enumerate(data.split(b"\n"), start=1):
    raw = raw.rstrip(b"\r")
    if not raw.strip():
      continue  # blank lines (e.g. the final newline) are not data
    if len(raw) > MAX_LINE_BYTES:
      contents.skipped[f"over {MAX_LINE_BYTES} bytes"] += 1
      continue
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError:
      contents.skipped["not UTF-8"] += 1
      continue
    columns = line.split("\t")
    if len(columns) < 2:
      contents.skipped["no tab"] += 1
      continue
    source, target = columns[0].strip(), columns[1].strip()
    if not source or not target:
      contents.skipped["empty side"] += 1
      continue
    contents.pairs.append((source, target))
    contents.extras.append(columns[2].strip() if len(columns) > 2 else "")
    contents.line_numbers.append(line_number)

  if contents.skipped:
    logging.warning(
      "%s: skipped %d lines (%s)",
      path,
      sum(contents.skipped.values()),
      ", ".join(f"{n} {why}" for why, n in sorted(contents.skipped.items())),
    )
  if not contents.pairs:
    why = ", ".join(f"{n} {why}" for why, n in sorted(contents.skipped.items()))
    raise ConfigError(f"TSV file has no usable source<TAB>target line: {path} (skipped: {why})")
  logging.info("%s: %d usable pairs", path, len(contents.pairs))
  return contents


def heldout_fraction(num_pairs: int) -> float:
  """The share of pairs that goes to validation, and again to test."""
  return min(MAX_HELDOUT_FRACTION, HELDOUT_PAIRS / max(num_pairs, 1))


def split_of(source_sentence: str, fraction: float) -> str:
  """'train', 'validation' or 'test', from a hash of the sentence (stable across runs)."""
  digest = hashlib.sha256(source_sentence.encode("utf-8")).digest()
  u = int.from_bytes(digest[:8], "big") / 2.0**64  # uniform in [0, 1)
  if u < fraction:
    return "validation"
  if u < 2 * fraction:
    return "test"
  return "train"


def split_indices(pairs: list[tuple[str, str]]) -> dict[str, list[int]]:
  """Indices of `pairs` per split, in order; the split is decided by pair[0]."""
  fraction = heldout_fraction(len(pairs))
  indices: dict[str, list[int]] = {split: [] for split in SPLITS}
  for i, (source, _) in enumerate(pairs):
    indices[split_of(source, fraction)].append(i)
  return indices
