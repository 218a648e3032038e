"""Group commit: many threads' writes, one batch at a time, each caller back once its write is done.

A caller queues its item and then takes the write lock; whoever holds it writes everything
queued so far in one call of `write_batch` (one transaction, one fsync), and the callers whose
items went with it find them done when their turn at the lock comes. An item queued while a
batch is being written goes in the next batch. Nobody returns before its own item was
written, so whatever durability `write_batch` gives a batch, each caller gets for its item;
under load the transactions and fsyncs are shared instead of paid per write, and a lone
writer is written at once (no linger, no extra thread).

`write_batch(items)` returns one outcome per item, in order: a result, or the exception that
item alone raised (a caller gets its own outcome; one bad item does not fail its
neighbours). An exception raised by `write_batch` itself is every item's outcome.
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, Sequence, TypeVar, Union

Item = TypeVar("Item")
Result = TypeVar("Result")


class _Slot:
    __slots__ = ("item", "outcome", "done")

    def __init__(self, item) -> None:
        self.item = item
        self.outcome = None
        self.done = False


class GroupCommit(Generic[Item, Result]):
    def __init__(self, write_batch: Callable[[list], Sequence[Union[Result, BaseException]]], max_batch: int = 0) -> None:
        """`max_batch` > 0 caps how many items one call writes (the rest go in the next)."""
        self._write_batch = write_batch
        self._max_batch = max_batch
        self._queue: list[_Slot] = []
        self._queue_lock = threading.Lock()
        self._write_lock = threading.Lock()

    def submit(self, item: Item) -> Result:
        """Write `item` (with whatever else is queued); returns its result or raises its exception."""
        return self.submit_many([item])[0]

    def submit_many(self, items: list[Item]) -> list[Result]:
        """Write several items of one caller, in one batch when they fit; results in order.
        Raises the first item's exception if any item failed (after all were written)."""
        slots = [_Slot(item) for item in items]
        with self._queue_lock:
            self._queue.extend(slots)
        while not all(slot.done for slot in slots):
            with self._write_lock:
                if all(slot.done for slot in slots):
                    break
                with self._queue_lock:
                    if self._max_batch and len(self._queue) > self._max_batch:
                        batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
                    else:
                        batch, self._queue = self._queue, []
                self._write(batch)
        for slot in slots:
            if isinstance(slot.outcome, BaseException):
                raise slot.outcome
        return [slot.outcome for slot in slots]

    def enqueue(self, item: Item) -> None:
        """Queue `item` without waiting: the next batch anyone writes takes it along (its
        outcome is not reported; use it for writes a later one supersedes)."""
        with self._queue_lock:
            self._queue.append(_Slot(item))

    def flush(self) -> None:
        """Write whatever is queued now (what `enqueue` left) and wait for it."""
        with self._queue_lock:
            pending = list(self._queue)
        while not all(slot.done for slot in pending):
            with self._write_lock:
                with self._queue_lock:
                    batch, self._queue = self._queue, []
                if batch:
                    self._write(batch)

    def writing(self) -> threading.Lock:
        """The write lock: held, no batch is being written (e.g. while closing what
        `write_batch` writes to)."""
        return self._write_lock

    def _write(self, batch: list[_Slot]) -> None:
        try:
            outcomes = list(self._write_batch([slot.item for slot in batch]))
            if len(outcomes) != len(batch):
                raise RuntimeError(f"write_batch returned {len(outcomes)} outcomes for {len(batch)} items")
        except BaseException as exc:  # the whole batch failed: each caller gets the error
            outcomes = [exc] * len(batch)
        for slot, outcome in zip(batch, outcomes):
            slot.outcome, slot.done = outcome, True
