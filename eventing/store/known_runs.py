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

On PostgreSQL the runs change in other processes too (a projector folds a run's creation, a
gateway beside this one its cancel). Every store there announces the runs its transaction
changed, with a NOTIFY in that transaction (so exactly when it commits:
`EventStore.announce_runs`), and a gateway that hears them (`functions/runtime.py`) follows
them here: an announced run is dropped, and all are dropped whenever its LISTEN connection
starts again (`clear`), since what was announced meanwhile is lost. A row is also kept no
longer than `max_age` there, so even a writer that announces nothing (an older version during
an upgrade) leaves a gateway wrong for seconds at most.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Iterable, Optional

IGNORED = frozenset({"last_request_time"})  # moved by every request; not kept right here


class KnownRuns:
    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self.following = False
        self.max_age: Optional[float] = None
        self._rows: OrderedDict[str, tuple[Any, float]] = (
            OrderedDict()
        )  # model_id -> (row, kept at); the tenant is a column
        self._generation = 0
        self._lock = threading.Lock()

    def follow(self, max_age: Optional[float] = None) -> None:
        """Keep rows from now on, each for at most `max_age` seconds (None: until changed);
        the module docstring says where that is sound."""
        self.max_age = max_age
        self.following = True

    def get(self, tenant: str, model_id: str) -> Optional[Any]:
        """The kept row if `tenant` owns it; None when not kept (read the store) or another
        tenant's (the store's read would find none for this tenant either)."""
        kept = self._rows.get(model_id)
        if kept is None or (self.max_age is not None and time.monotonic() - kept[1] > self.max_age):
            return None
        row = kept[0]
        return row if row.tenant == tenant else None

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
            self._rows[model_id] = (row, time.monotonic())
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

    def clear(self) -> None:
        """Drop every row (changes may have gone unheard), and refuse `put`s of reads begun before."""
        with self._lock:
            self._generation += 1
            self._rows.clear()
