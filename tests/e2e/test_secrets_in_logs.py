"""No secret in any log line or error body: a short real SDK session against `openrl serve`
at DEBUG on PostgreSQL (with a password in its URL), then every line the server and the
client logged, and every error body the server answered, is searched for the API keys, the
download-link signing secret and the database password."""

from __future__ import annotations

import logging
import secrets
import urllib.request

import httpx
import pytest
import tinker
from tinker import types

from functions.local_server import LocalServer

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]
MODEL = "openrl/tiny-qwen3"


def test_a_session_logs_no_secret(tmp_path, pg_url, monkeypatch, caplog):
    key, other_key = "tml-alice-" + secrets.token_hex(16), "tml-bob-" + secrets.token_hex(16)
    password, download_secret = "pw" + secrets.token_hex(12), "dl" + secrets.token_hex(24)
    database_url = pg_url.replace("postgres@", f"postgres:{password}@", 1)
    assert password in database_url  # the server really is given it (this PostgreSQL trusts local users)
    env = {"OPENRL_LOG_LEVEL": "DEBUG", "OPENRL_DATABASE_URL": database_url, "OPENRL_DOWNLOAD_SECRET": download_secret}
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
        sample = sampler.sample(types.ModelInput.from_ints(tokens[:4]), 1, types.SamplingParams(max_tokens=3, seed=1)).result()
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
        wrong_key = key[:-1] + ("1" if key.endswith("0") else "0")  # always differs from the real key
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
        service.close("success").result()
    server_log = server.log_path.read_text()

    assert " DEBUG " in server_log  # it really logged at DEBUG
    client_log = "\n".join(f"{record.name} {record.getMessage()} {record.args!r}" for record in caplog.records)
    for secret, name in ((key, "alice's API key"), (other_key, "bob's API key"), (password, "the database password"),
                         (download_secret, "the download-link secret")):  # fmt: skip
        assert secret not in server_log, f"{name} is in the server log"
        assert not [body for body in error_bodies if secret in body], f"{name} is in an error body"
        if secret != key:  # the client holds its own key; the others it never sees
            assert secret not in client_log, f"{name} is in the client log"
    # the client's own key may travel in its request headers, never in what it logs
    assert key not in client_log, "the SDK logged its API key"
