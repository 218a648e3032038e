"""Which offsets a consumer may commit when it finishes records out of order.

A worker that holds a record (the trainer waiting for a seq_id gap to fill) must not
commit past it, or a crash would lose it: the committed offset of a partition is the
lowest offset still held, or the next unread one when nothing is held.
"""

from __future__ import annotations

from typing import Iterable

from eventing.bus import Record, TopicPartition


class OffsetTracker:
    def __init__(self) -> None:
        self._next: dict[TopicPartition, int] = {}
        self._held: dict[TopicPartition, set[int]] = {}

    def polled(self, record: Record) -> None:
        tp = (record.topic, record.partition)
        self._next[tp] = max(self._next.get(tp, 0), record.offset + 1)

    def hold(self, record: Record) -> None:
        self._held.setdefault((record.topic, record.partition), set()).add(record.offset)

    def release(self, topic: str, partition: int, offset: int) -> None:
        held = self._held.get((topic, partition))
        if held is not None:
            held.discard(offset)

    def committable(self, also_needed: Iterable[tuple[str, int, int]] = ()) -> dict[TopicPartition, int]:
        """Next offsets safe to commit; `also_needed` are records kept for other reasons
        (the trainer's recovery anchors) that a restart must see again."""
        lowest = {tp: min(held) for tp, held in self._held.items() if held}
        for topic, partition, offset in also_needed:
            tp = (topic, partition)
            lowest[tp] = min(offset, lowest.get(tp, offset))
        return {tp: min(lowest.get(tp, position), position) for tp, position in self._next.items()}
