"""Kept connections (eventing/store/kept.py): a thread's connection to a SQLite file store
used again across calls, never leaving a transaction open, never handed to two uses at once."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import create_engine, text

from eventing.store.database import make_engine
from eventing.store.kept import Kept, kept


@pytest.fixture
def engine(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path}/kept.db")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (k TEXT PRIMARY KEY, v INTEGER)")
        conn.exec_driver_sql("INSERT INTO t VALUES ('a', 1)")
    yield engine
    engine.dispose()


def read(conn, key="a"):
    cursor = conn.connection.dbapi_connection.cursor()  # as the store's driver-SQL reads do
    try:
        cursor.execute("SELECT v FROM t WHERE k = ?", (key,))
        return cursor.fetchone()
    finally:
        cursor.close()


def test_a_thread_keeps_its_connection_and_sees_every_commit(engine):
    keep = Kept(engine)
    with keep.connect() as first:
        assert read(first) == (1,)
    # Another connection commits: the kept one's next read sees it (no snapshot was held).
    with engine.begin() as other:
        other.exec_driver_sql("UPDATE t SET v = 2 WHERE k = 'a'")
    with keep.connect() as again:
        assert again is first
        assert read(again) == (2,)
        assert not again.connection.dbapi_connection.in_transaction
    # A read through SQLAlchemy (which begins a transaction) is rolled back on the way out.
    with keep.connect() as conn:
        conn.execute(text("SELECT v FROM t")).all()
        assert conn.in_transaction()
    assert not first.in_transaction()
    assert not first.connection.dbapi_connection.in_transaction


def test_writes_commit_or_roll_back_on_the_kept_connection(engine):
    keep = Kept(engine)
    with keep.begin() as conn:
        conn.exec_driver_sql("INSERT INTO t VALUES ('b', 3)")
    with pytest.raises(RuntimeError):
        with keep.begin() as conn:
            conn.exec_driver_sql("INSERT INTO t VALUES ('c', 4)")
            raise RuntimeError("the caller failed")
    with engine.connect() as other:
        assert other.exec_driver_sql("SELECT k FROM t ORDER BY k").scalars().all() == ["a", "b"]
    with keep.begin() as again:
        assert again is conn  # still the thread's, after the rollback


def test_a_use_inside_another_gets_a_connection_of_its_own(engine):
    """A read inside the thread's own write must not share (and then roll back) its transaction."""
    keep = Kept(engine)
    with keep.begin() as writing:
        writing.exec_driver_sql("INSERT INTO t VALUES ('d', 5)")
        with keep.connect() as reading:
            assert reading is not writing
            assert read(reading, "d") is None  # not committed yet: another connection's view
        assert writing.in_transaction()
    with keep.connect() as conn:
        assert conn is writing and read(conn, "d") == (5,)


def test_threads_have_their_own_and_at_most_so_many_keep_one(engine):
    keep = Kept(engine, most=2)
    seen: dict[int, list] = {}
    barrier = threading.Barrier(3)

    def work(index):
        barrier.wait()  # all three at once, so none reuses another's
        with keep.connect() as a:
            pass
        with keep.connect() as b:
            pass
        seen[index] = [a, b]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    kept_by = [a for a, b in seen.values() if a is b]
    assert len(kept_by) == 2 and kept_by[0] is not kept_by[1]
    assert len(keep._kept) == 2
    # The third thread checked out and gave back a pooled connection each time.
    assert [a.closed for a, b in seen.values() if a is not b] == [True]


def test_only_for_a_sqlite_file_and_closed_with_the_store(engine, tmp_path):
    assert not Kept(create_engine("sqlite://")).enabled  # in memory: one connection already
    assert not Kept(
        make_engine("postgresql://u@127.0.0.1:1/x")
    ).enabled  # the pool replaces dropped ones (pg_round_trips)
    keep = kept(engine)
    assert kept(engine) is keep  # one registry per engine, shared by the store and the reads
    with keep.connect() as conn:
        pass
    keep.close()
    assert conn.closed
    with keep.connect() as after:
        assert after is not conn and not after.closed  # from the pool now
    assert after.closed  # given back
