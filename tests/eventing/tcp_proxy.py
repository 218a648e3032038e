"""A TCP proxy the tests control, to take a shared server (PostgreSQL) away from one deployment.

The local PostgreSQL server is shared with other tests and sessions, so a test cannot stop it;
it points its deployment at this proxy instead and cuts it: `cut()` resets every open
connection and refuses new ones (a connection is accepted and closed at once, as a host
whose server is down answers), `restore()` forwards again. Threads only, no event loop, so
it runs beside anything.
"""

from __future__ import annotations

import socket
import threading
from typing import Optional

HOST = "127.0.0.1"


class TcpProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((HOST, 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._up = True
        self._closed = False
        self.refused = 0  # connections turned away while cut
        threading.Thread(target=self._accept, daemon=True).start()

    def url_for(self, url: str) -> str:
        """`url` (a SQLAlchemy / libpq URL naming the upstream) rewritten to go through here."""
        host, port = self.upstream
        return url.replace(f"@{host}:{port}/", f"@{HOST}:{self.port}/", 1)

    def cut(self) -> None:
        with self._lock:
            self._up = False
            open_sockets, self._open = self._open, set()
        for sock in open_sockets:
            _reset(sock)

    def restore(self) -> None:
        with self._lock:
            self._up = True

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                up = self._up
            if not up:
                self.refused += 1
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._open.update((client, server))
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with self._lock:
                    self._open.discard(sock)
                _reset(sock)


def _reset(sock: Optional[socket.socket]) -> None:
    """Drop a connection: the peer sees it die (SO_LINGER 0 turns the close into a reset);
    shutdown first, because only that wakes a pump thread blocked in recv on it."""
    for step in (
        lambda: sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"),
        lambda: sock.shutdown(socket.SHUT_RDWR),
        sock.close,
    ):
        try:
            step()
        except OSError:
            pass
