"""The dashboard: `GET /dashboard`, a page of plain HTML, CSS and JS shipped in this package
(`functions/gateway/dashboard/`), with no build step and nothing fetched from elsewhere.

The page and its two assets hold no data and need no key: the page asks for an API key,
keeps it in the browser's localStorage and calls the JSON API under `/api/openrl/v1` with it
(`openrl_runs`, `openrl_store`, `openrl_live`, `openrl_timeline`), so a tenant's key sees
that tenant's runs and the operator's key every tenant's, as in the CLI. The answers carry a
Content-Security-Policy that allows only this server's own scripts, styles and API, so an
injected string can never load or run code from anywhere else.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from openrl_core.errors import NotFound

router = APIRouter()
ASSETS = Path(__file__).resolve().parents[1] / "dashboard"
TYPES = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data: blob:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _asset(name: str) -> Response:
    media_type = TYPES.get(name)
    if media_type is None:
        raise NotFound(f"no dashboard file {name!r}; there are {', '.join(sorted(TYPES))}")
    return Response((ASSETS / name).read_bytes(), media_type=media_type, headers=HEADERS)


@router.get("/dashboard", include_in_schema=False)
def page() -> Response:
    return _asset("index.html")


@router.get("/dashboard/{name}", include_in_schema=False)
def asset(name: str) -> Response:
    return _asset(name)
