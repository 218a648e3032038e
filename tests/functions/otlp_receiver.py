"""A minimal OTLP/HTTP trace receiver on loopback, for the OpenTelemetry tests.

http.server in a thread; every POST /v1/traces is decoded as the protobuf
ExportTraceServiceRequest (OpenTelemetry's own generated message) and its spans kept.
`hang_s` makes it hold every POST that long before answering: an endpoint that is up but
stuck, the worst case for an exporter.
"""

from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class Receiver:
    def __init__(self, hang_s: float = 0.0) -> None:
        self.spans: list = []  # (resource attributes, span)
        self.posts = 0
        self.hang_s = hang_s
        self._released = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.posts += 1
                if receiver.hang_s:
                    receiver._released.wait(receiver.hang_s)
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans.extend((resource, span) for span in scope_spans.spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, predicate, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.05)
        return predicate()

    def close(self) -> None:
        self._released.set()
        self.server.shutdown()
        self.server.server_close()


def attributes(span) -> dict:
    return {
        a.key: (a.value.int_value if a.value.HasField("int_value") else a.value.string_value) for a in span.attributes
    }
