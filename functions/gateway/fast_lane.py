"""The hot Tinker routes served without FastAPI's generic request machinery.

A future costs two requests (submit, then a long-polled `retrieve_future`), and with a
no-op worker the framework around them was the largest single part of the server's work:
six middlewares, a linear route match over every router, dependency solving and the
telemetry wrappers. Bypassing it saved about 0.45 ms of CPU per request here (4.9 against
4.0 ms per future, bench/futures_throughput.py; the profile is in README.md at 40db992).

The routes taken are exactly those whose endpoint is `async def f(request, ctx, tenant)`
with nothing else to solve (no body, query or path parameters, no other dependency, the
default response class): the endpoint reads its own body. For those this lane does what
FastAPI would, in the same order, with FastAPI's own pieces:
- the server-wide body limit (`BodyLimit`, the same class every other route is behind);
- `scope["app"]` and `scope["route"]`, which the error handlers and the refusal audit read;
- the tenant from the API key (`deps.tenant_of_request`);
- the return value validated and serialized by the route's own response field
  (`fastapi.routing.serialize_response`, FastAPI's JSON fast path);
- an exception answered by the app's own handler for its class (Starlette's lookup along
  the MRO), a handler-less one re-raised after its 500 as ServerErrorMiddleware does.
Every other request, any of these under a `root_path`, and all of them while FastAPI's
OpenTelemetry instrumentation is on (an operator who installed a tracer or meter provider
gets the hot routes' spans and metrics too), go through FastAPI. The route table is read
from the app once its routes are all in (`enable_fast_lane`, last in `create_app`); a
route added later is FastAPI's. `tests/functions/gateway/test_fast_lane.py` sends the same
requests through both paths and compares the answers byte for byte.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Callable, Optional

from fastapi import FastAPI
from fastapi.datastructures import DefaultPlaceholder
from fastapi.routing import APIRoute, serialize_response
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from functions.gateway import deps
from functions.gateway.body_limit import BodyLimit
from functions.gateway.route_tree import leaf_routes

TELEMETRY_RECHECK_SECONDS = 1.0


@dataclass(frozen=True)
class LaneRoute:
    route: APIRoute
    request_arg: str  # the endpoint's name for its Request


def lane_routes(app: FastAPI) -> dict[str, LaneRoute]:
    """POST path -> route, for every route the lane can serve exactly as FastAPI does. A path
    that more than one route takes POST on is left to FastAPI, which decides between them."""
    posts: dict[str, list[APIRoute]] = {}
    for prefix, route in leaf_routes(app.routes):
        if isinstance(route, APIRoute) and "POST" in route.methods:
            posts.setdefault(prefix + route.path, []).append(route)
    table: dict[str, LaneRoute] = {}
    for path, routes in posts.items():
        route = routes[0]
        dependant = route.dependant
        plain = (
            len(routes) == 1
            and route.methods == {"POST"}
            and "{" not in path
            and isinstance(route.response_class, DefaultPlaceholder)
            and route.status_code is None
            and dependant.request_param_name is not None
            and not (dependant.path_params or dependant.query_params or dependant.header_params)
            and not (dependant.cookie_params or dependant.body_params)
            and dependant.background_tasks_param_name is None
            and dependant.response_param_name is None
            and inspect.iscoroutinefunction(route.endpoint)
            and [(d.call, d.name) for d in dependant.dependencies]
            == [(deps.get_ctx, "ctx"), (deps.get_tenant, "tenant")]
        )
        if plain:
            table[path] = LaneRoute(route, dependant.request_param_name)
    return table


class GatewayApp(FastAPI):
    """The gateway's FastAPI app, with the hot routes taken by the lane (see the module doc)."""

    _lane: Optional[dict[str, LaneRoute]] = None
    _limited: Optional[BodyLimit] = None
    _telemetry_until: float = float("-inf")  # `_telemetry_on` holds until then (monotonic)
    _telemetry_on: bool = False

    def enable_fast_lane(self) -> None:
        """Take the lane's routes; its body limit is the server-wide one (`state.ctx`'s settings)."""
        self._lane = lane_routes(self)
        self._limited = BodyLimit(self._serve_lane, limit=self.state.ctx.settings.max_request_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lane = self._lane
        if (
            lane is not None
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and not scope.get("root_path")
            and scope["path"] in lane
            and not self._telemetry_enabled()
        ):
            await self._limited(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def _telemetry_enabled(self) -> bool:
        """FastAPI's check whether OpenTelemetry is on, looked at once a second: it reads
        three providers and the environment each time (about 3 us, 6% of the event loop's
        work per future), and a provider is installed once, at start-up, not per request.
        One installed while serving takes its routes from the lane within a second."""
        now = time.monotonic()
        if now >= self._telemetry_until:
            self._telemetry_on = self._native_telemetry.enabled()
            self._telemetry_until = now + TELEMETRY_RECHECK_SECONDS
        return self._telemetry_on

    async def _serve_lane(self, scope: Scope, receive: Receive, send: Send) -> None:
        taken = self._lane[scope["path"]]
        scope["app"] = self
        scope["route"] = taken.route
        scope["endpoint"] = taken.route.endpoint
        scope.setdefault("path_params", {})
        request = Request(scope, receive, send)
        try:
            ctx = self.state.ctx
            tenant = deps.tenant_of_request(request)
            result = await taken.route.endpoint(**{taken.request_arg: request, "ctx": ctx, "tenant": tenant})
            if isinstance(result, Response):
                response = result
            else:
                body = await serialize_response(
                    field=taken.route.response_field, response_content=result, dump_json=True
                )
                response = Response(content=body, media_type="application/json")
        except Exception as exc:
            handler, last_resort = self._handler_for(exc)
            if handler is None:
                raise
            response = await handler(request, exc)
            await response(scope, receive, send)
            if last_resort:
                raise  # as ServerErrorMiddleware: the server logs it too
            return
        await response(scope, receive, send)

    def _handler_for(self, exc: Exception) -> tuple[Optional[Callable], bool]:
        handlers = self.exception_handlers
        for cls in type(exc).__mro__:
            if cls in handlers:
                return handlers[cls], cls is Exception
        return None, False
