"""The embedded event log: an append-only, partitioned, durable log in one SQLite file.

It is the one-machine stand-in for Kafka and keeps the semantics the rest of OpenRL relies
on (see `eventing/bus.py`): ordered per key, consumer groups with committed offsets,
redelivery of everything uncommitted after a restart. Records and offsets live in SQLite
(WAL, and `synchronous=FULL` unless told otherwise, so an acknowledged append survives a
crash of the process). Group membership lives in this process: the embedded deployment is
one process; a second process may read the log but not join its groups.

Writes are group-committed: appends and offset commits from every thread queue up, and one
of the waiting threads writes the whole queue in one transaction (one fsync) while the others
wait for it. Nobody returns before its write is durable, so the promise above holds; under
load the transactions, the fsyncs and the lock hold times are shared instead of paid per
write, and a lone writer still commits at once (no linger). Records become visible to
consumers only once committed, with offsets assigned in commit order.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
import zlib
from pathlib import Path
from typing import Optional

from eventing.bus import Record, TopicPartition
from eventing.codec import Message
from eventing.group_commit import GroupCommit

_SCHEMA = """
CREATE TABLE IF NOT EXISTS topics (name TEXT PRIMARY KEY, partitions INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    topic TEXT NOT NULL, partition INTEGER NOT NULL, offset INTEGER NOT NULL,
    key BLOB, headers TEXT NOT NULL, value BLOB NOT NULL, ts REAL NOT NULL,
    PRIMARY KEY (topic, partition, offset)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS commits (
    grp TEXT NOT NULL, topic TEXT NOT NULL, partition INTEGER NOT NULL, next_offset INTEGER NOT NULL,
    PRIMARY KEY (grp, topic, partition)
) WITHOUT ROWID;
"""
# A poll that finds nothing sleeps on a condition that appends in this process signal; the
# cap makes appends by another process visible too, with at most this much delay.
_MAX_IDLE_WAIT = 0.5
# The newest records this process appended, kept as the Records it made: a consumer that
# keeps up (the embedded deployment's workers and projector read what was appended
# milliseconds ago) gets them without reading and parsing them back from SQLite, and with
# the message still holding the event it was encoded from (`Message.decoded`). Older
# records, and any appended by another process, are read from the file as before. Bounded
# by count and by payload bytes (a claim-checked payload counted at its full size, which its
# decoded event holds), so large training requests cannot make it hold much memory.
_TAIL_RECORDS = 1024
_TAIL_BYTES = 32 * 1024 * 1024


def partition_for(key: Optional[bytes], partitions: int, counter: int) -> int:
    """Same key, same partition (crc32 is stable across processes, unlike hash())."""
    if key is None:
        return counter % partitions
    return zlib.crc32(key) % partitions


class _Write:
    """One queued write: an append (topic, message) or a group's offsets."""

    __slots__ = ("topic", "message", "offsets")

    def __init__(self, topic=None, message=None, offsets=None) -> None:
        self.topic, self.message, self.offsets = topic, message, offsets


def _connect(path: Path, fsync: bool) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
    conn.execute("PRAGMA busy_timeout=5000")
    return conn


class EmbeddedLog:
    def __init__(self, path: Path, partitions: int = 4, fsync: bool = True) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # Two connections: consumers read through `_conn` (under `_lock`) while a group commit
        # writes through `_writer` (under the group commit's write lock only); WAL lets the reads go on.
        self._conn = _connect(path, fsync)
        self._conn.executescript(_SCHEMA)
        self._writer = _connect(path, fsync)
        self._group: GroupCommit[_Write, Optional[Record]] = GroupCommit(self._write_batch)
        self._lock = threading.RLock()
        self._appended = threading.Condition(self._lock)
        self._default_partitions = partitions
        self._topics: dict[str, int] = dict(self._conn.execute("SELECT name, partitions FROM topics").fetchall())
        self._next: dict[TopicPartition, int] = {
            (t, p): int(o) + 1
            for t, p, o in self._conn.execute(
                "SELECT topic, partition, MAX(offset) FROM records GROUP BY topic, partition"
            )
        }
        self._groups: dict[str, _Group] = {}
        # (topic, partition, offset) -> Record, oldest first (insertion order), committed ones only.
        self._tail: dict[tuple[str, int, int], Record] = {}
        self._tail_bytes = 0
        self._unkeyed = 0
        self._closed = False

    # -- producing ------------------------------------------------------------------------

    def publish(self, topic: str, message: Message) -> Record:
        """Append; returns once the record is durable (and visible to consumers)."""
        return self._group.submit(_Write(topic=topic, message=message))  # type: ignore[return-value]

    def publish_many(self, messages: list[tuple[str, Message]]) -> list[Record]:
        """Append several records in one group commit; returns once all are durable."""
        return self._group.submit_many([_Write(topic=topic, message=message) for topic, message in messages])  # type: ignore[return-value]

    def _write_batch(self, batch: list[_Write]) -> list:
        """One transaction for the batch (see `GroupCommit`: only the thread holding its
        write lock gets here). Offsets come from the committed ends, and the in-memory ends
        move only after the commit succeeded. Outcomes: the Record of each append, None for
        offsets, or the exception of a write that failed alone."""
        with self._lock:
            if self._closed:
                return [sqlite3.ProgrammingError("the log is closed")] * len(batch)
            known = dict(self._topics)
        ends: dict[TopicPartition, int] = {}
        new_topics, rows, outcomes = [], [], []
        now = time.time()
        for write in batch:
            if write.message is None or write.topic is None:  # a group's offsets (an append has both)
                outcomes.append(None)
                continue
            if write.topic not in known:
                known[write.topic] = self._default_partitions
                new_topics.append(write.topic)
            self._unkeyed += 1
            tp = (write.topic, partition_for(write.message.key, known[write.topic], self._unkeyed))
            offset = ends.get(tp, self._next.get(tp, 0))
            ends[tp] = offset + 1
            headers = json.dumps({k: v.decode("latin-1") for k, v in write.message.headers.items()})
            rows.append((tp[0], tp[1], offset, write.message.key, headers, write.message.value, now))
            outcomes.append(Record(tp[0], tp[1], offset, write.message, now))
        offsets = [row for write in batch if write.offsets is not None for row in write.offsets]
        try:
            self._writer.execute("BEGIN IMMEDIATE")
            try:
                self._writer.executemany(
                    "INSERT OR IGNORE INTO topics VALUES (?, ?)", [(t, known[t]) for t in new_topics]
                )
                self._writer.executemany(
                    "INSERT INTO records (topic, partition, offset, key, headers, value, ts) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    rows,
                )
                self._writer.executemany(
                    "INSERT INTO commits (grp, topic, partition, next_offset) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (grp, topic, partition) DO UPDATE SET next_offset = excluded.next_offset",
                    offsets,
                )
                self._writer.execute("COMMIT")
            except BaseException:
                if self._writer.in_transaction:
                    self._writer.execute("ROLLBACK")
                raise
        except Exception as exc:  # nothing of the batch was written
            if len(batch) > 1:  # one bad write must not fail its neighbours: each alone
                return [self._write_batch([write])[0] for write in batch]
            return [exc]
        with self._lock:
            for topic in new_topics:
                self._topics[topic] = known[topic]
                for group in self._groups.values():
                    group.generation += 1  # pattern subscribers must pick the new topic up
            self._next.update(ends)
            tail = self._tail
            for record in outcomes:
                if record is not None:
                    tail[(record.topic, record.partition, record.offset)] = record
                    self._tail_bytes += record.message.payload_bytes()
            while tail and (len(tail) > _TAIL_RECORDS or self._tail_bytes > _TAIL_BYTES):
                self._tail_bytes -= tail.pop(next(iter(tail))).message.payload_bytes()
            self._appended.notify_all()
        return outcomes

    # -- consuming ------------------------------------------------------------------------

    def consumer(
        self,
        group: str,
        *,
        topics: Optional[list[str]] = None,
        pattern: Optional[str] = None,
        from_beginning: bool = True,
        instance_id: Optional[str] = None,
    ) -> "EmbeddedConsumer":
        if (topics is None) == (pattern is None):
            raise ValueError("subscribe to a list of topics or to a pattern, not both")
        with self._lock:
            consumer = EmbeddedConsumer(self, group, topics, pattern, from_beginning, instance_id)
            self._groups.setdefault(group, _Group()).join(consumer)
            return consumer

    def end_offsets(self, topic: str) -> dict[int, int]:
        with self._lock:
            return {p: self._next.get((topic, p), 0) for p in range(self._topics.get(topic, 0))}

    def topics(self) -> dict[str, int]:
        with self._lock:
            return dict(self._topics)

    def close(self) -> None:
        self._group.flush()  # offsets committed without waiting
        with self._group.writing(), self._lock:  # not in the middle of a group commit
            self._closed = True
            self._appended.notify_all()
            self._conn.close()
            self._writer.close()

    def _leave(self, consumer: "EmbeddedConsumer") -> None:
        with self._lock:
            group = self._groups.get(consumer.group)
            if group is not None:
                group.leave(consumer)


class _Group:
    def __init__(self) -> None:
        self.members: list[EmbeddedConsumer] = []
        self.generation = 0

    def join(self, consumer: "EmbeddedConsumer") -> None:
        if consumer.instance_id is not None:
            for replaced in [m for m in self.members if m.instance_id == consumer.instance_id]:
                replaced._closed = True  # fenced, as Kafka fences a static member's predecessor
                self.members.remove(replaced)
        self.members.append(consumer)
        self.generation += 1

    def leave(self, consumer: "EmbeddedConsumer") -> None:
        if consumer in self.members:
            self.members.remove(consumer)
            self.generation += 1


class EmbeddedConsumer:
    def __init__(self, log: EmbeddedLog, group: str, topics, pattern, from_beginning: bool, instance_id=None) -> None:
        self._log = log
        self.group = group
        self.instance_id = instance_id
        self._topics = set(topics or [])
        self._pattern = re.compile(pattern) if pattern else None
        self._from_beginning = from_beginning
        self._generation = -1
        self._positions: dict[TopicPartition, int] = {}
        self._closed = False

    def assignment(self) -> list[TopicPartition]:
        with self._log._lock:
            self._sync()
            return sorted(self._positions)

    def poll(self, max_records: int = 100, timeout: float = 1.0) -> list[Record]:
        deadline = time.monotonic() + timeout
        with self._log._lock:
            while not self._closed and not self._log._closed:
                self._sync()
                records = self._fetch(max_records)
                if records:
                    return records
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._log._appended.wait(min(remaining, _MAX_IDLE_WAIT))
        return []

    def commit(self, offsets: Optional[dict[TopicPartition, int]] = None, *, wait: bool = True) -> None:
        """Store the group's offsets; returns once they are durable (group-committed), or at
        once with `wait=False`, leaving them to the log's next write (or its close)."""
        with self._log._lock:
            if self._closed:
                return
            chosen = dict(self._positions) if offsets is None else offsets
        write = _Write(offsets=[(self.group, t, p, o) for (t, p), o in chosen.items()])
        if wait:
            self._log._group.submit(write)
        else:
            self._log._group.enqueue(write)

    def committed(self) -> dict[TopicPartition, int]:
        with self._log._lock:
            rows = self._log._conn.execute(
                "SELECT topic, partition, next_offset FROM commits WHERE grp = ?", (self.group,)
            )
            return {(t, p): o for t, p, o in rows}

    def close(self) -> None:
        with self._log._lock:
            self._closed = True
            self._log._leave(self)
            self._log._appended.notify_all()

    def _matches(self, topic: str) -> bool:
        return topic in self._topics or bool(self._pattern and self._pattern.match(topic))

    def _sync(self) -> None:
        """Recompute this member's partitions after any join, leave or new topic."""
        group = self._log._groups[self.group]
        if group.generation == self._generation:
            return
        self._generation = group.generation
        everything = sorted(
            (topic, p) for topic, n in self._log._topics.items() if self._matches(topic) for p in range(n)
        )
        index = group.members.index(self)
        mine = [tp for i, tp in enumerate(everything) if i % len(group.members) == index]
        committed = self.committed()
        # A partition this member already had keeps its position (like Kafka's cooperative
        # sticky assignment): a new topic elsewhere must not hand a worker again everything it
        # polled but holds uncommitted (a trainer holds a model's offsets while it waits for
        # an earlier seq_id), which it would answer twice. A partition that comes from another
        # member starts at the group's committed offset, so what that member polled but did
        # not commit is delivered again (at-least-once).
        held = self._positions
        self._positions = {
            tp: held[tp] if tp in held else committed.get(tp, 0 if self._from_beginning else self._log._next.get(tp, 0))
            for tp in mine
        }

    def _fetch(self, max_records: int) -> list[Record]:
        records: list[Record] = []
        tail = self._log._tail
        for (topic, partition), position in sorted(self._positions.items()):
            end = self._log._next.get((topic, partition), 0)
            if end <= position:
                continue
            # From memory while the records are still there (they are in order from `position`
            # on, since the tail drops the oldest first); the file for the rest.
            while position < end and len(records) < max_records and (cached := tail.get((topic, partition, position))):
                records.append(cached)
                position += 1
            self._positions[(topic, partition)] = position
            if len(records) >= max_records:
                break
            if position >= end:
                continue
            rows = self._log._conn.execute(
                "SELECT offset, key, headers, value, ts FROM records "
                "WHERE topic = ? AND partition = ? AND offset >= ? ORDER BY offset LIMIT ?",
                (topic, partition, position, max_records - len(records)),
            ).fetchall()
            for offset, key, headers, value, ts in rows:
                message = Message(
                    headers={k: v.encode("latin-1") for k, v in json.loads(headers).items()}, key=key, value=value
                )
                records.append(Record(topic, partition, offset, message, ts))
                self._positions[(topic, partition)] = offset + 1
            if len(records) >= max_records:
                break
        return records
