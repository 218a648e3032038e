"""A rebuild's SQLite writes in a process of their own: batches of statements in, one answer
per batch out, each batch one transaction, committed in the order sent.

Why a process: Python's sqlite3 gives the GIL up around every row it steps and has to take it
back for the next row's parameters, so a writer thread beside a busy fold waits for the GIL
at every row (the switch interval, 5 ms) and writes slower than the fold it was to overlap.
A process has a GIL of its own: on SQLite a rebuild's inserts, commits and WAL checkpoints
(about a third of its time, measured) then run on the second core while the next batch is
read and folded. The statements arrive with their parameters already through SQLAlchemy's
bind processors (`DeferredWrites`), as plain values, so this side needs only the standard
library and starts in a few tens of milliseconds.

The wire, both ways: pickles, one after another. Parent to child: a batch, a
list of (sql, rows) to `executemany` in one transaction, or `FINISH`, which checkpoints the
WAL (truncating it) and ends the child. Child to parent, per message: None when it committed,
else (the sqlite3 exception's class name, its message); a failed batch is rolled back whole
and the child waits for the next one. The parent's end of the pipe closing (the parent died
or gave up) rolls back whatever is open and ends the child: nothing half-written is committed.
"""

from __future__ import annotations

import io
import pickle
import sqlite3
import subprocess
import sys
import threading
from typing import IO, BinaryIO, Optional

FINISH = "finish"
_PIPE_BYTES = 1 << 20


def _bytes(view: memoryview):
    return bytes, (view.tobytes(),)


# SQLAlchemy hands SQLite a BLOB as a memoryview (sqlite3.Binary), which pickle refuses;
# it goes as the bytes it views, which sqlite3 stores as the same BLOB.
_REDUCERS = {memoryview: _bytes}


def _widen(stream: IO[bytes]) -> None:
    """A batch is megabytes (its events' payloads): through a pipe of the default 64 KiB the
    parent's write waits for the child's read every 64 KiB, two context switches each."""
    try:
        import fcntl

        fcntl.fcntl(stream.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except (ImportError, AttributeError, OSError):
        pass  # not Linux, or over the system's pipe-max-size: the default pipe works, slower


def _dumps(message) -> bytes:
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _REDUCERS
    pickler.dump(message)
    return buffer.getvalue()


def _send(stream: IO[bytes], message) -> None:
    stream.write(_dumps(message))
    stream.flush()


def _receive(stream: IO[bytes]):
    """The next message (pickles delimit themselves); EOFError once the other end has closed."""
    try:
        return pickle.load(stream)
    except pickle.UnpicklingError as exc:  # cut off in the middle
        raise EOFError from exc


class SqliteWriter:
    """The parent's side: `send` a batch, `receive` its answer (one batch in flight at a time
    is the caller's rule), `finish` once done, `abort` on the way out of a failure."""

    def __init__(self, path: str, busy_timeout_ms: int = 30_000) -> None:
        # -I: the child imports only the standard library, nothing of the caller's environment.
        self._process = subprocess.Popen(
            [sys.executable, "-I", __file__, path, str(busy_timeout_ms)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        if self._process.stdin is None or self._process.stdout is None:  # never: both are pipes
            raise RuntimeError("the rebuild's SQLite writer has no pipes")
        self._stdin: IO[bytes] = self._process.stdin
        self._stdout: IO[bytes] = self._process.stdout
        _widen(self._stdin)
        self._sending: Optional[threading.Thread] = None
        self._send_error: Optional[OSError] = None

    def send(self, statements: list[tuple[str, list]]) -> None:
        """Pickled here, written by a thread: a batch is megabytes, more than the pipe holds,
        so its write waits on the child's reading, and a thread waits with the GIL released
        while this one folds the next batch."""
        self._wait_sent()
        data = _dumps(statements)
        self._sending = threading.Thread(target=self._write, args=(data,), name="rebuild-writer-pipe", daemon=True)
        self._sending.start()

    def _write(self, data: bytes) -> None:
        try:
            self._stdin.write(data)
            self._stdin.flush()
        except OSError as exc:  # the child is gone: said by `receive`
            self._send_error = exc

    def _wait_sent(self) -> None:
        if self._sending is not None:
            self._sending.join()
            self._sending = None
        if self._send_error is not None:
            raise self._gone() from self._send_error

    def receive(self) -> Optional[tuple[str, str]]:
        """None: the batch sent last is committed; else (sqlite3 error class, message)."""
        self._wait_sent()
        try:
            return _receive(self._stdout)
        except EOFError:
            raise self._gone() from None

    @property
    def broken(self) -> bool:
        """Whether the child was found gone (said to the caller already)."""
        return self._process.returncode is not None

    def finish(self) -> None:
        """Checkpoint the WAL into the database and end the child."""
        try:
            self._wait_sent()
            _send(self._stdin, FINISH)
            failure = self.receive()
        except BrokenPipeError:
            raise self._gone() from None
        finally:
            self._close()
        if failure is not None:
            raise RuntimeError(f"the rebuild's SQLite writer could not checkpoint: {failure[0]}: {failure[1]}")

    def abort(self) -> None:
        """End the child at once: a batch it has not committed never is (SQLite's commit is
        atomic), and a write to it still going on ends with the pipe."""
        self._process.kill()
        self._close()

    def _close(self) -> None:
        for stream in (self._stdin, self._stdout):
            try:
                stream.close()
            except OSError:
                pass  # the child is already gone
        # Without a timeout: the child is past its last answer (`finish`) or killed (`abort`),
        # so it is ending, and a wait with one polls it with sleeps (15 ms of a rebuild).
        self._process.wait()
        if self._sending is not None:
            self._sending.join()
            self._sending = None

    def _gone(self) -> RuntimeError:
        code = self._process.wait()
        return RuntimeError(f"the rebuild's SQLite writer (pid {self._process.pid}) exited with code {code}")


def serve(path: str, busy_timeout_ms: int, inbox: BinaryIO, outbox: BinaryIO) -> None:
    """The child's side (see the module docstring)."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=busy_timeout_ms / 1000)
    try:
        conn.execute("PRAGMA synchronous=NORMAL")  # as the store's own connections (database.make_engine)
        while True:
            try:
                message = _receive(inbox)
            except EOFError:
                return  # the parent went away: an open transaction is rolled back by the close
            if message == FINISH:
                _send(outbox, _answer(lambda: conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()))
                return
            _send(outbox, _answer(lambda: _write(conn, message)))
    finally:
        conn.close()


def _write(conn: sqlite3.Connection, statements: list[tuple[str, list]]) -> None:
    # IMMEDIATE: the write lock is taken (or waited for) at the start, never by an upgrade.
    conn.execute("BEGIN IMMEDIATE")
    try:
        cursor = conn.cursor()
        for sql, rows in statements:
            if len(rows) == 1:
                cursor.execute(sql, rows[0])
            else:
                cursor.executemany(sql, rows)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _answer(work) -> Optional[tuple[str, str]]:
    try:
        work()
    except sqlite3.Error as exc:
        return type(exc).__name__, str(exc)
    return None


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), sys.stdin.buffer, sys.stdout.buffer)
