"""Training runs' rows kept in memory for the gateway's per-request lookup, where this
process sees every change of them.

Every training request looks its run up (`functions/gateway/deps.require_run`: its tenant,
base model, kind and state). On a SQLite store that lookup is a point read on the gateway's
event loop, a tenth of the loop's work per no-op future (a py-spy profile of the futures
bench), and each of its calls into SQLite lets another thread take the interpreter's lock,
which the loop then waits to get back.

Where every write of `training_runs` goes through this store object (`follow`, off by
default: the embedded deployment, where the gateway and the projector share one process),
a row read once stays right until a transaction of this store changes it. The store drops a
row once a committed transaction changed any column of it but `last_request_time`, which
every request moves and no lookup reads (`IGNORED`), so a row kept here may hold an older
`last_request_time` and nothing else older. A read that races a change cannot keep the old
row: `put` is refused once anything was dropped since the caller asked for `generation()`
before its read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Iterable, Optional

IGNORED = frozenset({"last_request_time"})  # moved by every request; not kept right here


class KnownRuns:
    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self.following = False
        self._rows: OrderedDict[str, Any] = OrderedDict()  # model_id -> row (its tenant among its columns)
        self._generation = 0
        self._lock = threading.Lock()

    def follow(self) -> None:
        """Keep rows from now on (the module docstring says where that is sound)."""
        self.following = True

    def get(self, tenant: str, model_id: str) -> Optional[Any]:
        """The kept row if `tenant` owns it; None when not kept (read the store) or another
        tenant's (the store's read would find none for this tenant either)."""
        row = self._rows.get(model_id)
        return row if row is not None and row.tenant == tenant else None

    def generation(self) -> int:
        """Ask before reading the store for a row to `put`."""
        return self._generation

    def put(self, model_id: str, row: Any, generation: int) -> None:
        """Keep `row`, read after `generation()` gave `generation`, unless a row was dropped since."""
        if not self.following or row is None:
            return
        with self._lock:
            if generation != self._generation:
                return
            self._rows[model_id] = row
            self._rows.move_to_end(model_id)
            while len(self._rows) > self.capacity:
                self._rows.popitem(last=False)

    def changed(self, model_ids: Iterable[str]) -> None:
        """A committed transaction changed these runs: drop them (and refuse any `put` of a
        read begun before)."""
        model_ids = list(model_ids)
        if not model_ids:
            return
        with self._lock:
            self._generation += 1
            for model_id in model_ids:
                self._rows.pop(model_id, None)
