"""Long-poll wake-ups across processes through PostgreSQL LISTEN/NOTIFY.

In the distributed deployment the projector and the gateways are separate processes that
share only the event store. The projector calls `notify` after its transaction has
committed; every process that `subscribe`d (each gateway) receives the request ids on its
own LISTEN connection and wakes its waiters. Same interface as `LocalNotifier`.
NOTIFY payloads are limited to 8000 bytes, so long id lists are sent in pieces.

A projector also sends the small finished futures rows it committed (`rows`), as JSON pieces
(`{"rows": [...]}`) ahead of their ids, in the same transaction, so they arrive first: a
gateway keeps them (`on_rows`) and answers the long-polls the ids then wake without reading
the store, as it does for rows its own process committed (`eventing/store/finished.py`). A
terminal row never changes, so a copy is as good as the store's. A row whose JSON is longer
than ROW_MOST_BYTES (a forward_backward's logprobs) goes by id alone and is read. A listener
of an older version splits such a piece into nonsense ids, which wake nobody.

Every store on PostgreSQL also announces the training runs its transaction changed, as
`{"runs": [...]}` pieces sent by a NOTIFY inside that transaction (`run_pieces`,
`EventStore.announce_runs`): a gateway drops its kept rows of them (`on_runs`,
`eventing/store/known_runs.py`).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Callable, Iterable, LiteralString, Optional

import psycopg

from eventing.store.database import json_text

log = logging.getLogger(__name__)
CHANNEL = "openrl_futures"
_MAX_PAYLOAD = 7900
ROW_MOST_BYTES = 2048
# What the gateway answers a finished future from (functions/gateway/routes/futures.py).
ROW_FIELDS = ("request_id", "tenant", "kind", "model_id", "state", "result", "error", "category")


def _dsn(url: str) -> str:
    """psycopg wants a libpq URL, not SQLAlchemy's `postgresql+psycopg://`."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def chunks(ids: list[str]) -> list[str]:
    return _joined(ids, "", "")


def row_pieces(rows: Iterable) -> list[str]:
    """The small rows' payloads, each under the payload limit; larger rows are left out."""
    texts = (json_text({name: getattr(row, name, None) for name in ROW_FIELDS}) for row in rows)
    return _joined([text for text in texts if len(text) <= ROW_MOST_BYTES], '{"rows":[', "]}")


def run_pieces(model_ids: list[str]) -> list[str]:
    """The payloads that announce these runs changed, each under the payload limit."""
    return _joined([json.dumps(model_id) for model_id in model_ids], '{"runs":[', "]}")


def _joined(texts: list[str], head: str, tail: str) -> list[str]:
    """`texts` comma-joined between `head` and `tail`, in as few payloads under the limit as fit."""
    pieces, current, size = [], [], len(head) + len(tail)
    for text in texts:
        if current and size + 1 + len(text) > _MAX_PAYLOAD:
            pieces.append(head + ",".join(current) + tail)
            current, size = [], len(head) + len(tail)
        size += len(text) + (1 if current else 0)
        current.append(text)
    if current:
        pieces.append(head + ",".join(current) + tail)
    return pieces


class PgNotifier:
    def __init__(self, url: str) -> None:
        self._dsn = _dsn(url)
        self._send_lock = threading.Lock()
        self._sender: psycopg.Connection | None = None
        self._listeners: list[Callable[[list[str]], None]] = []
        self._gap_listeners: list[Callable[[], None]] = []
        self._row_listeners: list[Callable[[list[dict]], None]] = []
        self._run_listeners: list[Callable[[list[str]], None]] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._listening = threading.Event()

    def notify(self, request_ids: Iterable[str], rows: Iterable = ()) -> None:
        """Wake the waiters of `request_ids` everywhere; `rows`: finished futures rows
        (attributes ROW_FIELDS) among them, which listeners get first (module docstring)."""
        ids = list(request_ids)
        if not ids:
            return
        pieces = row_pieces(rows) + chunks(ids)
        # One statement, so one transaction: its notifications arrive together, in order.
        calls: list[LiteralString] = ["pg_notify(%s, %s)"] * len(pieces)
        statement = "SELECT " + ", ".join(calls)
        params = [value for piece in pieces for value in (CHANNEL, piece)]
        with self._send_lock:
            for attempt in (1, 2):
                try:
                    if self._sender is None or self._sender.closed:
                        self._sender = psycopg.connect(self._dsn, autocommit=True)
                    self._sender.execute(statement, params)
                    return
                except psycopg.OperationalError:
                    self._sender = None  # the server restarted: reconnect once
                    if attempt == 2:
                        raise

    def subscribe(
        self,
        listener: Callable[[list[str]], None],
        *,
        on_gap: Optional[Callable[[], None]] = None,
        on_rows: Optional[Callable[[list[dict]], None]] = None,
        on_runs: Optional[Callable[[list[str]], None]] = None,
    ) -> None:
        """`listener(ids)` for every notification; `on_gap()` each time LISTEN starts (the
        first time too), since notifications sent while it was not listening are lost;
        `on_rows(rows)` for the finished rows sent, before their ids; `on_runs(model_ids)`
        for the runs a store's transaction changed."""
        self._listeners.append(listener)
        if on_gap is not None:
            self._gap_listeners.append(on_gap)
        if on_rows is not None:
            self._row_listeners.append(on_rows)
        if on_runs is not None:
            self._run_listeners.append(on_runs)
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
                            self._heard(notification.payload)
            except psycopg.OperationalError:
                log.warning("pg-listen: connection lost; reconnecting")
                self._stop.wait(1.0)

    def _heard(self, payload: str) -> None:
        if payload.startswith("{"):
            try:
                message = json.loads(payload)
                kind = "runs" if "runs" in message else "rows"
                values = list(message[kind])
            except (ValueError, KeyError, TypeError):
                log.warning("pg-listen: an unreadable notification ignored")
                return
            for listener in list(self._run_listeners if kind == "runs" else self._row_listeners):
                listener(values)
            return
        ids = payload.split(",")
        for listener in list(self._listeners):
            listener(ids)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sender is not None:
            self._sender.close()
