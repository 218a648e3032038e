"""A gateway with two tenants and no workers, plus checkpoints made the way the trainer makes
them: the save request goes through the route, its completion (with blobs really stored) is
appended to the store exactly as the projector would append it."""

from __future__ import annotations

from datetime import datetime
from typing import Optional

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from eventing.store import tables
from functions.gateway.app import create_app
from functions.runtime import Runtime
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.events.lifecycle import CheckpointSaved, RequestCompleted
from openrl_core.settings import Settings

ALICE, BOB = "tml-rest-alice", "tml-rest-bob"
OPERATOR = "tml-rest-operator"  # sees every tenant on /api/openrl/v1, and is nobody's key elsewhere
MODEL = "openrl/tiny-qwen3"
SAVE_ROUTE = {
    "weights": ("/api/v1/save_weights", te.SAVE_WEIGHTS),
    "sampler_weights": ("/api/v1/save_weights_for_sampler", te.SAVE_WEIGHTS_FOR_SAMPLER),
    "external_weights": ("/api/v1/save_weights_external", te.SAVE_WEIGHTS_EXTERNAL),
}


@pytest.fixture
def rest(tmp_path, tiny_files):
    settings = Settings(
        data_dir=tmp_path, models=[MODEL], api_keys=[f"alice={ALICE}", f"bob={BOB}"], operator_api_key=OPERATOR
    )
    runtime = Runtime(settings)
    with TestClient(create_app(runtime.gateway_context())) as client:
        yield Rig(client, runtime)
    runtime.close()


class Rig:
    def __init__(self, client: TestClient, runtime: Runtime) -> None:
        self.client, self.runtime = client, runtime
        self._seq: dict[str, int] = {}

    @property
    def ctx(self):
        return self.client.app.state.ctx

    def request(self, method: str, path: str, body=None, key: Optional[str] = ALICE, **kwargs):
        headers = {"X-API-Key": key} if key else {}
        headers.update(kwargs.pop("headers", {}))
        if body is not None:
            kwargs["json"] = body
        return self.client.request(method, path, headers=headers, **kwargs)

    def ok(self, method: str, path: str, body=None, key: str = ALICE, **kwargs):
        response = self.request(method, path, body, key, **kwargs)
        assert response.status_code in (200, 204), response.text
        return response.json() if response.status_code == 200 else None

    def session(self, key: str = ALICE, **fields) -> str:
        return self.ok("POST", "/api/v1/create_session", {"tags": [], "user_metadata": {}, **fields}, key)["session_id"]

    def model(self, session_id: str, model_seq_id: int = 0, key: str = ALICE, rank: int = 4, **fields) -> str:
        body = {
            "session_id": session_id,
            "model_seq_id": model_seq_id,
            "base_model": MODEL,
            "lora_config": {"rank": rank},
            **fields,
        }
        return self.ok("POST", "/api/v1/create_model", body, key)["model_id"]

    def next_seq(self, model_id: str) -> int:
        self._seq[model_id] = self._seq.get(model_id, 0) + 1
        return self._seq[model_id]

    def save(
        self,
        model_id: str,
        name: str,
        kind: str = "weights",
        files: Optional[dict[str, bytes]] = None,
        expires_at: Optional[datetime] = None,
        key: str = ALICE,
        tenant: str = "alice",
        user_metadata: Optional[dict] = None,
    ) -> CheckpointSaved:
        route, family = SAVE_ROUTE[kind]
        future = self.ok("POST", route, {"model_id": model_id, "seq_id": self.next_seq(model_id), "path": name}, key)
        files = files or {
            "adapter_model.safetensors": f"{model_id}/{name}".encode(),
            "adapter_config.json": b'{"r": 4}',
        }
        refs = {file: self.runtime.blobs.put(tenant, content) for file, content in files.items()}
        checkpoint = CheckpointSaved(
            run_id=model_id, kind=kind, name=name, files=refs, expires_at=expires_at, user_metadata=user_metadata
        )
        done = RequestCompleted(
            request_id=future["request_id"], result={"path": checkpoint.tinker_path}, checkpoint=checkpoint
        )
        self.runtime.store.append(
            new_event(family["completed"], done, tenant=tenant, source="/test-trainer", key=model_id)
        )
        return checkpoint

    def snapshot(self) -> dict:
        """Every projection row, to prove a refused request changed none of them."""
        with self.runtime.engine.connect() as conn:
            return {
                name: conn.execute(select(table)).all()
                for name, table in tables.metadata.tables.items()
                if name not in ("events", "submissions")
            }

    def count_events(self, fragment: str = "") -> int:
        with self.runtime.engine.connect() as conn:
            return conn.execute(select(func.count()).where(tables.events.c.type.contains(fragment))).scalar()

    def blob_exists(self, tenant: str, ref) -> bool:
        return self.runtime.blobs.exists(tenant, ref)


def assert_clear_4xx(response, status: int, fragment: str) -> None:
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str) and fragment in detail, detail
