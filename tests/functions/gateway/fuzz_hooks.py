"""Schemathesis hooks for the API fuzz run (`SCHEMATHESIS_HOOKS`, see test_api_fuzz.py).

- Protobuf bodies are left out of the schema-driven run: no JSON Schema says which bytes
  are a valid ForwardBackwardRequest, so they get their own cases in test_api_fuzz.py.
- `refused_requests_store_nothing`: a request answered 4xx leaves the event store as it
  was, except for what a refusal records on purpose (the audit event of a refused lookup,
  the `seq.skipped` of a refused seq_id). The server's SQLite store is read before and after
  each call (one worker, so no other request runs in between); only the gateway's own
  events count, since workers may still be finishing earlier, accepted requests.
- `schema_valid_requests_accepted` (in place of schemathesis's `positive_data_acceptance`,
  which the run excludes): a request valid by the description is answered 2xx, or with a
  status that answers the server's state rather than the request's shape: an object that
  does not exist (404), a seq_id already used (409), a finished session or cancelled run
  (410), a result not ready yet (408), a key not known (401), a link that does not verify
  (403). A 400 fails the run, unless its detail is one of the `UNSTATED` rules: the few a
  JSON Schema cannot state (a sum over a list, a length relative to another field, the
  store's state), each named with its reason. Every other 400 still fails.
- `map_case`: the description's example bodies carry a placeholder model id; in the examples
  phase they get the seeded run's (`OPENRL_FUZZ_MODEL`) and a fresh seq_id each.
- `after_call` writes each answer's operation, status and seconds to `OPENRL_FUZZ_STATUSES`
  (the test's coverage report).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sqlite3

import schemathesis

from functions.gateway.openapi_routes import MODEL_ID as PLACEHOLDER_MODEL

PROTOBUF = "application/x-protobuf"
GATEWAY = "/openrl/gateway"
ON_PURPOSE = ("%access.lookup.refused%", "%seq.skipped%")
STATE_STATUSES = {401, 403, 404, 408, 409, 410}
CONTEXT = "the prompt's tokens summed over its chunks (or prompts), with max_tokens, against the model's context: a sum"
# operation -> [(what the 400's detail says, why the description cannot say it)]
UNSTATED: dict[str, list[tuple[str, str]]] = {
    "POST /api/v1/asample": [
        (r"exceeds the model context|leaves no room in the model context", CONTEXT),
        (r"^prompt_logprobs_last_n must be between 1 and", "at most the prompt's length - 1: a sum over its chunks"),
    ],
    "POST /v1/completions": [(r"exceeds it|leaves no room|context", CONTEXT)],
    "POST /v1/chat/completions": [(r"exceeds it|leaves no room|context", "the rendered chat's tokens with max_tokens: a sum")],
    "POST /api/v1/forward_backward": [
        (r"^data\[\d+\]\.(model_input has \d+ tokens|loss_fn_inputs)", "a datum's loss inputs against its own token count and loss: lengths"),
    ],
    "POST /api/v1/forward": [
        (r"^data\[\d+\]\.(model_input has \d+ tokens|loss_fn_inputs)", "a datum's loss inputs against its own token count and loss: lengths"),
    ],
    "POST /api/v1/save_weights": [(r"already exists; pass overwrite=True", "the store's state: a checkpoint of that name")],
    "POST /api/v1/save_weights_for_sampler": [(r"^sampling session .* already exists", "the store's state: that sampling session")],
    "POST /api/openrl/v1/runs/{run_id}/fork": [(r"^step must be between 0 and \d+ \(the run's completed", "the run's state: its steps")],
}
_before: dict[str, int] = {}
_fresh_seq_ids = itertools.count(5000)  # above the seeded dictionary's (test_api_fuzz.py)


def gateway_events() -> int:
    with sqlite3.connect(f"file:{os.environ['OPENRL_FUZZ_DB']}?mode=ro", uri=True, timeout=30) as conn:
        query = "SELECT count(*) FROM events WHERE source = ? AND type NOT LIKE ? AND type NOT LIKE ?"
        return conn.execute(query, (GATEWAY, *ON_PURPOSE)).fetchone()[0]


@schemathesis.hook
def filter_case(context, case) -> bool:
    return case.media_type != PROTOBUF


@schemathesis.hook
def map_case(context, case):
    meta, body = case.meta, case.body
    if meta is not None and meta.phase.name == "examples" and isinstance(body, dict) and body.get("model_id") == PLACEHOLDER_MODEL:
        case.body = {**body, "model_id": os.environ["OPENRL_FUZZ_MODEL"], "seq_id": next(_fresh_seq_ids)}
    return case


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    _before[case.id] = gateway_events()


@schemathesis.hook
def after_call(context, case, response) -> None:
    path = os.environ.get("OPENRL_FUZZ_STATUSES")
    if path:
        with open(path, "a") as out:
            out.write(f"{case.operation.label}\t{response.status_code}\t{response.elapsed:.3f}\n")


@schemathesis.check
def refused_requests_store_nothing(ctx, response, case):
    before = _before.pop(case.id, None)
    if before is None or not 400 <= response.status_code < 500:
        return None
    after = gateway_events()
    if after != before:
        raise AssertionError(f"a request refused with {response.status_code} stored {after - before} event(s)")
    return True


def detail_of(response) -> str:
    try:
        body = json.loads(response.content)
    except ValueError:
        return ""
    error = body.get("error") if isinstance(body, dict) else None
    return str(body.get("detail", "") if error is None else error.get("message", ""))


@schemathesis.check
def schema_valid_requests_accepted(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return None
    status = response.status_code
    if 200 <= status < 300 or status in STATE_STATUSES:
        return True
    detail = detail_of(response)
    if status == 400 and any(re.search(rule, detail) for rule, _why in UNSTATED.get(case.operation.label, ())):
        return True
    raise AssertionError(f"a request valid by the description was refused with {status}: {detail[:300]}")
