"""Wake-ups across processes through PostgreSQL LISTEN/NOTIFY (the distributed long-poll)."""

from __future__ import annotations

import queue

import pytest

from eventing.pg_notify import PgNotifier, chunks

pytestmark = pytest.mark.postgres


def test_a_notification_reaches_every_subscriber_of_another_connection(pg_url):
    sender, receiver = PgNotifier(pg_url), PgNotifier(pg_url)
    got: queue.Queue = queue.Queue()
    receiver.subscribe(got.put)
    try:
        ids = [f"req-{i:040d}" for i in range(400)]  # over the 8000-byte NOTIFY payload limit
        sender.notify(ids)
        received = []
        while len(received) < len(ids):
            received += got.get(timeout=5)
        assert received == ids
    finally:
        sender.close()
        receiver.close()


def test_chunks_stay_under_the_payload_limit():
    ids = [f"req-{i:060d}" for i in range(300)]
    pieces = chunks(ids)
    assert len(pieces) > 1 and all(len(p) <= 7900 for p in pieces)
    assert [i for p in pieces for i in p.split(",")] == ids
