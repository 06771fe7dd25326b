"""Where sentence pairs come from: a tfds translation dataset or the user's own TSV.

Both kinds give the same thing downstream: a `tf.data.Dataset` of (source, target)
string scalars per split, in a fixed order (optionally file-shuffled by a seed), and the
raw pairs of a split as Python strings for writing references.
"""

from __future__ import annotations

import functools
import hashlib

import tensorflow as tf
import tensorflow_datasets as tfds
from absl import logging

from transformer.config import ConfigError, parse_direction
from transformer.data import (
  tatoeba,  # registers `tatoeba_en_es` with tfds
  tsv,
)

del tatoeba  # imported for its registration only

TSV_PREFIX = "tsv:"


class TfdsSource:
  """A tfds dataset with one text feature per language (e.g. wmt14_translate/de-en)."""

  def __init__(self, name: str, direction: str, data_dir: str = "", manual_dir: str = ""):
    self.name = name
    self.direction = direction
    self.source_lang, self.target_lang = parse_direction(direction)
    try:
      self.builder = tfds.builder(name, data_dir=data_dir or None)
    except tfds.core.registered.DatasetNotFoundError as e:
      raise ConfigError(f"dataset: {name!r} is not a tfds dataset nor tsv:PATH") from e
    self._manual_dir = manual_dir
    languages = set(self.builder.info.features.keys())
    if not {self.source_lang, self.target_lang} <= languages:
      raise ConfigError(
        f"direction: {direction!r} needs languages {sorted(languages)} of dataset {name!r}"
      )

  @property
  def cache_key(self) -> str:
    return f"{self.name}:{self.builder.version}"

  def prepare(self) -> None:
    """Builds the dataset on disk if needed (downloads, or reads manual_dir)."""
    config = tfds.download.DownloadConfig(manual_dir=self._manual_dir or None)
    self.builder.download_and_prepare(download_config=config)

  def text_dataset(self, split: str, shuffle_seed: int | None = None) -> tf.data.Dataset:
    """(source, target) string scalars; `shuffle_seed` shuffles the order of the files."""
    self.prepare()
    read_config = tfds.ReadConfig(shuffle_seed=shuffle_seed, try_autocache=False)
    ds = self.builder.as_dataset(
      split=split, shuffle_files=shuffle_seed is not None, read_config=read_config
    )
    return ds.map(
      lambda ex: (ex[self.source_lang], ex[self.target_lang]), num_parallel_calls=tf.data.AUTOTUNE
    )


class TsvSource:
  """The user's TSV: column 1 is the source, column 2 the target, whatever `direction` says.

  With only the main file, validation and test are carved out of it by the hash of the
  source sentence (tsv.split_of); a split given its own file takes it from there instead.
  """

  def __init__(self, path: str, validation_file: str = "", test_file: str = ""):
    self.name = TSV_PREFIX + path
    self._files = {"validation": validation_file, "test": test_file}
    # Reading everything now turns a missing or empty file into an error before any
    # vocabulary training or compilation starts.
    main = tsv.read_tsv(path)
    indices_by_split: dict[str, list[int]] = {split: [] for split in tsv.SPLITS}
    for split, indices in tsv.split_indices(main.pairs).items():
      destination = "train" if self._files.get(split) else split
      indices_by_split[destination].extend(indices)
    self._pairs = {s: [main.pairs[i] for i in sorted(ix)] for s, ix in indices_by_split.items()}
    for split, file in self._files.items():
      if file:
        self._pairs[split] = tsv.read_tsv(file).pairs
    logging.info("%s: %s", self.name, {s: len(p) for s, p in self._pairs.items()})
    fingerprint = hashlib.sha256()
    for file in (path, validation_file, test_file):
      fingerprint.update(file.encode() + b"\0" + _file_head_digest(file))
    self.cache_key = f"{self.name}:{fingerprint.hexdigest()[:16]}"

  def prepare(self) -> None:
    pass

  def pairs(self, split: str) -> list[tuple[str, str]]:
    return self._pairs[split]

  def text_dataset(self, split: str, shuffle_seed: int | None = None) -> tf.data.Dataset:
    del shuffle_seed  # one in-memory "file": the example shuffle does all the work
    pairs = self._pairs[split]
    sources = [s for s, _ in pairs]
    targets = [t for _, t in pairs]
    return tf.data.Dataset.from_tensor_slices(
      (tf.constant(sources, tf.string), tf.constant(targets, tf.string))
    )


def _file_head_digest(path: str, num_bytes: int = 1 << 20) -> bytes:
  """Size and first MiB of a file: cheap, and the same on every host (unlike mtime)."""
  if not path:
    return b""
  with tf.io.gfile.GFile(path, "rb") as f:
    head = f.read(num_bytes)
  return hashlib.sha256(head + str(tf.io.gfile.stat(path).length).encode()).digest()


def make_source(config) -> TfdsSource | TsvSource:
  """The pair source named by config.dataset ('tsv:PATH' or a tfds name).

  Cached per setting, so that every evaluation does not re-read a large TSV.
  """
  return _make_source(
    config.dataset,
    config.direction,
    config.data_dir,
    config.manual_dir,
    config.validation_file,
    config.test_file,
  )


@functools.lru_cache(maxsize=8)
def _make_source(dataset, direction, data_dir, manual_dir, validation_file, test_file):
  if dataset.startswith(TSV_PREFIX):
    parse_direction(direction)  # only labels here, but still well-formed
    return TsvSource(dataset[len(TSV_PREFIX) :], validation_file, test_file)
  if validation_file or test_file:
    raise ConfigError("validation_file / test_file only apply to dataset=tsv:PATH")
  return TfdsSource(dataset, direction, data_dir, manual_dir)


def raw_pairs(source: TfdsSource | TsvSource, split: str) -> list[tuple[str, str]]:
  """Every (source_text, target_text) of a split, in the split's fixed order."""
  if isinstance(source, TsvSource):
    return list(source.pairs(split))
  return [
    (s.decode("utf-8"), t.decode("utf-8"))
    for s, t in source.text_dataset(split).as_numpy_iterator()
  ]
