"""API keys are checked in constant time and never echoed; request bodies over the
`max_request_bytes` setting are refused with a 413 that names the limit, before any route
reads them, whether the client declares a length or streams the body in chunks."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from functions.gateway import context
from functions.gateway.app import create_app
from functions.runtime import Runtime
from openrl_core.settings import Settings
from tests.functions.gateway.rest_rig import ALICE, BOB, MODEL

LIMIT = 4096


@pytest.fixture
def gateway(tmp_path, tiny_files):
    settings = Settings(
        data_dir=tmp_path,
        models=[MODEL],
        api_keys=[f"alice={ALICE}", f"bob={BOB}", "tml-third-key"],
        max_request_bytes=LIMIT,
    )
    runtime = Runtime(settings)
    with TestClient(create_app(runtime.gateway_context())) as client:
        yield client, runtime
    runtime.close()


def sessions(runtime) -> int:
    return len(runtime.projections.table_rows("sessions"))


def test_a_key_is_compared_with_every_configured_key_in_constant_time(gateway, monkeypatch):
    client, _ = gateway
    ctx = client.app.state.ctx
    compared = []
    real = context.hmac.compare_digest
    monkeypatch.setattr(context.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    for key, tenant in ((ALICE, "alice"), (BOB, "bob"), ("tml-not-a-key", None), ("", None)):
        compared.clear()
        assert ctx.tenant_for_key(key) == tenant
        # no early exit at a match: the time taken does not depend on which key matched
        assert len(compared) == 3 and {a for a, _ in compared} == set(ctx.key_tenants)


def test_a_refused_key_is_not_echoed(gateway):
    client, _ = gateway
    for headers in ({"X-API-Key": "tml-guess-" + "x" * 40}, {}):
        response = client.post("/api/v1/create_session", json={"tags": []}, headers=headers)
        assert response.status_code == 401, response.text
        assert "API key" in response.json()["detail"] or "X-API-Key" in response.json()["detail"]
        assert "tml-guess" not in response.text


@pytest.mark.parametrize("route", ["/api/v1/create_session", "/api/v1/forward_backward", "/api/v1/retrieve_future"])
def test_a_body_over_the_limit_is_a_413_that_names_it(gateway, route):
    client, runtime = gateway
    before = sessions(runtime)
    big = json.dumps({"tags": [], "user_metadata": {"pad": "x" * LIMIT}}).encode()
    headers = {"X-API-Key": ALICE, "Content-Type": "application/json"}
    declared = client.post(route, content=big, headers=headers)
    assert declared.status_code == 413, declared.text
    detail = declared.json()["detail"]
    assert f"{len(big)} bytes" in detail and f"{LIMIT}-byte limit" in detail and "max_request_bytes" in detail

    def chunks():  # no Content-Length: the body is counted as it arrives
        for start in range(0, len(big), 1000):
            yield big[start : start + 1000]

    streamed = client.post(route, content=chunks(), headers=headers)
    assert streamed.status_code == 413, streamed.text
    assert f"more than {LIMIT} bytes is over this server's {LIMIT}-byte limit" in streamed.json()["detail"]
    assert sessions(runtime) == before  # nothing was made from a refused body

    if route == "/api/v1/create_session":  # a body within the limit, sent either way, is read as usual
        small = json.dumps({"tags": ["ok"]}).encode()
        assert client.post(route, content=small, headers=headers).status_code == 200
        assert client.post(route, content=iter([small[:5], small[5:]]), headers=headers).status_code == 200
        assert sessions(runtime) == before + 2


def test_a_zstd_body_is_decompressed_only_up_to_the_limit(gateway):
    import zstandard

    client, _ = gateway
    headers = {"X-API-Key": ALICE, "Content-Type": "application/json", "Content-Encoding": "zstd"}
    # 10 MB of zeros in about 300 bytes, its size stated in the frame header (which made
    # `decompress(max_output_size=...)` ignore the bound)
    bomb = zstandard.ZstdCompressor().compress(b"\0" * 10_000_000)
    assert len(bomb) < LIMIT
    response = client.post("/api/v1/forward_backward", content=bomb, headers=headers)
    assert response.status_code == 413, response.text
    assert (
        f"decompresses to more than {LIMIT} bytes" in response.json()["detail"]
        and "max_request_bytes" in response.json()["detail"]
    )
    # a small compressed body is read as usual (here: a model that does not exist)
    small = zstandard.ZstdCompressor().compress(
        json.dumps(
            {"model_id": "s:train:0", "seq_id": 1, "forward_backward_input": {"data": [], "loss_fn": "cross_entropy"}}
        ).encode()
    )
    response = client.post("/api/v1/forward_backward", content=small, headers=headers)
    assert response.status_code == 404 and "unknown model_id" in response.json()["detail"], response.text
    garbage = client.post("/api/v1/forward_backward", content=b"not zstd", headers=headers)
    assert garbage.status_code == 400 and "zstd" in garbage.json()["detail"]
