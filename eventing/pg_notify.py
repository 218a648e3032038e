"""Long-poll wake-ups across processes through PostgreSQL LISTEN/NOTIFY.

In the distributed deployment the projector and the gateways are separate processes that
share only the event store. The projector calls `notify` after its transaction has
committed; every process that `subscribe`d (each gateway) receives the request ids on its
own LISTEN connection and wakes its waiters. Same interface as `LocalNotifier`.
NOTIFY payloads are limited to 8000 bytes, so long id lists are sent in pieces.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable, Optional

import psycopg

log = logging.getLogger(__name__)
CHANNEL = "openrl_futures"
_MAX_PAYLOAD = 7900


def _dsn(url: str) -> str:
    """psycopg wants a libpq URL, not SQLAlchemy's `postgresql+psycopg://`."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def chunks(ids: list[str]) -> list[str]:
    pieces, current = [], ""
    for request_id in ids:
        if current and len(current) + 1 + len(request_id) > _MAX_PAYLOAD:
            pieces.append(current)
            current = ""
        current = f"{current},{request_id}" if current else request_id
    if current:
        pieces.append(current)
    return pieces


class PgNotifier:
    def __init__(self, url: str) -> None:
        self._dsn = _dsn(url)
        self._send_lock = threading.Lock()
        self._sender: psycopg.Connection | None = None
        self._listeners: list[Callable[[list[str]], None]] = []
        self._gap_listeners: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._listening = threading.Event()

    def notify(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if not ids:
            return
        with self._send_lock:
            for attempt in (1, 2):
                try:
                    if self._sender is None or self._sender.closed:
                        self._sender = psycopg.connect(self._dsn, autocommit=True)
                    for piece in chunks(ids):
                        self._sender.execute("SELECT pg_notify(%s, %s)", (CHANNEL, piece))
                    return
                except psycopg.OperationalError:
                    self._sender = None  # the server restarted: reconnect once
                    if attempt == 2:
                        raise

    def subscribe(self, listener: Callable[[list[str]], None], *, on_gap: Optional[Callable[[], None]] = None) -> None:
        """`listener(ids)` for every notification; `on_gap()` each time LISTEN starts (the
        first time too), since notifications sent while it was not listening are lost."""
        self._listeners.append(listener)
        if on_gap is not None:
            self._gap_listeners.append(on_gap)
        if self._thread is None:
            self._thread = threading.Thread(target=self._listen, name="pg-listen", daemon=True)
            self._thread.start()
            self._listening.wait(10)

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._dsn, autocommit=True) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    for on_gap in list(self._gap_listeners):
                        on_gap()
                    self._listening.set()
                    # A generator that blocks in the socket until a NOTIFY arrives (or the
                    # timeout passes, to notice `close`): no polling of the store.
                    while not self._stop.is_set():
                        for notification in conn.notifies(timeout=1.0):
                            ids = notification.payload.split(",")
                            for listener in list(self._listeners):
                                listener(ids)
            except psycopg.OperationalError:
                log.warning("pg-listen: connection lost; reconnecting")
                self._stop.wait(1.0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sender is not None:
            self._sender.close()
