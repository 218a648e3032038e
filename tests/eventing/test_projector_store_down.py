"""The projector while PostgreSQL is away: a batch the store could not take is stored once the
database is back, never skipped (regression: the consumer had already moved past the failed
batch, so the next batch's commit recorded it as done and its futures stayed pending).

PostgreSQL is the real local server, reached through a TCP proxy the test cuts (the server
itself is shared with other tests)."""

from __future__ import annotations

import pytest

from eventing import topics
from eventing.blobs import BlobStore
from eventing.codec import Codec
from eventing.embedded_log import EmbeddedLog
from eventing.notify import LocalNotifier
from eventing.projector import Projector
from eventing.store import database
from eventing.store.event_store import EventStore
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.events.lifecycle import RequestCompleted
from tests.eventing.tcp_proxy import TcpProxy

pytestmark = pytest.mark.postgres


def completion(request_id: str):
    payload = RequestCompleted(request_id=request_id, result={"metrics": {}})
    return new_event(
        te.OPTIM_STEP["completed"], payload, tenant="alice", source="/test-worker", key="m", subject=request_id
    )


def stored_ids(engine) -> set[str]:
    from sqlalchemy import select

    from eventing.store import tables

    with engine.connect() as conn:
        return {row.subject for row in conn.execute(select(tables.events.c.subject))}


def test_a_batch_that_failed_while_the_database_was_down_is_stored_when_it_is_back(tmp_path, pg_url):
    direct = database.make_engine(pg_url)
    database.upgrade(direct)
    proxy = TcpProxy("127.0.0.1", 5432)
    engine = database.make_engine(proxy.url_for(pg_url))
    log = EmbeddedLog(tmp_path / "log.db", fsync=False)
    codec = Codec(BlobStore(tmp_path / "blobs"), inline_limit=2048)
    projector = Projector(log, EventStore(engine, codec), LocalNotifier())
    topic = topics.topic("alice", "completions")
    try:
        log.publish(topic, codec.encode(completion("req-1")))
        assert projector.run_once() == 1 and stored_ids(direct) == {"req-1"}

        proxy.cut()
        log.publish(topic, codec.encode(completion("req-2")))
        with pytest.raises(Exception):
            projector.run_once()  # the store is unreachable: nothing committed
        log.publish(topic, codec.encode(completion("req-3")))
        proxy.restore()
        while projector.run_once(timeout=0.2):
            pass
        assert stored_ids(direct) == {"req-1", "req-2", "req-3"}
    finally:
        proxy.close()
        engine.dispose()
        direct.dispose()
        log.close()
