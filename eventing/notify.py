"""Wake-ups for long-polls: "this request's future changed" from the projector to waiters.

The projector calls `notify` only after the store has committed, so a woken waiter always
finds the new state. In the embedded deployment the waiters live in the same process; the
distributed deployment delivers the same call through PostgreSQL LISTEN/NOTIFY.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

Listener = Callable[[list[str]], None]


class LocalNotifier:
    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    def subscribe(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def notify(self, request_ids: Iterable[str], rows: Iterable = ()) -> None:
        """`rows` (finished futures rows) are for other processes' listeners (PgNotifier);
        here the store's own memory has them already."""
        ids = list(request_ids)
        if not ids:
            return
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener(ids)
