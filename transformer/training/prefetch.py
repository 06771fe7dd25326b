"""Global batches built on a background thread, ahead of the training step.

The input pipeline (tf.data, tokenization, batching) and the host-to-device copy of the
next batches run while the current step computes, so a step never waits on the host,
not even after the loop syncs on a log or checkpoint step.

Each batch travels with the iterator state just after it: `get_state()` is where the
*consumed* batches end, not the prefetched ones, so a checkpoint resumes exactly at the
next batch the step would have taken.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from transformer import storage

_DONE = object()
_POLL_S = 0.1


class Prefetcher:
  """Iterates `transform(next(iterator))` computed `size` items ahead on a thread.

  timeout_s bounds the wait for the next item: if the iterator has made no progress for
  that long, `__next__` raises storage.StorageTimeout naming `what` (a stalled read of
  the corpus would otherwise hold the loop, and every host with it, for good). Progress
  is the iterator's `last_progress` (time.monotonic() of its last read, as
  pipeline.TrainIterator keeps it) where it has one, else the item itself: a first batch
  that replays an epoch up to a checkpoint reads all the while, and is not cut short.
  """

  def __init__(
    self,
    iterator,
    transform: Callable[[Any], Any],
    size: int = 2,
    timeout_s: float | None = None,
    what: str = "the input",
  ):
    if size < 1:
      raise ValueError(f"prefetch size must be at least 1, got {size}")
    self._iterator = iterator
    self._timeout_s, self._what = timeout_s, what
    self._state = iterator.get_state()
    self._queue: queue.Queue = queue.Queue(maxsize=size)
    self._stop = threading.Event()
    self._thread = threading.Thread(
      target=self._produce, args=(transform,), daemon=True, name="batch-prefetch"
    )
    self._thread.start()

  def _produce(self, transform) -> None:
    try:
      while not self._stop.is_set():
        item = transform(next(self._iterator))
        self._put((item, self._iterator.get_state(), None))
    except StopIteration:
      self._put((_DONE, None, None))
    except BaseException as e:  # re-raised in the consuming thread, with its traceback
      self._put((_DONE, None, e))

  def _put(self, entry) -> None:
    while not self._stop.is_set():
      try:
        self._queue.put(entry, timeout=0.1)
        return
      except queue.Full:
        continue

  def __iter__(self) -> Iterator[Any]:
    return self

  def __next__(self) -> Any:
    item, state, error = self._next_entry()
    if error is not None:
      self.close(close_iterator=False)
      raise error
    if item is _DONE:
      self.close()
      raise StopIteration
    self._state = state
    return item

  def _next_entry(self):
    if self._timeout_s is None:
      return self._queue.get()
    waiting_since = time.monotonic()
    while True:
      try:
        return self._queue.get(timeout=_POLL_S)
      except queue.Empty:
        progress = max(waiting_since, getattr(self._iterator, "last_progress", 0.0))
        if time.monotonic() - progress > self._timeout_s:
          raise storage.StorageTimeout(
            storage.timeout_message(self._what, self._timeout_s, doing="reading")
          ) from None

  def get_state(self) -> Any:
    """The wrapped iterator's state after the last item returned by `__next__`."""
    return self._state

  def close(self, close_iterator: bool = True) -> None:
    """Stops the thread, then closes the wrapped iterator if it has a `close`.

    close_iterator=False leaves the iterator as it is: on an error path, where the process
    is about to exit, tearing down a tf.data iterator after a failed collective was seen
    to block until JAX's coordination service aborted the process.
    """
    self._stop.set()
    self._thread.join(timeout=10)
    iterator_close = getattr(self._iterator, "close", None)
    if close_iterator and iterator_close is not None and not self._thread.is_alive():
      iterator_close()
