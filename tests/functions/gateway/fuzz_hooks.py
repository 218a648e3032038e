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
- `before_call`: the description's example bodies carry a placeholder model id; in the examples
  phase they get the seeded run's (`OPENRL_FUZZ_MODEL`) and a fresh seq_id each. A valid
  request for the seeded run gets a fresh seq_id too: each seq_id of a model is used once,
  and generators draw the same few again and again (each a 409 that tests nothing new).
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
from jsonschema import Draft202012Validator

from functions.gateway.openapi_bodies import MODEL_ID as PLACEHOLDER_MODEL

PROTOBUF = "application/x-protobuf"
GATEWAY = "/openrl/gateway"
ON_PURPOSE = ("%access.lookup.refused%", "%seq.skipped%")
STATE_STATUSES = {401, 403, 404, 408, 409, 410}
CONTEXT = "the prompt's tokens summed over its chunks (or prompts), with max_tokens, against the model's context: a sum"
DATUM_RULES = [
    (
        r"^data\[\d+\]\.(model_input has \d+ tokens|loss_fn_inputs)",
        "a datum's loss inputs against its own token count and loss: lengths",
    ),
    (
        r"has \d+ values but shape|^sparse (tensor has|column index)|^sparse_crow_indices must",
        "a tensor's shape against its value count (a product), its CSR indices against its values (lengths)",
    ),
]
# operation -> [(what the 400's detail says, why the description cannot say it)]
UNSTATED: dict[str, list[tuple[str, str]]] = {
    "POST /api/v1/asample": [
        (r"exceeds the model context|leaves no room in the model context", CONTEXT),
        (r"^prompt_logprobs_last_n must be between 1 and", "at most the prompt's length - 1: a sum over its chunks"),
        (
            r"^target_prompt_logprobs must have shape \[|the prompt needs at least 2 tokens",
            "rows = the prompt's length - 1: a sum over its chunks",
        ),
        (
            r"^target_prompt_logprobs has \d+ values but shape|^sparse (tensor has|column index)|"
            r"^sparse_crow_indices must|^target_prompt_logprobs names no token id",
            "a tensor's shape against its value count (a product), its CSR indices against its values (lengths)",
        ),
        (r"^(prompt_alt_tokens_k|target_prompt_logprobs): len\(prompt\)", "the prompt's length times k: a product"),
    ],
    "POST /api/v1/save_weights_external": [
        (r"is not an age recipient: ", "an age key's bech32 checksum, an SSH key's encoding: no pattern states them")
    ],
    "POST /v1/completions": [
        (r"exceeds it|leaves no room|context", CONTEXT),
        (r"^at most \d+ choices per request \(prompts x n\)", "the number of prompts times n: a product"),
    ],
    "POST /v1/chat/completions": [
        (r"exceeds it|leaves no room|context", "the rendered chat's tokens with max_tokens: a sum")
    ],
    "POST /api/v1/forward_backward": DATUM_RULES,
    "POST /api/v1/forward": DATUM_RULES,
    "POST /api/v1/save_weights": [
        (r"already exists; pass overwrite=True", "the store's state: a checkpoint of that name")
    ],
    "POST /api/v1/save_weights_for_sampler": [
        (r"^sampling session .* already exists", "the store's state: that sampling session")
    ],
    "POST /api/openrl/v1/runs/{run_id}/fork": [
        (r"^step must be between 0 and \d+ \(the run's completed", "the run's state: its steps")
    ],
}
_before: dict[str, int] = {}
_fresh_seq_ids = itertools.count(1000)  # above the seeded run's own


def gateway_events() -> int:
    with sqlite3.connect(f"file:{os.environ['OPENRL_FUZZ_DB']}?mode=ro", uri=True, timeout=30) as conn:
        query = "SELECT count(*) FROM events WHERE source = ? AND type NOT LIKE ? AND type NOT LIKE ?"
        return conn.execute(query, (GATEWAY, *ON_PURPOSE)).fetchone()[0]


@schemathesis.hook
def filter_case(context, case) -> bool:
    return case.media_type != PROTOBUF


def seeded_ids(case) -> None:
    """Edited in place before the call (schemathesis then revalidates the case): the examples
    phase's placeholder model id becomes the seeded run, and a valid request for that run
    gets a fresh seq_id."""
    meta, body, model = case.meta, case.body, os.environ["OPENRL_FUZZ_MODEL"]
    if meta is None or not isinstance(body, dict):
        return
    if meta.phase.name == "examples" and body.get("model_id") == PLACEHOLDER_MODEL:
        body["model_id"] = model
    if (
        body.get("model_id") == model
        and isinstance(body.get("seq_id"), int)
        and (meta.generation.mode.is_positive or meta.phase.name == "examples")
    ):
        body["seq_id"] = next(_fresh_seq_ids)  # any seq_id >= 1 is as valid; a used one is a 409


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    seeded_ids(case)
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


_validators: dict[tuple[str, str], Draft202012Validator] = {}


def valid_body(case) -> bool:
    """Whether the body sent is valid by the description itself: a dictionary entry put in
    after generation (a seeded id where the generator had chosen null) can make it invalid."""
    if not isinstance(case.body, (dict, list)):
        return True
    key = (case.operation.label, str(case.media_type))
    if key not in _validators:
        spec = case.operation.schema.raw_schema
        content = (
            spec["paths"][case.operation.path][case.operation.method.lower()].get("requestBody", {}).get("content", {})
        )
        schema = (content.get(case.media_type) or {}).get("schema", {})
        _validators[key] = Draft202012Validator({**schema, "components": spec.get("components", {})})
    return _validators[key].is_valid(case.body)


@schemathesis.check
def schema_valid_requests_accepted(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or not valid_body(case):
        return None
    status = response.status_code
    if 200 <= status < 300 or status in STATE_STATUSES:
        return True
    detail = detail_of(response)
    if status == 400 and any(re.search(rule, detail) for rule, _why in UNSTATED.get(case.operation.label, ())):
        return True
    raise AssertionError(f"a request valid by the description was refused with {status}: {detail[:300]}")
