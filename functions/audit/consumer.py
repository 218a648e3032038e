"""The audit function's two front doors over one journal: the log consumer and the HTTP handler.

`AuditConsumer` reads every OpenRL topic (pattern `topics.everything()`) in its own
consumer group from the beginning, so a first start writes the whole history; then each
batch is decoded, appended to the journal (which fsyncs) and only then committed, so a
crash redelivers at most the uncommitted batch, which the journal recognises by event id.
`AuditFunction` is the Knative shape (func-python): `handle` takes one CloudEvent per POST,
as a KafkaSource delivers them, and appends it through the same `AuditJournal.append`; it
answers 200 only after the line is on disk, so the source's retry covers any failure.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Optional

from eventing import topics
from eventing.blobs import BlobStore
from eventing.bus import EventBus
from eventing.codec import Codec
from functions import event_asgi as asgi
from functions.audit.journal import AuditJournal
from openrl_core.settings import Settings

log = logging.getLogger(__name__)
GROUP = "openrl-audit"
MAX_BATCH = 256


def audit_dir(settings: Settings) -> Path:
    return settings.data_dir / "audit"


class AuditConsumer:
    def __init__(
        self, bus: EventBus, codec: Codec, journal: AuditJournal, group: str = GROUP, instance_id: Optional[str] = None
    ) -> None:
        self.codec = codec
        self.journal = journal
        # A batch never exceeds the journal's dedup window, so everything a restart can
        # deliver again is still within the ids the journal remembers.
        self.max_batch = min(MAX_BATCH, journal.window)
        self.consumer = bus.consumer(group, pattern=topics.everything(), from_beginning=True, instance_id=instance_id)

    @classmethod
    def from_settings(
        cls, bus: EventBus, codec: Codec, settings: Settings, instance_id: Optional[str] = None
    ) -> "AuditConsumer":
        return cls(bus, codec, AuditJournal(audit_dir(settings), settings.audit_dedup_window), instance_id=instance_id)

    def run_once(self, timeout: float = 1.0) -> int:
        records = self.consumer.poll(max_records=self.max_batch, timeout=timeout)
        if not records:
            return 0
        events = []
        for record in records:
            try:
                events.append(self.codec.decode(record.message))
            except Exception:  # a poison record must not stall the audit of every tenant
                log.exception(
                    "audit: undecodable record %s/%s@%s skipped", record.topic, record.partition, record.offset
                )
        self.journal.append(events)  # fsynced when it returns
        self.consumer.commit()
        return len(records)

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    self.run_once(timeout=0.5)
                except Exception:
                    log.exception("audit: batch failed; retrying")
                    stop.wait(0.5)
        finally:
            self.close()

    def close(self) -> None:
        self.consumer.close()
        self.journal.close()


class AuditFunction:
    """func-python shape: handle(scope, receive, send) plus start/stop/alive/ready."""

    def __init__(self, journal: Optional[AuditJournal] = None, codec: Optional[Codec] = None) -> None:
        self.journal = journal
        self.codec = codec

    def start(self, cfg: dict) -> None:
        settings = asgi.settings_from(cfg)
        # Claim-checked payloads are read from the blob store, as the log consumer reads them.
        self.codec = Codec(BlobStore(settings.data_dir / "blobs"), settings.inline_payload_limit)
        self.journal = AuditJournal(audit_dir(settings), settings.audit_dedup_window)

    def stop(self) -> None:
        if self.journal is not None:
            self.journal.close()

    def alive(self) -> tuple[bool, str]:
        return True, "alive"

    def ready(self) -> tuple[bool, str]:
        started = self.journal is not None and self.codec is not None
        return started, ("ready" if started else "starting")

    async def handle(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await asgi.lifespan(receive, send)
            return
        if self.journal is None or self.codec is None:
            raise RuntimeError("audit function not started")
        request = await asgi.read_request(scope, receive)
        if request.method != "POST":
            await asgi.respond_json(send, 405, {"detail": "POST a CloudEvent (binary mode) to record it"})
            return
        event = await asgi.event_or_answer(self.codec, request, send)
        if event is None:
            return
        written = await asyncio.to_thread(self.journal.append, [event])
        await asgi.respond_json(send, 200, {"id": event.id, "written": written})
