"""Property-based fuzzing of the gateway from its own OpenAPI description, against a live
`openrl serve` on the tiny model, authenticated.

`test_schemathesis_finds_nothing` runs schemathesis (examples, coverage and fuzzing phases,
every check that needs no second user) over every route in `/openapi.json`: no 5xx, no
answer outside its documented statuses and schemas (405s with an `Allow` header), no
schema-valid request refused with a 400, no schema-invalid one accepted, no refused request
that changes the store (fuzz_hooks.py). Short here (`OPENRL_FUZZ_EXAMPLES`, default 5 per
operation); `make fuzz` runs it long, with the stateful phase too.

Protobuf and compressed bodies, which no JSON Schema describes, get their own cases: random
bytes, truncations of a real SDK request, zstd bombs and bodies over `max_request_bytes`
(a 413 naming the limit and the setting), each answered 4xx and storing nothing.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tinker import types
from tinker.proto import request_conv

from functions.local_server import LocalServer

pytestmark = pytest.mark.e2e
KEY, OPERATOR = "tml-fuzz-alice", "tml-fuzz-operator"
LIMIT = 256 * 1024  # max_request_bytes of the fuzzed server: small, so oversized bodies are cheap
EXAMPLES = int(os.environ.get("OPENRL_FUZZ_EXAMPLES", "5"))
LONG = EXAMPLES > 20
HOOKS = "tests.functions.gateway.fuzz_hooks"
CONFIG = Path(__file__).with_name("schemathesis.toml")
ON_PURPOSE = ("%access.lookup.refused%", "%seq.skipped%")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("openrl-fuzz")
    env = {"OPENRL_OPERATOR_API_KEY": OPERATOR, "OPENRL_MAX_REQUEST_BYTES": str(LIMIT)}
    srv = LocalServer(data, ["openrl/tiny-qwen3"], f"alice={KEY}", extra_env=env)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def stored(server) -> int:
    """The gateway's events but those a refusal records on purpose (workers may still be
    finishing accepted requests: their events are not the refused request's doing)."""
    with sqlite3.connect(f"file:{server.data_dir / 'events.db'}?mode=ro", uri=True, timeout=30) as conn:
        query = "SELECT count(*) FROM events WHERE source = '/openrl/gateway' AND type NOT LIKE ? AND type NOT LIKE ?"
        return conn.execute(query, ON_PURPOSE).fetchone()[0]


def digest(output: str) -> str:
    """Each failure's operation, check, status and answer: what a failed run needs to show."""
    keep = ("___", "- ST", "[4", "[5", "    `{", "    Received", "    Documented", "Test cases", "  ❌")
    return "\n".join(line[:400] for line in output.splitlines() if line.lstrip().startswith(keep) or line.startswith(keep))


def test_schemathesis_finds_nothing(server, tmp_path):
    report = tmp_path / "schemathesis.json"
    phases = "examples,coverage,fuzzing,stateful" if LONG else "examples,coverage,fuzzing"
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run", f"{server.url}/openapi.json",
        "-H", f"X-API-Key: {KEY}", "-H", f"Authorization: Bearer {KEY}",
        "--checks", "all", "--exclude-checks", "use_after_free,ensure_resource_availability,object_level_authorization",
        "--phases", phases, "--max-examples", str(EXAMPLES), "--workers", "1", "--seed", os.environ.get("OPENRL_FUZZ_SEED", "1"),
        "--request-timeout", "60", "--suppress-health-check", "filter_too_much,too_slow", "--max-failures", "1000",
        "--report", "json", "--report-json-path", str(report), "--output-truncate", "true",
    ]  # fmt: skip
    env = dict(os.environ, SCHEMATHESIS_HOOKS=HOOKS, OPENRL_FUZZ_DB=str(server.data_dir / "events.db"), OPENRL_FUZZ_STATUSES=os.environ.get("OPENRL_FUZZ_STATUSES", ""))
    run = subprocess.run(command, env=env, cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True, timeout=1800)
    summary = json.loads(report.read_text()) if report.exists() else {}
    cases, operations = summary.get("test_cases") or {}, summary.get("operations") or {}
    print(f"schemathesis: {cases.get('generated')} cases over {operations.get('tested')} operations, "
          f"{cases.get('unique_failures')} unique failures, {len(summary.get('errors') or [])} errors")  # fmt: skip
    assert run.returncode == 0, digest(run.stdout) + run.stderr[-5000:]
    assert summary["operations"]["tested"] >= 50 and cases["generated"] >= 50 * EXAMPLES
    assert not summary["failures"] and not summary["errors"]


# -- protobuf and compressed bodies -----------------------------------------------------------


@pytest.fixture(scope="module")
def model(server):
    """A LoRA run of the tiny model, and a real SDK ForwardBackwardRequest for it."""
    api = httpx.Client(base_url=server.url, headers={"X-API-Key": KEY}, timeout=60)
    session = api.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": "openrl/tiny-qwen3", "lora_config": {"rank": 4}}
    model_id = api.post("/api/v1/create_model", json=body).json()["model_id"]
    yield api, model_id, sdk_request(model_id, seq_id=1)
    api.close()


def sdk_request(model_id: str, seq_id: int) -> bytes:
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})
    fb_input = types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy")
    request = types.ForwardBackwardRequest(forward_backward_input=fb_input, model_id=model_id, seq_id=seq_id)
    return request_conv.forward_backward_request_to_proto(request).SerializeToString()


def post(api, body: bytes, **headers) -> httpx.Response:
    return api.post("/api/v1/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf", **headers})


def assert_refused(response: httpx.Response, statuses=(400, 404, 409, 413)) -> None:
    assert response.status_code in statuses, response.text
    assert response.json()["detail"], response.text


@settings(max_examples=30 if not LONG else 300, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.binary(max_size=2048))
def test_random_protobuf_is_refused_and_stores_nothing(server, model, body):
    api, _, _ = model
    before = stored(server)
    response = post(api, body)
    # Random bytes may decode as a protobuf naming some model: that is a lookup (404).
    assert_refused(response)
    assert stored(server) == before


def test_every_truncation_of_a_real_request_is_refused_and_stores_nothing(server, model):
    api, _, real = model
    before = stored(server)
    cuts = range(len(real)) if LONG else sorted({*range(0, len(real), max(1, len(real) // 40)), len(real) - 1})
    for cut in cuts:
        response = post(api, real[:cut])
        # The fields go model_id, seq_id, data, loss_fn: a cut leaves a model id cut short
        # (404), no seq_id (400), or data without a loss (400, the seq_id consumed by a
        # seq.skipped on purpose), and after the first such refusal a used seq_id (409).
        assert_refused(response)
    assert stored(server) == before


def test_zstd_bombs_and_bodies_over_the_limit_get_a_413_naming_it(server, model):
    api, _, real = model
    before = stored(server)
    bomb = zstandard.ZstdCompressor(level=3).compress(b"\0" * (64 * LIMIT))  # ~2 KB, 64x the limit unpacked
    assert len(bomb) < LIMIT
    for response in (
        post(api, bomb, **{"Content-Encoding": "zstd"}),
        post(api, real + b"\0" * LIMIT),  # declared Content-Length over the limit
        api.post("/api/v1/forward_backward", content=iter([real, b"\0" * LIMIT]), headers={"Content-Type": "application/x-protobuf"}),
        api.post("/api/v1/create_session", content=b"{" + b" " * LIMIT + b"}", headers={"Content-Type": "application/json"}),
        api.post("/v1/completions", content=b" " * (LIMIT + 1), headers={"Authorization": f"Bearer {KEY}"}),
    ):
        assert response.status_code == 413, response.text
        message = response.json().get("detail") or response.json()["error"]["message"]
        assert str(LIMIT) in message and "max_request_bytes" in message, message
    garbage = post(api, b"\x28\xb5\x2f\xfd" + os.urandom(64), **{"Content-Encoding": "zstd"})  # zstd magic, then noise
    assert_refused(garbage, (400,))
    assert "zstd" in garbage.json()["detail"]
    assert stored(server) == before


def test_the_real_request_is_accepted_compressed_or_not(server, model):
    """The cases above are refusals of what is wrong, not of everything."""
    api, model_id, _ = model
    real = sdk_request(model_id, seq_id=2)  # seq_id 1 was consumed by the refused truncations
    first = post(api, zstandard.ZstdCompressor().compress(real), **{"Content-Encoding": "zstd"})
    assert first.status_code == 200, first.text
    again = post(api, real)  # the same body for the same seq_id: the same future
    assert again.status_code == 200 and again.json()["request_id"] == first.json()["request_id"]
