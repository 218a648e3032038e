"""`openrl timeslicer`: the node daemon, serving the timeslicer service on a Unix socket.

One asyncio loop does everything, so the service is only ever called from that thread:
each worker connection is an owner (its jobs, leases and waiters die with it), each line
it sends is one request, and a ticker expires overdue leases every `TICK_SECONDS`. A line
that is not JSON, or too long, gets an error reply and the connection stays up. HTTP on
`http_port` serves `GET /healthz`, `GET /metrics` (Prometheus text), `GET /status`
(JSON) and `GET /timeline?since=<unix seconds>` (who held each device when, and the parks)
for probes, scrapers, the scheduler and dashboards.

`openrl serve` runs the same daemon in a thread of its own process (`start_in_thread`),
so its trainer and sampler reach it through the socket exactly as separate processes do.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from pathlib import Path
from typing import Optional

from functions.timeslicer.service import SlicerService

log = logging.getLogger(__name__)
TICK_SECONDS = 0.05
MAX_LINE = 1 << 20


class Daemon:
    def __init__(
        self, service: SlicerService, socket_path: Path, http_host: str = "127.0.0.1", http_port: Optional[int] = None
    ) -> None:
        self.service = service
        self.socket_path = Path(socket_path)
        self.http_host = http_host
        self.http_port = http_port
        self.bound_http_port: Optional[int] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self.ready = threading.Event()

    async def serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if self.socket_path.exists():
            self.socket_path.unlink()  # a stale socket of a daemon that died
        server = await asyncio.start_unix_server(self._connection, path=str(self.socket_path), limit=MAX_LINE)
        # Worker pods may run as other users; the host directory is the trust boundary.
        os.chmod(self.socket_path, 0o666)
        http = None
        if self.http_port is not None:
            http = await asyncio.start_server(self._http, self.http_host, self.http_port)
            self.bound_http_port = http.sockets[0].getsockname()[1]
        ticker = asyncio.create_task(self._tick())
        budgets = {d["device"]: d["budget_bytes"] for d in self.service.status()["devices"]}
        log.info("timeslicer on %s (http %s), budgets %s", self.socket_path, self.bound_http_port, budgets)
        self.ready.set()
        try:
            await self._stop.wait()
        finally:
            ticker.cancel()
            server.close()
            if http is not None:
                http.close()
            try:
                self.socket_path.unlink()
            except FileNotFoundError:
                pass

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def start_in_thread(self) -> threading.Thread:
        thread = threading.Thread(target=lambda: asyncio.run(self.serve()), name="timeslicer", daemon=True)
        thread.start()
        if not self.ready.wait(30):
            raise RuntimeError(f"the timeslicer did not start on {self.socket_path}")
        return thread

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            try:
                self.service.tick()
            except Exception:
                log.exception("timeslicer: tick failed")

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        def sink(message: dict) -> None:
            writer.write((json.dumps(message) + "\n").encode())

        owner = self.service.connect(sink)
        try:
            while True:
                try:
                    line = await reader.readline()
                except (asyncio.LimitOverrunError, ValueError):
                    sink({"id": None, "ok": False, "error": f"message longer than {MAX_LINE} bytes", "code": 400})
                    break
                if not line:
                    break
                try:
                    message = json.loads(line)
                except ValueError as error:
                    sink({"id": None, "ok": False, "error": f"not a JSON line: {error}", "code": 400})
                    continue
                self.service.handle(owner, message)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self.service.disconnect(owner)
            writer.close()

    async def _http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 10)
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # headers: nothing here needs them
            parts = request.decode("latin-1").split()
            path, _, query = (parts[1] if len(parts) >= 2 else "").partition("?")
            if len(parts) < 2 or parts[0] != "GET":
                status, kind, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            elif path == "/healthz":
                status, kind, body = "200 OK", "text/plain", b"ok\n"
            elif path == "/metrics":
                status, kind, body = "200 OK", "text/plain; version=0.0.4; charset=utf-8", self.service.metrics_text()
            elif path == "/status":
                status, kind, body = "200 OK", "application/json", json.dumps(self.service.status()).encode()
            elif path == "/timeline":
                since = _since(query)
                if since is None:
                    status, kind, body = "400 Bad Request", "text/plain", b"since must be unix seconds\n"
                else:
                    timeline = self.service.timeline(since)
                    status, kind, body = "200 OK", "application/json", json.dumps({"timeline": timeline}).encode()
            else:
                status, kind, body = "404 Not Found", "text/plain", b"try /healthz, /metrics, /status or /timeline\n"
            head = f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
            if status.startswith("405"):
                head += "Allow: GET\r\n"
            writer.write(head.encode() + b"\r\n" + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass
        finally:
            writer.close()


def _since(query: str):
    from urllib.parse import parse_qs

    values = parse_qs(query).get("since", ["0"])
    try:
        return float(values[0])
    except ValueError:
        return None
