"""The gateway function: the Tinker HTTP API as an ASGI app over the event store and log.

`create_app(ctx)` builds the FastAPI app; `new()` is the Knative Functions entry point
(func-python lifecycle: `handle` is ASGI, `start(cfg)` builds the context from settings).
On a cluster the function is the whole gateway process, so `start` also runs what
`openrl gateway` runs beside the app: the checkpoint TTL reaper and the outbox relay.
func-python keeps the ASGI lifespan to itself, so the long-poll waiters are bound to the
event loop on the first request instead of at app startup.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI

from functions.gateway import downloads, errors, openapi
from functions.gateway.body_limit import BodyLimit
from functions.gateway.context import GatewayContext
from functions.gateway.fast_lane import GatewayApp
from functions.gateway.routes import (
    admin,
    checkpoints,
    client,
    dashboard,
    futures,
    models,
    openai_compat,
    openrl_forks,
    openrl_live,
    openrl_runs,
    openrl_store,
    openrl_timeline,
    runs,
    sampling,
    session_rest,
    sessions,
    training,
)

log = logging.getLogger(__name__)


def create_app(ctx: GatewayContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.waiters.bind(asyncio.get_running_loop())
        yield

    app = GatewayApp(title="OpenRL gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.add_middleware(BodyLimit, limit=ctx.settings.max_request_bytes)
    errors.install(app)
    for module in (client, sessions, models, training, sampling, futures):
        app.include_router(module.router)
    for module in (runs, checkpoints, downloads, session_rest, admin):
        app.include_router(module.router)
    app.include_router(openai_compat.router)  # /v1: the OpenAI-compatible endpoint
    # OpenRL's own API, /api/openrl/v1 (the `openrl runs` CLI), and the dashboard page over it
    for module in (openrl_runs, openrl_forks, openrl_store, openrl_live, openrl_timeline, dashboard):
        app.include_router(module.router)
    openapi.install(app)  # /openapi.json: every route's real bodies and statuses
    app.enable_fast_lane()  # last: it reads the finished route table
    return app


class GatewayFunction:
    """func-python shape: handle(scope, receive, send) plus start/stop/alive/ready."""

    def __init__(self) -> None:
        self._app: Optional[FastAPI] = None
        self._runtime = None
        self._ctx: Optional[GatewayContext] = None
        self._bound = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, cfg: dict) -> None:
        from functions.gateway.relay import OutboxRelay
        from functions.gateway.routes.checkpoints import Reaper
        from functions.runtime import Runtime
        from openrl_core.settings import Settings

        self._runtime = Runtime(
            Settings(**{k.lower(): v for k, v in cfg.items() if k.lower() in Settings.model_fields})
        )
        self._ctx = self._runtime.gateway_context()
        self._app = create_app(self._ctx)
        settings = self._runtime.settings
        for name, loop in (
            ("reaper", Reaper(self._ctx, settings.checkpoint_reaper_seconds)),
            ("outbox", OutboxRelay(self._ctx)),
        ):
            thread = threading.Thread(target=loop.run, args=(self._stop,), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        if self._runtime is not None:
            self._runtime.close()

    def alive(self) -> tuple[bool, str]:
        return True, "alive"

    def ready(self) -> tuple[bool, str]:
        return (self._app is not None), ("ready" if self._app is not None else "starting")

    async def handle(self, scope, receive, send) -> None:
        if self._app is None:
            raise RuntimeError("gateway function not started")
        if not self._bound and scope["type"] == "http":
            self._ctx.waiters.bind(asyncio.get_running_loop())
            self._bound = True
        await self._app(scope, receive, send)


def new() -> GatewayFunction:
    return GatewayFunction()
