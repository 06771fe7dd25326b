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
    time.sleep(0.2)  # the thread runs ahead of what was consumed...
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
