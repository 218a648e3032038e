"""The EventBus contract, one suite for every backend (Kafka semantics)."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

from eventing.codec import Message
from eventing.embedded_log import EmbeddedLog


class EmbeddedBackend:
    def __init__(self, tmp_path):
        self.path = tmp_path / "log.db"

    def open(self):
        return EmbeddedLog(self.path, partitions=4)


@pytest.fixture(params=["embedded"])
def backend(request, tmp_path):
    return {"embedded": EmbeddedBackend}[request.param](tmp_path)


def msg(key: str, n: int) -> Message:
    return Message(headers={"n": str(n).encode()}, key=key.encode(), value=f"{key}:{n}".encode())


def drain(consumer, expected: int, timeout: float = 10.0):
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < expected and time.monotonic() < deadline:
        got += consumer.poll(max_records=50, timeout=0.5)
    return got


def test_order_per_key_and_one_partition_per_key(backend):
    bus = backend.open()
    keys = [f"model-{i}" for i in range(5)]
    for n in range(40):
        bus.publish("t.orders", msg(keys[n % 5], n))
    records = drain(bus.consumer("g", topics=["t.orders"]), 40)
    assert len(records) == 40
    by_key = defaultdict(list)
    partitions = defaultdict(set)
    for r in records:
        by_key[r.message.key].append(int(r.message.headers["n"]))
        partitions[r.message.key].add(r.partition)
    assert all(seq == sorted(seq) for seq in by_key.values())
    assert all(len(p) == 1 for p in partitions.values())
    bus.close()


def test_committed_offsets_survive_a_restart_and_the_rest_is_redelivered(backend):
    bus = backend.open()
    for n in range(20):
        bus.publish("t.work", msg("k", n))
    consumer = bus.consumer("workers", topics=["t.work"])
    first = drain(consumer, 20)
    assert len(first) == 20
    # commit only the first 8 (next offset 8), as a worker that crashed mid-batch would
    consumer.commit({(first[0].topic, first[0].partition): 8})
    bus.close()  # the process dies; everything not committed must come back

    bus = backend.open()
    again = drain(bus.consumer("workers", topics=["t.work"]), 12)
    assert [int(r.message.headers["n"]) for r in again] == list(range(8, 20))
    bus.close()


def test_uncommitted_records_are_redelivered_to_the_next_member(backend):
    bus = backend.open()
    for n in range(5):
        bus.publish("t.redeliver", msg("k", n))
    first = bus.consumer("g", topics=["t.redeliver"])
    assert len(drain(first, 5)) == 5
    first.close()  # no commit
    second = bus.consumer("g", topics=["t.redeliver"])
    assert [int(r.message.headers["n"]) for r in drain(second, 5)] == list(range(5))
    bus.close()


def test_groups_are_independent_and_members_split_partitions(backend):
    bus = backend.open()
    for n in range(32):
        bus.publish("t.split", msg(f"k{n % 8}", n))
    a1 = bus.consumer("A", topics=["t.split"])
    a2 = bus.consumer("A", topics=["t.split"])
    b = bus.consumer("B", topics=["t.split"])
    got_a1, got_a2 = drain(a1, 32, timeout=2), drain(a2, 32, timeout=2)
    assert {r.partition for r in got_a1}.isdisjoint({r.partition for r in got_a2})
    assert len(got_a1) + len(got_a2) == 32
    assert len(drain(b, 32)) == 32
    bus.close()


def test_pattern_subscription_sees_topics_created_later(backend):
    bus = backend.open()
    consumer = bus.consumer("p", pattern=r"^openrl\.[a-z0-9-]+\.training$")
    assert consumer.poll(timeout=0.2) == []
    bus.publish("openrl.alice.training", msg("m", 1))
    bus.publish("openrl.alice.sampling", msg("m", 2))  # not matched
    bus.publish("openrl.bob.training", msg("m", 3))
    got = drain(consumer, 2)
    assert sorted(r.topic for r in got) == ["openrl.alice.training", "openrl.bob.training"]
    assert consumer.poll(timeout=0.2) == []
    bus.close()


def test_latest_start_skips_history(backend):
    bus = backend.open()
    bus.publish("t.latest", msg("k", 0))
    consumer = bus.consumer("late", topics=["t.latest"], from_beginning=False)
    assert consumer.poll(timeout=0.2) == []
    bus.publish("t.latest", msg("k", 1))
    assert [int(r.message.headers["n"]) for r in drain(consumer, 1)] == [1]
    bus.close()


def test_a_waiting_poll_wakes_on_publish(backend):
    import threading

    bus = backend.open()
    consumer = bus.consumer("w", topics=["t.wake"])
    consumer.poll(timeout=0.05)
    threading.Timer(0.2, lambda: bus.publish("t.wake", msg("k", 1))).start()
    started = time.monotonic()
    got = consumer.poll(timeout=5.0)
    assert len(got) == 1 and time.monotonic() - started < 2.0
    bus.close()
