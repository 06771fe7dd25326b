"""shift_right, packing and token buckets, on hand-made examples."""

import numpy as np

from transformer.config import BOS_ID, EOS_ID, PAD_ID
from transformer.data import batching


def _ids(*values):
  return np.array(values, np.int32)


def test_shift_right_unpacked_exact_values():
  target = np.array([[5, 6, 7, EOS_ID, 0, 0], [8, EOS_ID, 0, 0, 0, 0]], np.int32)
  expected = np.array([[BOS_ID, 5, 6, 7, 0, 0], [BOS_ID, 8, 0, 0, 0, 0]], np.int32)
  np.testing.assert_array_equal(batching.shift_right(target), expected)


def test_shift_right_restarts_each_packed_segment_with_bos():
  target = np.array([[5, 6, EOS_ID, 7, EOS_ID, 9, EOS_ID, 0]], np.int32)
  segments = np.array([[1, 1, 1, 2, 2, 3, 3, 0]], np.int32)
  expected = np.array([[BOS_ID, 5, 6, BOS_ID, 7, BOS_ID, 9, PAD_ID]], np.int32)
  np.testing.assert_array_equal(batching.shift_right(target, segments), expected)


def test_packer_segment_ids_and_positions():
  packer = batching.Packer(rows=1, row_len=8, max_open_rows=1)
  examples = [
    {"source": _ids(11, 12, EOS_ID), "target": _ids(21, EOS_ID)},
    {"source": _ids(13, EOS_ID), "target": _ids(22, 23, 24, EOS_ID)},
    {"source": _ids(14, 15, 16, 17, EOS_ID), "target": _ids(25, EOS_ID)},  # no fit: new row
  ]
  batches = [packer.add(ex) for ex in examples]
  assert batches[:2] == [None, None]
  batch = batches[2]
  assert set(batch) == {
    "source",
    "target",
    "decoder_input",
    "source_segment_ids",
    "source_positions",
    "target_segment_ids",
    "target_positions",
  }
  np.testing.assert_array_equal(batch["source"], [[11, 12, EOS_ID, 13, EOS_ID, 0, 0, 0]])
  np.testing.assert_array_equal(batch["source_segment_ids"], [[1, 1, 1, 2, 2, 0, 0, 0]])
  np.testing.assert_array_equal(batch["source_positions"], [[0, 1, 2, 0, 1, 0, 0, 0]])
  np.testing.assert_array_equal(batch["target"], [[21, EOS_ID, 22, 23, 24, EOS_ID, 0, 0]])
  np.testing.assert_array_equal(batch["target_segment_ids"], [[1, 1, 2, 2, 2, 2, 0, 0]])
  np.testing.assert_array_equal(batch["target_positions"], [[0, 1, 0, 1, 2, 3, 0, 0]])
  np.testing.assert_array_equal(batch["decoder_input"], [[BOS_ID, 21, BOS_ID, 22, 23, 24, 0, 0]])
  assert all(v.dtype == np.int32 for v in batch.values())


def test_token_buckets_pad_each_example_to_its_own_bucket():
  rng = np.random.default_rng(0)
  rows_by_length = {8: 12, 16: 8, 24: 4, 40: 4}
  bucketer = batching.TokenBucketer(rows_by_length)
  batches = []
  for _ in range(2000):
    s, t = rng.integers(1, 41, size=2)
    batch = bucketer.add({"source": np.full(s, 5, np.int32), "target": np.full(t, 6, np.int32)})
    if batch is not None:
      batches.append(batch)
  assert len(batches) > 20
  for batch in batches:
    rows, length = batch["source"].shape
    assert batch["target"].shape == (rows, length)
    assert rows_by_length[length] == rows
    # Padded only within the bucket: the longest row is longer than the bucket below.
    below = max([n for n in rows_by_length if n < length], default=0)
    longest = max((batch["source"] != 0).sum(1).max(), (batch["target"] != 0).sum(1).max())
    assert below < longest <= length


def test_bucket_lengths_are_geometric_and_at_most_eight():
  assert batching.bucket_lengths(256) == [8, 16, 24, 40, 64, 96, 160, 256]
  for max_len in (1, 7, 8, 9, 24, 64, 100, 256, 512, 1024):
    lengths = batching.bucket_lengths(max_len)
    assert 1 <= len(lengths) <= batching.MAX_BUCKETS
    assert lengths == sorted(set(lengths)) and lengths[-1] == batching.round_up(max_len, 8)
    assert all(length % batching.LENGTH_MULTIPLE == 0 for length in lengths)
  # Each bucket is at most about (256 / 8) ** (1 / 7) = 1.64 times the one below, +8.
  lengths = batching.bucket_lengths(256)
  assert all(b <= 1.64 * a + 8 for a, b in zip(lengths, lengths[1:]))


def test_rows_count_real_tokens_not_padding():
  full = {"source": np.array([[5, 5, 5, 5]] * 2), "decoder_input": np.array([[2, 6, 0, 0]] * 2)}
  half = {"source": np.array([[5, 5, 0, 0]] * 2), "decoder_input": np.array([[2, 6, 0, 0]] * 2)}
  assert batching.real_tokens_per_row([full]) == 4.0  # the fuller side
  assert batching.real_tokens_per_row([half]) == 2.0
  assert batching.real_tokens_per_row([full, half]) == 3.0
  # 2.0 real tokens per row: 100 tokens are 50 rows, the multiple of 8 below is 48.
  assert batching.rows_for_real_tokens(100, 2.0, 8) == 48
  assert batching.rows_for_real_tokens(108, 2.0, 8) == 48  # 54 rows: 56 would be over
  assert batching.rows_for_real_tokens(14, 2.0, 8) == 0  # 8 rows would be over 14


def test_geometric_length_is_the_smallest_doubling_that_holds_n():
  assert [batching.geometric_length(n, 256) for n in (1, 8, 9, 16, 17, 100, 200, 256)] == [
    8,
    8,
    16,
    16,
    32,
    128,
    256,
    256,
  ]
  assert batching.geometric_length(70, 100) == 100  # capped at max_len
  # However many lengths a split has, at most log2(cap / 8) + 1 shapes come out.
  assert {batching.geometric_length(n, 256) for n in range(1, 257)} == {8, 16, 32, 64, 128, 256}


def test_planned_rows_never_exceed_the_budget_and_miss_it_by_under_one_multiple():
  """The most rows, in multiples of row_multiple, whose expected real tokens fit; the
  nearest multiple went up to +95% over (1.49 multiples rounded to 1 ... 1.5 to 2)."""
  rng = np.random.default_rng(0)
  for _ in range(2000):
    budget = int(rng.integers(8, 50_000))
    real = float(rng.uniform(1.0, 300.0))
    multiple = int(rng.choice([1, 2, 4, 8, 16, 64, 256]))
    rows = batching.rows_for_real_tokens(budget, real, multiple)
    assert rows % multiple == 0 and rows >= 0
    assert rows * real <= budget
    assert (rows + multiple) * real > budget
  assert batching.rows_for_real_tokens(384, 128.0, 2) == 2  # 3 rows fit, 4 do not
  assert batching.rows_for_real_tokens(384, 20.0, 8) == 16  # 19.2 rows: 16, not 24
  # Format-1 data states were planned to the nearest multiple (pipeline.DATA_STATE_FORMAT).
  assert batching.rows_for_real_tokens(384, 25.6, 8) == 8  # 15 rows
  assert batching.rows_for_real_tokens(384, 25.6, 8, nearest=True) == 16
  assert batching.rows_for_real_tokens(384, 20.0, 8, nearest=True) == 16
