"""The app's routes as a flat list, through included routers at any depth.

Newer FastAPI keeps an included router as one node (`original_router`, with the prefix in
its `include_context`) instead of copying its routes up, so whoever needs every route with
its full path walks the tree. Two readers: the fast lane (which POST paths it can take) and
the 405 answer (which methods a path allows)."""

from __future__ import annotations

from typing import Iterator

from starlette.routing import BaseRoute


def leaf_routes(routes: list[BaseRoute], prefix: str = "") -> Iterator[tuple[str, BaseRoute]]:
    """(the prefix it is mounted under, route) for every route that is not an included router."""
    for route in routes:
        branch = getattr(route, "original_router", None)
        if branch is not None:
            yield from leaf_routes(
                branch.routes, prefix + getattr(getattr(route, "include_context", None), "prefix", "")
            )
        else:
            yield prefix, route
