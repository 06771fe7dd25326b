"""`python -m transformer.tools.input_speed`: counting a batch's pairs and tokens, and
timing the training stream of a tiny TSV run. Timings themselves are not asserted."""

import numpy as np
import pytest

from tests.helpers.tiny_run import make_config
from transformer.data import pipeline
from transformer.tools import input_speed


def test_count_unpacked_batch():
  """Pairs are rows with any decoder token; tokens are non-pad source and decoder-input
  tokens (the target repeats them, shifted); all-pad fill rows count nothing."""
  batch = {
    "source": np.array([[5, 6, 1, 0], [7, 1, 0, 0], [0, 0, 0, 0]], np.int32),
    "target": np.array([[8, 1, 0], [9, 9, 1], [0, 0, 0]], np.int32),
    "decoder_input": np.array([[2, 8, 0], [2, 9, 9], [0, 0, 0]], np.int32),
  }
  assert input_speed.count(batch) == {
    "pairs": 2,
    "source_tokens": 3 + 2,
    "source_slots": 12,
    "target_tokens": 2 + 3,
    "target_slots": 9,
  }


def test_count_packed_batch():
  """Packed rows hold several pairs: one per target segment (segments count from 1);
  segment ids and positions are not tokens."""
  batch = {
    "source": np.array([[5, 1, 6, 7, 1, 0], [4, 4, 4, 1, 0, 0], [0] * 6], np.int32),
    "source_segment_ids": np.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0], [0] * 6], np.int32),
    "source_positions": np.array([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 0], [0] * 6], np.int32),
    "target": np.array([[8, 1, 9, 1, 0, 0], [5, 1, 0, 0, 0, 0], [0] * 6], np.int32),
    "target_segment_ids": np.array([[1, 1, 2, 2, 0, 0], [1, 1, 0, 0, 0, 0], [0] * 6], np.int32),
    "target_positions": np.array([[0, 1, 0, 1, 0, 0], [0, 1, 0, 0, 0, 0], [0] * 6], np.int32),
    "decoder_input": np.array([[2, 8, 2, 9, 0, 0], [2, 5, 0, 0, 0, 0], [0] * 6], np.int32),
  }
  assert input_speed.count(batch) == {
    "pairs": 3,
    "source_tokens": 5 + 4,
    "source_slots": 18,
    "target_tokens": 4 + 2,
    "target_slots": 18,
  }


def test_count_decoder_only_batch():
  """A decoder-only batch has no source; every token of its sequences counts, the prompt
  too, though the target (the loss) is zero there."""
  batch = {
    "target": np.array([[0, 0, 7, 1], [0, 5, 1, 0]], np.int32),
    "decoder_input": np.array([[2, 4, 1, 7], [2, 3, 1, 5]], np.int32),
  }
  assert input_speed.count(batch) == {"pairs": 2, "target_tokens": 8, "target_slots": 8}


class _Recording:
  """Wraps a train iterator, keeping every batch it hands out and whether it was closed."""

  def __init__(self, iterator):
    self.iterator, self.batches, self.closed = iterator, [], 0

  def __next__(self):
    batch = next(self.iterator)
    self.batches.append(batch)
    return batch

  @property
  def rows_by_length(self):
    return self.iterator.rows_by_length

  def close(self):
    self.closed += 1
    self.iterator.close()


@pytest.fixture
def recorded(monkeypatch):
  """The iterators `measure` makes, recorded."""
  made = []
  real = pipeline.make_train_iterator

  def make(*args, **kwargs):
    made.append(_Recording(real(*args, **kwargs)))
    return made[-1]

  monkeypatch.setattr(pipeline, "make_train_iterator", make)
  return made


@pytest.mark.parametrize("batching", ["tokens", "packed"])
def test_measure_times_the_asked_batches_after_one_warm_up(small_corpus, recorded, batching):
  """`num_batches` batches are timed after one untimed warm-up; the rates are the counts
  of exactly those batches over the time; the stream is closed afterwards."""
  config = make_config(small_corpus, batching=batching)
  r = input_speed.measure(config, 3)
  assert r["batches"] == 3
  assert r["seconds"] > 0 and r["examples_per_sec"] > 0 and r["tokens_per_sec"] > 0
  [iterator] = recorded
  assert len(iterator.batches) == 4 and iterator.closed == 1
  counts = [input_speed.count(b) for b in iterator.batches[1:]]
  assert r["examples_per_sec"] * r["seconds"] == pytest.approx(sum(c["pairs"] for c in counts))
  assert r["tokens_per_sec"] * r["seconds"] == pytest.approx(
    sum(c["source_tokens"] + c["target_tokens"] for c in counts)
  )
  for side in ("source", "target"):
    assert r[f"{side}_padding_efficiency"] == pytest.approx(
      sum(c[f"{side}_tokens"] for c in counts) / sum(c[f"{side}_slots"] for c in counts)
    )
  shapes = {b["decoder_input"].shape for b in iterator.batches[1:]}
  assert r["shapes"] == len(shapes) <= r["planned_shapes"] <= 8
  if batching == "packed":
    assert "target_segment_ids" in iterator.batches[1]


def test_measure_closes_the_stream_when_counting_fails(small_corpus, recorded, monkeypatch):
  def broken(batch):
    raise RuntimeError("broken count")

  monkeypatch.setattr(input_speed, "count", broken)
  with pytest.raises(RuntimeError, match="broken count"):
    input_speed.measure(make_config(small_corpus), 2)
  assert recorded[0].closed == 1


def test_the_record_holds_the_view_s_fields_with_the_flags_that_made_the_config(
  small_corpus, recorded
):
  """--json's object: what docs/data.md's padding table reads, from measure's figures."""
  config = make_config(small_corpus, batching="tokens")
  r = input_speed.measure(config, 2)
  record = input_speed.record(config, r, overrides=["--config.batching=tokens"])
  assert (record["name"], record["flags"], record["batching"]) == (
    "input_padding",
    "--config.batching=tokens",
    "tokens",
  )
  assert (record["max_len"], record["tokens_per_batch"]) == (
    config.max_len,
    config.tokens_per_batch,
  )
  for side in ("source", "target"):
    assert record[f"{side}_padding_efficiency"] == r[f"{side}_padding_efficiency"]
    assert record[f"{side}_tokens_per_batch"] == r[f"{side}_tokens_per_batch"]
  assert (record["shapes_seen"], record["shapes_planned"], record["num_batches"]) == (
    r["shapes"],
    r["planned_shapes"],
    2,
  )
  assert record["versions"]["jax"]
