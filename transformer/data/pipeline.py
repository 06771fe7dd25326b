"""Training and evaluation input: text pairs -> token ids -> batches (batching.py format).

tf.data reads and shuffles on its C++ threads and groups sentences in chunks; each chunk
is tokenized in one SentencePiece call, then bucketing and packing run in numpy. This
split costs less than per-example tf.data ops (docs/data.md, "Speed", and its measurements).

Training stream, identical on every host: epoch e is the training split shuffled by
(seed, e), tokenized, filtered to max_len and batched. Every host builds the same
global batch and keeps its own contiguous block of rows, so the global batch at a step
does not depend on the number of hosts. State is (epoch, batch index) and the batch plan
(rows per batch shape); restoring replays the epoch up to that batch (it costs the
tokenization of the skipped part) with the saved plan, so a run resumed on another mesh
trains on the same examples in the same global batches (`TrainIterator.set_state`).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Generator

import numpy as np
import tensorflow as tf
from absl import logging

from transformer.config import EOS_ID, ConfigError
from transformer.data import batching, sources
from transformer.data.tokenizer import Tokenizer, with_eos

TOKENIZE_CHUNK = 1024  # sentences per SentencePiece call
# The first pairs of epoch 0 that size each batch shape for the real-token budget, and
# the fewest rows of a shape among them that count as a measurement.
PLAN_SAMPLE_PAIRS = 20_000
MIN_SAMPLE_ROWS = 32


def _encode_chunk(tokenizer: Tokenizer):
  def encode(texts_N):
    ids = tokenizer.encode_batch([t.decode("utf-8") for t in texts_N])
    lengths_N = np.array([len(x) + 1 for x in ids], np.int32)  # + EOS
    flat = np.fromiter((i for x in ids for i in (*x, EOS_ID)), np.int32, lengths_N.sum())
    return flat, lengths_N

  return encode


def tokenized_chunks(
  source,
  tokenizer: Tokenizer,
  split: str,
  *,
  shuffle_seed: int | None = None,
  shuffle_buffer_size: int = 0,
):
  """Numpy chunks (source_flat, source_lengths, target_flat, target_lengths), EOS included.

  tf.data reads, shuffles and groups the text on its own C++ threads; each chunk is then
  tokenized here, in the consuming thread (one SentencePiece call per side, which runs in
  C++ without the GIL). Tokenizing inside tf.data (tf.numpy_function) was as fast, but
  then tf.data's threads call into Python, and one still running at exit aborted the
  process as the interpreter shut down.
  """
  ds = source.text_dataset(split, shuffle_seed=shuffle_seed)
  # One thread for tf.data's reading and shuffling: it needs little, and every core
  # it keeps busy (TensorFlow's pools spin while they wait) is taken from the step.
  options = tf.data.Options()
  options.threading.private_threadpool_size = 1
  options.threading.max_intra_op_parallelism = 1
  ds = ds.with_options(options)
  if shuffle_seed is not None:
    ds = ds.shuffle(shuffle_buffer_size, seed=shuffle_seed, reshuffle_each_iteration=False)
  encode = _encode_chunk(tokenizer)
  for sources_N, targets_N in ds.batch(TOKENIZE_CHUNK).prefetch(2).as_numpy_iterator():
    yield (*encode(sources_N), *encode(targets_N))


def fit_to_length(ids: np.ndarray, max_len: int, clip: bool) -> np.ndarray | None:
  """`ids` (ending in EOS) if short enough; else clipped keeping the EOS, or None."""
  if len(ids) <= max_len:
    return ids
  return with_eos(ids[:-1], max_len) if clip else None


def make_example(
  source_ids: np.ndarray, target_ids: np.ndarray, decoder_only: bool, lm_loss: str = "target"
) -> dict[str, np.ndarray]:
  """Translation example, or an LM sequence source+EOS+target+EOS.

  lm_loss (config.lm_loss, decoder-only only): "target" puts the loss on the target
  side alone, so the source is a prompt the model reads but is not scored on (a prefix
  LM); "sequence" scores every token, the source side's too.
  """
  if not decoder_only:
    return {"source": source_ids, "target": target_ids}
  if lm_loss not in ("target", "sequence"):
    raise ConfigError(f"lm_loss: {lm_loss!r} must be 'target' or 'sequence'")
  source_weight = np.zeros_like if lm_loss == "target" else np.ones_like
  return {
    "target": np.concatenate([source_ids, target_ids]),
    "loss_mask": np.concatenate([source_weight(source_ids), np.ones_like(target_ids)]),
  }


# The config keys a batch plan is made from, besides the mesh (row_multiple).
PLAN_KEYS = ("tokens_per_batch", "batching", "max_len")
# The data state's format (`TrainIterator.get_state`), saved with it:
#   1  {epoch, batch_in_epoch}: no plan; the rows were rounded to the nearest multiple
#      of row_multiple (over budget or under). Written before plans were saved.
#   2  adds "format", start_pair, pairs_read and the plan with the keys it was made from.
DATA_STATE_FORMAT = 2


def _epoch_seed(seed: int, epoch: int) -> int:
  return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


class TrainIterator:
  """Endless training batches (this process's rows), with a JSON-able resume state."""

  def __init__(
    self,
    config,
    tokenizer: Tokenizer,
    source,
    *,
    process_index: int,
    process_count: int,
    row_multiple: int,
  ):
    if row_multiple % process_count:
      raise ValueError(
        f"row_multiple {row_multiple} must be a multiple of process_count {process_count}"
      )
    self._config, self._tokenizer, self._source = config, tokenizer, source
    self._process_index, self._process_count = process_index, process_count
    self._decoder_only = bool(config.model.decoder_only)
    self._lm_loss = config.lm_loss  # validation (_eval_examples) scores the target only
    # A decoder-only sequence holds both sides: twice the length and the token budget.
    sides = 2 if self._decoder_only else 1
    self._row_len, self._budget = sides * config.max_len, sides * config.tokens_per_batch
    if config.batching not in ("tokens", "packed"):
      raise ConfigError(f"batching: {config.batching!r} must be 'tokens' or 'packed'")
    self._row_multiple = row_multiple
    self._plan: dict[int, int] | None = None  # made at first use, or restored
    # Position: epoch, batches taken in it, the pair of the epoch's order its batching
    # started at (0 unless the plan changed mid-epoch), and the pairs read so far.
    self._epoch, self._batch_in_epoch, self._start_pair, self._pairs_read = 0, 0, 0, 0
    self._batches: Generator[tuple[dict[str, np.ndarray], int], None, None] | None = None
    self._shapes_seen: set[tuple[tuple[str, tuple[int, ...]], ...]] = set()
    # time.monotonic() when the last chunk of text was read: how a reader of this stream
    # (training.prefetch.Prefetcher) tells a long replay from a stalled read.
    self.last_progress = time.monotonic()

  @property
  def rows_by_length(self) -> dict[int, int]:
    """{padded length: global rows} of every batch shape: the batch plan."""
    if self._plan is None:
      self._plan = self._plan_rows(self._row_multiple)
    return self._plan

  def _make_batcher(self):
    if self._config.batching == "packed":
      (rows,) = self.rows_by_length.values()
      return batching.Packer(rows, self._row_len)
    return batching.TokenBucketer(self.rows_by_length)

  def _plan_rows(self, row_multiple: int, nearest: bool = False) -> dict[int, int]:
    """{padded length: rows} of every batch shape, sized to hold tokens_per_batch real
    (non-pad) tokens per side on average.

    Padding is not free to count as batch: on Tatoeba packed rows are ~92% real and
    length buckets ~75%, so a budget of padded slots trains on fewer tokens than it
    says. The real tokens per row of each shape are measured on the first pairs of
    epoch 0 (the same on every process) batched as training batches them; a bucket
    that sample hardly reaches is sized as if its rows were full. Each shape gets the
    most rows, a multiple of row_multiple, whose expected real tokens stay within the
    budget (`batching.rows_for_real_tokens`): never over it. nearest: rows rounded to
    the nearest multiple instead, as format-1 data states were planned (`set_state`).
    """
    config = self._config
    examples = self._examples(0, log=False)
    try:
      sample = [example for _, example in itertools.islice(examples, PLAN_SAMPLE_PAIRS)]
    finally:
      examples.close()  # stops its tf.data iterator's threads now
    if config.batching == "packed":
      lengths = [self._row_len]
      packer = batching.Packer(rows=1, row_len=self._row_len)  # one finished row per batch
      rows_seen = {self._row_len: [b for b in map(packer.add, sample) if b is not None]}
    else:
      lengths = batching.bucket_lengths(self._row_len)
      by_length: dict[int, list[dict[str, np.ndarray]]] = {length: [] for length in lengths}
      for example in sample:
        longest = max(len(a) for k, a in example.items() if k != "loss_mask")
        by_length[batching.bucket_of(longest, lengths)].append(example)
      rows_seen = {
        length: [
          batching.finalize(
            {k: batching.pad_stack([ex[k] for ex in examples], length) for k in examples[0]}
          )
        ]
        if examples
        else []
        for length, examples in by_length.items()
      }
    plan = {}
    for length in lengths:
      batches = rows_seen[length]
      real = batching.real_tokens_per_row(batches)
      if sum(len(b["decoder_input"]) for b in batches) < MIN_SAMPLE_ROWS:
        real = length  # too few rows seen to estimate: count every slot as real
      plan[length] = batching.rows_for_real_tokens(self._budget, real, row_multiple, nearest)
      if plan[length] == 0:
        raise ConfigError(
          f"tokens_per_batch: {config.tokens_per_batch} holds no multiple of "
          f"{row_multiple} rows of length {length} (about {real:.0f} real tokens each)"
        )
      logging.info(
        "Batches of length %d: %d rows, about %.0f real tokens per side (%.0f%% of slots)",
        length,
        plan[length],
        plan[length] * real,
        100 * real / length,
      )
    return plan

  def get_state(self) -> dict:
    """JSON-able: the position and the batch plan, with the config values it was made
    from, so that a resumed run can go on with the same batches on any mesh."""
    return {
      "format": DATA_STATE_FORMAT,
      "epoch": self._epoch,
      "batch_in_epoch": self._batch_in_epoch,
      "start_pair": self._start_pair,
      "pairs_read": self._pairs_read,
      "plan": {
        "rows_by_length": [[length, rows] for length, rows in self.rows_by_length.items()],
        **{key: self._config[key] for key in PLAN_KEYS},
      },
    }

  def set_state(self, state: dict, layout: str = "") -> None:
    """Goes on from `state` (get_state's, or an older checkpoint's without a plan).

    A format-1 state (no plan, `DATA_STATE_FORMAT`) is planned as the code that wrote it
    planned, rows rounded to the nearest multiple of row_multiple, so that its
    batch_in_epoch counts the same batches, and a one-line warning says so: today's
    rounding (down) would make other batches, and skip or replay examples for the rest
    of the epoch. The state does not say which mesh it ran on, so the plan takes this
    run's row_multiple: the same batches only on a mesh with the same one, as the warning
    says. A format this code does not know is a one-line ConfigError.

    The saved plan is kept while its rows split over this run's row_multiple, so the
    stream is the uninterrupted run's on any mesh; where they do not, a one-line
    ConfigError (`layout` describes the mesh in it). If tokens_per_batch, batching or
    max_len changed, the batches are planned again, a one-line warning says so, and
    the stream goes on from the first pair of the epoch not yet read (examples that
    waited for a batch to fill are skipped: at most a batch per shape).
    """
    self.close()
    data_format = int(state.get("format", 2 if "plan" in state else 1))
    if data_format > DATA_STATE_FORMAT:
      raise ConfigError(
        f"the checkpoint's data state is of format {data_format}, written by a newer "
        f"version of this code (this one reads formats up to {DATA_STATE_FORMAT}): "
        "resume with the code that wrote it"
      )
    self._epoch, self._batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
    self._start_pair = int(state.get("start_pair", 0))
    self._pairs_read = int(state.get("pairs_read", 0))
    saved = state.get("plan")
    if saved is None:  # format 1: plan as the code that wrote it did
      self._plan_as_format_1()
    else:
      self._go_on_with_plan(saved, layout)

  def _plan_as_format_1(self) -> None:
    """Plans a format-1 state's batches as its code did (rows to the nearest multiple)."""
    self._plan = self._plan_rows(self._row_multiple, nearest=True)
    logging.warning(
      "the checkpoint's data state (format 1) has no batch plan: batches planned again "
      "with this run's mesh, rows rounded as its code did, to the nearest multiple of %d "
      "(rows by length %s); its %d batches of epoch %d are the ones it counted only if "
      "the mesh it ran on had that row multiple too",
      self._row_multiple,
      self._plan,
      self._batch_in_epoch,
      self._epoch,
    )

  def _go_on_with_plan(self, saved: dict, layout: str) -> None:
    """Keeps the `saved` plan, or plans again from the next unread pair if PLAN_KEYS
    changed; ConfigError if its rows do not split over this run's row_multiple."""
    saved_rows = {int(length): int(rows) for length, rows in saved["rows_by_length"]}
    changed = [
      f"{key} {saved[key]!r} -> {self._config[key]!r}"
      for key in PLAN_KEYS
      if saved[key] != self._config[key]
    ]
    if changed:
      logging.warning(
        "%s since the checkpoint: batches planned again (rows by length %s, were %s); "
        "the stream goes on at pair %d of epoch %d",
        ", ".join(changed),
        self.rows_by_length,
        saved_rows,
        self._pairs_read,
        self._epoch,
      )
      self._start_pair, self._batch_in_epoch = self._pairs_read, 0
      return
    uneven = {length: rows for length, rows in saved_rows.items() if rows % self._row_multiple}
    if uneven:
      common = math.gcd(*saved_rows.values())
      raise ConfigError(
        f"the checkpoint's batches have {uneven} rows by length, which are not multiples "
        f"of {self._row_multiple}, the least common multiple of this run's row shards and "
        f"processes ({layout or f'{self._process_count} processes'}); use a mesh whose "
        f"row shards and processes both divide {common}, or change "
        f"tokens_per_batch to plan the batches again"
      )
    self._plan = saved_rows

  def close(self) -> None:
    """Stops the epoch's tf.data iterator now; the next batch starts a new one at the state."""
    if self._batches is not None:
      self._batches.close()  # drops the generator's tf.data iterator, which stops its threads
      self._batches = None

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    while True:
      if self._batches is None:
        self._batches = self._epoch_batches(
          self._epoch, skip=self._batch_in_epoch, start_pair=self._start_pair
        )
      batch, pairs_read = next(self._batches, (None, 0))
      if batch is not None:
        break
      if self._batch_in_epoch == 0:
        raise ConfigError(
          f"tokens_per_batch: {self._config.tokens_per_batch} is more than "
          f"one epoch of {self._source.name} yields"
        )
      self._epoch, self._batch_in_epoch, self._batches = self._epoch + 1, 0, None
      self._start_pair, self._pairs_read = 0, 0
    self._batch_in_epoch += 1
    self._pairs_read = pairs_read
    self._log_new_shape(batch)
    rows = len(batch["target"]) // self._process_count
    start = self._process_index * rows
    return {k: v[start : start + rows] for k, v in batch.items()}

  def _epoch_batches(
    self, epoch: int, skip: int, start_pair: int = 0
  ) -> Generator[tuple[dict[str, np.ndarray], int], None, None]:
    """(global batch, pairs of the epoch read when it was complete) of one epoch, batching
    from pair `start_pair` on, after the first `skip` batches (built, then dropped)."""
    batcher, produced = self._make_batcher(), 0
    examples = self._examples(epoch)
    try:
      for pairs_read, example in examples:
        if pairs_read <= start_pair:
          continue
        batch = batcher.add(example)
        if batch is not None:
          produced += 1
          if produced > skip:
            yield batch, pairs_read
    finally:
      examples.close()  # on close() too: its tf.data iterator stops now, not at exit
    logging.info("Epoch %d of %s: %d batches", epoch, self._source.name, produced)

  def _examples(
    self, epoch: int, log: bool = True
  ) -> Generator[tuple[int, dict[str, np.ndarray]], None, None]:
    """Epoch `epoch`'s training examples in order, filtered or clipped to max_len, each
    with the count of the epoch's pairs read up to it (dropped ones included)."""
    config = self._config
    chunks = tokenized_chunks(
      self._source,
      self._tokenizer,
      "train",
      shuffle_seed=_epoch_seed(config.seed, epoch),
      shuffle_buffer_size=config.shuffle_buffer_size,
    )
    clip = not config.drop_long_examples
    dropped, pairs_read = 0, 0
    self.last_progress = time.monotonic()
    for source_flat, source_lengths, target_flat, target_lengths in chunks:
      self.last_progress = time.monotonic()
      source_ids = np.split(source_flat, np.cumsum(source_lengths)[:-1])
      target_ids = np.split(target_flat, np.cumsum(target_lengths)[:-1])
      for source, target in zip(source_ids, target_ids):
        pairs_read += 1
        s, t = (
          fit_to_length(source, config.max_len, clip),
          fit_to_length(target, config.max_len, clip),
        )
        if s is None or t is None:
          dropped += 1
          continue
        yield pairs_read, make_example(s, t, self._decoder_only, self._lm_loss)
    if log and dropped:
      logging.info(
        "Epoch %d of %s: %d pairs longer than max_len %d dropped",
        epoch,
        self._source.name,
        dropped,
        config.max_len,
      )

  def _log_new_shape(self, batch: dict[str, np.ndarray]) -> None:
    shape = tuple((k, v.shape) for k, v in sorted(batch.items()) if k in ("source", "target"))
    if shape not in self._shapes_seen:
      self._shapes_seen.add(shape)
      logging.info(
        "New global batch shape %s: %d distinct so far", dict(shape), len(self._shapes_seen)
      )


def make_train_iterator(
  config,
  tokenizer: Tokenizer,
  *,
  process_index: int = 0,
  process_count: int = 1,
  row_multiple: int = 1,
  source=None,
) -> TrainIterator:
  """This process's part of every global training batch, forever.

  row_multiple: the global row count is a multiple of it; pass process_count times the
  data-parallel devices per process so batches split evenly.
  """
  return TrainIterator(
    config,
    tokenizer,
    source or sources.make_source(config),
    process_index=process_index,
    process_count=process_count,
    row_multiple=row_multiple,
  )


def load_raw_pairs(config, split: str, *, source=None) -> list[tuple[str, str]]:
  """[(source_text, reference_text)] of a split in order: the rows `index` refers to."""
  return sources.raw_pairs(source or sources.make_source(config), split)


def spread_over(items: list, count: int) -> list:
  """`count` of `items` spread evenly over them (all of them for count 0, or count at
  least len(items)): the middle item of each of `count` equal runs, the same every call.
  Of batches in length order, a subset that spans every length."""
  if not count or count >= len(items):
    return list(items)
  return [items[int((k + 0.5) * len(items) / count)] for k in range(count)]


def make_eval_batches(
  config, tokenizer: Tokenizer, split: str, *, source=None, max_batches: int = 0
) -> list[dict[str, np.ndarray]]:
  """Every sentence of a split once, in padded batches of eval_batch_size rows; or, with
  max_batches > 0, that many of those batches spread over the length order
  (`spread_over`), a fixed subset from the shortest sentences to the longest.

  Sentences are batched in order of source length, so each batch pads only to its own
  longest sentence, rounded up to 8, 16, 32, ... (at most max_len): a handful of shapes
  to compile for a whole split, whatever its size; 'index'
  [B] gives each row's position in the split (-1 on fill rows), so outputs can be put
  back in the split's order. A sentence longer than max_len is clipped for the model only
  (references come from load_raw_pairs), and the count is logged. With a decoder-only
  model, 'source' is the prompt (source + EOS).

  Every process gets the same whole batches; `sharding.global_batch_from_whole` then
  places on each device only the rows it computes, so each process works on its share
  and every output row stays with its 'index' whatever the devices' order.
  """
  examples = _eval_examples(config, tokenizer, split, source)
  if not examples:
    return []
  rows = config.eval_batch_size
  decoder_only = bool(config.model.decoder_only)
  max_lengths = {"source": config.max_len, "target": (2 if decoder_only else 1) * config.max_len}
  max_lengths["loss_mask"] = max_lengths["target"]
  by_length = sorted(range(len(examples)), key=lambda i: len(examples[i]["source"]))
  batches = []
  for start in range(0, len(examples), rows):
    indices = by_length[start : start + rows]
    arrays = {}
    for key in examples[0]:
      longest = max(len(examples[i][key]) for i in indices)
      length = batching.geometric_length(longest, max_lengths[key])
      padded_rows: list[np.ndarray | list[int]] = [examples[i][key] for i in indices]
      padded_rows += [[]] * (rows - len(indices))
      arrays[key] = batching.pad_stack(padded_rows, length)
    batch = batching.finalize(arrays)
    batch["index"] = np.array(indices + [-1] * (rows - len(indices)), np.int32)
    batches.append(batch)
  return spread_over(batches, max_batches)


def _eval_examples(config, tokenizer: Tokenizer, split: str, source) -> list[dict[str, np.ndarray]]:
  """The split's examples in order, each with 'source' (the model's input) as well."""
  pairs = load_raw_pairs(config, split, source=source)
  decoder_only = bool(config.model.decoder_only)
  examples, clipped = [], 0
  for i in range(0, len(pairs), TOKENIZE_CHUNK):
    chunk = pairs[i : i + TOKENIZE_CHUNK]
    for source_ids, target_ids in zip(*[tokenizer.encode_batch(texts) for texts in zip(*chunk)]):
      clipped += max(len(source_ids), len(target_ids)) + 1 > config.max_len  # + EOS
      s, t = with_eos(source_ids, config.max_len), with_eos(target_ids, config.max_len)
      example = make_example(s, t, decoder_only)
      example["source"] = s
      examples.append(example)
  if clipped:
    logging.warning(
      "%s %s: %d of %d pairs clipped to max_len %d for the model input",
      config.dataset,
      split,
      clipped,
      len(pairs),
      config.max_len,
    )
  return examples
