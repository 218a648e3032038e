"""The rebuild's SQLite writer process: batches commit whole and in order, a failing batch
rolls back whole and is answered, a batch cut off by its parent's death is never committed,
a killed writer is reported, and `finish` leaves the WAL checkpointed."""

from __future__ import annotations

import sqlite3

import pytest

from eventing.store import sqlite_writer
from eventing.store.sqlite_writer import SqliteWriter

INSERT = "INSERT INTO t (id, body) VALUES (?, ?)"


@pytest.fixture
def path(tmp_path):
    path = str(tmp_path / "target.db")
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB)")
    conn.commit()
    conn.close()
    return path


def stored(path) -> list[tuple]:
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT id, body FROM t ORDER BY id").fetchall()


def test_batches_commit_in_order_and_a_failing_one_rolls_back_whole(path):
    writer = SqliteWriter(path)
    try:
        writer.send([(INSERT, [(1, b"a"), (2, memoryview(b"b"))])])  # a BLOB as SQLAlchemy binds it
        assert writer.receive() is None
        writer.send([(INSERT, [(3, b"c")]), (INSERT, [(4, b"d"), (1, b"again")])])  # its second statement collides
        name, message = writer.receive()
        assert name == "IntegrityError" and "UNIQUE" in message
        writer.send([("UPDATE t SET body = ? WHERE id = ?", [(b"z", 2)]), (INSERT, [(5, b"e")])])
        assert writer.receive() is None
    finally:
        writer.finish()
    assert stored(path) == [(1, b"a"), (2, b"z"), (5, b"e")]  # nothing of the failed batch, 3 included


def test_finish_checkpoints_the_wal_and_ends_the_child(path, tmp_path):
    reader = sqlite3.connect(
        path
    )  # open throughout: the writer's close is then not the last, which would checkpoint anyway
    try:
        reader.execute("SELECT count(*) FROM t").fetchall()
        writer = SqliteWriter(path)
        writer.send([(INSERT, [(i, bytes(1000)) for i in range(200)])])
        assert writer.receive() is None
        assert (tmp_path / "target.db-wal").stat().st_size > 200_000  # the batch's pages, in the WAL
        writer.finish()
        assert writer._process.returncode == 0
        assert (tmp_path / "target.db-wal").stat().st_size == 0  # truncated: every page is in the database
        assert len(stored(path)) == 200
    finally:
        reader.close()


def test_a_batch_cut_off_by_its_parents_death_is_never_committed(path):
    writer = SqliteWriter(path)
    writer.send([(INSERT, [(1, b"a")])])
    assert writer.receive() is None
    whole = sqlite_writer._dumps([(INSERT, [(i, bytes(5000)) for i in range(2, 400)])])
    writer._process.stdin.write(whole[: len(whole) // 2])  # the parent dies halfway through a batch
    writer._process.stdin.flush()
    writer._process.stdin.close()
    assert writer._process.wait(timeout=30) == 0
    assert stored(path) == [(1, b"a")]


def test_a_killed_writer_is_reported_with_its_exit_code(path):
    writer = SqliteWriter(path)
    writer._process.kill()
    writer._process.wait()
    with pytest.raises(RuntimeError, match="exited with code -9"):
        writer.send([(INSERT, [(1, b"a")])])
        writer.receive()
    writer.abort()  # and ending it again is quiet
    assert stored(path) == []
