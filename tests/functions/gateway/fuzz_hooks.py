"""Schemathesis hooks for the API fuzz run (`SCHEMATHESIS_HOOKS`, see test_api_fuzz.py).

- Protobuf bodies are left out of the schema-driven run: no JSON Schema says which bytes
  are a valid ForwardBackwardRequest, so they get their own cases in test_api_fuzz.py.
- `refused_requests_store_nothing`: a request answered 4xx leaves the event store as it
  was, except for what a refusal records on purpose (the audit event of a refused lookup,
  the `seq.skipped` of a refused seq_id). The server's SQLite store is read before and after
  each call (one worker, so no other request runs in between); only the gateway's own
  events count, since workers may still be finishing earlier, accepted requests.
"""

from __future__ import annotations

import os
import sqlite3

import schemathesis

PROTOBUF = "application/x-protobuf"
GATEWAY = "/openrl/gateway"
ON_PURPOSE = ("%access.lookup.refused%", "%seq.skipped%")
_before: dict[str, int] = {}


def gateway_events() -> int:
    with sqlite3.connect(f"file:{os.environ['OPENRL_FUZZ_DB']}?mode=ro", uri=True, timeout=30) as conn:
        query = "SELECT count(*) FROM events WHERE source = ? AND type NOT LIKE ? AND type NOT LIKE ?"
        return conn.execute(query, (GATEWAY, *ON_PURPOSE)).fetchone()[0]


@schemathesis.hook
def filter_case(context, case) -> bool:
    return case.media_type != PROTOBUF


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    _before[case.id] = gateway_events()


@schemathesis.check
def refused_requests_store_nothing(ctx, response, case):
    before = _before.pop(case.id, None)
    if before is None or not 400 <= response.status_code < 500:
        return None
    after = gateway_events()
    if after != before:
        raise AssertionError(f"a request refused with {response.status_code} stored {after - before} event(s)")
    return True


@schemathesis.hook
def after_call(context, case, response) -> None:
    path = os.environ.get("OPENRL_FUZZ_STATUSES")
    if path:
        with open(path, "a") as out:
            out.write(f"{case.operation.label}\t{response.status_code}\n")
