"""The SDK's sampling futures with the flags this server turns on: every sample waits on the
sampling session's retrieve_futures long-poll (`sample_use_retrieve_futures`), and a sample
the caller abandons is cancelled on the server (`sample_cancel_enabled`) instead of run."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from types import SimpleNamespace

import httpx
import pytest
import tinker
from tinker import types
from tinker.lib import api_future_impl

from functions.timeslicer.setup import socket_path
from tests.e2e.conftest import API_KEY
from tests.e2e.sdk_close import close_service

pytestmark = pytest.mark.e2e
MODEL = "openrl/tiny-qwen3"
PROMPT = types.ModelInput.from_ints([785, 3974, 13876, 38835])


def server_flags(url: str) -> tuple[dict, dict]:
    headers = {"X-API-Key": API_KEY}
    static = httpx.post(url + "/api/v1/client/config", json={"sdk_version": tinker.__version__}, headers=headers).json()
    dynamic = httpx.post(
        url + "/api/v1/client/dynamic_config", json={"sdk_version": tinker.__version__}, headers=headers
    ).json()
    return static, dynamic


def sampler_computes(server) -> bool:
    """Whether the sampler holds the accelerator now (asked of the server's own timeslicer)."""
    path = socket_path(SimpleNamespace(timeslicer_socket=None, data_dir=server.data_dir))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(b'{"op": "status", "id": 1}\n')
        status = json.loads(sock.makefile("rb").readline())["status"]
    return any(d["holder"] is not None and "sampler" in d["holder"]["job"] for d in status["devices"])


def record_request_ids(monkeypatch) -> list[str]:
    ids: list[str] = []
    init = api_future_impl._APIFuture.__init__

    def recording(self, model_cls, holder, untyped_future, *args, **kwargs):
        ids.append(untyped_future.request_id)
        init(self, model_cls, holder, untyped_future, *args, **kwargs)

    monkeypatch.setattr(api_future_impl._APIFuture, "__init__", recording)
    return ids


def test_concurrent_samples_arrive_through_the_session_poller(sdk_env):
    static, dynamic = server_flags(sdk_env.url)
    assert static["sample_use_retrieve_futures"] is True and dynamic["sample_cancel_enabled"] is True
    service = tinker.ServiceClient()
    sampler = service.create_sampling_client(base_model=MODEL).result()
    futures = [
        sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=n, temperature=0.0, stop=[])) for n in (1, 6, 3, 9, 2)
    ]
    assert [len(f.result().sequences[0].tokens) for f in futures] == [1, 6, 3, 9, 2]
    assert sampler._futures_poller is not None  # they waited on retrieve_futures, not each on its own poll
    greedy = futures[3].result().sequences[0].tokens
    assert (
        sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=9, temperature=0.0, stop=[]))
        .result()
        .sequences[0]
        .tokens
        == greedy
    )
    logprobs = sampler.compute_logprobs(PROMPT).result()
    assert logprobs[0] is None and len(logprobs) == PROMPT.length
    close_service(service)


def test_an_abandoned_sample_is_cancelled_before_it_runs(sdk_env, monkeypatch):
    ids = record_request_ids(monkeypatch)
    service = tinker.ServiceClient()
    sampler = service.create_sampling_client(base_model=MODEL).result()
    sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=1)).result()  # warm

    async def abandon():
        # A long sample occupies the sampler; the second one queues behind it and is abandoned.
        submitted = len(ids)
        busy = sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=60, temperature=1.0, seed=1, stop=[]))
        while len(ids) == submitted:  # the server has the long one (its future exists) ...
            await asyncio.sleep(0.02)
        deadline = time.monotonic() + 30
        while not sampler_computes(sdk_env) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # ... and the sampler has started it (on a busy machine, not at once)
        assert sampler_computes(sdk_env), "the sampler never took the long sample"
        queued = sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=3, seed=2, stop=[]))
        with pytest.raises(asyncio.TimeoutError):
            await queued.result_async(timeout=0.2)
        return await busy.result_async()

    busy = asyncio.run(abandon())
    assert len(busy.sequences[0].tokens) == 60  # the running one was not touched
    abandoned = ids[-1]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        answer = httpx.post(
            sdk_env.url + "/api/v1/retrieve_future",
            json={"request_id": abandoned},
            headers={"X-API-Key": API_KEY},
            timeout=60,
        )
        if answer.status_code != 408:
            break
    assert answer.json() == {"error": "cancelled by the client before it started", "category": "user"}
    close_service(service)
