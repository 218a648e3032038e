"""The Kafka backend of the EventBus: the contract of `eventing/bus.py` on any Kafka-protocol broker.

A record is acknowledged only once the broker has it (acks=all), in the partition that
kafka-python's default partitioner (murmur2 of the key) picks, so one key's records stay
in order; CloudEvents travel in binary mode, their `ce_*` attributes as Kafka headers.
Offsets are committed only when the caller says so (never automatically), because a
consumer commits after its effect is durable; whatever was polled but not committed is
delivered again after a rebalance or a restart (at-least-once).

A broker that restarts and loses the idempotent producer's state fails the batches in flight
(OutOfOrderSequenceNumber, UnknownProducerId); the producer renews its id and `publish_many`
sends those records again. They may then land after later records of their key, which the
consumers tolerate as they do redelivery: requests apply in seq order (`SeqGate`), a
request's first completion wins.

Topics are created (with `partitions` partitions) by the first publish to them or the
first subscription that names them, never with a broker's default count.

Differences from the embedded log that callers may notice, all of them Kafka's own:
- a member takes part in its group from its first `poll`, and gets partitions (and, when
  `from_beginning=False`, its starting offsets) only once the group has formed; the
  consumer's `assignment()` blocks until that is settled for what it returns;
- a member that stops polling for `max_poll_interval_ms` is removed from its group.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

# The `pyright: ignore`s in this module: pyright's bundled kafka-python stubs describe 2.3,
# and these names and arguments are 3.0's (the version constraints.txt pins).
from kafka.admin import OffsetSpec  # pyright: ignore[reportAttributeAccessIssue]
from kafka.errors import (
    InvalidProducerEpochError,
    OutOfOrderSequenceNumberError,
    TopicAlreadyExistsError,
    UnknownProducerIdError,
)
from kafka.structs import (
    MemberState,  # pyright: ignore[reportAttributeAccessIssue]
    OffsetAndMetadata,
    TopicPartition,
)
from kafka.version import __version__ as kafka_version

from eventing.bus import Record
from eventing.bus import TopicPartition as TP
from eventing.codec import Message

log = logging.getLogger(__name__)
# What the idempotent producer recovers from by renewing its producer id or epoch (a broker that
# restarted and lost its producer state, KIP-360): the batches in flight at that moment fail and
# are not written, so they are sent again. A record the broker did write and acknowledged is
# never resent; one sent again after all would be a duplicate the consumers drop (by event id).
PRODUCER_STATE_ERRORS = (OutOfOrderSequenceNumberError, UnknownProducerIdError, InvalidProducerEpochError)
PRODUCER_STATE_RETRIES = 3


class KafkaBus:
    def __init__(
        self,
        bootstrap_servers: str,
        *,
        client_id: str = "openrl",
        session_timeout_ms: int = 6000,
        heartbeat_interval_ms: int = 1000,
        max_poll_interval_ms: int = 300_000,
        metadata_max_age_ms: int = 500,
        partitions: int = 4,
        replication_factor: int = 1,
        request_timeout_ms: int = 30_000,
        publish_timeout: float = 30.0,
        fetch_max_wait_ms: int = 500,
        idle_poll_pause_ms: int = 0,
    ) -> None:
        self._partitions = partitions
        self._idle_poll_pause = idle_poll_pause_ms / 1000
        self._replication = replication_factor
        self._publish_timeout = publish_timeout
        self._session_timeout_ms = session_timeout_ms
        self._consumer_config: dict[str, Any] = dict(
            bootstrap_servers=bootstrap_servers,
            client_id=client_id,
            # Kafka's default broker floor (group.min.session.timeout.ms) is 6 s; Tansu
            # also waits half the session timeout for members before it forms a group.
            session_timeout_ms=session_timeout_ms,
            heartbeat_interval_ms=heartbeat_interval_ms,
            max_poll_interval_ms=max_poll_interval_ms,
            # A pattern subscription sees a new topic only when metadata is refreshed,
            # so a new tenant's topic is picked up within about this long.
            metadata_max_age_ms=metadata_max_age_ms,
            request_timeout_ms=request_timeout_ms,
            # Apache Kafka answers a fetch as soon as a record arrives, so this only bounds
            # an idle fetch; a broker that holds every fetch for the full wait (Tansu does)
            # adds up to this much latency to each event, so such a deployment lowers it.
            fetch_max_wait_ms=fetch_max_wait_ms,
            # Offsets are committed by the caller after its effect is durable.
            enable_auto_commit=False,
            # Topics are created explicitly with the configured partition count (but see
            # `consumer`: kafka-python 3.0.12 does not honour this setting).
            allow_auto_create_topics=False,
            # Nothing reads kafka-python's own sensors (OpenRL's metrics come from events),
            # and recording them cost about a twentieth of the server's Python per future.
            metrics_enabled=False,
        )
        self._producer = KafkaProducer(
            bootstrap_servers=bootstrap_servers,
            client_id=client_id,
            acks="all",
            # Idempotence keeps retried batches from being duplicated or reordered, which
            # is what per-key order needs once retries are on.
            enable_idempotence=True,
            linger_ms=0,
            allow_auto_create_topics=False,
            metadata_max_age_ms=metadata_max_age_ms,
            request_timeout_ms=request_timeout_ms,
            max_block_ms=int(publish_timeout * 1000),
            delivery_timeout_ms=max(int(publish_timeout * 1000), request_timeout_ms + 1),
            metrics_enabled=False,
        )
        self._admin = KafkaAdminClient(
            bootstrap_servers=bootstrap_servers, client_id=client_id, request_timeout_ms=request_timeout_ms
        )
        self._lock = threading.Lock()
        self._created: set[str] = set()
        self._consumers: list[KafkaBusConsumer] = []
        self._closed = False

    # -- producing ------------------------------------------------------------------------

    def publish(self, topic: str, message: Message) -> Record:
        return self.publish_many([(topic, message)])[0]

    def publish_many(self, messages: list[tuple[str, Message]]) -> list[Record]:
        """Every send first, then every acknowledgement: the producer batches what is
        queued together, so many records cost about one round trip to the broker. Each
        key's records stay in order (idempotent producer, one partition per key)."""
        for topic in {topic for topic, _message in messages}:
            self._ensure_topic(topic)
        records: list[Optional[Record]] = [None] * len(messages)
        pending = list(range(len(messages)))
        for attempt in range(PRODUCER_STATE_RETRIES + 1):
            futures = [(i, self._send(*messages[i])) for i in pending]
            pending = []
            for i, future in futures:
                topic, message = messages[i]
                try:
                    metadata = future.get(timeout=self._publish_timeout)
                except PRODUCER_STATE_ERRORS as error:
                    if attempt == PRODUCER_STATE_RETRIES:
                        raise
                    pending.append(i)
                    log.warning("kafka: %s to %s failed with %s; the producer has renewed its id, sending again",
                                message.key, topic, type(error).__name__)  # fmt: skip
                    continue
                # The broker's LogAppendTime if it sets one, else the CreateTime the producer stamped.
                records[i] = Record(topic, metadata.partition, metadata.offset, message, _seconds(metadata.timestamp))
            if not pending:
                break
        return [record for record in records if record is not None]

    def _send(self, topic: str, message: Message):
        return self._producer.send(topic, key=message.key, value=message.value, headers=list(message.headers.items()))

    def _ensure_topic(self, topic: str) -> None:
        """Create the topic before its first record, so that record already goes to the
        partition its key will always map to (auto-creation would use the broker's
        default partition count, and a later increase would move keys)."""
        if topic in self._created:
            return
        with self._lock:
            if topic in self._created:
                return
            try:
                self._admin.create_topics(
                    {topic: {"num_partitions": self._partitions, "replication_factor": self._replication}},
                    wait_for_metadata=True,  # pyright: ignore[reportCallIssue] (3.0's; the stubs are 2.3's)
                )
            except TopicAlreadyExistsError:
                pass  # another process (or this one, before a restart) created it
            self._created.add(topic)

    # -- consuming ------------------------------------------------------------------------

    def consumer(
        self,
        group: str,
        *,
        topics: Optional[list[str]] = None,
        pattern: Optional[str] = None,
        from_beginning: bool = True,
        instance_id: Optional[str] = None,
    ) -> "KafkaBusConsumer":
        if (topics is None) == (pattern is None):
            raise ValueError("subscribe to a list of topics or to a pattern, not both")
        # Asking for a topic's metadata creates it with the broker's default partition
        # count (noida-db: 1): kafka-python 3.0.12 never passes allow_auto_create_topics on
        # to its metadata requests. So a subscription creates its topics first, as publish
        # does. (A pattern asks for every topic's metadata, which creates none.)
        for topic in topics or []:
            self._ensure_topic(topic)
        consumer = KafkaConsumer(
            group_id=group,
            auto_offset_reset="earliest" if from_beginning else "latest",
            # Static membership: a replacement with the same instance id (a restarted pod)
            # takes its predecessor's partitions at once, without waiting for the dead
            # member to be noticed (noida-db never evicts a dead dynamic member).
            group_instance_id=instance_id,
            **self._consumer_config,
        )
        _keep_finished_joins(consumer)
        if topics is not None:
            consumer.subscribe(topics=list(topics))
        else:
            consumer.subscribe(pattern=pattern)
        wrapped = KafkaBusConsumer(
            self, consumer, group, close_timeout_ms=self._session_timeout_ms, idle_pause=self._idle_poll_pause
        )
        with self._lock:
            self._consumers.append(wrapped)
        return wrapped

    # -- inspecting -----------------------------------------------------------------------

    def topics(self) -> dict[str, int]:
        """Every non-internal topic and its partition count."""
        described = self._admin.describe_topics()
        return {
            t["name"]: len(t["partitions"])
            for t in described
            if not t.get("is_internal") and not t["name"].startswith("__")
        }

    def end_offsets(self, topic: str) -> dict[int, int]:
        """Per partition, the offset the next record will get ({} for an unknown topic)."""
        count = self.topics().get(topic, 0)
        if count == 0:
            return {}
        specs = {TopicPartition(topic, p): OffsetSpec.LATEST for p in range(count)}
        found = self._admin.list_partition_offsets(specs)  # pyright: ignore[reportAttributeAccessIssue] (3.0's)
        return {tp.partition: int(o.offset) for tp, o in found.items()}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            consumers, self._consumers = self._consumers, []
        for consumer in consumers:
            consumer.close()
        self._producer.close()
        self._admin.close()

    def _forget(self, consumer: "KafkaBusConsumer") -> None:
        with self._lock:
            if consumer in self._consumers:
                self._consumers.remove(consumer)


class KafkaBusConsumer:
    """One member of a consumer group; like KafkaConsumer, use it from one thread."""

    def __init__(
        self, bus: KafkaBus, consumer: KafkaConsumer, group: str, close_timeout_ms: int, idle_pause: float = 0.0
    ) -> None:
        self._bus = bus
        self._consumer = consumer
        self.group = group
        self._close_timeout_ms = close_timeout_ms
        self._idle_pause = idle_pause
        self._closed = False

    def poll(self, max_records: int = 100, timeout: float = 1.0) -> list[Record]:
        if self._closed:
            return []
        if self._idle_pause > 0:
            batches = self._poll_pausing(max_records, timeout)
        else:
            batches = self._consumer.poll(timeout_ms=max(0, int(timeout * 1000)), max_records=max_records)
        records: list[Record] = []
        for tp, batch in batches.items():
            for r in batch:
                headers = {name: value if value is not None else b"" for name, value in (r.headers or [])}
                message = Message(headers=headers, key=r.key, value=r.value if r.value is not None else b"")
                records.append(Record(tp.topic, tp.partition, r.offset, message, _seconds(r.timestamp)))
        return records

    def _poll_pausing(self, max_records: int, timeout: float) -> dict:
        """For a broker that answers an empty fetch at once instead of holding it for
        fetch_max_wait_ms (noida-db does): kafka-python's poll then sends the next fetch at
        once, and an idle consumer spins a core until its timeout. Here each round polls for
        1 ms and pauses between rounds that found nothing, so a record waits at most about
        one pause longer than it would with Kafka. (A round of 0 ms gave the group protocol
        no time: a join started by a new pattern-matched topic never completed.)"""
        deadline = time.monotonic() + timeout
        while True:
            batches = self._consumer.poll(timeout_ms=1, max_records=max_records)
            remaining = deadline - time.monotonic()
            if batches or remaining <= 0 or self._closed:
                return batches
            time.sleep(min(self._idle_pause, remaining))

    def commit(self, offsets: Optional[dict[TP, int]] = None, *, wait: bool = True) -> None:
        """Commit the given next-offsets, or else everything polled so far (`wait=False`:
        kafka-python's asynchronous commit, which a later one supersedes).

        A commit made while the group rebalances fails (kafka.errors.CommitFailedError);
        the records are then delivered again, to this member or another one."""
        if self._closed:
            return
        chosen = (
            None
            if offsets is None
            else {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()}
        )
        if wait:
            self._consumer.commit(chosen)  # None: the positions after the last record poll returned
        else:
            self._consumer.commit_async(chosen)

    def committed(self) -> dict[TP, int]:
        """The group's committed next-offsets for the partitions this member holds."""
        found = {}
        for tp in self._consumer.assignment():
            offset = self._consumer.committed(tp)
            if offset is not None:
                found[(tp.topic, tp.partition)] = offset
        return found

    def assignment(self) -> list[TP]:
        """The partitions this member holds now, with their starting positions resolved."""
        assigned = sorted(self._consumer.assignment())
        for tp in assigned:
            self._consumer.position(tp)  # resolves committed / earliest / latest now
        return [(tp.topic, tp.partition) for tp in assigned]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # Leaving the group at once hands the partitions over without waiting for
            # the session to time out; nothing is committed on the way out. Waiting for
            # the LeaveGroup answer longer than a session is pointless: by then the
            # broker has dropped the member anyway.
            self._consumer.close(autocommit=False, timeout_ms=self._close_timeout_ms)
        finally:
            self._bus._forget(self)


def _seconds(timestamp_ms: Optional[int]) -> float:
    """A Kafka timestamp in seconds; -1 (none recorded, old message formats) becomes now."""
    return timestamp_ms / 1000 if timestamp_ms is not None and timestamp_ms >= 0 else time.time()


def _keep_finished_joins(consumer: KafkaConsumer) -> None:
    """Finish group joins the way the Java client does (kafka-python 3.0 loses some).

    A poll whose timeout ends during JoinGroup/SyncGroup leaves that round running, and
    kafka-python 3.0.12 then goes wrong in two ways. (1) When the round finishes before
    the next poll, that poll finds it done, drops the assignment it brought and sends a
    new JoinGroup, which makes every other member rejoin too: two members that poll in
    turn rebalance for ever. (2) A round started because the subscribed topics changed
    (a pattern matched a new topic) is not "needed" any more once sent, so no later poll
    waits for it and the member never takes its assignment. This is the Java client's
    rule: a join is needed while one is pending, and a finished one is completed with
    its result, exactly as kafka-python completes a round it awaited itself.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is None or not kafka_version.startswith("3.0.") or not hasattr(coordinator, "_join_task"):
        return
    join, needed = coordinator.join_group_async, coordinator.need_rejoin

    def need_rejoin():
        return needed() or coordinator._join_task is not None

    async def join_group_async(timeout_ms=None):
        finished = coordinator._join_task
        if finished is not None and finished.succeeded():
            coordinator._join_task = None
            with coordinator._lock:
                coordinator.rejoining = False
                coordinator.rejoin_needed = False
                coordinator.state = MemberState.STABLE
                coordinator._enable_heartbeat()
            generation = coordinator._generation
            await coordinator._on_join_complete_async(
                generation.generation_id, generation.member_id, generation.protocol, finished.value
            )
        return await join(timeout_ms=timeout_ms)

    coordinator.need_rejoin = need_rejoin
    coordinator.join_group_async = join_group_async
