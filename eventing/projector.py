"""The projector: persists every worker event into the event store, then wakes waiters.

It consumes the completions stream of every tenant (by pattern), appends each event
idempotently (a redelivered event id is a no-op), commits the log offsets only after the
store has committed, and only then notifies long-polls. Requests are not read here: the
gateway stores them itself before publishing (outbox), so they are never missing.

A batch the store could not take (the database is down) is retried as it is until it can:
the consumer's position has already moved past it, so polling on would skip it and the next
commit would record it as done, leaving its futures pending forever.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from eventing import topics
from eventing.bus import EventBus
from eventing.store.event_store import EventStore

log = logging.getLogger(__name__)


class Projector:
    def __init__(
        self,
        bus: EventBus,
        store: EventStore,
        notifier,
        group: str = "openrl-projector",
        instance_id: Optional[str] = None,
        observer: Optional[Callable[[list], None]] = None,
    ) -> None:
        self.store = store
        # Told of every stored batch, after the commit (the optional OpenTelemetry traces,
        # functions/request_traces.py); it must not block, and what it raises is only logged.
        self.observer = observer
        self.notifier = notifier
        self.consumer = bus.consumer(group, pattern=topics.pattern("completions"), instance_id=instance_id)
        self._unstored: list = []  # a polled batch the store has not taken yet

    def run_once(self, timeout: float = 1.0) -> int:
        records = self._unstored or self.consumer.poll(max_records=256, timeout=timeout)
        self._unstored = records  # until every event is stored; appending again is a no-op
        events = []
        for record in records:
            try:
                events.append(self.store.codec.decode(record.message))
            except Exception:  # a poison record must not stall every tenant behind it
                log.exception(
                    "projector: undecodable record %s/%s@%s skipped", record.topic, record.partition, record.offset
                )
        # One transaction for the whole poll (a redelivered event id is still a no-op).
        self.store.append_batch([(event, None) for event in events])
        woken = [request_id for event in events if (request_id := getattr(event.data, "request_id", None))]
        self._unstored = []
        if records:
            # The store has committed: wake the long-polls first, then record the offsets,
            # without waiting for them to be durable: appending an event again is a no-op, so
            # a crash before they are only redelivers what is stored, and the next poll need
            # not sit through an fsync.
            # The finished rows go along: a gateway in another process answers from them.
            self.notifier.notify(woken, rows=self.store.finished.peek_many(woken))
            self.consumer.commit(wait=False)
            if self.observer is not None and events:
                try:
                    self.observer(events)
                except Exception:
                    log.exception("projector: observer failed; the batch is stored")
        return len(records)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once(timeout=0.5)
            except Exception:
                log.exception("projector: batch failed; retrying")
                stop.wait(0.5)
        self.consumer.close()
