"""The metrics function's front doors: the log consumer with its /metrics server, and `handle`.

Start position and restarts (`MetricsService`, what `openrl metrics` runs): the state is
saved to `<data_dir>/metrics/state.json` and the consumer group is named after the saved
state's epoch (`openrl-metrics-<epoch>`). A first start, or a start whose saved state is
gone, makes a new epoch, hence a new group that reads every topic from the beginning: the
counters are rebuilt from the whole log. A restart loads the saved state and resumes from
its group's committed offsets. Offsets are committed only right after a save, and a save
happens every `metrics_checkpoint_seconds` and before half a dedup window of events is
unsaved, so everything delivered again after a crash or rebalance is either not in the
saved state (and is applied now) or among the remembered ids (and is ignored): exact.
A poll that returns nothing settles the finishes still waiting for their request (see
`state.py`): on the embedded log an empty poll means every partition is at its end; on
Kafka it usually does, and a request that turns up after its finish was settled is counted
without ever entering the queue depth.

`MetricsFunction` (Knative, func-python) is stateless as far as Knative knows: it loads the
saved state on `start`, folds each pushed CloudEvent in, serves `GET /metrics`, and saves
on the same cadence and on `stop`. A KafkaSource does not wait for those saves, so a pod
killed without `stop` loses what it acknowledged since the last save (at most
`metrics_checkpoint_seconds` of events); run one replica, with `data_dir` on a volume.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST, start_http_server

from eventing import topics
from eventing.blobs import BlobStore
from eventing.bus import EventBus
from eventing.codec import Codec
from functions import event_asgi as asgi
from functions.metrics.exposition import Metrics
from openrl_core.settings import Settings

log = logging.getLogger(__name__)
MAX_BATCH = 256
EARLY_GRACE_SECONDS = 600.0


def state_path(settings: Settings) -> Path:
    return settings.data_dir / "metrics" / "state.json"


def load_metrics(settings: Settings) -> Metrics:
    return Metrics.load(state_path(settings), settings.metrics_dedup_window, settings.metrics_rate_window_seconds)


class MetricsService:
    def __init__(
        self, bus: EventBus, codec: Codec, metrics: Metrics, *, host: str = "127.0.0.1", port: int = 9464,
        checkpoint_seconds: float = 5.0, instance_id: Optional[str] = None,
    ) -> None:  # fmt: skip
        self.codec = codec
        self.metrics = metrics
        self.host, self.port = host, port
        self.checkpoint_seconds = checkpoint_seconds
        self.group = f"openrl-metrics-{metrics.state.epoch}"
        self.consumer = bus.consumer(
            self.group, pattern=topics.everything(), from_beginning=True, instance_id=instance_id
        )
        self._last_save = time.monotonic()
        self._server = None

    @classmethod
    def from_settings(
        cls, bus: EventBus, codec: Codec, settings: Settings, instance_id: Optional[str] = None
    ) -> "MetricsService":
        return cls(
            bus, codec, load_metrics(settings), host=settings.metrics_host, port=settings.metrics_port,
            checkpoint_seconds=settings.metrics_checkpoint_seconds, instance_id=instance_id,
        )  # fmt: skip

    def run_once(self, timeout: float = 1.0) -> int:
        records = self.consumer.poll(max_records=MAX_BATCH, timeout=timeout)
        if not records:
            # Every partition is at its end, so every request appended before a finish
            # already read has been read too: a finish still waiting for one never will.
            self.metrics.settle()
        events = []
        for record in records:
            try:
                events.append(self.codec.decode(record.message))
            except Exception:  # a poison record must not stop the counting of every other
                log.exception(
                    "metrics: undecodable record %s/%s@%s skipped", record.topic, record.partition, record.offset
                )
        self.metrics.ingest(events)
        if self.metrics.unsaved and (
            self.metrics.save_due() or time.monotonic() - self._last_save >= self.checkpoint_seconds
        ):
            self.checkpoint()
        return len(records)

    def checkpoint(self) -> None:
        """Save, then commit: committed offsets never run ahead of the saved state."""
        self.metrics.save()
        self.consumer.commit()
        self._last_save = time.monotonic()

    def serve_http(self) -> int:
        """Start /metrics on (host, port); returns the bound port (port 0 picks a free one)."""
        self._server, _ = start_http_server(self.port, addr=self.host, registry=self.metrics.registry)
        self.port = self._server.server_address[1]
        log.info("metrics: serving http://%s:%s/metrics", self.host, self.port)
        return self.port

    def run(self, stop: threading.Event) -> None:
        try:
            if self._server is None:
                self.serve_http()
            while not stop.is_set():
                try:
                    self.run_once(timeout=0.5)
                except Exception:
                    log.exception("metrics: batch failed; retrying")
                    stop.wait(0.5)
        finally:
            self.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        try:
            self.checkpoint()
        finally:
            self.consumer.close()


class MetricsFunction:
    """func-python shape: handle(scope, receive, send) plus start/stop/alive/ready."""

    def __init__(
        self, metrics: Optional[Metrics] = None, codec: Optional[Codec] = None, checkpoint_seconds: float = 5.0
    ) -> None:
        self.metrics = metrics
        self.codec = codec
        self.checkpoint_seconds = checkpoint_seconds
        self._last_save = time.monotonic()

    def start(self, cfg: dict) -> None:
        settings = asgi.settings_from(cfg)
        self.codec = Codec(BlobStore(settings.data_dir / "blobs"), settings.inline_payload_limit)
        self.metrics = load_metrics(settings)
        self.checkpoint_seconds = settings.metrics_checkpoint_seconds

    def stop(self) -> None:
        if self.metrics is not None:
            self.metrics.save()

    def alive(self) -> tuple[bool, str]:
        return True, "alive"

    def ready(self) -> tuple[bool, str]:
        started = self.metrics is not None and self.codec is not None
        return started, ("ready" if started else "starting")

    async def handle(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await asgi.lifespan(receive, send)
            return
        if self.metrics is None or self.codec is None:
            raise RuntimeError("metrics function not started")
        request = await asgi.read_request(scope, receive)
        if request.method == "GET":
            if request.path.rstrip("/") != "/metrics":
                await asgi.respond_json(send, 404, {"detail": "metrics are at GET /metrics"})
                return
            body = await asyncio.to_thread(self.metrics.exposition)
            await asgi.respond(send, 200, body, CONTENT_TYPE_LATEST)
            return
        if request.method != "POST":
            await asgi.respond_json(send, 405, {"detail": "GET /metrics, or POST a CloudEvent (binary mode)"})
            return
        event = await asgi.event_or_answer(self.codec, request, send)
        if event is None:
            return
        applied = self.metrics.ingest([event])
        # Pushed deliveries have no "caught up" moment: a finish waits at most this long
        # (event time) for its request, which a live source delivers within seconds.
        self.metrics.settle(grace=EARLY_GRACE_SECONDS)
        if self.metrics.save_due() or time.monotonic() - self._last_save >= self.checkpoint_seconds:
            self._last_save = time.monotonic()
            await asyncio.to_thread(self.metrics.save)
        await asgi.respond_json(send, 200, {"id": event.id, "applied": bool(applied)})
