"""The EventBus contract: Kafka's semantics, whatever the backend.

- `publish` appends a record to a topic; records with the same key land in the same
  partition and are read back in the order they were appended.
- A consumer belongs to a group; each partition of its subscription is read by one member
  of the group at a time. `commit` records, per partition, the offset of the next record
  the group needs. A member that joins (or a process that restarts) resumes from the
  committed offsets, so whatever was polled but not committed is delivered again:
  at-least-once, which is why every consumer must be idempotent.
- Subscriptions name topics or a regular expression; a pattern picks up topics created
  later (a new tenant) without a restart.
- A consumer created with an `instance_id` replaces any live member of its group with the
  same id (a worker's replacement after a crash takes over without a rebalance wait).
The embedded SQLite log and the Kafka backend both implement this and pass one contract
suite (`tests/eventing/test_bus_contract.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from eventing.codec import Codec, Message
from eventing.dedup import Dedup
from openrl_core.events import Event


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    message: Message
    timestamp: float


TopicPartition = tuple[str, int]


class Consumer(Protocol):
    def poll(self, max_records: int = 100, timeout: float = 1.0) -> list[Record]: ...

    def commit(self, offsets: Optional[dict[TopicPartition, int]] = None, *, wait: bool = True) -> None:
        """Commit the given next-offsets, or else everything polled so far. `wait=False`
        returns at once and the offsets become durable with the log's next write (Kafka: an
        asynchronous commit): for a consumer whose effects are idempotent, so a crash before
        then only redelivers what it already did; it then polls on without waiting a commit."""

    def close(self) -> None: ...


class EventBus(Protocol):
    def publish(self, topic: str, message: Message) -> Record: ...

    def publish_many(self, messages: list[tuple[str, Message]]) -> list[Record]:
        """Append several records at once (one commit, or one pipelined round of sends);
        returns once every one is acknowledged. Each key's records keep their order."""
        ...

    def consumer(
        self,
        group: str,
        *,
        topics: Optional[list[str]] = None,
        pattern: Optional[str] = None,
        from_beginning: bool = True,
        instance_id: Optional[str] = None,
    ) -> Consumer:
        """`instance_id`: a stable identity (static membership); a new consumer with the
        id of an earlier one replaces it in the group at once."""
        ...

    def close(self) -> None: ...


class EventPublisher:
    """Typed events in, encoded records out."""

    def __init__(self, bus: EventBus, codec: Codec) -> None:
        self.bus = bus
        self.codec = codec

    def publish(self, topic: str, event: Event, dedup: Optional[Dedup] = None) -> Record:
        return self.bus.publish(topic, self.codec.encode(event, dedup))

    def publish_many(self, events: list[tuple[str, Event, Optional[Dedup]]]) -> list[Record]:
        """(topic, event, dedup) each; one append for all (see `EventBus.publish_many`)."""
        if not events:
            return []
        return self.bus.publish_many([(topic, self.codec.encode(event, dedup)) for topic, event, dedup in events])
