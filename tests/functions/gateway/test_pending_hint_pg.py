"""The pending hint on PostgreSQL, where the projector may be another process.

A gateway on PostgreSQL hears every projector's announcements (LISTEN/NOTIFY), so a future it
stored unfinished and has heard nothing of since still runs: its retrieve_future's first look
need not read the store. An announced id drops its hint before the wake-up, and a lost LISTEN
connection drops them all (`eventing/store/finished.py`). The completions here are written by
another store object and announced by another notifier, as another process's projector would.

PENDING_HINT_WAIT is raised to 5 s in these tests, so that a hint wrongly kept (a wait of 5 s
before the store is read) cannot pass for an answer after the announcement."""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from eventing.pg_notify import PgNotifier
from eventing.store import database
from eventing.store.event_store import EventStore
from functions.gateway.app import create_app
from functions.gateway.routes import futures as futures_route
from functions.runtime import Runtime
from functions.serve import Node
from openrl_core.settings import Settings
from tests.functions.gateway.test_pending_hint import (
    KEYS,
    MODEL,
    RESULT,
    completed,
    count_store_reads,
    retrieve_finished_meanwhile,
    submit_one_step,
)

pytestmark = pytest.mark.postgres

WRONG_HINT_WAIT = 5.0


@pytest.fixture
def gateway(tmp_path, tiny_files, pg_url, monkeypatch):
    """(client, runtime, request_id, reads): a gateway on PostgreSQL with no projector beside
    it, one optim_step of alice's stored and running; `reads` lists the store reads of
    retrieve_future from then on."""
    monkeypatch.setattr(futures_route, "PENDING_HINT_WAIT", WRONG_HINT_WAIT)
    reads = count_store_reads(monkeypatch)
    with ExitStack() as running:
        settings = Settings(data_dir=tmp_path, database_url=pg_url, models=[MODEL], long_poll_seconds=20,
                            api_keys=[f"{t}={k}" for t, k in KEYS.items()])  # fmt: skip
        runtime = Runtime(settings)
        running.callback(runtime.close)
        client = running.enter_context(TestClient(create_app(runtime.gateway_context())))
        client.headers["X-API-Key"] = KEYS["alice"]
        request_id = submit_one_step(client)
        reads.clear()
        yield client, runtime, request_id, reads


def finish_in_another_process(runtime, request_id: str, with_row: bool = False) -> None:
    """What another process's projector does: store the completion, then announce it (its
    finished row along when `with_row`, as `eventing/projector.py` sends it)."""
    url = runtime.engine.url.render_as_string(hide_password=False)
    engine = database.make_engine(url)
    notifier = PgNotifier(url)
    try:
        store = EventStore(engine, runtime.codec)
        store.append(completed(request_id))
        notifier.notify([request_id], rows=store.finished.peek_many([request_id]) if with_row else ())
    finally:
        notifier.close()
        engine.dispose()


def wait_until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_running_future_is_waited_on_without_a_first_read_and_answered_once_announced(gateway):
    client, runtime, request_id, reads = gateway
    assert runtime.store.finished.pending("alice", request_id)
    answer, waited = retrieve_finished_meanwhile(
        client, request_id, lambda: finish_in_another_process(runtime, request_id)
    )
    assert answer.status_code == 200 and answer.json() == RESULT
    assert 0.3 <= waited < WRONG_HINT_WAIT - 1  # woken by the announcement, not by the hint's timeout
    assert reads == [request_id]  # the woken look only (without the hint: the first look too)
    assert not runtime.store.finished.pending("alice", request_id)


def test_a_future_announced_before_its_retrieve_is_read_at_once(gateway):
    client, runtime, request_id, reads = gateway
    finish_in_another_process(runtime, request_id)
    wait_until(lambda: not runtime.store.finished.pending("alice", request_id))  # heard on pg-listen
    started = time.monotonic()
    answer = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
    assert answer.status_code == 200 and answer.json() == RESULT
    assert time.monotonic() - started < WRONG_HINT_WAIT - 1
    assert reads == [request_id]


def end_listen_connections(pg_url: str) -> None:
    """End every LISTEN connection to the test's database, as a network fault would."""
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            ended = conn.execute(text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND query LIKE 'LISTEN %' AND pid <> pg_backend_pid()"
            )).scalars().all()  # fmt: skip
        assert ended and all(ended)
    finally:
        admin.dispose()


def test_a_lost_listen_connection_drops_every_hint(gateway, pg_url):
    _client, runtime, request_id, _reads = gateway
    assert runtime.store.finished.pending("alice", request_id)
    end_listen_connections(pg_url)
    # Announcements sent while it reconnects are lost, so none of the hints is trusted after.
    wait_until(lambda: not runtime.store.finished.pending("alice", request_id))


def test_a_gateway_of_its_own_on_postgresql_follows_pending_futures(tmp_path, tiny_files, pg_url):
    node = Node(Settings(data_dir=tmp_path, database_url=pg_url, models=[MODEL]), ("gateway",))
    try:
        node.runtime.store.finished.put_many([{"request_id": "r", "tenant": "t", "state": "pending"}])
        assert node.runtime.store.finished.pending("t", "r")
    finally:
        node.stop()


def test_a_future_announced_with_its_row_is_answered_without_any_read(gateway):
    client, runtime, request_id, reads = gateway
    answer, _waited = retrieve_finished_meanwhile(
        client, request_id, lambda: finish_in_another_process(runtime, request_id, True)
    )
    assert answer.status_code == 200 and answer.json() == RESULT
    assert reads == []  # the announced row answered the woken poll
    # Another tenant asking for it is answered as for an unknown id, row kept or not.
    client.headers["X-API-Key"] = KEYS["bob"]
    theirs = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
    assert theirs.status_code == 404 and reads == [request_id]
