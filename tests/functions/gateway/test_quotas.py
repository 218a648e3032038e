"""Per-tenant quotas at the gateway: each limit refuses with a 429 that has a Retry-After and
names the limit and its setting; the refused request changes nothing stored and consumes no
seq_id (its retry, same seq_id, succeeds once capacity frees); another tenant is unaffected.

No workers run: a test finishes a future by appending its completion to the store, as the
projector would, so it decides exactly when capacity frees.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from fastapi.testclient import TestClient

from eventing.store import tables
from functions.gateway.app import create_app
from functions.runtime import Runtime
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.events.lifecycle import RequestCompleted
from openrl_core.settings import Settings
from tests.functions.gateway.rest_rig import ALICE, BOB, MODEL, Rig

ALICE_QUOTAS = {
    "requests_in_flight": 3,
    "queued_training_tokens": 20,
    "sampling_tokens_per_minute": 40,
    "checkpoint_bytes": 64,
}


@pytest.fixture
def rig(tmp_path, tiny_files):
    # Defaults apply to bob; alice has her own limits (the override setting).
    settings = Settings(
        data_dir=tmp_path, models=[MODEL], api_keys=[f"alice={ALICE}", f"bob={BOB}"], quota_requests_in_flight=100,
        tenant_quotas={"alice": ALICE_QUOTAS},
    )  # fmt: skip
    runtime = Runtime(settings)
    with TestClient(create_app(runtime.gateway_context())) as client:
        yield Rig(client, runtime)
    runtime.close()


def datum(tokens: int) -> dict:
    ids = list(range(1, tokens + 1))
    return {
        "model_input": {"chunks": [{"tokens": ids, "type": "encoded_text"}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": ids, "dtype": "int64", "shape": [tokens]},
            "weights": {"data": [1.0] * tokens, "dtype": "float32", "shape": [tokens]},
        },
    }


def fwdbwd(model_id: str, seq_id: int, tokens: int = 4) -> dict:
    return {
        "forward_backward_input": {"data": [datum(tokens)], "loss_fn": "cross_entropy"},
        "model_id": model_id,
        "seq_id": seq_id,
    }


def complete(rig: Rig, request_id: str, family, tenant: str = "alice", key: str = "m") -> None:
    done = RequestCompleted(request_id=request_id, result={"type": "done"})
    rig.runtime.store.append(new_event(family["completed"], done, tenant=tenant, source="/test-worker", key=key))


def ready_model(rig: Rig, key: str = ALICE, tenant: str = "alice") -> str:
    """A model whose create_model future is finished (so it holds no slot in flight)."""
    session = rig.session(key)
    body = {"session_id": session, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 4}}
    future = rig.ok("POST", "/api/v1/create_model", body, key)
    complete(rig, future["request_id"], te.CREATE_MODEL, tenant)
    return future["model_id"]


def assert_refused(rig: Rig, response, limit: str, setting: str) -> int:
    assert response.status_code == 429, response.text
    detail = response.json()["detail"]
    assert f"the {limit} limit is" in detail and setting in detail, detail
    retry_after = int(response.headers["retry-after"])
    assert 1 <= retry_after <= 60
    return retry_after


def unchanged(rig: Rig):
    """What a refused request must leave as it was: every projection row and every event."""
    return rig.snapshot(), rig.count_events(), len(rig.runtime.projections.table_rows("submissions"))


def test_requests_in_flight_refuse_the_next_until_one_finishes_and_the_seq_id_is_kept(rig):
    model = ready_model(rig)
    first = rig.ok("POST", "/api/v1/forward_backward", fwdbwd(model, 1))
    rig.ok("POST", "/api/v1/optim_step", {"model_id": model, "seq_id": 2, "adam_params": {"learning_rate": 1e-4}})
    rig.ok("POST", "/api/v1/forward_backward", fwdbwd(model, 3))
    before = unchanged(rig)
    refused = rig.request("POST", "/api/v1/forward_backward", fwdbwd(model, 4))
    assert assert_refused(rig, refused, "requests_in_flight", "tenant_quotas['alice']['requests_in_flight']") == 1
    assert unchanged(rig) == before  # no event, no future, no dedup row: the seq_id is not used
    assert rig.count_events("seq.skipped") == 0
    # A retry of a request already accepted is answered with its future, never refused.
    again = rig.ok("POST", "/api/v1/forward_backward", fwdbwd(model, 1))
    assert again["request_id"] == first["request_id"]
    # Bob's limit is the default (100): alice being full does not touch him.
    bobs = ready_model(rig, BOB, "bob")
    for seq in range(1, 6):
        rig.ok("POST", "/api/v1/forward_backward", fwdbwd(bobs, seq), key=BOB)
    complete(rig, first["request_id"], te.FORWARD_BACKWARD)
    retried = rig.ok("POST", "/api/v1/forward_backward", fwdbwd(model, 4))  # the SDK's retry: same seq_id, same body
    assert rig.runtime.projections.future("alice", retried["request_id"]).state == "pending"


def test_queued_training_tokens_count_unfinished_forward_backward_tokens(rig):
    model = ready_model(rig)
    first = rig.ok("POST", "/api/v1/forward_backward", fwdbwd(model, 1, tokens=12))
    before = unchanged(rig)
    refused = rig.request("POST", "/api/v1/forward_backward", fwdbwd(model, 2, tokens=9))  # 12 + 9 > 20
    assert_refused(rig, refused, "queued_training_tokens", "tenant_quotas['alice']['queued_training_tokens']")
    assert "has 12 queued training tokens and this request adds 9" in refused.json()["detail"]
    assert unchanged(rig) == before
    rig.ok("POST", "/api/v1/forward_backward", fwdbwd(model, 2, tokens=8))  # 12 + 8 fits exactly
    complete(rig, first["request_id"], te.FORWARD_BACKWARD)
    # Bigger than the whole limit: a 400 that consumes the seq_id like any refusal (never a 429 loop).
    never = rig.request("POST", "/api/v1/forward_backward", fwdbwd(model, 3, tokens=21))
    assert never.status_code == 400 and "can never be admitted" in never.json()["detail"], never.text
    assert rig.count_events("seq.skipped") == 1


def sample_body(sampling_session_id: str, seq_id: int, prompt: int, max_tokens, n: int = 1) -> dict:
    params = {"seed": 1} if max_tokens is None else {"max_tokens": max_tokens, "seed": 1}
    return {
        "sampling_session_id": sampling_session_id,
        "seq_id": seq_id,
        "num_samples": n,
        "prompt": {"chunks": [{"tokens": list(range(1, prompt + 1)), "type": "encoded_text"}]},
        "sampling_params": params,
    }


def test_sampling_tokens_per_minute_is_a_sliding_window_and_covers_the_openai_routes(rig):
    session = rig.session()
    body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": MODEL}
    sampler = rig.ok("POST", "/api/v1/create_sampling_session", body)["sampling_session_id"]
    rig.ok("POST", "/api/v1/asample", sample_body(sampler, 1, prompt=4, max_tokens=8, n=2))  # 4 + 8 x 2 = 20
    rig.ok("POST", "/api/v1/asample", sample_body(sampler, 2, prompt=4, max_tokens=6, n=2))  # 16 more: 36
    before = unchanged(rig)
    refused = rig.request("POST", "/api/v1/asample", sample_body(sampler, 3, prompt=2, max_tokens=2, n=2))  # 6 more: 42
    assert_refused(rig, refused, "sampling_tokens_per_minute", "tenant_quotas['alice']['sampling_tokens_per_minute']")
    assert "has 36 sampling tokens in the last minute" in refused.json()["detail"]
    assert unchanged(rig) == before
    # The OpenAI-compatible route spends the same quota and says so in OpenAI's error shape.
    openai = rig.request("POST", "/v1/completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": 5})  # 7 more: 43
    assert openai.status_code == 429 and openai.json()["error"]["code"] == "rate_limit_exceeded", openai.text
    assert 1 <= int(openai.headers["retry-after"]) <= 60 and unchanged(rig) == before
    # Finishing the samples frees nothing: the window counts what was submitted in the last minute.
    # Sliding it: age the first sample by 55 s; the wait is then until it leaves (about 5 s).
    with rig.runtime.engine.begin() as conn:
        oldest = datetime.now(timezone.utc) - timedelta(seconds=55)
        rows = conn.execute(
            tables.futures.select().where(tables.futures.c.kind == "sample").order_by(tables.futures.c.created_at)
        ).all()
        conn.execute(
            tables.futures.update().where(tables.futures.c.request_id == rows[0].request_id).values(created_at=oldest)
        )
    again = rig.request("POST", "/api/v1/asample", sample_body(sampler, 3, prompt=2, max_tokens=2, n=2))
    assert assert_refused(rig, again, "sampling_tokens_per_minute", "OPENRL_TENANT_QUOTAS") <= 6
    # No max_tokens is charged up to the model's context, which is more than alice's whole minute.
    whole = rig.request("POST", "/api/v1/asample", sample_body(sampler, 4, prompt=2, max_tokens=None))
    assert whole.status_code == 400 and "can never be admitted" in whole.json()["detail"], whole.text
    # Bob has no sampling limit.
    bobs = rig.ok("POST", "/api/v1/create_sampling_session", {**body, "session_id": rig.session(BOB)}, BOB)[
        "sampling_session_id"
    ]
    rig.ok("POST", "/api/v1/asample", sample_body(bobs, 1, prompt=4, max_tokens=100, n=4), BOB)


def test_checkpoint_bytes_refuse_saves_and_copies_once_the_tenant_is_at_its_limit(rig):
    model = ready_model(rig)
    rig.save(model, "first", files={"adapter_model.safetensors": b"x" * 40})  # 40 of 64 bytes
    seq = rig.next_seq(model)
    future = rig.ok(
        "POST", "/api/v1/save_weights", {"model_id": model, "seq_id": seq, "path": "second"}
    )  # under: admitted
    complete(rig, future["request_id"], te.SAVE_WEIGHTS)
    stored = rig.save(
        model,
        "third",
        files={"adapter_model.safetensors": b"y" * 30},
        expires_at=datetime.now(timezone.utc) + timedelta(seconds=20),
    )
    destination = rig.session()
    before = unchanged(rig)
    body = {"model_id": model, "seq_id": rig.next_seq(model), "path": "fourth"}
    refused = rig.request("POST", "/api/v1/save_weights", body)  # 70 bytes stored, at or over 64
    retry_after = assert_refused(rig, refused, "checkpoint_bytes", "tenant_quotas['alice']['checkpoint_bytes']")
    assert 15 <= retry_after <= 20  # when the expiring checkpoint frees its bytes
    copy = rig.request(
        "POST",
        "/api/v1/copy_weights",
        {"source_path": stored.tinker_path, "session_id": destination, "model_seq_id": 1},
    )
    assert_refused(rig, copy, "checkpoint_bytes", "OPENRL_TENANT_QUOTAS")
    assert unchanged(rig) == before
    # A sampler session's weights make no checkpoint record: not refused.
    rig.ok(
        "POST",
        "/api/v1/save_weights_for_sampler",
        {"model_id": model, "seq_id": body["seq_id"], "sampling_session_seq_id": 1},
    )
    # Deleting a checkpoint frees its bytes.
    assert rig.request("DELETE", f"/api/v1/training_runs/{model}/checkpoints/weights/third").status_code in (200, 204)
    rig.ok("POST", "/api/v1/save_weights", {"model_id": model, "seq_id": rig.next_seq(model), "path": "fourth"})


def test_quota_settings_come_from_the_environment_and_refuse_unknown_limits(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENRL_QUOTA_CHECKPOINT_BYTES", "2KiB")
    monkeypatch.setenv(
        "OPENRL_TENANT_QUOTAS", json.dumps({"alice": {"requests_in_flight": 2, "checkpoint_bytes": None}})
    )
    settings = Settings(data_dir=tmp_path)
    assert settings.quotas("bob")[0].checkpoint_bytes == 2048
    limits, overridden = settings.quotas("alice")
    assert (
        limits.requests_in_flight == 2
        and limits.checkpoint_bytes is None
        and overridden == {"requests_in_flight", "checkpoint_bytes"}
    )
    monkeypatch.setenv("OPENRL_TENANT_QUOTAS", json.dumps({"alice": {"in_flight": 2}}))
    with pytest.raises(ValueError, match="unknown limits"):
        Settings(data_dir=tmp_path)


def test_two_gateway_replicas_over_one_postgresql_store_share_the_tenants_usage(tmp_path, tiny_files, pg_url):
    """Usage is read from the shared store, so what one replica admitted counts on the other."""
    rigs, runtimes = [], []
    for name in ("one", "two"):
        settings = Settings(
            data_dir=tmp_path / name, database_url=pg_url, models=[MODEL], api_keys=[f"alice={ALICE}", f"bob={BOB}"],
            tenant_quotas={"alice": {"requests_in_flight": 2}},
        )  # fmt: skip
        runtime = Runtime(settings)
        client = TestClient(create_app(runtime.gateway_context()))
        client.__enter__()
        rigs.append(Rig(client, runtime))
        runtimes.append(runtime)
    try:
        one, two = rigs
        model = ready_model(one)
        one.ok("POST", "/api/v1/forward_backward", fwdbwd(model, 1))
        two.ok("POST", "/api/v1/forward_backward", fwdbwd(model, 2))
        for rig in rigs:  # both replicas see the two in flight
            assert_refused(
                rig,
                rig.request("POST", "/api/v1/forward_backward", fwdbwd(model, 3)),
                "requests_in_flight",
                "OPENRL_TENANT_QUOTAS",
            )
        assert one.count_events("seq.skipped") == 0
    finally:
        for rig, runtime in zip(rigs, runtimes):
            rig.client.__exit__(None, None, None)
            runtime.close()
