"""A plain HTTP server answering `GET /status` with a fixed body: for status shapes the real
daemon (`tests/functions/scheduler/node_timeslicer.py`) never produces, such as fields a newer
daemon version would add."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StandinTimeslicer:
    def __init__(self, host: str, status: dict, port: int = 0) -> None:
        self.status = status
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path == "/status":
                    body, code = json.dumps(owner.status).encode(), 200
                elif self.path == "/healthz":
                    body, code = b"ok", 200
                else:
                    body, code = b"not found", 404
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.port = self.server.server_address[1]

    def __enter__(self) -> "StandinTimeslicer":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
