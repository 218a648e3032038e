"""The few ASGI steps a consumer function (audit, metrics) needs: read a request, answer it, decode a CloudEvent.

A Knative KafkaSource pushes each record as an HTTP POST in CloudEvents binary mode (`ce-*`
headers, the payload as the body); `cloud_event` turns one into a typed `Event` with the
same codec the log consumer uses, so both paths feed the same code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from eventing.codec import Codec
from openrl_core.events import Event


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


async def read_request(scope, receive) -> Request:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    return Request(scope.get("method", "GET"), scope.get("path", "/"), headers, b"".join(chunks))


async def respond(send, status: int, body: bytes, content_type: str = "application/json") -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type.encode())]})
    await send({"type": "http.response.body", "body": body})


async def respond_json(send, status: int, payload: dict) -> None:
    await respond(send, status, json.dumps(payload).encode())


async def lifespan(receive, send) -> None:
    """Answer the server's startup and shutdown; the function's own start/stop do the work."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def cloud_event(codec: Codec, request: Request) -> Event:
    """Raises (ServerError, ValueError, KeyError…) for a body that is not an OpenRL CloudEvent."""
    return codec.decode_http(request.headers, request.body)
