"""Futures that just finished, kept in memory for the long-polls waiting on them.

A future's row never changes once it is terminal (`openrl_core.futures`: a terminal state
absorbs every later event), so a copy of it is as good as the store's. The store puts the
rows a transaction finished here once that transaction has committed; the gateway in the
same process (`openrl serve`, where the projector runs beside it) answers a woken
`retrieve_future` from here, without a read of the store or a worker-thread hop. Bounded
and least-recently-used: it serves the moment after a completion, not history. Anywhere
else (a gateway of its own, a miss) the store is read as before.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from types import SimpleNamespace
from typing import Iterable, Optional

from openrl_core.futures import FutureState, is_terminal


class FinishedFutures:
    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._rows: OrderedDict[str, SimpleNamespace] = OrderedDict()
        self._lock = threading.Lock()

    def put_many(self, rows: Iterable[dict]) -> None:
        """Keep the terminal ones among these committed futures rows."""
        finished = [SimpleNamespace(**row) for row in rows if is_terminal(FutureState(row["state"]))]
        if not finished or self.capacity <= 0:
            return
        with self._lock:
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
