"""Turning tokenized examples into batches: length buckets, packing, shifting right.

An example is a dict of 1-D int32 arrays that already end in EOS: {'source', 'target'}
for translation, or {'target', 'loss_mask'} for a decoder-only LM. Keys starting with
'source' are the encoder side; all others share the decoder side's length.

Batch format (numpy int32; the model and the trainer rely on it):
  'source' [B,S], 'decoder_input' [B,T], 'target' [B,T]; PAD_ID = 0 everywhere padded.
  Packed: also 'source_segment_ids', 'source_positions' [B,S] and 'target_segment_ids',
  'target_positions' [B,T] (segments count from 1, 0 = padding; positions restart at 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from transformer.config import BOS_ID, PAD_ID

LENGTH_MULTIPLE = 8  # bucket lengths are multiples of this: few, static shapes


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def geometric_length(n: int, cap: int, smallest: int = 8) -> int:
  """The smallest of smallest, 2*smallest, 4*smallest, ... that holds n, at most `cap`.

  Evaluation pads each batch to this: log2(cap / smallest) + 1 lengths at most per
  array (6 for max_len 256), so a whole split compiles a handful of shapes.
  """
  length = smallest
  while length < n:
    length *= 2
  return min(length, cap)


def side_of(key: str) -> str:
  return "source" if key.startswith("source") else "target"


def shift_right(target_BxT: np.ndarray, segment_ids_BxT: np.ndarray | None = None) -> np.ndarray:
  """Decoder input: BOS followed by the target, one step late, restarting per segment.

  The only place targets are shifted. Without segment ids the non-pad tokens of a row
  form one segment. Positions where the target is padding stay PAD_ID.
  """
  target_BxT = np.asarray(target_BxT, np.int32)
  if segment_ids_BxT is None:
    segment_ids_BxT = (target_BxT != PAD_ID).astype(np.int32)
  shifted_BxT = np.zeros_like(target_BxT)
  shifted_BxT[:, 1:] = target_BxT[:, :-1]
  previous_segment_BxT = np.zeros_like(segment_ids_BxT)
  previous_segment_BxT[:, 1:] = segment_ids_BxT[:, :-1]
  starts_segment_BxT = segment_ids_BxT != previous_segment_BxT
  decoder_input_BxT = np.where(starts_segment_BxT, BOS_ID, shifted_BxT)
  return np.where(segment_ids_BxT != 0, decoder_input_BxT, PAD_ID).astype(np.int32)


def pad_stack(arrays: Sequence[np.ndarray | Sequence[int]], length: int) -> np.ndarray:
  """[len(arrays), length] int32, each row left-aligned and padded with PAD_ID."""
  out = np.full((len(arrays), length), PAD_ID, np.int32)
  for row, a in enumerate(arrays):
    out[row, : len(a)] = a
  return out


def pad_batch(
  sequences: Sequence[Sequence[int] | np.ndarray], rows: int, length: int | None = None
) -> np.ndarray:
  """[rows, length] int32 from ragged id lists, fill rows all PAD_ID; length defaults to
  the longest sequence rounded up to a multiple of 8 (few shapes to compile)."""
  if len(sequences) > rows:
    raise ValueError(f"{len(sequences)} sequences do not fit {rows} rows")
  longest = max((len(s) for s in sequences), default=1)
  length = length or round_up(max(longest, 1), LENGTH_MULTIPLE)
  padded_rows: list[np.ndarray | list[int]] = [np.asarray(s, np.int32) for s in sequences]
  padded_rows += [[]] * (rows - len(sequences))
  return pad_stack(padded_rows, length)


def finalize(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Adds 'decoder_input' and turns an LM's loss_mask into zeros in 'target'."""
  batch = dict(arrays)
  batch["decoder_input"] = shift_right(batch["target"], batch.get("target_segment_ids"))
  if "loss_mask" in batch:  # decoder-only: no loss on the prompt (source + EOS)
    batch["target"] = batch["target"] * batch.pop("loss_mask")
  return {k: v.astype(np.int32) for k, v in batch.items()}


MAX_BUCKETS = 8  # training step shapes under length bucketing: each one is a compile


def bucket_lengths(
  max_len: int, count: int = MAX_BUCKETS, smallest: int = LENGTH_MULTIPLE
) -> list[int]:
  """At most `count` padded lengths from `smallest` to max_len (rounded up to a multiple
  of 8), spaced geometrically: every bucket wastes about the same fraction of its slots,
  where equal steps of 8 would give max_len / 8 shapes (32 at 256), each a compile.

  For max_len 256: [8, 16, 24, 40, 64, 96, 160, 256].
  """
  top = round_up(max_len, LENGTH_MULTIPLE)
  if top <= smallest or count < 2:
    return [top]
  ratio = top / smallest
  return sorted(
    {
      min(top, round_up(round(smallest * ratio ** (i / (count - 1))), LENGTH_MULTIPLE))
      for i in range(count)
    }
  )


def bucket_of(length: int, lengths: list[int]) -> int:
  """The smallest bucket length that holds `length` (lengths sorted ascending)."""
  return lengths[int(np.searchsorted(lengths, length))]


def rows_for_real_tokens(
  tokens_per_batch: int, real_tokens_per_row: float, row_multiple: int, nearest: bool = False
) -> int:
  """The most rows, a multiple of row_multiple, whose expected real (non-pad) tokens stay
  within the budget (0 when even row_multiple rows would exceed it): the paper's batch
  counts the tokens the model reads, not the padding. Never over budget, so at most one
  row_multiple of rows under it.

  nearest: the rows of the nearest multiple instead, over budget or under, as plans were
  made before checkpoints saved them (data states of format 1, `pipeline.TrainIterator`);
  only such a checkpoint's resume plans that way.
  """
  if nearest:  # the expression of then, so that the rows are the same to the last bit
    return round(tokens_per_batch / real_tokens_per_row / row_multiple) * row_multiple
  return int(tokens_per_batch / real_tokens_per_row // row_multiple) * row_multiple


def real_tokens_per_row(batches: list[dict[str, np.ndarray]]) -> float:
  """Mean non-pad tokens per row on the fuller side of finished batches, or 0.0 for none.

  The decoder side is counted on 'decoder_input', which holds every token of the row
  (a decoder-only 'target' has zeros where the loss is masked).
  """
  if not batches:
    return 0.0
  rows = sum(len(b["decoder_input"]) for b in batches)
  return max(
    sum(int((b[side] != PAD_ID).sum()) for b in batches) / rows
    for side in ("source", "decoder_input")
    if side in batches[0]
  )


class TokenBucketer:
  """Groups examples by padded length; a bucket is emitted once it holds its row count.

  `rows_by_length` maps each bucket length (see `bucket_lengths`) to its rows; an example
  goes to the smallest bucket that holds its longer side. What is left in the buckets at
  the end of an epoch is dropped.
  """

  def __init__(self, rows_by_length: dict[int, int]):
    self.rows = dict(sorted(rows_by_length.items()))
    self._lengths = list(self.rows)
    self._waiting: dict[int, list[dict[str, np.ndarray]]] = {length: [] for length in self.rows}

  def add(self, example: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """Adds one example; returns a finished batch or None."""
    length = bucket_of(max(len(a) for a in example.values()), self._lengths)
    waiting = self._waiting[length]
    waiting.append(example)
    if len(waiting) < self.rows[length]:
      return None
    self._waiting[length] = []
    return finalize({k: pad_stack([ex[k] for ex in waiting], length) for k in example})


class Packer:
  """Packs several examples per row (first fit over a few open rows), `rows` per batch.

  Rows are [row_len] per side. Each example becomes one segment on each side, with the
  same segment id on both; a full batch is emitted as soon as it has `rows` rows.
  """

  def __init__(self, rows: int, row_len: int, max_open_rows: int = 8):
    self.num_rows = rows
    self.row_len = row_len
    self.max_open_rows = max_open_rows
    self._open: list[list[dict[str, np.ndarray]]] = []  # rows being filled: lists of examples
    self._done: list[list[dict[str, np.ndarray]]] = []  # finished rows, waiting for a full batch

  def _fits(self, row: list[dict], example: dict) -> bool:
    return all(sum(len(ex[k]) for ex in row) + len(example[k]) <= self.row_len for k in example)

  def add(self, example: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    for row in self._open:
      if self._fits(row, example):
        row.append(example)
        break
    else:
      if len(self._open) == self.max_open_rows:
        self._done.append(self._open.pop(0))  # the oldest row has had its chances
      self._open.append([example])
    if len(self._done) < self.num_rows:
      return None
    rows, self._done = self._done[: self.num_rows], self._done[self.num_rows :]
    return self._batch(rows)

  def _batch(self, rows: list[list[dict]]) -> dict[str, np.ndarray]:
    arrays = {}
    for key in rows[0][0]:
      arrays[key] = pad_stack(
        [np.concatenate([ex[key] for ex in row]) for row in rows], self.row_len
      )
      side = side_of(key)
      if f"{side}_segment_ids" in arrays:
        continue
      segment_ids, positions = [], []
      for row in rows:
        lengths = [len(ex[key]) for ex in row]
        segment_ids.append(np.repeat(np.arange(1, len(row) + 1), lengths))
        positions.append(np.concatenate([np.arange(n) for n in lengths]))
      arrays[f"{side}_segment_ids"] = pad_stack(segment_ids, self.row_len)
      arrays[f"{side}_positions"] = pad_stack(positions, self.row_len)
    return finalize(arrays)
