"""The embedded log's group commit: many writers, one transaction, nothing lost or reordered.

The EventBus contract (test_bus_contract.py) covers the log's Kafka semantics; these tests
cover what only the embedded log does: writes queued by many threads are written together,
each writer returns only once its write is durable, and a bad write fails alone.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest

from eventing.codec import Message
from eventing.embedded_log import EmbeddedLog


def message(key: str, n: int) -> Message:
    return Message(headers={"n": str(n).encode()}, key=key.encode(), value=f"{key}:{n}".encode())


def drain(log: EmbeddedLog, group: str, topic: str) -> list:
    consumer = log.consumer(group, topics=[topic])
    records, batch = [], consumer.poll(timeout=0.2)
    while batch:
        records += batch
        batch = consumer.poll(timeout=0.2)
    consumer.close()
    return records


def test_writes_queued_together_commit_in_one_batch_and_each_writer_gets_its_record(tmp_path, monkeypatch):
    log = EmbeddedLog(tmp_path / "log.db", partitions=2)
    batches: list[int] = []
    write_batch = log._group._write_batch
    monkeypatch.setattr(log._group, "_write_batch", lambda batch: (batches.append(len(batch)), write_batch(batch))[1])
    results: dict[int, object] = {}
    # Holding the write lock stands for a commit in progress: every publisher queues behind it.
    with log._group.writing():
        threads = [
            threading.Thread(target=lambda n=n: results.__setitem__(n, log.publish("t", message(f"k{n % 3}", n))))
            for n in range(12)
        ]
        for thread in threads:
            thread.start()
        while len(log._group._queue) < 12:
            threading.Event().wait(0.01)
    for thread in threads:
        thread.join(10)
    assert batches == [12]  # the first thread in wrote everyone's record
    by_partition = defaultdict(list)
    for n, record in results.items():
        assert record.message.value == f"k{n % 3}:{n}".encode()
        by_partition[record.partition].append(record.offset)
    for offsets in by_partition.values():
        assert sorted(offsets) == list(range(len(offsets)))  # dense, each once
    stored = {r.message.value for r in drain(log, "g", "t")}
    assert stored == {f"k{n % 3}:{n}".encode() for n in range(12)}
    log.close()


def test_concurrent_writers_keep_each_keys_order_and_survive_a_reopen(tmp_path):
    path = tmp_path / "log.db"
    log = EmbeddedLog(path, partitions=4)

    def writer(key: str) -> None:
        for n in range(40):
            log.publish("t", message(key, n))

    threads = [threading.Thread(target=writer, args=(f"key{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    log.close()

    reopened = EmbeddedLog(path, partitions=4)
    seen = defaultdict(list)
    for record in drain(reopened, "g", "t"):
        seen[record.message.key.decode()].append(int(record.message.headers["n"]))
    assert seen == {f"key{i}": list(range(40)) for i in range(8)}
    assert reopened.publish("t", message("key0", 40)).offset > 0  # ends reloaded: appends continue
    reopened.close()


def test_offset_commits_are_group_committed_and_durable(tmp_path):
    path = tmp_path / "log.db"
    log = EmbeddedLog(path, partitions=1)
    for n in range(5):
        log.publish("t", message("k", n))
    consumer = log.consumer("g", topics=["t"])
    assert len(consumer.poll(timeout=0.2)) == 5
    consumer.commit()
    log.close()
    reopened = EmbeddedLog(path, partitions=1)
    assert reopened.consumer("g", topics=["t"]).committed() == {("t", 0): 5}
    reopened.close()


def test_a_bad_write_fails_alone_and_its_batch_neighbours_are_written(tmp_path):
    log = EmbeddedLog(tmp_path / "log.db", partitions=1)
    outcomes: dict[str, object] = {}

    def publish(name: str, value) -> None:
        try:
            outcomes[name] = log.publish("t", Message(headers={}, key=b"k", value=value))
        except Exception as exc:  # the bad one's own error
            outcomes[name] = exc

    with log._group.writing():
        threads = [
            threading.Thread(target=publish, args=("good-1", b"a")),
            threading.Thread(target=publish, args=("bad", object())),  # sqlite cannot store it
            threading.Thread(target=publish, args=("good-2", b"b")),
        ]
        for thread in threads:
            thread.start()
        while len(log._group._queue) < 3:
            threading.Event().wait(0.01)
    for thread in threads:
        thread.join(10)
    assert isinstance(outcomes["bad"], Exception)
    assert {outcomes["good-1"].message.value, outcomes["good-2"].message.value} == {b"a", b"b"}
    assert sorted(r.message.value for r in drain(log, "g", "t")) == [b"a", b"b"]
    assert sorted(r.offset for r in drain(log, "g2", "t")) == [0, 1]  # no hole where the bad one was
    log.close()


def test_a_write_after_close_raises(tmp_path):
    log = EmbeddedLog(tmp_path / "log.db")
    log.close()
    with pytest.raises(Exception, match="closed"):
        log.publish("t", message("k", 0))


def test_a_new_topic_does_not_hand_a_member_its_uncommitted_records_again(tmp_path):
    """A pattern subscriber re-syncs when a topic appears; the partitions it keeps keep their
    positions (a trainer holding a model's offsets would otherwise run those requests twice)."""
    log = EmbeddedLog(tmp_path / "log.db", partitions=1)
    consumer = log.consumer("g", pattern=r"tenant\..*")
    for n in range(3):
        log.publish("tenant.a", message("k", n))
    assert [r.offset for r in consumer.poll(timeout=0.2)] == [0, 1, 2]  # polled, not committed
    log.publish("tenant.b", message("k", 0))  # a new topic: the group re-syncs
    again = consumer.poll(timeout=0.2)
    assert [(r.topic, r.offset) for r in again] == [("tenant.b", 0)]
    # A member that takes the partition over still gets what was never committed.
    consumer.close()
    successor = log.consumer("g", pattern=r"tenant\..*")
    assert sorted((r.topic, r.offset) for r in successor.poll(timeout=0.2)) == [
        ("tenant.a", 0),
        ("tenant.a", 1),
        ("tenant.a", 2),
        ("tenant.b", 0),
    ]
    log.close()


# -- the tail: what this process appended is handed to its consumers from memory -----------


def test_a_consumer_that_keeps_up_gets_the_appended_records_themselves(tmp_path):
    log = EmbeddedLog(tmp_path / "log.db", partitions=1)
    appended = log.publish_many([("t", message("k", n)) for n in range(5)])
    consumer = log.consumer("g", topics=["t"])
    polled = consumer.poll(timeout=0.2)
    assert [r.offset for r in polled] == [0, 1, 2, 3, 4]
    assert all(got is made for got, made in zip(polled, appended))  # no read back from the file
    log.close()


def test_a_lagging_consumer_reads_the_file_then_the_tail_in_order(tmp_path, monkeypatch):
    import eventing.embedded_log as embedded

    monkeypatch.setattr(embedded, "_TAIL_RECORDS", 4)  # keeps the last 4 of 10 in memory
    log = EmbeddedLog(tmp_path / "log.db", partitions=1)
    appended = log.publish_many([("t", message("k", n)) for n in range(10)])
    assert sorted(key[2] for key in log._tail) == [6, 7, 8, 9]
    consumer = log.consumer("g", topics=["t"])
    first = consumer.poll(max_records=3, timeout=0.2) + consumer.poll(max_records=3, timeout=0.2)
    rest = consumer.poll(max_records=100, timeout=0.2)
    # 0-5 from the file (equal records, not the same objects), 6-9 from memory, one sequence
    assert [r.offset for r in first + rest] == list(range(10))
    assert [r.message for r in first + rest] == [r.message for r in appended]
    assert not any(r is a for r, a in zip(first, appended[:6]))
    assert all(r is a for r, a in zip(rest, appended[6:]))
    # and what the file gives another reader (a second process) is the same content
    log.close()
    again = EmbeddedLog(tmp_path / "log.db", partitions=1)
    from_file = drain(again, "other", "t")
    assert [(r.offset, r.message, r.timestamp) for r in from_file] == [
        (r.offset, r.message, r.timestamp) for r in appended
    ]
    again.close()


def test_the_tail_keeps_only_its_newest_records(tmp_path, monkeypatch):
    import eventing.embedded_log as embedded

    monkeypatch.setattr(embedded, "_TAIL_RECORDS", 8)
    log = EmbeddedLog(tmp_path / "log.db", partitions=2)
    for n in range(30):
        log.publish("t", message(f"k{n % 3}", n))
    assert len(log._tail) == 8
    assert {r.message.headers["n"] for r in log._tail.values()} == {str(n).encode() for n in range(22, 30)}
    log.close()


def test_the_tail_is_bounded_by_payload_bytes_too(tmp_path, monkeypatch):
    import eventing.embedded_log as embedded

    monkeypatch.setattr(embedded, "_TAIL_BYTES", 1000)
    log = EmbeddedLog(tmp_path / "log.db", partitions=1)
    log.publish_many([("t", Message(headers={}, key=b"k", value=bytes(300))) for _ in range(5)])
    # a claim-checked payload counts at the size its decoded event holds, not the empty value
    log.publish("t", Message(headers={"ce_claimsize": b"600"}, key=b"k", value=b""))
    assert sorted(key[2] for key in log._tail) == [4, 5]  # 300 + 600 bytes kept
    assert log._tail_bytes == 900
    consumer = log.consumer("g", topics=["t"])
    assert [r.offset for r in consumer.poll(timeout=0.2)] == [0, 1, 2, 3, 4, 5]
    log.close()
