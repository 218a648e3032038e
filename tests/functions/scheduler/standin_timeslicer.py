"""A stand-in for the node timeslicer's HTTP status endpoint, until the daemon (issue 11) is in this tree.

It serves `GET /status` with JSON of exactly the shape the daemon's interface promises
(node, policy, devices with budget, resident bytes, holder, waiters, residents) and
`GET /healthz`, on a loopback address of the test's choosing. Tests that use it say so;
they switch to the real `openrl timeslicer` once it lands.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def device(index: int, budget: int, residents=(), holder=None, waiters=()) -> dict:
    return {
        "device": f"cuda:{index}",
        "budget_bytes": budget,
        "resident_bytes": sum(r["bytes"] for r in residents if not r["parked"]),
        "holder": holder,
        "waiters": list(waiters),
        "residents": list(residents),
    }


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
