"""Every status a route can answer is in its OpenAPI description, derived from the routes
themselves rather than written down twice.

Each route of the app gets real requests (`test_tenant_isolation.cases`, as the owner and as
another tenant, plus the routes that take no object id) against a gateway on PostgreSQL,
reached through a TCP proxy the test controls:

- every status answered is documented for its route;
- a route that recorded an event (any but the audit of a refused lookup, which never fails
  its request) documents 507: an event's payload over `inline_payload_limit` goes to the
  blob store, and a full data disk there is a `StorageFull` (the OpenAI routes, which wait
  for a sampler this rig does not run, record their samples as `asample` does);
- with the store cut away, every route that answers 503 documents it, and every route that
  documents 503 answers it: the description is exact there.

`test_a_full_blob_disk_is_a_507_on_the_wire_and_stores_nothing` shows the 507 path for real,
on a size-limited tmpfs (tests/small_disk.py; skipped where mounting is not allowed).
"""

from __future__ import annotations

from collections import defaultdict
from urllib.parse import urlsplit

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from eventing.store import tables
from functions.gateway.app import create_app
from functions.runtime import Runtime
from openrl_core.settings import Settings
from tests.eventing.tcp_proxy import TcpProxy
from tests.functions.gateway.rest_rig import ALICE, BOB, MODEL, OPERATOR, Rig
from tests.functions.gateway.route_requests import STORE_ONLY_AT_TIMES, WAITS_FOR_A_WORKER, every_request, send
from tests.functions.gateway.test_tenant_isolation import app_routes
from tests.small_disk import fill, small_disk

pytestmark = pytest.mark.postgres
REFUSED_LOOKUP = "access.lookup.refused"


@pytest.fixture
def gateway(tmp_path, tiny_files, pg_url):
    where = urlsplit(pg_url.replace("postgresql+psycopg://", "postgresql://", 1))
    proxy = TcpProxy(where.hostname, where.port or 5432)
    settings = Settings(
        data_dir=tmp_path, models=[MODEL], api_keys=[f"alice={ALICE}", f"bob={BOB}"], operator_api_key=OPERATOR,
        database_url=proxy.url_for(pg_url), long_poll_seconds=0.5,
    )  # fmt: skip
    runtime = Runtime(settings)
    try:
        with TestClient(create_app(runtime.gateway_context())) as client:
            yield Rig(client, runtime), proxy
    finally:
        proxy.restore()
        runtime.close()
        proxy.close()


def recorded(rig: Rig) -> int:
    with rig.runtime.engine.connect() as conn:
        return conn.execute(select(func.count()).where(tables.events.c.type.notlike(f"%{REFUSED_LOOKUP}%"))).scalar()


def documented(spec: dict) -> dict[tuple[str, str], set[int]]:
    return {
        (method.upper(), path): {int(code) for code in operation["responses"]}
        for path, item in spec["paths"].items()
        for method, operation in item.items()
    }


def test_every_status_a_route_answers_is_in_its_description(gateway):
    rig, proxy = gateway
    spec = documented(rig.client.get("/openapi.json").json())
    requests = every_request(rig)
    assert {route for route, *_ in requests} == app_routes(rig.client.app)  # every route is called

    answered: dict[tuple[str, str], set[int]] = defaultdict(set)
    emitting: set[tuple[str, str]] = set()
    for route, key, method, path, body in requests:
        if key == ALICE and route in WAITS_FOR_A_WORKER:
            continue
        before = recorded(rig)
        answered[route].add(send(rig, key, method, path, body).status_code)
        if recorded(rig) > before:
            emitting.add(route)
    proxy.cut()
    unreachable: set[tuple[str, str]] = set()
    for route, key, method, path, body in requests:
        response = send(rig, key, method, path, body)
        if response.status_code == 503:
            unreachable.add(route)
            assert int(response.headers["retry-after"]) > 0, (route, response.headers)
        else:
            answered[route].add(response.status_code)
    proxy.restore()
    in_schema = {route for route in answered if route in spec}
    undocumented = {
        route: sorted(answered[route] - spec[route]) for route in in_schema if answered[route] - spec[route]
    }
    assert not undocumented, undocumented
    assert emitting >= {
        ("POST", "/api/v1/create_session"),
        ("POST", "/api/v1/forward_backward"),
        ("POST", "/api/v1/asample"),
    }
    assert not {route for route in emitting & in_schema if 507 not in spec[route]}
    assert unreachable & in_schema == {route for route in in_schema if 503 in spec[route]} - set(STORE_ONLY_AT_TIMES)


def test_a_full_blob_disk_is_a_507_on_the_wire_and_stores_nothing(tmp_path, tiny_files):
    """The path the 507s above stand for: payloads over `inline_payload_limit` go to the blob
    store; with its disk full the request is a 507 that names the full disk, nothing is
    stored, and the same request goes through once space is freed."""
    with small_disk(tmp_path / "data" / "blobs", "1m") as disk:
        runtime = Runtime(
            Settings(data_dir=tmp_path / "data", models=[MODEL], api_keys=[f"alice={ALICE}"], inline_payload_limit=1024)
        )
        try:
            with TestClient(create_app(runtime.gateway_context())) as client:
                rig = Rig(client, runtime)
                spec = documented(client.get("/openapi.json").json())
                session = rig.session()
                sampler = rig.ok(
                    "POST",
                    "/api/v1/create_sampling_session",
                    {"session_id": session, "sampling_session_seq_id": 0, "base_model": MODEL},
                )
                big_session = {"tags": [], "user_metadata": {"notes": "x" * 4096}}
                prompt = {"chunks": [{"type": "encoded_text", "tokens": list(range(1, 600))}]}
                big_sample = {"sampling_session_id": sampler["sampling_session_id"], "seq_id": 1, "num_samples": 1, "prompt": prompt,
                              "sampling_params": {"max_tokens": 2}}  # fmt: skip
                filler = fill(disk)
                before = rig.snapshot(), rig.count_events()
                for path, body in (("/api/v1/create_session", big_session), ("/api/v1/asample", big_sample)):
                    refused = rig.request("POST", path, body)
                    assert refused.status_code == 507 and 507 in spec[("POST", path)], refused.text
                    assert "data disk is full" in refused.json()["detail"] and str(disk) not in refused.text
                assert (rig.snapshot(), rig.count_events()) == before
                filler.unlink()
                assert rig.request("POST", "/api/v1/create_session", big_session).status_code == 200
                assert rig.request("POST", "/api/v1/asample", big_sample).status_code == 200
        finally:
            runtime.close()
