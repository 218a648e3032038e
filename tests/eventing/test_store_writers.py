"""One SQLite store, several writing threads (the gateway's writer, the projector): they take
turns on the store's own lock, never on SQLite's busy wait, which sleeps and retries."""

from __future__ import annotations

import threading

from sqlalchemy import event as sa_event

from eventing.blobs import BlobStore
from eventing.codec import Codec
from eventing.store import database
from eventing.store.event_store import EventStore
from tests.eventing.test_appender import created


def test_writers_in_one_process_never_meet_sqlites_busy_wait(tmp_path):
    engine = database.make_engine(f"sqlite:///{tmp_path / 'events.db'}")
    database.upgrade(engine)

    @sa_event.listens_for(engine, "connect")
    def _no_busy_wait(dbapi_connection, _record):
        # With no busy wait a writer that meets another's open write fails at once
        # ("database is locked"), so any collision shows as an error.
        dbapi_connection.execute("PRAGMA busy_timeout=0")

    engine.dispose()  # the connections made so far predate the listener
    store = EventStore(engine, Codec(BlobStore(tmp_path / "blobs")))
    errors: list[BaseException] = []

    def gateway_writer() -> None:
        try:
            for n in range(150):
                batch = [(created(f"g{n}-{i}"), "openrl.alice.control", None) for i in range(3)]
                outcomes = store.append_many(batch)
                store.mark_published_many([event.id for event, _t, _d in batch])
                errors.extend(outcome for outcome in outcomes if isinstance(outcome, BaseException))
        except BaseException as exc:
            errors.append(exc)

    def projector() -> None:
        try:
            for n in range(150):
                store.append_batch([(created(f"p{n}-{i}"), None) for i in range(3)])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=gateway_writer), threading.Thread(target=projector)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT COUNT(*) FROM events").scalar() == 2 * 150 * 3
        assert conn.exec_driver_sql("SELECT COUNT(*) FROM outbox").scalar() == 0
    engine.dispose()
