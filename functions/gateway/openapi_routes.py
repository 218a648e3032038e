"""What each gateway route takes and answers, for its OpenAPI description (`openapi.py`).

One `Doc` per (method, path template), for every route the app serves (a test fails for a
route without one). A `Doc` says what FastAPI cannot see: the JSON body a route reads by
hand (the Tinker wire model it validates against), the protobuf or binary bodies it also
takes, what it answers besides JSON, the error statuses it can answer beyond the ones every
route shares (and whether it reads the event store, hence a 503 while that is unreachable,
and records events, hence a 507 when the blob store's disk is full), and the rules its
hand-written checks enforce on parameters (page limits, the `tinker://` path grammar) and
bodies (`openapi_bodies.py`), written as JSON Schema so that a request valid by the
description is one the route accepts. The fuzz test (tests/functions/gateway/test_api_fuzz.py)
holds each claim to the live server: every answered status documented, every answer valid
against its schema, no schema-valid request refused with a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from pydantic import BaseModel

from functions.gateway import jsonbodies
from functions.gateway import openai_wire as oai
from functions.gateway.openapi_bodies import (
    BINARY,
    FB_INPUT,
    KIND,
    MODEL_ID,
    NAME,
    PAGE,
    PROTOBUF,
    RUN_ID,
    SCOPE,
    SEQUENCED,
    TINKER_PATH,
    TTL,
    Served,
    asample_rules,
    cancel_run_rules,
    chat_rules,
    completion_rules,
    copy_weights_rules,
    create_model_rules,
    fork_rules,
    load_weights_rules,
    project_rules,
    sampling_session_rules,
    save_external_rules,
    save_for_sampler_rules,
    save_weights_rules,
    sequenced_rules,
)  # fmt: skip
from functions.gateway.routes import rest_wire
from functions.gateway.routes.openrl_live import MAX_HISTORY
from functions.gateway.routes.openrl_runs import MAX_LIMIT, STATUSES
from functions.gateway.routes.openrl_runs import PREFIX as OPENRL
from openrl_core.wire import base, futures, sampling, session_search, training
from openrl_core.wire.futures import MAX_POSITION


@dataclass(frozen=True)
class Doc:
    errors: tuple[int, ...] = ()  # besides 400 (bad input), 401 (bad key) and 413 (body over the limit)
    body: Optional[type[BaseModel]] = None  # a JSON body the route reads by hand
    body_schema: Optional[Callable[[], dict]] = None  # a body no model describes
    body_patch: Optional[Callable[[dict, "Served"], None]] = (
        None  # the route's own checks, as schema (given what is served)
    )
    body_required: bool = True
    protobuf_body: bool = False  # also takes application/x-protobuf
    params: dict[str, dict] = field(default_factory=dict)  # schema of hand-checked parameters
    ok_content: dict[str, dict] = field(default_factory=dict)  # 2xx media types besides JSON
    ok_schema: Optional[type[BaseModel]] = None  # the JSON 2xx body, where FastAPI cannot see it
    ok_not_json: bool = False  # the 2xx body is never JSON
    authenticated: bool = True
    never_ok: bool = False  # a route that only ever refuses (a feature not offered)
    openai: bool = False  # errors in OpenAI's shape, key as Bearer
    example: Optional[dict] = None  # a JSON body the route takes (ids are placeholders)
    store: bool = True  # reads or writes the event store: a 503 while it is unreachable
    records: bool = False  # records events, whose payloads may go to the blob store: a 507 when its disk is full


V1 = "/api/v1"
CKPT = V1 + "/training_runs/{run_id}/checkpoints/{rest}"
CKPT_ID = f"{KIND}/{NAME}"
RUN_PARAM = {"run_id": {"type": "string", "pattern": f"^{RUN_ID}$"}}


# An event stream's schema describes each event (OpenAPI 3.1): its `data`, and what it holds.
def sse(data: dict, description: str) -> dict:
    properties = {"data": data, "id": {"type": "string"}, "event": {"type": "string"}}
    return {
        "text/event-stream": {
            "type": "object",
            "required": ["data"],
            "properties": properties,
            "description": description,
        }
    }


STREAM = sse({"type": "string", "minLength": 1}, "with stream: true, OpenAI chunks (JSON) ending data: [DONE]")
RUN_EVENT = {
    "type": "object",
    "required": ["schema", "position", "id", "type", "name", "key", "time", "fields"],
    "properties": {
        "schema": {"const": "openrl.event.v1"}, "position": {"type": "integer", "minimum": 1}, "id": {"type": "string"},
        "type": {"type": "string"}, "name": {"type": "string"}, "key": {"type": "string"}, "subject": {"type": ["string", "null"]},
        "time": {"type": "string"}, "fields": {"type": "object"},
    },
}  # fmt: skip
RUN_EVENTS = sse(
    {"type": "string", "contentMediaType": "application/json", "contentSchema": RUN_EVENT},
    "one stored event of the run each",
)
# The AdminClient's parameters. A billing window's other rules (starting_on not in the
# future, ending_before after it and within 14 days) join two parameters and the clock, which
# no schema says: the fuzz run sends a fixed valid window (tests/functions/gateway/test_api_fuzz.py).
AUDIT_PARAMS = {
    "event_type": {"type": "string", "enum": ["all", "checkpoints", "projects", "teams", "organizations"]},
    "day": {"type": "string", "format": "date", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
}
HOUR = {"type": "string", "format": "date-time", "pattern": r"^\d{4}-\d{2}-\d{2}T\d{2}:00:00(\.0+)?(Z|[+-]\d{2}:00)?$"}
BILLING_PARAMS = {"starting_on": HOUR, "ending_before": HOUR}
STORAGE_PARAMS = {"project_id": {"type": "string", "minLength": 1, "maxLength": 200, "pattern": r"\S"}}

ROUTES: dict[tuple[str, str], Doc] = {
    ("GET", "/openapi.json"): Doc(authenticated=False, store=False),
    ("GET", V1 + "/healthz"): Doc(authenticated=False, store=False),
    ("POST", V1 + "/client/config"): Doc(store=False),
    ("POST", V1 + "/client/dynamic_config"): Doc(store=False),
    ("GET", V1 + "/get_server_capabilities"): Doc(store=False),
    ("POST", V1 + "/telemetry"): Doc(records=True),
    ("POST", V1 + "/create_session"): Doc(records=True),
    ("POST", V1 + "/session_heartbeat"): Doc(errors=(404, 410), records=True),
    ("POST", V1 + "/sessions/{session_id}/finish"): Doc(errors=(404,), records=True),
    ("POST", V1 + "/create_model"): Doc(
        errors=(404, 409, 429), records=True, body=training.CreateModelRequest, body_patch=create_model_rules
    ),
    ("POST", V1 + "/get_info"): Doc(errors=(404, 410)),
    ("POST", V1 + "/load_weights"): Doc(
        errors=SEQUENCED, records=True, body=training.LoadWeightsRequest, body_patch=load_weights_rules
    ),
    ("POST", V1 + "/forward_backward"): Doc(
        errors=SEQUENCED,
        records=True,
        body=jsonbodies.ForwardBackwardRequest,
        body_patch=sequenced_rules,
        protobuf_body=True,
        example={"model_id": MODEL_ID, "seq_id": 1, "forward_backward_input": FB_INPUT},
    ),
    ("POST", V1 + "/forward"): Doc(
        errors=SEQUENCED,
        records=True,
        body=jsonbodies.ForwardRequest,
        body_patch=sequenced_rules,
        example={"model_id": MODEL_ID, "seq_id": 1, "forward_input": FB_INPUT},
    ),
    ("POST", V1 + "/optim_step"): Doc(errors=SEQUENCED, records=True, body=training.OptimStepRequest),
    ("POST", V1 + "/save_weights"): Doc(
        errors=SEQUENCED, records=True, body=training.SaveWeightsRequest, body_patch=save_weights_rules
    ),
    ("POST", V1 + "/save_weights_for_sampler"): Doc(
        errors=SEQUENCED, records=True, body=training.SaveWeightsForSamplerRequest, body_patch=save_for_sampler_rules
    ),
    ("POST", V1 + "/save_weights_external"): Doc(
        errors=SEQUENCED, records=True, body=rest_wire.SaveWeightsExternalRequest, body_patch=save_external_rules
    ),
    ("POST", V1 + "/create_sampling_session"): Doc(
        errors=(404, 409), records=True, body=sampling.CreateSamplingSessionRequest, body_patch=sampling_session_rules
    ),
    ("GET", V1 + "/samplers/{sampling_session_id}"): Doc(errors=(404,)),
    ("POST", V1 + "/asample"): Doc(
        errors=SEQUENCED, records=True, body=sampling.SampleRequest, body_patch=asample_rules
    ),
    # 200: the result (JSON, or protobuf for forward_backward and sample results when the
    # Accept header asks for it); 408: not finished within the long-poll window (try_again).
    ("POST", V1 + "/retrieve_future"): Doc(
        errors=(404, 408, 410), body=base.FutureRetrieveRequest, ok_content={PROTOBUF: BINARY}
    ),
    ("POST", V1 + "/retrieve_futures"): Doc(
        errors=(404,), body=futures.FuturesRetrieveRequest, ok_schema=futures.FuturesRetrieveResponse
    ),
    ("POST", V1 + "/cancel_future"): Doc(errors=(404,), records=True, body=futures.CancelFutureRequest),
    ("GET", V1 + "/training_runs"): Doc(params={**PAGE, **SCOPE}),
    ("GET", V1 + "/training_runs/{run_id}"): Doc(errors=(404,), params=SCOPE),
    ("POST", V1 + "/weights_info"): Doc(
        errors=(404,), body_patch=lambda s, _served: s["properties"].update(tinker_path=TINKER_PATH)
    ),
    ("GET", V1 + "/sessions"): Doc(params={**PAGE, **SCOPE}),
    ("GET", V1 + "/sessions/{session_id}"): Doc(errors=(404,), params=SCOPE),
    ("GET", V1 + "/training_runs/{run_id}/checkpoints"): Doc(errors=(404,)),
    ("GET", V1 + "/checkpoints"): Doc(params=PAGE),
    ("DELETE", CKPT): Doc(
        errors=(404,),
        records=True,
        params={**RUN_PARAM, "rest": {"type": "string", "pattern": f"^{CKPT_ID}(/publish)?$"}},
    ),
    ("POST", CKPT): Doc(
        errors=(404,), records=True, params={**RUN_PARAM, "rest": {"type": "string", "pattern": f"^{CKPT_ID}/publish$"}}
    ),
    ("PUT", CKPT): Doc(
        errors=(404,),
        records=True,
        params={**RUN_PARAM, "rest": {"type": "string", "pattern": f"^{CKPT_ID}/ttl$"}},
        body_patch=lambda s, _served: s["properties"].update(ttl_seconds=TTL),
    ),  # fmt: skip
    ("GET", CKPT): Doc(
        errors=(404,),
        params={**RUN_PARAM, "rest": {"type": "string", "pattern": f"^external_weights/{NAME}/external_weights_urls$"}},
    ),
    ("POST", V1 + "/copy_weights"): Doc(
        errors=(404, 409, 429), records=True, body=rest_wire.CopyWeightsRequest, body_patch=copy_weights_rules
    ),
    # A signed link is its own authorisation: 403 for a bad signature, 410 once expired or deleted.
    ("GET", V1 + "/downloads/{tenant}/{sha256}/{filename}"): Doc(
        errors=(403, 410),
        authenticated=False,
        ok_content={"application/octet-stream": BINARY},
        ok_not_json=True,
        store=False,
    ),
    # The AdminClient's reads of the tenant's own store (routes/admin.py); they record nothing.
    ("GET", V1 + "/audit"): Doc(params=AUDIT_PARAMS),
    ("GET", V1 + "/billing/usage/events"): Doc(params=BILLING_PARAMS),
    ("GET", V1 + "/billing/usage/checkpoints/current"): Doc(params=STORAGE_PARAMS),
    ("PUT", V1 + "/sessions/{session_id}/project"): Doc(
        errors=(404,), records=True, body=session_search.AssignSessionProjectRequest, body_patch=project_rules
    ),
    # Builds the trace now and stores it as a blob: ready at once, with a signed link.
    ("GET", V1 + "/sessions/{session_id}/trace_export"): Doc(errors=(404,), records=True),
    ("POST", V1 + "/sessions/search"): Doc(body=session_search.SessionSearchRequest),
    # OpenAI-compatible: 500 when the sampler fails a sample for a server-side reason.
    ("GET", "/v1/models"): Doc(openai=True),
    ("GET", "/v1/models/{model}"): Doc(errors=(404,), openai=True),
    ("POST", "/v1/completions"): Doc(
        errors=(404, 409, 429, 500),
        records=True,
        body=oai.CompletionRequest,
        body_patch=completion_rules,
        ok_content=STREAM,
        openai=True,
    ),
    ("POST", "/v1/chat/completions"): Doc(
        errors=(404, 409, 429, 500),
        records=True,
        body=oai.ChatCompletionRequest,
        body_patch=chat_rules,
        ok_content=STREAM,
        openai=True,
    ),
    # OpenRL's own API.
    ("GET", OPENRL + "/runs"): Doc(
        params={
            **PAGE,
            "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
            "status": {"type": "string", "enum": list(STATUSES)},
        }
    ),
    ("GET", OPENRL + "/runs/{run_id}"): Doc(errors=(404,)),
    ("GET", OPENRL + "/runs/{run_id}/metrics"): Doc(
        errors=(404,),
        params={"after_step": {"type": "integer", "minimum": 0, "maximum": MAX_POSITION}},
        ok_content={"application/x-ndjson": {"type": "string"}},
        ok_not_json=True,
    ),
    ("POST", OPENRL + "/runs/{run_id}/cancel"): Doc(
        errors=(404, 409), records=True, body_schema=cancel_run_rules, body_required=False
    ),
    ("GET", OPENRL + "/checkpoints"): Doc(errors=(404,)),
    ("GET", OPENRL + "/checkpoints/archive"): Doc(
        errors=(404, 410), params={"path": TINKER_PATH}, ok_content={"application/x-tar": BINARY}, ok_not_json=True
    ),
    ("DELETE", OPENRL + "/checkpoints"): Doc(errors=(404,), records=True, params={"path": TINKER_PATH}),
    ("GET", OPENRL + "/runs/{run_id}/events"): Doc(
        errors=(404,),
        params={
            "after": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_POSITION}, {"type": "null"}]},
            "history": {"type": "integer", "minimum": 0, "maximum": MAX_HISTORY},
        },
        ok_content=RUN_EVENTS,
        ok_not_json=True,
    ),  # fmt: skip
    ("GET", OPENRL + "/runs/{run_id}/sampling"): Doc(errors=(404,)),
    # 413 also for a body over the route's own 4 KiB; 409: nothing to fork, or a key reused for another step.
    ("POST", OPENRL + "/runs/{run_id}/fork"): Doc(errors=(404, 409, 429), records=True, body_schema=fork_rules),
    ("GET", OPENRL + "/timeline"): Doc(params={"since": {"type": "number", "minimum": 0}}),
    # The dashboard's static files (left out of the description: no API there).
    ("GET", "/dashboard"): Doc(authenticated=False, store=False),
    ("GET", "/dashboard/{name}"): Doc(errors=(404,), authenticated=False, store=False),
    ("GET", OPENRL + "/sessions"): Doc(
        params={**PAGE, "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}}
    ),
}
