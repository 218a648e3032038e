"""The infrastructure one process stands on, built from its settings.

Database engine (migrated to head on start), blob store, codec, the event log (embedded
SQLite), the event store and its read side, the model directory and the API-key map.
Every function's `start` and `openrl serve` build exactly one of these.
"""

from __future__ import annotations

from functools import cached_property

from eventing.blobs import BlobStore
from eventing.bus import EventBus, EventPublisher
from eventing.codec import Codec
from eventing.embedded_log import EmbeddedLog
from eventing.notify import LocalNotifier
from eventing.pg_notify import PgNotifier
from eventing.store import database
from eventing.store.event_store import EventStore
from eventing.store.kept import close_kept
from eventing.store.queries import Projections
from functions.compute.models import ModelDirectory
from openrl_core.catalog import Catalog
from openrl_core.settings import Settings

# How long a gateway on PostgreSQL keeps a run's row at most (eventing/store/known_runs.py):
# announcements keep it right; this bounds how wrong a change nobody announced leaves it.
KEPT_RUN_SECONDS = 5.0


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.engine = database.make_engine(settings.resolved_database_url())
        database.upgrade(self.engine)
        self.blobs = BlobStore(settings.data_dir / "blobs")
        self.codec = Codec(self.blobs, settings.inline_payload_limit)
        self.store = EventStore(self.engine, self.codec)
        self.projections = Projections(self.engine)
        # Long-poll wake-ups: in process for SQLite; through LISTEN/NOTIFY for PostgreSQL,
        # where the projector and the gateways may be separate processes.
        self.notifier = (
            PgNotifier(self.engine.url.render_as_string(hide_password=False))
            if self.engine.dialect.name == "postgresql"
            else LocalNotifier()
        )
        if self.engine.dialect.name == "postgresql":
            self.store.announce_runs()  # for the gateways' kept runs, whichever process changes them
        self._gateways: list = []  # the gateway contexts made here: their queued appends finish before the log closes
        self.catalog = Catalog.from_names(settings.models or None, settings.local_models, settings.model_aliases)
        self.models = ModelDirectory(self.catalog, settings.model_cache)

    @cached_property
    def bus(self) -> EventBus:
        if self.settings.bus == "kafka":
            from eventing.kafka_bus import KafkaBus

            return KafkaBus(
                self.settings.kafka_bootstrap,
                partitions=self.settings.log_partitions,
                fetch_max_wait_ms=self.settings.kafka_fetch_max_wait_ms,
                idle_poll_pause_ms=self.settings.kafka_idle_poll_pause_ms,
            )
        return EmbeddedLog(self.settings.data_dir / "log.db", self.settings.log_partitions, self.settings.log_fsync)

    @cached_property
    def publisher(self) -> EventPublisher:
        return EventPublisher(self.bus, self.codec)

    def gateway_context(self):
        from functions.gateway.context import GatewayContext

        tenants = {GatewayContext.hash_key(key): tenant for key, tenant in self.settings.tenant_keys().items()}
        self.projections.register_keys(tenants)
        ctx = GatewayContext(
            settings=self.settings,
            store=self.store,
            projections=self.projections,
            publisher=self.publisher,
            models=self.models,
            key_tenants=tenants,
            operator_key_hash=GatewayContext.hash_key(operator) if (operator := self.settings.operator_key()) else None,
            notifier=self.notifier,
        )
        if isinstance(self.notifier, PgNotifier):
            # Every projector announces what it folded here, so a future this gateway stored
            # unfinished and has heard nothing of since still runs: the first look of its
            # retrieve_future need not read the store (eventing/store/finished.py).
            finished = self.store.finished
            finished.follow_pending()
            # Every store here announces the runs it changed (known_runs.py): this gateway may
            # keep the runs it looked up, dropping each announced one and, as a last resort,
            # any kept longer than KEPT_RUN_SECONDS.
            runs = self.store.runs
            runs.follow(max_age=KEPT_RUN_SECONDS)

            def gap() -> None:
                finished.clear_pending()
                runs.clear()

            def announced(ids: list[str]) -> None:
                finished.forget_pending(ids)  # before the wake-up, so a woken poll reads
                ctx.waiters.notify(ids)

            # Rows a projector sent with its announcement come first: kept, a woken poll
            # answers from them without reading the store (eventing/pg_notify.py).
            self.notifier.subscribe(announced, on_gap=gap, on_rows=finished.put_many, on_runs=runs.changed)
        else:
            self.notifier.subscribe(ctx.waiters.notify)
        ctx.republish_outbox()
        self._gateways.append(ctx)
        return ctx

    def close(self) -> None:
        for ctx in self._gateways:
            ctx.close()
        if "bus" in self.__dict__:
            self.bus.close()
        if isinstance(self.notifier, PgNotifier):
            self.notifier.close()
        close_kept(self.engine)  # the threads' kept connections (eventing/store/kept.py)
        self.engine.dispose()
