"""One OpenRL process: any set of roles over one runtime.

`openrl serve` runs every role in one process over the embedded log and a SQLite store:
the gateway answers HTTP on the event loop; the projector, trainer and sampler each run
their consume loop in a thread (torch releases the GIL in its kernels), and the trainer
and sampler take turns on the accelerator through a timeslicer daemon the process runs
itself on <data_dir>/timeslicer.sock (or the node's, when `timeslicer_socket` is set),
reached over the socket exactly as separate worker processes reach the node's daemon.
The distributed deployment runs the same roles one per process (`openrl gateway`,
`openrl trainer`, …) over Kafka and PostgreSQL.
Shutdown (SIGTERM, SIGINT) stops the loops, then closes the log.
"""

from __future__ import annotations

import logging
import signal
import socket as socket_module
import threading
from typing import Iterable, Optional

import uvicorn

from eventing import topics
from eventing.projector import Projector
from functions.heap import settle_startup_heap
from functions.runtime import Runtime
from functions.timeslicer import setup as timeslicer_setup
from functions.trainer.snapshots import SnapshotStore
from openrl_core.settings import Settings

log = logging.getLogger("openrl.serve")
ROLES = ("gateway", "projector", "trainer", "sampler")
# Roles a Node runs only when named (`openrl audit`, `openrl metrics`), not in `openrl serve`:
# the audit fsyncs a line per event on top of the log's own fsync, and metrics binds a port
# of its own; one-machine users who want them run them beside `openrl serve`.
OPTIONAL_ROLES = ("audit", "metrics")
MODEL_ROLES = {"gateway", "trainer", "sampler"}


class Node:
    def __init__(
        self,
        settings: Settings,
        roles: Iterable[str] = ROLES,
        base_models: Optional[list[str]] = None,
        trainer_kinds: Iterable[str] = ("lora", "full"),
        only_model: Optional[str] = None,
    ) -> None:
        self.settings = settings
        self.roles = tuple(roles)
        unknown = set(self.roles) - set(ROLES) - set(OPTIONAL_ROLES)
        if unknown:
            raise ValueError(f"unknown roles {sorted(unknown)}")
        self.runtime = rt = Runtime(settings)
        # Workers subscribe to the topics of the weights they hold; aliases share them.
        self.base_models = sorted({rt.catalog.canonical(m) for m in base_models}) if base_models else None
        base_models = self.base_models
        # Only the roles that read weights or tokenizers build the local model files; the
        # projector, audit and metrics start without them.
        if MODEL_ROLES & set(self.roles):
            for name in base_models or rt.catalog.names():
                files = rt.models.files(name)
                log.info("model %s ready at %s", files.name, files.path)
        self._stop = threading.Event()
        self._loops: list[tuple[str, object]] = []
        self.app = None
        self.timeslicer = None
        socket = None
        if {"trainer", "sampler"} <= set(self.roles) and settings.timeslicer_socket is None:
            from functions.timeslicer.daemon import Daemon

            socket = timeslicer_setup.socket_path(settings)
            self.timeslicer = Daemon(timeslicer_setup.service(settings), socket)
            self.timeslicer.start_in_thread()
        self._clients = []

        def slicer(role: str):
            client = timeslicer_setup.connect(settings, self._instance_id(role), socket=socket)
            self._clients.append(client)
            return client

        if "gateway" in self.roles:
            from functions.gateway.app import create_app
            from functions.gateway.relay import OutboxRelay
            from functions.gateway.routes.checkpoints import Reaper

            self.ctx = rt.gateway_context()
            self.app = create_app(self.ctx)
            # Checkpoint TTLs: expired records and the blobs only they used are removed periodically.
            self._loops.append(("reaper", Reaper(self.ctx, settings.checkpoint_reaper_seconds)))
            self._loops.append(("outbox", OutboxRelay(self.ctx)))
            if settings.blob_collector_seconds > 0:
                from functions.collector import BlobCollector, CollectorLoop

                # The gateway holds the event store and the blob store: the records and the files.
                snapshots = SnapshotStore(settings.data_dir / "snapshots", rt.blobs)
                collector = BlobCollector(
                    self.ctx.projections, rt.blobs, settings.sampler_versions_kept, settings.blob_grace_seconds,
                    pinned=[snapshots.referenced],
                )  # fmt: skip
                self._loops.append(("collector", CollectorLoop(collector, settings.blob_collector_seconds)))
        if "projector" in self.roles:
            tracer = None
            if settings.otel_endpoint:  # only then is OpenTelemetry's SDK imported
                from functions.request_traces import RequestTracer

                tracer = RequestTracer.from_settings(settings, rt.store)
            projector = Projector(
                rt.bus, rt.store, rt.notifier, instance_id=self._instance_id("projector"),
                observer=tracer.observe if tracer is not None else None,
            )  # fmt: skip
            self._loops.append(("projector", projector))
            if tracer is not None:
                self._loops.append(("otel", tracer))
            if "gateway" in self.roles and settings.bus == "embedded":
                # One process writes every future here (the embedded log has no other), so a
                # future its store committed unfinished and has not seen finish is running:
                # the gateway's first look at it need not read (eventing/store/finished.py).
                rt.store.finished.follow_pending()
                # For the same reason every change of a run's row is this process's own: the
                # gateway may keep the rows it looked up (eventing/store/known_runs.py). On
                # PostgreSQL its context follows them already, with an age bound kept here.
                if not rt.store.runs.following:
                    rt.store.runs.follow()
        if "trainer" in self.roles:
            from functions.trainer.worker import TrainerWorker

            snapshots = SnapshotStore(settings.data_dir / "snapshots", rt.blobs)
            from functions.trainer.worker import TrainerOptions

            options = TrainerOptions(
                kinds=tuple(trainer_kinds), only_model=only_model, serving_dtype=settings.serving_dtype,
                delta_full_every=settings.delta_full_every, delta_max_share=settings.delta_max_share,
                pack=settings.trainer_packing, pack_linger=settings.trainer_pack_linger_ms / 1000, pack_max_tokens=settings.trainer_pack_max_tokens,
                cohort_wait=settings.trainer_cohort_wait_ms / 1000,
                pack_max_rows=settings.trainer_pack_max_rows,
                pack_max_shared_bytes=settings.trainer_pack_max_shared_mib << 20,
                release_memory=settings.release_host_memory,
                release_idle_seconds=settings.release_host_memory_idle_ms / 1000,
                release_runs_after=settings.trainer_release_runs_after_s,
                precision=settings.trainer_precision,
                activation_checkpointing=settings.trainer_activation_checkpointing,
                full_shards=settings.trainer_full_shards,
            )  # fmt: skip
            self.trainer = TrainerWorker(
                rt.bus, rt.publisher, rt.blobs, rt.models, slicer("trainer"), settings.device,
                base_models=base_models, snapshots=snapshots, snapshot_every_steps=settings.snapshot_every_steps,
                instance_id=self._instance_id("trainer"), options=options,
                group="openrl-trainer" if only_model is None else f"openrl-trainer-{topics.model_slug(only_model)}",
            )  # fmt: skip
            self._loops.append(("trainer", self.trainer))
        if "sampler" in self.roles:
            from functions.sampler.worker import SamplerWorker, engine_options

            self.sampler = SamplerWorker(
                rt.bus, rt.publisher, rt.blobs, rt.models, slicer("sampler"), settings.device,
                settings.sampler_max_batch_rows, settings.sampler_max_adapters, base_models=base_models,
                instance_id=self._instance_id("sampler"), max_full_models=settings.sampler_max_full_models,
                share_base=settings.share_base_weights, release_memory=settings.release_host_memory,
                release_idle_seconds=settings.release_host_memory_idle_ms / 1000,
                cohort_wait=settings.sampler_cohort_wait_ms / 1000,
                max_run_versions=settings.sampler_versions_kept,
                **engine_options(settings),
            )  # fmt: skip
            self._loops.append(("sampler", self.sampler))
        if "audit" in self.roles:
            from functions.audit import AuditConsumer

            self._loops.append(
                ("audit", AuditConsumer.from_settings(rt.bus, rt.codec, settings, self._instance_id("audit")))
            )
        if "metrics" in self.roles:
            from functions.metrics import MetricsService

            self.metrics = MetricsService.from_settings(rt.bus, rt.codec, settings, self._instance_id("metrics"))
            self._loops.append(("metrics", self.metrics))
        self._threads = [
            threading.Thread(target=loop.run, args=(self._stop,), name=name, daemon=True) for name, loop in self._loops
        ]

    def _instance_id(self, role: str) -> str:
        """Stable across restarts of this replica, so its successor takes over without a wait."""
        suffix = "-" + topics.model_slug(",".join(self.base_models)) if self.base_models else ""
        return self.settings.instance_id or f"{role}-{socket_module.gethostname()}{suffix}"

    def start_workers(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            if thread.ident is not None:  # a node stopped before it started has none to join
                thread.join(timeout=30)
        for client in self._clients:
            client.close()
        if self.timeslicer is not None:
            self.timeslicer.stop()
        self.runtime.close()

    def serve_forever(self) -> None:
        # Everything start-up built lives as long as the process: out of the collector's
        # full passes, which otherwise stop every thread for tens of milliseconds (functions/heap.py).
        settle_startup_heap()
        self.start_workers()
        try:
            if self.app is not None:
                # No access log: at log level warning uvicorn prints none of its lines anyway,
                # but with it on it still formats each request's (2-3% of the event loop).
                config = uvicorn.Config(
                    self.app, host=self.settings.host, port=self.settings.port, log_level="warning", timeout_keep_alive=75,
                    access_log=False,
                )  # fmt: skip
                uvicorn.Server(config).run()
            else:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(signum, lambda *_: self._stop.set())
                self._stop.wait()
        finally:
            self.stop()
