"""The few ASGI steps a consumer function (audit, metrics) needs: read a request, answer it, decode a CloudEvent.

A Knative KafkaSource pushes each record as an HTTP POST in CloudEvents binary mode (`ce-*`
headers, the payload as the body); `cloud_event` turns one into a typed `Event` with the
same codec the log consumer uses, so both paths feed the same code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from eventing.codec import Codec
from openrl_core.events import Event
from openrl_core.settings import Settings


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


async def event_or_answer(codec: Codec, request: Request, send) -> Optional[Event]:
    """The request's event; or None once the request is answered with why it has none."""
    try:
        return cloud_event(codec, request)
    except OSError as exc:  # the blob store (claim check) is unreachable: worth a retry
        await respond_json(send, 503, {"detail": f"payload unavailable: {exc}"})
    except Exception as exc:
        # 4xx: the source must not retry a body that can never decode (a dead-letter sink,
        # where configured, keeps it).
        await respond_json(send, 400, {"detail": f"not an OpenRL CloudEvent: {type(exc).__name__}: {exc}"})
    return None


def settings_from(cfg: dict) -> Settings:
    """A function's settings from the func-python start() config (OPENRL_* keys, any case)."""
    return Settings(**{k.lower(): v for k, v in cfg.items() if k.lower() in Settings.model_fields})
