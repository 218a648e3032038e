"""A gateway over a real store and log with its projector running, for the futures tests.

No sampler thread: a test completes samples by hand (an event on the completions topic) or
runs a real `SamplerWorker` one poll at a time, so it decides exactly when work happens.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from fastapi.testclient import TestClient

from eventing import topics
from eventing.projector import Projector
from functions.gateway.app import create_app
from functions.runtime import Runtime
from openrl_core.events import new_event
from openrl_core.events.lifecycle import RequestCompleted, RequestFailed
from openrl_core.events.sampling import SAMPLE
from openrl_core.settings import Settings

ALICE, BOB = "tml-feed-alice", "tml-feed-bob"
MODEL = "openrl/tiny-qwen3"


@dataclass
class Rig:
    client: TestClient
    runtime: Runtime
    session_id: str
    sampling_session_id: str

    def post(self, path: str, body: dict, key: str = ALICE, **headers):
        return self.client.post(path, json=body, headers={"X-API-Key": key, **headers})

    def sample(
        self, seq_id: int = 1, prompt=(1, 2, 3), max_tokens: int = 4, sampling_session_id: str | None = None
    ) -> str:
        body = {
            "sampling_session_id": sampling_session_id or self.sampling_session_id,
            "seq_id": seq_id,
            "num_samples": 1,
            "prompt": {"chunks": [{"tokens": list(prompt), "type": "encoded_text"}]},
            "sampling_params": {"max_tokens": max_tokens, "seed": 1, "temperature": 1.0},
        }
        answer = self.post("/api/v1/asample", body)
        assert answer.status_code == 200, answer.text
        return answer.json()["request_id"]

    def finish_sample(self, request_id: str, tokens=(7, 8), failed: bool = False, key: str | None = None) -> None:
        """What a sampler emits; the projector stores it and wakes the long-polls."""
        if failed:
            payload = RequestFailed(request_id=request_id, error="boom", category="server")
        else:
            sequence = {"tokens": list(tokens), "logprobs": [-0.5] * len(tokens), "stop_reason": "length"}
            payload = RequestCompleted(
                request_id=request_id,
                result={"sequences": [sequence], "prompt_logprobs": None, "topk_prompt_logprobs": None},
            )
        type_ = SAMPLE["failed" if failed else "completed"]
        event = new_event(
            type_,
            payload,
            tenant="alice",
            source="/test-sampler",
            key=key or self.sampling_session_id,
            subject=request_id,
        )
        self.runtime.publisher.publish(topics.topic("alice", "completions"), event)


def start(tmp_path, **settings) -> tuple[Rig, callable]:
    base = dict(data_dir=tmp_path, models=[MODEL], api_keys=[f"alice={ALICE}", f"bob={BOB}"], long_poll_seconds=1.5)
    runtime = Runtime(Settings(**{**base, **settings}))
    stop = threading.Event()
    projector = Projector(runtime.bus, runtime.store, runtime.notifier)
    thread = threading.Thread(target=projector.run, args=(stop,), daemon=True)
    thread.start()
    client = TestClient(create_app(runtime.gateway_context()))
    client.__enter__()
    headers = {"X-API-Key": ALICE}
    session_id = client.post("/api/v1/create_session", json={}, headers=headers).json()["session_id"]
    created = client.post(
        "/api/v1/create_sampling_session",
        json={"session_id": session_id, "sampling_session_seq_id": 0, "base_model": MODEL},
        headers=headers,
    )
    rig = Rig(client, runtime, session_id, created.json()["sampling_session_id"])

    def close() -> None:
        client.__exit__(None, None, None)
        stop.set()
        thread.join()
        runtime.close()

    return rig, close
