"""Futures that just finished, kept in memory for the long-polls waiting on them, and, where
this process sees every change of a future, the ones still running.

A future's row never changes once it is terminal (`openrl_core.futures`: a terminal state
absorbs every later event), so a copy of it is as good as the store's. The store puts the
rows a transaction finished here once that transaction has committed; the gateway in the
same process (`openrl serve`, where the projector runs beside it) answers a woken
`retrieve_future` from here, without a read of the store or a worker-thread hop. Bounded
and least-recently-used: it serves the moment after a completion, not history. Anywhere
else (a gateway of its own, a miss) the store is read as before.

Pending futures (`follow_pending`, off by default): a `retrieve_future` usually arrives
before its future finishes, and its first store read, in a gateway thread, only learns
that it runs. That read and its thread hop were about a tenth of a no-op future's server
CPU and a third of its thread switches (README.md at 40db992, "where a no-op future's time goes"). Where every write to the futures table
goes through this store object, a future it committed unfinished, and has not seen finish
since, is still running, and the gateway may wait for its completion without reading.
That holds in the embedded deployment (one process: the gateway appends the request, the
projector beside it folds the completion). On PostgreSQL another process's projector may
finish it, but every projector announces what it folded through LISTEN/NOTIFY, so a gateway
that hears those announcements (`eventing/pg_notify.py`) forgets each announced id here
(`forget_pending`) before it wakes the waiters, and forgets every hint (`clear_pending`)
whenever it may have missed some (its LISTEN connection started again). It is a hint, not
a record: the gateway still reads the store after a short wait
(`functions/gateway/routes/futures.py`), so a hint that is wrong (a row changed by another
process unannounced) costs that wait, never an answer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from types import SimpleNamespace
from typing import Iterable, Optional

from openrl_core.futures import FutureState, is_terminal


class FinishedFutures:
    def __init__(self, capacity: int = 1024, pending_capacity: int = 16384) -> None:
        self.capacity = capacity
        self.pending_capacity = pending_capacity
        self._rows: OrderedDict[str, SimpleNamespace] = OrderedDict()
        self._pending: Optional[OrderedDict[str, str]] = None  # request_id -> tenant, once followed
        self._lock = threading.Lock()

    def follow_pending(self) -> None:
        """Keep the unfinished futures this store commits too (the module docstring says
        where that is sound); from now on, so a future committed before is not pending here."""
        with self._lock:
            if self._pending is None:
                self._pending = OrderedDict()

    def put_many(self, rows: Iterable[dict]) -> None:
        """Keep the terminal ones among these committed futures rows (and, when followed,
        note the others as pending)."""
        following = self._pending is not None
        finished, running = [], []
        for row in rows:
            if is_terminal(FutureState(row["state"])):
                finished.append(SimpleNamespace(**row))
            elif following:
                running.append(row)
        if not finished and not running:
            return
        with self._lock:
            pending = self._pending
            if pending is not None:
                for row in running:
                    pending[row["request_id"]] = row["tenant"]
                    pending.move_to_end(row["request_id"])
                for row in finished:
                    pending.pop(row.request_id, None)
                while len(pending) > self.pending_capacity:
                    pending.popitem(last=False)
            if self.capacity <= 0:
                return
            for row in finished:
                self._rows[row.request_id] = row
                self._rows.move_to_end(row.request_id)
            while len(self._rows) > self.capacity:
                self._rows.popitem(last=False)

    def get(self, tenant: str, request_id: str) -> Optional[SimpleNamespace]:
        """The finished future's row, if kept and the tenant's; None otherwise (read the store)."""
        with self._lock:
            row = self._rows.get(request_id)
        return row if row is not None and row.tenant == tenant else None

    def forget_pending(self, request_ids: Iterable[str]) -> None:
        """These futures changed somewhere (another process may have finished them): no
        longer a hint that they run."""
        with self._lock:
            pending = self._pending
            if pending:
                for request_id in request_ids:
                    pending.pop(request_id, None)

    def clear_pending(self) -> None:
        """Changes may have gone unheard: no hints until futures are committed again."""
        with self._lock:
            if self._pending:
                self._pending.clear()

    def peek_many(self, request_ids: Iterable[str]) -> list[SimpleNamespace]:
        """The kept finished rows among these ids (to announce them to other processes)."""
        with self._lock:
            return [row for request_id in request_ids if (row := self._rows.get(request_id)) is not None]

    def pending(self, tenant: str, request_id: str) -> bool:
        """Whether this store committed the tenant's future unfinished and has not seen it
        finish since (always False unless `follow_pending`): a hint, see the module docstring."""
        with self._lock:
            pending = self._pending
            return pending is not None and pending.get(request_id) == tenant
