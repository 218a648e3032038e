"""`openrl events tail`: the event stream as readable lines, filtered by tenant, model, type.

History comes from the event store; `follow` then reads the log itself (a consumer group
of its own, starting at the end), so new events appear as they are published.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Iterator, Optional

from eventing.bus import EventBus
from eventing.codec import Codec
from eventing.store.event_store import EventStore
from openrl_core.events import Event

_ALL_TOPICS = r"^openrl\.[a-z0-9-]+\.[a-z]+$"


@dataclass(frozen=True)
class EventFilter:
    tenant: Optional[str] = None
    model: Optional[str] = None
    type_contains: Optional[str] = None

    def matches(self, event: Event) -> bool:
        if self.tenant and event.tenant != self.tenant:
            return False
        if self.model and self.model not in (event.key, getattr(event.data, "model_id", None)):
            return False
        return not self.type_contains or self.type_contains in event.type


def history(store: EventStore, wanted: EventFilter, limit: int) -> list[Event]:
    matched = [event for _, event in store.iterate() if wanted.matches(event)]
    return matched[-limit:] if limit else matched


def follow(bus: EventBus, codec: Codec, wanted: EventFilter) -> Iterator[Event]:
    consumer = bus.consumer(f"openrl-tail-{uuid.uuid4().hex[:8]}", pattern=_ALL_TOPICS, from_beginning=False)
    try:
        while True:
            for record in consumer.poll(timeout=1.0):
                event = codec.decode(record.message)
                if wanted.matches(event):
                    yield event
    finally:
        consumer.close()


def describe(event: Event) -> str:
    """One line: time, tenant, family.verb.phase, key, then the payload's small fields."""
    short_type = ".".join(event.type.split(".")[2:5])
    fields = []
    for name, value in event.data:
        if isinstance(value, list):
            fields.append(f"{name}=[{len(value)}]")
        elif isinstance(value, dict):
            fields.append(f"{name}={{{', '.join(list(value)[:4])}{', …' if len(value) > 4 else ''}}}")
        elif value is not None and name not in ("request_id",):
            text = str(value)
            fields.append(f"{name}={text if len(text) <= 40 else text[:37] + '…'}")
    request = getattr(event.data, "request_id", None)
    when = event.time.strftime("%H:%M:%S.%f")[:-3]
    return f"{when} {event.tenant} {short_type} {event.key or '-'} {request or ''} {' '.join(fields)}".rstrip()
