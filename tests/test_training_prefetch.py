"""The background batch prefetcher: order, resume state, errors, shutdown."""

import threading
import time

import pytest

from transformer.training import prefetch


class CountingIterator:
  """Yields 0, 1, 2, ...; its state is the next value; can fail at a given item."""

  def __init__(self, fail_at=None, stop_at=None):
    self.next_value, self.fail_at, self.stop_at = 0, fail_at, stop_at

  def __next__(self):
    if self.next_value == self.fail_at:
      raise ValueError(f"bad record {self.next_value}")
    if self.next_value == self.stop_at:
      raise StopIteration
    self.next_value += 1
    return self.next_value - 1

  def get_state(self):
    return {"next": self.next_value}

  closed_from = None

  def close(self):
    self.closed_from = threading.current_thread().name


def test_items_arrive_in_order_transformed_and_state_follows_consumption():
  source = CountingIterator()
  batches = prefetch.Prefetcher(source, lambda x: x * 10, size=3)
  try:
    assert batches.get_state() == {"next": 0}
    assert [next(batches) for _ in range(4)] == [0, 10, 20, 30]
    # The thread runs ahead of what was consumed (waited for, however slow this machine)...
    deadline = time.monotonic() + 30
    while source.next_value <= 4 and time.monotonic() < deadline:
      time.sleep(0.01)
    assert source.next_value > 4
    assert batches.get_state() == {"next": 4}  # ...but the state is the consumer's
  finally:
    batches.close()


def test_errors_reach_the_consumer_after_the_good_items():
  batches = prefetch.Prefetcher(CountingIterator(fail_at=2), lambda x: x)
  assert [next(batches), next(batches)] == [0, 1]
  with pytest.raises(ValueError, match="bad record 2"):
    next(batches)


def test_exhaustion_stops_iteration():
  assert list(prefetch.Prefetcher(CountingIterator(stop_at=3), lambda x: x)) == [0, 1, 2]


def test_close_stops_the_thread_even_with_a_full_queue():
  batches = prefetch.Prefetcher(CountingIterator(), lambda x: x, size=1)
  next(batches)
  batches.close()
  assert not any(t.name == "batch-prefetch" and t.is_alive() for t in threading.enumerate())


def test_close_closes_the_wrapped_iterator_after_the_thread_stops():
  source = CountingIterator()
  batches = prefetch.Prefetcher(source, lambda x: x)
  next(batches)
  batches.close()
  # From this thread, once the producer has stopped: never while it is inside next().
  assert source.closed_from == threading.current_thread().name


def test_close_can_leave_the_wrapped_iterator_open_as_an_error_does():
  source = CountingIterator()
  batches = prefetch.Prefetcher(source, lambda x: x)
  next(batches)
  batches.close(close_iterator=False)
  assert source.closed_from is None
  failing = CountingIterator(fail_at=1)
  batches = prefetch.Prefetcher(failing, lambda x: x)
  next(batches)
  with pytest.raises(ValueError):
    next(batches)
  assert failing.closed_from is None


class SlowIterator(CountingIterator):
  """Item 1 takes `item_s` seconds, `reading` all the while (its `last_progress` is
  whenever it is asked: no thread has to be scheduled to move it, so no timing of this
  machine's decides) or stalled (`last_progress` stays at its start)."""

  def __init__(self, item_s, reading):
    super().__init__()
    self.item_s, self.reading = item_s, reading
    self.started = time.monotonic()
    self.release = threading.Event()

  @property
  def last_progress(self):
    return time.monotonic() if self.reading else self.started

  def __next__(self):
    if self.next_value == 1:
      self.release.wait(self.item_s)
    return super().__next__()


def test_a_stalled_input_is_a_timeout_naming_it_and_a_slow_one_is_not():
  from transformer import storage

  stalled = SlowIterator(item_s=30, reading=False)
  batches = prefetch.Prefetcher(stalled, lambda x: x, timeout_s=0.3, what="the corpus X")
  try:
    assert next(batches) == 0
    started = time.monotonic()
    with pytest.raises(storage.StorageTimeout) as error:
      next(batches)
    assert time.monotonic() - started < 10  # not the 30 s the read would have taken
    assert str(error.value).startswith(
      "reading the corpus X did not finish within 0.3 s (config.storage_timeout_s)"
    )
  finally:
    stalled.release.set()
    batches.close()
  # Slower than the limit in all, but reading all the while (an epoch replayed up to a
  # checkpoint): waited for.
  slow = SlowIterator(item_s=1.0, reading=True)
  batches = prefetch.Prefetcher(slow, lambda x: x, timeout_s=0.3)
  try:
    assert [next(batches) for _ in range(3)] == [0, 1, 2]
  finally:
    batches.close()
