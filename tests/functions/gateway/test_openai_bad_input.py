"""Refusals of the OpenAI-compatible routes, in process and without workers: OpenAI's error
shape and statuses, the official client's exceptions, a model whose tokenizer has no chat
template, that a refused request stores nothing, and a sample the "sampler" (the test, by
hand) fails, reported before a stream starts as a status and after as an error event."""

from __future__ import annotations

import threading
import time

import openai
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from eventing.store import tables
from functions.gateway.app import create_app
from functions.runtime import Runtime
from openrl_core.settings import Settings
from tests.functions.gateway.sampling_rig import ALICE as RIG_ALICE
from tests.functions.gateway.sampling_rig import start

ALICE = "tml-openai-alice"
MODEL = "openrl/tiny-qwen3"
PLAIN = "local/no-chat-template"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def api(tmp_path, tiny_files):
    # The tiny model's files without its chat template: a tokenizer that cannot format chats.
    plain = tmp_path / "plain-model"
    plain.mkdir()
    for source in tiny_files.path.iterdir():
        if source.name != "chat_template.jinja":
            (plain / source.name).symlink_to(source)
    settings = Settings(
        data_dir=tmp_path / "data", models=[MODEL, PLAIN], local_models={PLAIN: str(plain)}, api_keys=[f"alice={ALICE}"]
    )
    runtime = Runtime(settings)
    with TestClient(create_app(runtime.gateway_context())) as client:
        yield client, runtime
    runtime.close()


def stored_events(runtime) -> int:
    """Every stored event but the audit records of refused lookups (a 404 to a known key
    leaves exactly one, as on the Tinker routes; `refused_lookups` counts them)."""
    with runtime.store.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(tables.events)).scalar() - refused_lookups(runtime)


def refused_lookups(runtime) -> int:
    with runtime.store.engine.connect() as conn:
        return conn.execute(select(func.count()).where(tables.events.c.type.contains("access.lookup.refused"))).scalar()


def test_errors_have_openais_shape_and_status(api):
    client, _ = api
    cases = [
        (client.get("/v1/models"), 401, "invalid_api_key"),
        (client.get("/v1/models", headers={"Authorization": "Bearer tml-wrong"}), 401, "invalid_api_key"),
        (
            client.post(
                "/v1/completions", headers={"Authorization": f"Bearer {ALICE}"}, json={"model": "nope", "prompt": "x"}
            ),
            404,
            "model_not_found",
        ),
        (
            client.post(
                "/v1/completions", headers={"X-API-Key": ALICE}, json={"model": MODEL, "prompt": "x", "max_tokens": 0}
            ),
            400,
            None,
        ),
        (client.post("/v1/completions", headers={"X-API-Key": ALICE}, content=b"{not json"), 400, None),
        (client.get("/v1/embeddings", headers={"X-API-Key": ALICE}), 404, None),
    ]
    for response, status, code in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["code"] == code
        assert error["type"] == ("authentication_error" if status == 401 else "invalid_request_error")
    # The Tinker routes keep their own shape.
    assert client.post("/api/v1/create_session", json={}).json() == {"detail": "missing X-API-Key header"}


def test_no_chat_template_and_other_refusals_store_nothing(api):
    client, runtime = api
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key=ALICE, http_client=client, max_retries=0)
    assert {m.id for m in oai.models.list()} == {MODEL, PLAIN}
    before, refusals = stored_events(runtime), refused_lookups(runtime)
    with pytest.raises(openai.BadRequestError, match="has no chat template") as refused:
        oai.chat.completions.create(model=PLAIN, messages=MESSAGES, max_tokens=2)
    assert refused.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        oai.completions.create(model=MODEL, prompt=[1, 2, 10**7], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="at most 4"):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=2, stop=["a", "b", "c", "d", "e"])
    with pytest.raises(openai.BadRequestError, match="echo"):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=2, echo=True)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="tinker://nobody:train:0/sampler_weights/x", prompt="x", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url="http://testserver/v1", api_key="tml-wrong", http_client=client, max_retries=0
        ).models.list()
    assert stored_events(runtime) == before
    assert refused_lookups(runtime) == refusals + 1  # the unknown model, probed with a Bearer key


# -- a sample that fails in the sampler -------------------------------------------------------


def pending_sample(runtime, timeout: float = 30.0):
    """The one unfinished sample the request under test submitted (request id, sampling session)."""
    query = select(tables.futures.c.request_id, tables.futures.c.model_id).where(
        tables.futures.c.kind == "sample", tables.futures.c.state == "pending"
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with runtime.store.engine.connect() as conn:
            rows = conn.execute(query).all()
        if rows:
            return rows[0]
        time.sleep(0.05)
    raise AssertionError("no sample was submitted")


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_sample_is_an_openai_error_streamed_or_not(tmp_path, tiny_files, stream):
    rig, close = start(tmp_path)
    try:
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key=RIG_ALICE, http_client=rig.client, max_retries=0)
        outcome: dict = {}

        def call() -> None:
            try:
                answer = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, stream=stream)
                outcome["chunks"] = list(answer) if stream else answer
            except openai.APIError as error:
                outcome["error"] = error

        caller = threading.Thread(target=call)
        caller.start()
        request_id, sampling_session_id = pending_sample(rig.runtime)
        rig.finish_sample(request_id, failed=True, key=sampling_session_id)
        caller.join(timeout=30)
        error = outcome.get("error")
        # Before the stream starts the status says it; after, the error event does (same message).
        assert isinstance(error, openai.APIError) and "sampling failed: boom" in error.message, outcome
        if not stream:
            assert isinstance(error, openai.InternalServerError)  # the sampler's category was "server"
    finally:
        close()
