"""The gateway function: the Tinker HTTP API as an ASGI app over the event store and log.

`create_app(ctx)` builds the FastAPI app; `new()` is the Knative Functions entry point
(func-python lifecycle: `handle` is ASGI, `start(cfg)` builds the context from settings).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI

from functions.gateway import errors
from functions.gateway.context import GatewayContext
from functions.gateway.routes import client, futures, models, sampling, sessions, training
from functions.gateway import downloads
from functions.gateway.routes import checkpoints, runs
from functions.gateway.routes import unsupported

log = logging.getLogger(__name__)


def create_app(ctx: GatewayContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.waiters.bind(asyncio.get_running_loop())
        yield

    app = FastAPI(title="OpenRL gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    errors.install(app)
    for module in (client, sessions, models, training, sampling, futures):
        app.include_router(module.router)
    for module in (runs, checkpoints, downloads):
        app.include_router(module.router)
    app.include_router(unsupported.router)  # Tinker endpoints a self-hosted server refuses, with reasons
    return app


class GatewayFunction:
    """func-python shape: handle(scope, receive, send) plus start/stop/alive/ready."""

    def __init__(self) -> None:
        self._app: Optional[FastAPI] = None
        self._runtime = None

    def start(self, cfg: dict) -> None:
        from functions.runtime import Runtime
        from openrl_core.settings import Settings

        self._runtime = Runtime(Settings(**{k.lower(): v for k, v in cfg.items() if k.lower() in Settings.model_fields}))
        self._app = create_app(self._runtime.gateway_context())

    def stop(self) -> None:
        if self._runtime is not None:
            self._runtime.close()

    def alive(self) -> tuple[bool, str]:
        return True, "alive"

    def ready(self) -> tuple[bool, str]:
        return (self._app is not None), ("ready" if self._app is not None else "starting")

    async def handle(self, scope, receive, send) -> None:
        if self._app is None:
            raise RuntimeError("gateway function not started")
        await self._app(scope, receive, send)


def new() -> GatewayFunction:
    return GatewayFunction()
