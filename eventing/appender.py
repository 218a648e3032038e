"""The appender: a process's own events onto the record, store first, then the log.

`append(event, topic, dedup)` stores the event (with its dedup row, its projection change
and an outbox row) and then publishes it, returning once the log has acknowledged it. It is
group-committed (`eventing.group_commit`): every event queued meanwhile, from any thread,
shares one store transaction, one log append and one outbox clean-up, so concurrent
requests cost about one fsync together instead of one each.

The order of the promises is the outbox's: an event is in the store before it is on the
log, and its outbox row goes only after the log has it. If publishing fails (the broker is
away) or the process dies in between, the event waits in the outbox; a retried submission
(answered as a duplicate) or the outbox relay publishes it later.

A published batch's outbox rows are deleted by the next batch's store transaction when one
is already queued (under load there always is), instead of in a transaction of their own:
on PostgreSQL that clean-up was a round trip and a WAL flush on the writer's path, about a
sixth of its time per batch (bench/futures_throughput.py, one process per role). Rows not
yet deleted are never published again by this process: the relay, a retry's republish and
`close` delete them first. A crash before they are deleted republishes them at the next
start, as a crash between publish and clean-up always could (consumers skip an event id
they hold).
"""

from __future__ import annotations

import asyncio
from typing import Optional

from eventing.bus import EventPublisher
from eventing.dedup import Dedup
from eventing.group_commit import GroupCommit
from eventing.store.event_store import Appended, EventStore
from openrl_core.events import Event


class Appender:
    def __init__(self, store: EventStore, publisher: EventPublisher) -> None:
        self.store = store
        self.publisher = publisher
        self._group: GroupCommit[tuple[Event, str, Optional[Dedup]], Appended] = GroupCommit(self._write_batch)
        # On the log, their outbox rows not yet deleted (module docstring); the writer's own.
        self._published: list[str] = []

    def append(self, event: Event, topic: str, dedup: Optional[Dedup] = None) -> Appended:
        """Store and publish `event` (see the module docstring); raises the store's Conflict
        for a seq_id reused with another body, or the log's error when it cannot publish."""
        return self._group.submit((event, topic, dedup))

    def append_later(
        self, event: Event, topic: str, dedup: Optional[Dedup], loop: asyncio.AbstractEventLoop
    ) -> "asyncio.Future[Appended]":
        """`append` for a caller on an event loop: returns at once; the future (of `loop`)
        settles as `append` would return or raise, once the group's writer thread wrote it."""
        return self._group.submit_later((event, topic, dedup), loop)

    def close(self) -> None:
        self._group.close()
        with self._group.writing():
            self._delete_published()

    def republish_outbox(self) -> int:
        """Publish what the store holds but the log never acknowledged; returns how many.
        Not while a batch is being written: that batch's rows are in the outbox between its
        store commit and its own publish, and taking them too would put them on the log twice."""
        with self._group.writing():
            return self._republish()

    def _delete_published(self) -> None:
        published, self._published = self._published, []
        try:
            self.store.mark_published_many(published)
        except BaseException:
            self._published = published + self._published
            raise

    def _republish(self) -> int:
        self._delete_published()  # or they would be read below as never published
        pending = self.store.unpublished()
        if pending:
            self.publisher.publish_many([(topic, event, dedup) for event, topic, dedup in pending])
            self.store.mark_published_many([event.id for event, _topic, _dedup in pending])
        return len(pending)

    def _write_batch(self, items: list[tuple[Event, str, Optional[Dedup]]]) -> list:
        published, self._published = self._published, []
        try:
            outcomes = self.store.append_many(items, published=published)
        except BaseException:
            self._published = published + self._published  # still to delete
            raise
        fresh = [i for i, outcome in enumerate(outcomes) if isinstance(outcome, Appended) and outcome.stored]
        if fresh:
            try:
                self.publisher.publish_many([(items[i][1], items[i][0], items[i][2]) for i in fresh])
            except Exception as exc:  # stored, not published: the outbox keeps them
                for i in fresh:
                    outcomes[i] = exc
                return outcomes
            ids = [items[i][0].id for i in fresh]
            if self._group.queued():  # the next batch's transaction deletes their rows
                self._published += ids
            else:
                self.store.mark_published_many(ids)
        if any(isinstance(outcome, Appended) and outcome.duplicate_of is not None for outcome in outcomes):
            # A retry: its first attempt may have been stored and then failed to publish
            # (broker down). Finish that now rather than leave its future hanging.
            self._republish()
        return outcomes
