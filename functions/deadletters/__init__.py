"""The dead-letter sink: keeps every event a KafkaSource could not deliver after all its retries.

Each POST is written whole (its headers, including Knative's `kn-error-*` ones, and its body)
to `<data_dir>/dead-letters/<sha256>.json`, named by the content so a redelivered dead
letter overwrites itself instead of piling up, and fsynced before the 200. An operator reads
them, fixes the cause, and replays the events from the log (`openrl replay --from-log`).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Optional

from functions import event_asgi as asgi


def keep(directory: Path, headers: dict[str, str], body: bytes) -> str:
    record = {"headers": dict(sorted(headers.items())), "body_base64": base64.b64encode(body).decode()}
    text = json.dumps(record, sort_keys=True).encode()
    name = hashlib.sha256(text).hexdigest() + ".json"
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / (name + ".partial")
    with open(partial, "wb") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, directory / name)
    return name


class DeadLetterFunction:
    def __init__(self, directory: Optional[Path] = None) -> None:
        self.directory = directory

    def start(self, cfg: dict) -> None:
        self.directory = asgi.settings_from(cfg).data_dir / "dead-letters"

    def alive(self) -> tuple[bool, str]:
        return True, "alive"

    def ready(self) -> tuple[bool, str]:
        return self.directory is not None, ("ready" if self.directory is not None else "starting")

    async def handle(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await asgi.lifespan(receive, send)
            return
        if self.directory is None:
            raise RuntimeError("dead-letter function not started")
        request = await asgi.read_request(scope, receive)
        if request.method != "POST":
            await asgi.respond_json(send, 405, {"detail": "POST a dead letter to keep it"})
            return
        name = await asyncio.to_thread(keep, self.directory, request.headers, request.body)
        await asgi.respond_json(send, 200, {"kept": name})


def new() -> DeadLetterFunction:
    return DeadLetterFunction()
