"""No secret in any log line or error body: a short real SDK session against `openrl serve`
at DEBUG on PostgreSQL (with a password in its URL) and the operator's key at work on the
OpenRL API (its HTTP routes and `openrl runs`), then every line the server and the client
logged, and every error body the server answered, is searched for the API keys, the
operator's key, the download-link signing secret and the database password.

The distributed roles log on their own: a separate `openrl gateway` and `openrl projector`
over a Kafka-protocol broker and PostgreSQL get the same secrets and the same search (no
trainer: what they log about requests, keys and the database is what counts)."""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import time
import urllib.request

import httpx
import pytest
import tinker
from sqlalchemy import select
from tinker import types

from eventing.store import tables
from functions.local_server import REPO, LocalServer
from tests.e2e.cluster import Cluster
from tests.e2e.sdk_close import close_service

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]
MODEL = "openrl/tiny-qwen3"
OPENRL = "/api/openrl/v1"


def other_than(key: str) -> str:
    """The key with its last character changed: always differs from it."""
    return key[:-1] + ("1" if key.endswith("0") else "0")


def assert_nowhere(secrets_: dict[str, str], logs: dict[str, str], error_bodies: list[str]) -> None:
    for name, secret in secrets_.items():
        for where, text in logs.items():
            assert secret not in text, f"{name} is in the {where}"
        assert not [body for body in error_bodies if secret in body], f"{name} is in an error body"


def test_a_session_logs_no_secret(tmp_path, pg_url, monkeypatch, caplog):
    key, other_key = "tml-alice-" + secrets.token_hex(16), "tml-bob-" + secrets.token_hex(16)
    operator = "tml-operator-" + secrets.token_hex(16)
    password, download_secret = "pw" + secrets.token_hex(12), "dl" + secrets.token_hex(24)
    database_url = pg_url.replace("postgres@", f"postgres:{password}@", 1)
    assert password in database_url  # the server really is given it (this PostgreSQL trusts local users)
    env = {"OPENRL_LOG_LEVEL": "DEBUG", "OPENRL_DATABASE_URL": database_url, "OPENRL_DOWNLOAD_SECRET": download_secret,
           "OPENRL_OPERATOR_API_KEY": operator}  # fmt: skip
    caplog.set_level(logging.DEBUG)  # the client side: the SDK, httpx, httpcore
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    error_bodies: list[str] = []
    with LocalServer(tmp_path / "data", [MODEL], f"alice={key},bob={other_key}", extra_env=env) as server:
        service = tinker.ServiceClient(base_url=server.url, api_key=key)
        rest = tinker.RestClient(base_url=server.url, api_key=key)
        training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
        tokens = list(range(5, 21))
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        training.save_state("state").result()
        sampler = training.save_weights_and_get_sampling_client().result()
        sample = sampler.sample(
            types.ModelInput.from_ints(tokens[:4]), 1, types.SamplingParams(max_tokens=3, seed=1)
        ).result()
        assert len(sample.sequences[0].tokens) >= 1
        export = training.save_weights_external("export").result().path
        links = rest.get_external_weights_urls(export).result().urls
        for url in links.values():
            with urllib.request.urlopen(url, timeout=60) as response:
                assert response.read()

        # refusals of every kind, their bodies kept: a bad key, no key, another tenant's run,
        # bad input, a tampered and an expired download link, an oversized body
        base = server.url + "/api/v1"
        link = next(iter(links.values()))
        wrong_key = other_than(key)
        answers = [
            httpx.get(f"{base}/training_runs/{training.model_id}", headers={"X-API-Key": wrong_key}),
            httpx.get(f"{base}/training_runs/{training.model_id}", headers={"X-API-Key": other_key}),
            httpx.post(f"{base}/create_session", json={"tags": "not a list"}, headers={"X-API-Key": key}),
            httpx.post(f"{base}/create_session", json={}),
            httpx.get(link.replace("signature=", "signature=0")),
            httpx.get(link.split("?")[0] + "?expires=1&signature=" + "0" * 64),
            httpx.post(f"{base}/retrieve_future", content=b"x" * (128 * 1024), headers={"X-API-Key": key}),
        ]
        assert [answer.status_code for answer in answers] == [401, 404, 400, 401, 403, 403, 413]
        error_bodies += [answer.text for answer in answers]
        with pytest.raises(tinker.NotFoundError) as refused:
            tinker.RestClient(base_url=server.url, api_key=other_key).get_training_run(training.model_id).result()
        error_bodies.append(str(refused.value))
        close_service(service)
        error_bodies += operator_at_work(server.url, operator, training.model_id, export)
        cli = openrl_runs(server.url, operator, "list", "--json")
        assert cli.returncode == 0 and training.model_id in cli.stdout, cli.stderr
    server_log = server.log_path.read_text()

    assert " DEBUG " in server_log  # it really logged at DEBUG
    client_log = "\n".join(f"{record.name} {record.getMessage()} {record.args!r}" for record in caplog.records)
    # the client's own key may travel in its request headers, never in what it logs
    logs = {"server log": server_log, "client log": client_log, "output of openrl runs": cli.stdout + cli.stderr}
    assert_nowhere({"alice's API key": key, "bob's API key": other_key, "the operator's key": operator,
                    "the database password": password, "the download-link secret": download_secret}, logs, error_bodies)  # fmt: skip


def operator_at_work(url: str, operator: str, run_id: str, export: str) -> list[str]:
    """The operator's key on every kind of OpenRL route (reads, an archive, a cancel), and
    refused: on a Tinker route, with a wrong operator key, for an unknown run, a second
    cancel. Returns the refusals' bodies."""
    api = httpx.Client(base_url=url + OPENRL, headers={"X-API-Key": operator}, timeout=60)
    with api:
        assert run_id in {run["run_id"] for run in api.get("/runs").json()["runs"]}
        for path in (f"/runs/{run_id}", f"/runs/{run_id}/metrics", f"/runs/{run_id}/sampling", f"/checkpoints?run_id={run_id}",
                     "/sessions", "/timeline"):  # fmt: skip
            assert api.get(path).status_code == 200, path
        state = f"tinker://{run_id}/weights/state"
        assert api.get("/checkpoints/archive", params={"path": state}).headers["content-type"] == "application/x-tar"
        assert api.delete("/checkpoints", params={"path": export}).status_code == 200
        assert api.post(f"/runs/{run_id}/cancel", json={"reason": "secrets test"}).json()["status"] == "cancelled"
        refusals = [
            httpx.get(f"{url}/api/v1/training_runs/{run_id}", headers={"X-API-Key": operator}),
            api.get("/runs", headers={"X-API-Key": other_than(operator)}),
            api.get(f"/runs/{run_id}x"),
            api.post(f"/runs/{run_id}/cancel", json={}),
        ]
    assert [answer.status_code for answer in refusals] == [401, 401, 404, 409]
    return [answer.text for answer in refusals]


def openrl_runs(url: str, key: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TINKER_BASE_URL=url, TINKER_API_KEY=key)
    command = [sys.executable, "-m", "functions.cli", "runs", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.kafka
def test_the_gateway_and_projector_roles_log_no_secret(tmp_path, pg_url):
    key, operator = "tml-alice-" + secrets.token_hex(16), "tml-operator-" + secrets.token_hex(16)
    password = "pw" + secrets.token_hex(12)
    env = {
        "OPENRL_LOG_LEVEL": "DEBUG",
        "OPENRL_OPERATOR_API_KEY": operator,
        "OPENRL_DOWNLOAD_SECRET": "dl" + secrets.token_hex(24),
    }
    cluster = Cluster(
        tmp_path, pg_url.replace("postgres@", f"postgres:{password}@", 1), extra_env=env, keys=f"alice={key}"
    )
    try:
        cluster.start_role("projector").wait_ready()
        cluster.start_gateway()
        tinker_api = httpx.Client(base_url=cluster.url + "/api/v1", headers={"X-API-Key": key}, timeout=60)
        operator_api = httpx.Client(base_url=cluster.url + OPENRL, headers={"X-API-Key": operator}, timeout=60)
        with tinker_api, operator_api:
            session = tinker_api.post("/create_session", json={"tags": ["secrets"]}).json()["session_id"]
            assert tinker_api.post("/session_heartbeat", json={"session_id": session}).status_code == 200
            body = {"session_id": session, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 4}}
            model_id = tinker_api.post("/create_model", json=body).json()["model_id"]  # no trainer: it stays pending
            deadline = time.monotonic() + 60
            while model_id not in {run["run_id"] for run in operator_api.get("/runs").json()["runs"]}:
                assert time.monotonic() < deadline, "the operator never saw the run"
                time.sleep(0.2)
            assert session in {s["session_id"] for s in operator_api.get("/sessions").json()["sessions"]}
            assert operator_api.post(f"/runs/{model_id}/cancel", json={}).json()["status"] == "cancelled"
            refusals = [
                tinker_api.get(f"/training_runs/{model_id}", headers={"X-API-Key": other_than(key)}),
                tinker_api.get(f"/training_runs/{model_id}", headers={"X-API-Key": operator}),
                operator_api.get("/runs", headers={"X-API-Key": other_than(operator)}),
                operator_api.post(f"/runs/{model_id}/cancel", json={}),
            ]
        assert [answer.status_code for answer in refusals] == [401, 401, 401, 409]
        # the projector folded what the gateway logged: the cancelled run is in the store
        assert cluster.query(
            select(tables.training_runs.c.state).where(tables.training_runs.c.model_id == model_id)
        ) == [("cancelled",)]
    finally:
        cluster.stop()
    logs = {
        f"{role} log": path.read_text()
        for role, path in (("gateway", cluster.gateway.log_path), ("projector", cluster.workers["projector"].log_path))
    }
    # each file is its role's own output (at DEBUG these roles still log little of their own)
    assert "openrl: gateway for" in logs["gateway log"] and "openrl: projector for" in logs["projector log"]
    assert_nowhere({"alice's API key": key, "the operator's key": operator, "the database password": password,
                    "the download-link secret": env["OPENRL_DOWNLOAD_SECRET"]}, logs, [answer.text for answer in refusals])  # fmt: skip
