"""Property-based fuzzing of the gateway from its own OpenAPI description, against a live
`openrl serve` on the tiny model, authenticated.

`test_schemathesis_finds_nothing` runs schemathesis (examples, coverage and fuzzing phases,
every check that needs no second user) over every route in `/openapi.json`: no 5xx, no
answer outside its documented statuses and schemas (405s with an `Allow` header), no
schema-valid request refused with a 400, no schema-invalid one accepted, no refused request
that changes the store (fuzz_hooks.py). Short here (`OPENRL_FUZZ_EXAMPLES`, default 5 per
operation); `make fuzz` runs it long, with the stateful phase too (which follows the
description's links, create -> use).

Ids a generator cannot guess would leave most routes at their lookup (a 404), so real
objects are made first (`seeded`: sessions, a trained LoRA run with saved weights, sampler
weights and an export, a sampling session, finished futures, a download link) and the run's
config binds each id parameter to a dictionary of them (schemathesis dictionaries: a real id
most of the time, a generated one otherwise). Routes that end or delete things get objects of
their own, so the others keep theirs, and are fuzzed in a second run after all the others
(schemathesis also reuses ids it read from answers). The test also requires most operations to answer a 2xx
at least once, so a change that sends the fuzzing back to the lookups fails.

Protobuf and compressed bodies, which no JSON Schema describes, get their own cases: random
bytes, truncations of a real SDK request, zstd bombs and bodies over `max_request_bytes`
(a 413 naming the limit and the setting), each answered 4xx and storing nothing.
"""

from __future__ import annotations

import collections
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import tinker
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
MODEL = "openrl/tiny-qwen3"
# Operations that can never answer a 2xx: none (every Tinker route is served).
NEVER_OK: set[str] = set()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("openrl-fuzz")
    # Short waits: a long-poll on an unfinished future, a run's event stream.
    env = {"OPENRL_OPERATOR_API_KEY": OPERATOR, "OPENRL_MAX_REQUEST_BYTES": str(LIMIT), "OPENRL_LONG_POLL_SECONDS": "1",
           "OPENRL_EVENT_STREAM_SECONDS": "1"}  # fmt: skip
    srv = LocalServer(data, ["openrl/tiny-qwen3"], f"alice={KEY}", extra_env=env)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def seeded(server) -> dict[str, list]:
    """Real objects of the fuzzed tenant, each id list a schemathesis dictionary: what the
    generic routes use, and apart from them what the routes that end or delete things get."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TINKER_TELEMETRY", "0")
        return _seed(server)


def _seed(server) -> dict[str, list]:
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    tokens = list(range(5, 21))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 15},
    )
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    weights = training.save_state("w").result().path
    doomed = [
        training.save_state("d").result().path,
        training.save_weights_for_sampler("ds").result().path,
    ]  # OpenRL's DELETE
    doomed_here = training.save_state("d2").result().path  # the Tinker REST DELETE's
    sampler_weights = training.save_weights_for_sampler("s").result().path
    export = training.save_weights_external("e").result().path
    link = next(iter(rest.get_external_weights_urls(export).result().urls.values()))
    victim = service.create_lora_training_client(base_model=MODEL, rank=4, seed=2).result().model_id  # to be cancelled
    api = httpx.Client(base_url=server.url + "/api/v1", headers={"X-API-Key": KEY}, timeout=60)
    with api:
        session = training.model_id.split(":train:")[0]
        others = [api.post("/create_session", json={"tags": ["fuzz"]}).json()["session_id"] for _ in range(2)]
        body = {"session_id": session, "sampling_session_seq_id": 900, "model_path": sampler_weights}
        sampler = api.post("/create_sampling_session", json=body).json()["sampling_session_id"]
        prompt = {"chunks": [{"type": "encoded_text", "tokens": tokens[:4]}]}
        sample = api.post("/asample", json={"sampling_session_id": sampler, "seq_id": 1, "num_samples": 1, "prompt": prompt,
                                             "sampling_params": {"max_tokens": 2}}).json()["request_id"]  # fmt: skip
        for _ in range(60):  # long-polls of a second each (the fuzzed server's setting)
            if api.post("/retrieve_future", json={"request_id": sample}).status_code == 200:
                break
        else:
            raise AssertionError(f"the seeded sample {sample} never finished")
    # Finished, so that no heartbeat of the SDK's lands while a refused request is checked
    # for leaving the store as it was.
    service.close("success").result()
    run = training.model_id
    url = urlsplit(link)
    tenant, sha, filename = url.path.split("/")[-3:]
    query = {name: values[0] for name, values in parse_qs(url.query).items()}
    name = lambda path: path.split("/", 3)[3]  # noqa: E731  the checkpoint id: kind/name
    return {
        "sessions": [others[0], session], "finishable": [others[1]], "runs": [run], "victims": [victim],
        "samplers": [sampler], "futures": [sample], "models_v1": [MODEL, sampler_weights],
        "paths": [weights, sampler_weights], "sampler_paths": [sampler_weights], "doomed_paths": doomed,
        "rest_delete": [name(doomed_here)], "rest_publish": [name(weights) + "/publish"],
        "rest_ttl": [name(weights) + "/ttl"], "rest_urls": [name(export) + "/external_weights_urls"],
        "tenants": [tenant], "shas": [sha], "filenames": [filename], "expires": [query["expires"]], "signatures": [query["signature"]],
    }  # fmt: skip


# Which id goes where: (operation or "*" for every one, parameter, dictionary).
BINDINGS = [
    ("*", "path.session_id", "sessions"), ("*", "body.session_id", "sessions"), ("*", "body.model_id", "runs"),
    ("*", "path.run_id", "runs"), ("*", "query.run_id", "runs"), ("*", "body.sampling_session_id", "samplers"),
    ("*", "path.sampling_session_id", "samplers"), ("*", "body.request_id", "futures"), ("*", "body.tinker_path", "paths"),
    ("*", "body.source_path", "paths"), ("*", "body.model_path", "sampler_paths"), ("*", "query.path", "paths"),
    ("*", "path.model", "models_v1"), ("*", "body.model", "models_v1"),
    ("*", "path.tenant", "tenants"), ("*", "path.sha256", "shas"), ("*", "path.filename", "filenames"),
    ("*", "query.expires", "expires"), ("*", "query.signature", "signatures"),
    ("*", "body.target.sampling_session_id", "samplers"),
    ("POST /api/v1/load_weights", "body.path", "paths"),
    ("POST /api/v1/sessions/{session_id}/finish", "path.session_id", "finishable"),
    ("POST /api/openrl/v1/runs/{run_id}/cancel", "path.run_id", "victims"),
    ("DELETE /api/openrl/v1/checkpoints", "query.path", "doomed_paths"),
]  # fmt: skip
ID_PROBABILITY = 0.9  # the rest are generated ids: unknown ones, a 404 (tenant isolation is tested apart)
# Fixed values that bound the work an accepted request starts, so the run stays short: a
# sample of a couple of tokens (unbounded, the tiny model's context takes a minute on CPU),
# a fork answered at once.
FIXED = {
    "POST /v1/completions": {"body.max_tokens": 2}, "POST /v1/chat/completions": {"body.max_tokens": 2, "body.max_completion_tokens": 2},
    "POST /api/v1/asample": {"body.sampling_params.max_tokens": 2}, "POST /api/openrl/v1/runs/{run_id}/fork": {"body.wait_seconds": 0},
    # A valid window: its rules that join both ends and the clock are no schema's (openapi_routes.BILLING_PARAMS).
    "GET /api/v1/billing/usage/events": {"query.starting_on": "2026-01-01T00:00:00Z", "query.ending_before": "2026-01-02T00:00:00Z"},
}  # fmt: skip
# Path parameters that hold a "/" (a checkpoint id, a model path): schemathesis generates
# none and takes no dictionary entry with one, so these are fixed (seeded at run time).
FIXED_PATHS = {
    "POST /api/v1/training_runs/{run_id}/checkpoints/{rest}": ("path.rest", "rest_publish"),
    "PUT /api/v1/training_runs/{run_id}/checkpoints/{rest}": ("path.rest", "rest_ttl"),
    "GET /api/v1/training_runs/{run_id}/checkpoints/{rest}": ("path.rest", "rest_urls"),
    "DELETE /api/v1/training_runs/{run_id}/checkpoints/{rest}": ("path.rest", "rest_delete"),
    "GET /v1/models/{model}": ("path.model", "models_v1"),
}


def fuzz_config(seeded: dict[str, list], path: Path) -> Path:
    """schemathesis.toml plus the seeded dictionaries and the parameter bindings."""
    lines = [CONFIG.read_text(), ""]
    for name, values in seeded.items():
        lines += [f"[dictionaries.{name}]", f"values = {json.dumps(values)}", ""]
    by_operation = collections.defaultdict(list)
    for operation, parameter, dictionary in BINDINGS:
        by_operation[operation].append(
            f'"{parameter}" = {{ dictionary = "{dictionary}", probability = {ID_PROBABILITY} }}'
        )
    for operation, values in FIXED.items():
        by_operation[operation] += [f'"{parameter}" = {json.dumps(value)}' for parameter, value in values.items()]
    for operation, (parameter, dictionary) in FIXED_PATHS.items():
        by_operation[operation] = [line for line in by_operation[operation] if not line.startswith(f'"{parameter}"')]
        by_operation[operation].append(f'"{parameter}" = {json.dumps(seeded[dictionary][0])}')
    lines += ["[parameters]", *by_operation.pop("*"), ""]
    for operation, entries in by_operation.items():
        lines += ["[[operations]]", f'include-name = "{operation}"', "[operations.parameters]", *entries, ""]
    path.write_text("\n".join(lines))
    return path


def coverage(statuses: Path) -> dict[str, collections.Counter]:
    """Per operation, how many answers of each status (what fuzz_hooks.after_call wrote)."""
    answers: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in (statuses.read_text() if statuses.exists() else "").splitlines():
        operation, status, _seconds = line.rsplit("\t", 2)
        answers[operation][int(status)] += 1
    return answers


def stored(server) -> int:
    """The gateway's events but those a refusal records on purpose (workers may still be
    finishing accepted requests: their events are not the refused request's doing)."""
    with sqlite3.connect(f"file:{server.data_dir / 'events.db'}?mode=ro", uri=True, timeout=30) as conn:
        query = "SELECT count(*) FROM events WHERE source = '/openrl/gateway' AND type NOT LIKE ? AND type NOT LIKE ?"
        return conn.execute(query, ON_PURPOSE).fetchone()[0]


def digest(output: str) -> str:
    """Each failure's operation, check, status and answer: what a failed run needs to show."""
    keep = ("___", "- ST", "[4", "[5", "    `{", "    Received", "    Documented", "    curl", "Test cases", "  ❌")
    return "\n".join(
        line[:4000] for line in output.splitlines() if line.lstrip().startswith(keep) or line.startswith(keep)
    )


# What ends or removes a seeded object (a run, a session, a checkpoint, by a TTL): fuzzed in a
# second run, after every other operation, since schemathesis also reuses ids it read from
# answers (the seeded run's, from a listing) and would end what the others use.
ENDING = ("POST /api/openrl/v1/runs/{run_id}/cancel", "POST /api/v1/sessions/{session_id}/finish",
          "DELETE /api/openrl/v1/checkpoints", "DELETE /api/v1/training_runs/{run_id}/checkpoints/{rest}",
          "PUT /api/v1/training_runs/{run_id}/checkpoints/{rest}")  # fmt: skip


def schemathesis_run(
    server, seeded, config: Path, statuses: Path, report: Path, operations: list[str]
) -> tuple[subprocess.CompletedProcess, dict]:
    phases = "examples,coverage,fuzzing,stateful" if LONG else "examples,coverage,fuzzing"
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run", f"{server.url}/openapi.json",
        "-H", f"X-API-Key: {KEY}", "-H", f"Authorization: Bearer {KEY}",
        "--checks", "all", "--exclude-checks", "use_after_free,ensure_resource_availability,object_level_authorization,positive_data_acceptance",
        "--phases", phases, "--max-examples", str(EXAMPLES), "--workers", "1", "--seed", os.environ.get("OPENRL_FUZZ_SEED", "1"),
        "--request-timeout", "60", "--suppress-health-check", "filter_too_much,too_slow", "--max-failures", "1000",
        "--report", "json", "--report-json-path", str(report), "--output-truncate", "true", *operations,
    ]  # fmt: skip
    env = dict(os.environ, SCHEMATHESIS_HOOKS=HOOKS, OPENRL_FUZZ_DB=str(server.data_dir / "events.db"), OPENRL_FUZZ_STATUSES=str(statuses),
               OPENRL_FUZZ_MODEL=seeded["runs"][0])  # fmt: skip
    run = subprocess.run(
        command, env=env, cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True, timeout=1800
    )
    return run, (json.loads(report.read_text()) if report.exists() else {})


def test_schemathesis_finds_nothing(server, seeded, tmp_path):
    statuses, config = tmp_path / "statuses.tsv", fuzz_config(seeded, tmp_path / "schemathesis.toml")
    runs = [
        schemathesis_run(server, seeded, config, statuses, tmp_path / "first.json", [arg for name in ENDING for arg in ("--exclude-name", name)]),
        schemathesis_run(server, seeded, config, statuses, tmp_path / "ending.json", [arg for name in ENDING for arg in ("--include-name", name)]),
    ]  # fmt: skip
    generated = sum((summary.get("test_cases") or {}).get("generated") or 0 for _, summary in runs)
    tested = sum((summary.get("operations") or {}).get("tested") or 0 for _, summary in runs)
    print(f"schemathesis: {generated} cases over {tested} operations, "
          f"{sum(len(summary.get('failures') or []) for _, summary in runs)} failures, {sum(len(summary.get('errors') or []) for _, summary in runs)} errors")  # fmt: skip
    answers = coverage(statuses)
    for operation in sorted(answers):
        print(f"  {operation}: " + " ".join(f"{status}:{n}" for status, n in sorted(answers[operation].items())))
    succeeded = {operation for operation, counts in answers.items() if any(200 <= status < 300 for status in counts)}
    print(f"{len(succeeded)} of {len(answers)} operations answered a 2xx")
    for run, summary in runs:
        assert run.returncode == 0, digest(run.stdout) + run.stderr[-5000:]
        assert not summary["failures"] and not summary["errors"]
    assert tested >= 50 and generated >= 50 * EXAMPLES
    # the fuzzing reaches the routes' own logic: all but a few of those that can succeed did
    assert len(succeeded) >= len(set(answers) - NEVER_OK) - 3, sorted(set(answers) - NEVER_OK - succeeded)


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
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    fb_input = types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy")
    request = types.ForwardBackwardRequest(forward_backward_input=fb_input, model_id=model_id, seq_id=seq_id)
    return request_conv.forward_backward_request_to_proto(request).SerializeToString()


def post(api, body: bytes, **headers) -> httpx.Response:
    return api.post(
        "/api/v1/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf", **headers}
    )


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
        api.post(
            "/api/v1/forward_backward",
            content=iter([real, b"\0" * LIMIT]),
            headers={"Content-Type": "application/x-protobuf"},
        ),
        api.post(
            "/api/v1/create_session", content=b"{" + b" " * LIMIT + b"}", headers={"Content-Type": "application/json"}
        ),
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
