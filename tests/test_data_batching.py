"""shift_right, packing and token buckets, on hand-made examples."""

import numpy as np

from transformer.config import BOS_ID, EOS_ID, PAD_ID
from transformer.data import batching


def _ids(*values):
  return np.array(values, np.int32)


def test_shift_right_unpacked_exact_values():
  target = np.array([[5, 6, 7, EOS_ID, 0, 0],
                     [8, EOS_ID, 0, 0, 0, 0]], np.int32)
  expected = np.array([[BOS_ID, 5, 6, 7, 0, 0],
                       [BOS_ID, 8, 0, 0, 0, 0]], np.int32)
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
  assert set(batch) == {"source", "target", "decoder_input", "source_segment_ids",
                        "source_positions", "target_segment_ids", "target_positions"}
  np.testing.assert_array_equal(batch["source"], [[11, 12, EOS_ID, 13, EOS_ID, 0, 0, 0]])
  np.testing.assert_array_equal(batch["source_segment_ids"], [[1, 1, 1, 2, 2, 0, 0, 0]])
  np.testing.assert_array_equal(batch["source_positions"], [[0, 1, 2, 0, 1, 0, 0, 0]])
  np.testing.assert_array_equal(batch["target"], [[21, EOS_ID, 22, 23, 24, EOS_ID, 0, 0]])
  np.testing.assert_array_equal(batch["target_segment_ids"], [[1, 1, 2, 2, 2, 2, 0, 0]])
  np.testing.assert_array_equal(batch["target_positions"], [[0, 1, 0, 1, 2, 3, 0, 0]])
  np.testing.assert_array_equal(batch["decoder_input"],
                                [[BOS_ID, 21, BOS_ID, 22, 23, 24, 0, 0]])
  assert all(v.dtype == np.int32 for v in batch.values())


def test_token_buckets_respect_budget_and_row_multiple():
  rng = np.random.default_rng(0)
  bucketer = batching.TokenBucketer(tokens_per_batch=300, max_len=40, row_multiple=4)
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
    assert rows * length <= 300 and rows % 4 == 0 and rows > 0
    assert length % batching.LENGTH_MULTIPLE == 0
    # Padding only within the bucket: the longest row fills more than the bucket below.
    longest = max((batch["source"] != 0).sum(1).max(), (batch["target"] != 0).sum(1).max())
    assert length - batching.LENGTH_MULTIPLE < longest <= length


def test_decoder_only_batch_masks_the_prompt():
  bucketer = batching.TokenBucketer(tokens_per_batch=8, max_len=8, row_multiple=1)
  sequence = _ids(11, 12, EOS_ID, 21, EOS_ID)
  batch = bucketer.add({"target": sequence, "loss_mask": _ids(0, 0, 0, 1, 1)})
  assert set(batch) == {"target", "decoder_input"}
  np.testing.assert_array_equal(batch["decoder_input"], [[BOS_ID, 11, 12, EOS_ID, 21, 0, 0, 0]])
  np.testing.assert_array_equal(batch["target"], [[0, 0, 0, 21, EOS_ID, 0, 0, 0]])


def test_geometric_length_is_the_smallest_doubling_that_holds_n():
  assert [batching.geometric_length(n, 256) for n in (1, 8, 9, 16, 17, 100, 200, 256)] == \
      [8, 8, 16, 16, 32, 128, 256, 256]
  assert batching.geometric_length(70, 100) == 100  # capped at max_len
  # However many lengths a split has, at most log2(cap / 8) + 1 shapes come out.
  assert {batching.geometric_length(n, 256) for n in range(1, 257)} == {
      8, 16, 32, 64, 128, 256}
