"""One SentencePiece vocabulary shared by source and target, trained once and cached.

Token ids are fixed (transformer/config/schema.py): PAD=0, EOS=1, BOS=2, UNK=3. The model file is
cached under config.vocab_cache_dir with a name that hashes everything it depends on
(dataset, direction, type, size, sentence cap), and copied into each run's workdir as
`vocab.model` so evaluation needs nothing but the workdir. A run with config.vocab_from
set takes another run's `vocab.model` instead (a speculative-decoding draft must share its
target's ids exactly).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import time
from collections.abc import Iterable, Sequence

import numpy as np
import sentencepiece as spm
import tensorflow as tf
from absl import logging

from transformer import storage
from transformer.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, ConfigError
from transformer.data import sources

WORKDIR_VOCAB_NAME = "vocab.model"


class Tokenizer:
  """Text <-> ids with a SentencePiece model. `encode` adds no EOS; the pipeline does."""

  def __init__(self, model_proto: bytes):
    self.model_proto = model_proto
    self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    fixed = (self._sp.pad_id(), self._sp.eos_id(), self._sp.bos_id(), self._sp.unk_id())
    if fixed != (PAD_ID, EOS_ID, BOS_ID, UNK_ID):
      raise ValueError(
        f"SentencePiece model has pad/eos/bos/unk ids {fixed}, "
        f"expected {(PAD_ID, EOS_ID, BOS_ID, UNK_ID)}"
      )

  @classmethod
  def load(cls, path: str) -> Tokenizer:
    with tf.io.gfile.GFile(path, "rb") as f:
      return cls(f.read())

  def save(self, path: str) -> None:
    """Writes atomically: a reader polling for `path` never sees half a file."""
    tf.io.gfile.makedirs(os.path.dirname(path) or ".")
    temporary = f"{path}.tmp-{os.getpid()}-{time.time_ns()}"
    with tf.io.gfile.GFile(temporary, "wb") as f:
      f.write(self.model_proto)
    tf.io.gfile.rename(temporary, path, overwrite=True)

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Many sentences in one call; SentencePiece runs it in C++ without the GIL."""
    return self._sp.encode(list(texts))

  def encode_for_model(self, texts: Sequence[str], max_len: int) -> list[np.ndarray]:
    """What the model reads for each text: its ids and EOS, at most max_len tokens."""
    return [with_eos(ids, max_len) for ids in self.encode_batch(texts)]

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids` up to the first EOS; PAD and BOS are dropped."""
    kept = []
    for i in ids:
      i = int(i)
      if i == EOS_ID:
        break
      if i not in (PAD_ID, BOS_ID):
        kept.append(i)
    return self._sp.decode(kept)

  def id_to_piece(self, i: int) -> str:
    return self._sp.id_to_piece(int(i))


def with_eos(ids: Sequence[int] | np.ndarray, max_len: int) -> np.ndarray:
  """int32 ids followed by EOS, clipped to max_len tokens keeping the EOS.

  Clipping is for inputs only: the model never saw sentences longer than max_len.
  """
  return np.asarray(list(ids[: max_len - 1]) + [EOS_ID], np.int32)


def train_tokenizer(sentences: Iterable[str], *, vocab_size: int, vocab_type: str) -> Tokenizer:
  """Trains a SentencePiece model in memory with the fixed special ids."""
  writer = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(sentences),
    model_writer=writer,
    model_type=vocab_type,
    vocab_size=vocab_size,
    pad_id=PAD_ID,
    eos_id=EOS_ID,
    bos_id=BOS_ID,
    unk_id=UNK_ID,
    character_coverage=0.9995,
    hard_vocab_limit=False,  # a small corpus gets a slightly smaller vocabulary, not an error
    num_threads=os.cpu_count() or 1,
    minloglevel=2,
  )
  return Tokenizer(writer.getvalue())


def default_cache_dir(config) -> str:
  base = config.data_dir or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "transformer_vocab")


def vocab_cache_path(config, source) -> str:
  """Cache file for this vocabulary; the hash covers every setting it depends on."""
  settings = (
    f"{source.cache_key}|{config.direction}|{config.vocab_type}|"
    f"{config.vocab_size}|{config.vocab_max_sentences}"
  )
  digest = hashlib.sha256(settings.encode()).hexdigest()[:12]
  readable = "".join(c if c.isalnum() else "_" for c in source.name.split("/")[-1])[-40:]
  name = f"{readable}_{config.direction}_{config.vocab_type}{config.vocab_size}_{digest}.model"
  return os.path.join(config.vocab_cache_dir or default_cache_dir(config), name)


def training_sentences(source, max_per_side: int) -> Iterable[str]:
  """Both sides of the training split, alternating, up to `max_per_side` pairs."""
  # A fixed file shuffle: WMT's files are ordered by sub-corpus, so the first N pairs
  # in file order would all be Europarl.
  pairs = source.text_dataset("train", shuffle_seed=0).take(max_per_side)
  for source_bytes, target_bytes in pairs.batch(4096).as_numpy_iterator():
    for s, t in zip(source_bytes, target_bytes):
      yield s.decode("utf-8")
      yield t.decode("utf-8")


def load_or_train_tokenizer(config, *, source=None) -> Tokenizer:
  """The cached vocabulary, trained (and cached) first if missing.

  Only one process of a job calls this (training.loop shares its result with the
  others), so two hosts never train or write the same file.
  """
  source = source or sources.make_source(config)
  path = vocab_cache_path(config, source)
  cached = _read_vocab(config, path, lambda: tf.io.gfile.exists(path) and Tokenizer.load(path))
  if cached:
    logging.info("Vocabulary: reusing %s", path)
    return cached
  logging.info(
    "Vocabulary: training %s %d on %s (%s)",
    config.vocab_type,
    config.vocab_size,
    source.name,
    config.direction,
  )
  start = time.time()
  sentences = itertools.islice(
    training_sentences(source, config.vocab_max_sentences), 2 * config.vocab_max_sentences
  )
  tokenizer = train_tokenizer(sentences, vocab_size=config.vocab_size, vocab_type=config.vocab_type)
  tokenizer.save(path)
  logging.info(
    "Vocabulary: %d pieces in %.1fs -> %s", tokenizer.vocab_size, time.time() - start, path
  )
  return tokenizer


def copy_vocab_to_workdir(tokenizer: Tokenizer, workdir: str) -> str:
  """Writes WORKDIR/vocab.model (atomically) and returns its path."""
  path = os.path.join(workdir, WORKDIR_VOCAB_NAME)
  tokenizer.save(path)
  return path


def get_tokenizer(config, workdir: str, *, source=None) -> Tokenizer:
  """The run's vocabulary: WORKDIR/vocab.model when resuming, else config.vocab_from's
  vocab.model when set, else the cached one (trained if needed); then copied into the
  workdir. For one process of a job."""
  vocab_from = config.vocab_from
  path = os.path.join(workdir, WORKDIR_VOCAB_NAME)
  resumed = _read_vocab(
    config, path, lambda: tf.io.gfile.exists(path) and load_workdir_tokenizer(workdir)
  )
  if resumed:
    return resumed
  if vocab_from:
    tokenizer = _read_vocab(
      config,
      os.path.join(vocab_from, WORKDIR_VOCAB_NAME),
      lambda: vocab_from_run(vocab_from, config.vocab_size),
    )
  else:
    tokenizer = load_or_train_tokenizer(config, source=source)
  copy_vocab_to_workdir(tokenizer, workdir)
  return tokenizer


def _read_vocab(config, path: str, read):
  """`read()`, a read of the vocabulary at `path`, within config.storage_timeout_s, or
  storage.StorageTimeout naming it. (Training a vocabulary has no such bound.)"""
  return storage.read_within(config.storage_timeout_s, path, read)


def vocab_from_run(workdir: str, vocab_size: int) -> Tokenizer:
  """Another run's vocabulary (config.vocab_from), as that run saved it.

  A draft model for speculative decoding must share the target's token ids exactly; a
  vocabulary trained again, even with the same settings, need not be byte-identical.
  """
  path = os.path.join(workdir, WORKDIR_VOCAB_NAME)
  if not tf.io.gfile.exists(path):
    raise ConfigError(
      f"config.vocab_from: no {WORKDIR_VOCAB_NAME} in {workdir} (was a run trained there?)"
    )
  tokenizer = Tokenizer.load(path)
  if tokenizer.vocab_size > vocab_size:
    raise ConfigError(
      f"config.vocab_from: {path} has {tokenizer.vocab_size} pieces, more "
      f"than config.vocab_size={vocab_size}; set vocab_size to the run's"
    )
  logging.info("Vocabulary: %s (config.vocab_from)", path)
  return tokenizer


def load_workdir_tokenizer(workdir: str, timeout_s: float | None = None) -> Tokenizer:
  """The vocabulary a run saved in its workdir; a one-line error if it is missing.
  timeout_s (config.storage_timeout_s): the read's bound, storage.StorageTimeout after it
  (None: unbounded, for a caller already inside a bounded read)."""
  path = os.path.join(workdir, WORKDIR_VOCAB_NAME)

  def read() -> Tokenizer:
    if not tf.io.gfile.exists(path):
      raise ConfigError(f"workdir: no {WORKDIR_VOCAB_NAME} in {workdir} (was it trained here?)")
    return Tokenizer.load(path)

  return read() if timeout_s is None else storage.read_within(timeout_s, path, read)
