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

A caller on an event loop need not hold a thread while it waits: `submit_later` queues the
item for a writer thread of the group's own and answers an asyncio future, settled (one
wake-up of the loop per batch) once the batch is written. Why: a write can be slow for a
long time (a broker restarting keeps the log from acknowledging), and with a thread held per
waiting request a gateway's whole pool filled with submissions, so that its store reads, every
tenant's long-polls included, queued behind them. It did not make the no-op futures bench
faster (README.md at 40db992, "where a no-op future's time goes").
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from typing import Any, Callable, Generic, Optional, Sequence, TypeVar, Union

Item = TypeVar("Item")
Result = TypeVar("Result")


class _Slot:
    __slots__ = ("item", "outcome", "done", "future")

    def __init__(self, item, future: Optional[asyncio.Future] = None) -> None:
        self.item = item
        self.outcome: Any = None  # the write's Result, or the exception it raised
        self.done = False
        self.future = future  # submit_later's: settled on its loop once written


class GroupCommit(Generic[Item, Result]):
    def __init__(
        self, write_batch: Callable[[list], Sequence[Union[Result, BaseException]]], max_batch: int = 0
    ) -> None:
        """`max_batch` > 0 caps how many items one call writes (the rest go in the next)."""
        self._write_batch = write_batch
        self._max_batch = max_batch
        self._queue: list[_Slot] = []
        self._queue_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._wake = threading.Event()  # the writer thread's: something was queued for it
        self._writer: Optional[threading.Thread] = None
        self._closed = False

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
                    batch = self._take()
                self._write(batch)
        for slot in slots:
            if isinstance(slot.outcome, BaseException):
                raise slot.outcome
        return [slot.outcome for slot in slots]

    def submit_later(self, item: Item, loop: asyncio.AbstractEventLoop) -> "asyncio.Future[Result]":
        """Queue `item` for the writer thread and return at once (callable from any thread):
        the future, of `loop`, gets the item's result or exception once its batch is written."""
        slot = _Slot(item, loop.create_future())
        with self._queue_lock:
            if self._closed:
                raise RuntimeError("group commit is closed")
            self._queue.append(slot)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_queued, name="group-commit", daemon=True)
                self._writer.start()
        self._wake.set()
        return slot.future  # type: ignore[return-value]

    def close(self, timeout: float = 10.0) -> None:
        """Stop the writer thread once what is queued is written (later submits are refused)."""
        with self._queue_lock:
            self._closed = True
            writer = self._writer
        self._wake.set()
        if writer is not None:
            writer.join(timeout)

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

    def queued(self) -> bool:
        """Whether items wait for a batch now (from `write_batch`: another batch follows)."""
        with self._queue_lock:
            return bool(self._queue)

    def writing(self) -> threading.Lock:
        """The write lock: held, no batch is being written (e.g. while closing what
        `write_batch` writes to)."""
        return self._write_lock

    def _write_queued(self) -> None:
        """The writer thread: whenever woken, write batches until the queue is empty."""
        while True:
            self._wake.wait()
            self._wake.clear()
            while True:
                with self._write_lock:
                    with self._queue_lock:
                        batch = self._take()
                    if batch:
                        self._write(batch)
                if not batch:
                    break
            with self._queue_lock:
                if self._closed and not self._queue:
                    return

    def _take(self) -> list[_Slot]:
        """The next batch off the queue (at most `max_batch`); the caller holds the queue lock."""
        if self._max_batch and len(self._queue) > self._max_batch:
            batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
        else:
            batch, self._queue = self._queue, []
        return batch

    def _write(self, batch: list[_Slot]) -> None:
        try:
            outcomes = list(self._write_batch([slot.item for slot in batch]))
            if len(outcomes) != len(batch):
                raise RuntimeError(f"write_batch returned {len(outcomes)} outcomes for {len(batch)} items")
        except BaseException as exc:  # the whole batch failed: each caller gets the error
            outcomes = [exc] * len(batch)
        waiting: dict[asyncio.AbstractEventLoop, list[_Slot]] = defaultdict(list)
        for slot, outcome in zip(batch, outcomes):
            slot.outcome, slot.done = outcome, True
            if slot.future is not None:
                waiting[slot.future.get_loop()].append(slot)
        for loop, slots in waiting.items():
            try:
                loop.call_soon_threadsafe(_settle, slots)
            except RuntimeError:  # the loop is closed: nobody is left to await them
                pass


def _settle(slots: list[_Slot]) -> None:
    """On the loop: hand each awaited outcome over (a caller that gave up is skipped)."""
    for slot in slots:
        future = slot.future
        if future is None or future.done():  # (only slots with a future are settled here)
            continue
        if isinstance(slot.outcome, BaseException):
            future.set_exception(slot.outcome)
        else:
            future.set_result(slot.outcome)
