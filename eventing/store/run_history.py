"""A training run's history as the event store holds it: what forking a run rebuilds from.

`run_history` reads, for one run of one tenant, its creation request (create_model,
create-via-load, or the fork that made it), every sequenced training request with how its
future ended, and the trainer's snapshots of it, all in store order. Events the store
refused (`fenced`: produced under a lost lease) are not part of the history. Reading is
O(the run's events); a fork is rare enough that no index beyond the events' `key` serves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, cast

from sqlalchemy import or_, select

from eventing.store import tables as t
from eventing.store.event_store import EventStore
from openrl_core import forking
from openrl_core.events import Event
from openrl_core.events import training as te
from openrl_core.events.recovery import SNAPSHOT_TAKEN, SnapshotTaken
from openrl_core.futures import FutureState


class _Sequenced(Protocol):
    """A run's training request after its creation: it has its place in the run's order."""

    seq_id: int
    request_id: str


CREATIONS = (te.CREATE_MODEL["requested"], te.LOAD_WEIGHTS["requested"], te.FORK["requested"])
VERBS = {
    te.FORWARD_BACKWARD["requested"]: forking.FORWARD_BACKWARD,
    te.OPTIM_STEP["requested"]: forking.OPTIM_STEP,
    te.LOAD_WEIGHTS["requested"]: forking.LOAD_WEIGHTS,
}
OUTCOMES = {
    FutureState.COMPLETED.value: forking.COMPLETED,
    FutureState.PENDING.value: forking.UNFINISHED,
    FutureState.RUNNING.value: forking.UNFINISHED,
}


@dataclass
class RunHistory:
    origin: Optional[Event] = None  # the request that created the run
    requests: dict[int, Event] = field(default_factory=dict)  # seq_id -> its requested event
    logged: list[forking.Logged] = field(default_factory=list)
    snapshots: list[SnapshotTaken] = field(default_factory=list)


def run_history(store: EventStore, tenant: str, run_id: str) -> RunHistory:
    wanted = (*CREATIONS, *te.SEQUENCED_REQUESTS, SNAPSHOT_TAKEN)
    events = t.events.c
    query = (
        select(t.events)
        .where(
            events.tenant == tenant,
            events.key == run_id,
            events.type.in_(wanted),
            or_(events.fenced.is_(None), events.fenced.is_(False)),
        )
        .order_by(events.position)
    )
    futures = select(t.futures.c.request_id, t.futures.c.state).where(
        t.futures.c.tenant == tenant, t.futures.c.model_id == run_id
    )
    with store.engine.connect() as conn:
        rows = conn.execute(query).all()
        states = dict(conn.execute(futures).all())
    history = RunHistory()
    for row in rows:
        event = store.event_of(row)
        data = event.data
        if event.type == SNAPSHOT_TAKEN:
            snapshot = cast(SnapshotTaken, data)
            if snapshot.model_id == run_id:
                history.snapshots.append(snapshot)
            continue
        if getattr(data, "model_id", None) != run_id:
            continue
        if event.type in CREATIONS and getattr(data, "seq_id", None) is None:
            history.origin = history.origin or event
            continue
        request = cast(_Sequenced, data)  # a training request: its model_id is the run's
        seq_id = request.seq_id
        history.requests[seq_id] = event
        history.logged.append(
            forking.Logged(
                seq_id=seq_id,
                verb=VERBS.get(event.type, forking.OTHER),
                outcome=OUTCOMES.get(states.get(request.request_id, ""), forking.ENDED),
                forward_only=bool(getattr(data, "forward_only", False)),
            )
        )
    return history
