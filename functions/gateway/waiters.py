"""Long-poll waiters: `retrieve_future` sleeps here until its future changes.

The projector notifies from its own thread after the store commits; `notify` hands the
ids to the event loop, which sets the asyncio events of whoever waits on them. Waiters
register before they read the store, so a completion that lands between the read and the
wait still wakes them: nothing polls in a loop. `watch_all` wakes on every notification,
whatever its ids: the dashboard's event streams, which follow a whole run, use it to answer a
completion at once instead of at their next poll.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator, Optional


class FutureWaiters:
    def __init__(self) -> None:
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._waiting: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._any: set[asyncio.Event] = set()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def notify(self, request_ids: list[str]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake, request_ids)

    def _wake(self, request_ids: list[str]) -> None:
        for event in self._any:
            event.set()
        for request_id in request_ids:
            for event in self._waiting.get(request_id, ()):
                event.set()

    @contextmanager
    def watch(self, request_id: str) -> Iterator[asyncio.Event]:
        event = asyncio.Event()
        self._waiting[request_id].add(event)
        try:
            yield event
        finally:
            waiting = self._waiting.get(request_id)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._waiting[request_id]

    @contextmanager
    def watch_all(self) -> Iterator[asyncio.Event]:
        event = asyncio.Event()
        self._any.add(event)
        try:
            yield event
        finally:
            self._any.discard(event)

    @property
    def waiting(self) -> int:
        return sum(len(events) for events in self._waiting.values())
