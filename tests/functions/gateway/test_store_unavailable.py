"""The event store unreachable (PostgreSQL down, here cut away by a TCP proxy: the server is
shared) is a 503 with `Retry-After` and a message that says so, for writes and reads alike;
the gateway answers normally again as soon as the database is back, with no restart. Other
database errors stay 500s."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import exc as sql_errors

from functions.gateway.app import create_app
from functions.gateway.errors import store_unavailable
from functions.runtime import Runtime
from openrl_core.settings import Settings
from tests.eventing.tcp_proxy import TcpProxy
from tests.functions.gateway.rest_rig import ALICE, MODEL

pytestmark = pytest.mark.postgres


@pytest.fixture
def gateway(tmp_path, tiny_files, pg_url):
    where = urlsplit(pg_url.replace("postgresql+psycopg://", "postgresql://", 1))
    proxy = TcpProxy(where.hostname, where.port or 5432)
    runtime = Runtime(
        Settings(data_dir=tmp_path, models=[MODEL], api_keys=[f"alice={ALICE}"], database_url=proxy.url_for(pg_url))
    )
    try:
        with TestClient(create_app(runtime.gateway_context())) as client:
            client.headers["X-API-Key"] = ALICE
            yield client, proxy
    finally:
        proxy.restore()
        runtime.close()
        proxy.close()


def test_the_store_away_is_a_503_with_retry_after_and_service_resumes_when_it_is_back(gateway):
    client, proxy = gateway
    assert client.post("/api/v1/create_session", json={}).status_code == 200

    proxy.cut()
    refused = client.post("/api/v1/create_session", json={})
    assert refused.status_code == 503, refused.text
    assert int(refused.headers["retry-after"]) > 0
    assert "event store is unreachable" in refused.json()["detail"]
    assert "5432" not in refused.text and "postgres" not in refused.text.lower()  # no connection details
    polled = client.post("/api/v1/retrieve_future", json={"request_id": "req-0123456789abcdef0123456789abcdef"})
    assert polled.status_code == 503 and "retry-after" in polled.headers  # a read, not only a write

    proxy.restore()
    session = client.post("/api/v1/create_session", json={})
    assert session.status_code == 200 and session.json()["session_id"]


def test_only_connection_failures_count_as_the_store_away():
    assert store_unavailable(sql_errors.OperationalError("SELECT 1", {}, Exception("connection refused")))
    assert store_unavailable(sql_errors.TimeoutError("QueuePool limit reached"))
    assert not store_unavailable(sql_errors.IntegrityError("INSERT", {}, Exception("duplicate key")))
    assert not store_unavailable(sql_errors.ProgrammingError("SELEC", {}, Exception("syntax error")))
