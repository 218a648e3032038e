"""What each gateway route takes and answers, for its OpenAPI description (`openapi.py`).

One `Doc` per (method, path template), for every route the app serves (a test fails for a
route without one). A `Doc` says what FastAPI cannot see: the JSON body a route reads by
hand (the Tinker wire model it validates against), the protobuf or binary bodies it also
takes, what it answers besides JSON, the error statuses it can answer beyond the ones every
route shares (and whether it reads the event store, hence a 503 while that is unreachable,
and records events, hence a 507 when the blob store's disk is full), and the rules its hand-written checks enforce on parameters (page limits, the
`tinker://` path grammar), written as JSON Schema so that a request valid by the
description is one the route accepts. The fuzz test (tests/functions/gateway/test_api_fuzz.py)
holds each claim to the live server: every answered status documented, every answer valid
against its schema, no schema-valid request refused with a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pydantic import BaseModel

from functions.gateway import jsonbodies
from functions.gateway import openai_wire as oai
from functions.gateway.routes import rest_wire
from functions.gateway.routes.openrl_forks import MAX_WAIT as FORK_MAX_WAIT
from functions.gateway.routes.openrl_live import MAX_HISTORY
from functions.gateway.routes.openrl_runs import MAX_LIMIT, STATUSES, PREFIX as OPENRL
from functions.gateway.routes.sampling import MAX_NUM_SAMPLES, MAX_TOPK
from openrl_core.finetune import FULL_FINETUNE_KEY
from openrl_core.ids import CHECKPOINT_KINDS
from openrl_core.losses import LOSSES
from openrl_core.wire import base, futures, sampling, training
from openrl_core.wire.futures import MAX_POSITION

# The grammar `openrl_core.ids` checks (a path failing it is a 400 before any lookup).
RUN_ID = r"[A-Za-z0-9-]{1,64}:train:[0-9]{1,9}"
NAME = r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,127}"
KIND = "(" + "|".join(CHECKPOINT_KINDS) + ")"
TINKER_PATH = {"type": "string", "pattern": f"^tinker://{RUN_ID}/{KIND}/{NAME}$"}
NULLABLE_TINKER_PATH = {"anyOf": [TINKER_PATH, {"type": "null"}]}
PAGE = {
    "limit": {"type": "integer", "minimum": 1, "maximum": rest_wire.MAX_PAGE},
    "offset": {"type": "integer", "minimum": 0, "maximum": rest_wire.MAX_OFFSET},
}
SCOPE = {"access_scope": {"type": "string", "enum": ["owned", "accessible"], "default": "owned"}}
TTL = {"anyOf": [{"type": "integer", "minimum": rest_wire.MIN_TTL_SECONDS, "maximum": rest_wire.MAX_TTL_SECONDS}, {"type": "null"}]}
PROTOBUF = "application/x-protobuf"
BINARY = {"type": "string", "format": "binary"}
SEQUENCED = (404, 409, 410, 429)  # unknown model; seq_id reused with another body; cancelled run; over a quota


@dataclass(frozen=True)
class Served:
    """What the description depends on: the served model names, and the smallest vocabulary
    among them (token ids below it are valid for every served model; with one model, exact)."""

    names: list[str]
    vocab_size: int

    @property
    def token(self) -> dict:
        return {"type": "integer", "minimum": 0, "maximum": self.vocab_size - 1}


def only(value: Any, kind: str) -> dict:
    """An argument OpenAI has that this server takes only at its neutral value."""
    return {"anyOf": [{"type": kind, "const": value} if kind != "object" else {"type": "object", "maxProperties": 0}, {"type": "null"}]}


# A tensor's values as its dtype holds them: int64 ones whole and inside the int64 range (a
# bound the gateway applies to every value, 2**63 in magnitude), float32 ones inside float32's;
# a sparse (CSR) one 2-D with its index lists. Its shape against its value count is a product,
# and its CSR indices against its values, lengths: neither is stated (fuzz_hooks.UNSTATED).
INT64_VALUE = {"type": "number", "multipleOf": 1, "exclusiveMinimum": -(2**63), "exclusiveMaximum": 2**63}
FLOAT32_VALUE = {"type": "number", "minimum": -3.4028234663852886e38, "maximum": 3.4028234663852886e38}
TENSOR_RULES = [
    {"if": {"properties": {"dtype": {"const": "int64"}}}, "then": {"properties": {"data": {"items": INT64_VALUE}}}},
    {"if": {"properties": {"dtype": {"const": "float32"}}}, "then": {"properties": {"data": {"items": FLOAT32_VALUE}}}},
    {"if": {"anyOf": [{"required": [name], "properties": {name: {"type": "array"}}} for name in ("sparse_crow_indices", "sparse_col_indices")]},
     "then": {"required": ["shape", "sparse_crow_indices", "sparse_col_indices"],
              "properties": {"shape": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"minimum": 0}},
                             "sparse_crow_indices": {"type": "array"}, "sparse_col_indices": {"type": "array"}}}},
]  # fmt: skip


# A model input holding at least one token: some chunk has one.
NONEMPTY_INPUT = {"allOf": [{"$ref": "#/components/schemas/ModelInput"}], "properties": {"chunks": {"contains": {"properties": {"tokens": {"minItems": 1}}}}}}


def _create_model(schema: dict, served: Served) -> None:
    """A LoRA run needs its lora_config; a full fine-tuning run (user_metadata flag "true")
    takes none, or one that leaves every weight trained. (A server whose settings make some
    base models full fine-tuning by default takes no lora_config flags for them; not stated.)"""
    props = schema["properties"]
    props["base_model"] = {"type": "string", "enum": served.names}
    flag = {"type": "string", "enum": ["true", "false"]}
    props["user_metadata"] = {"anyOf": [{"type": "object", "properties": {FULL_FINETUNE_KEY: flag}}, {"type": "null"}]}
    full = {"required": ["user_metadata"], "properties": {"user_metadata": {"type": "object", "required": [FULL_FINETUNE_KEY],
            "properties": {FULL_FINETUNE_KEY: {"const": "true"}}}}}  # fmt: skip
    every_weight = {"type": "object", "properties": {name: {"const": True} for name in ("train_attn", "train_mlp", "train_unembed")}}
    schema["anyOf"] = [
        {"required": ["lora_config"], "properties": {"lora_config": {"$ref": "#/components/schemas/LoraConfig"}}, "not": full},
        {**full, "properties": {**full["properties"], "lora_config": {"anyOf": [every_weight, {"type": "null"}]}}},
    ]


def _asample(schema: dict, served: Served) -> None:
    # asample samples in a session it was given; the SDK's direct base_model form is refused.
    schema["required"] = sorted({*schema.get("required", ()), "sampling_session_id"})
    props = schema["properties"]
    props["sampling_session_id"] = {"type": "string"}
    # a prompt holds at least one token (some chunk has one); its total with max_tokens must fit
    # the model's context, which no JSON Schema can sum (stated here, checked by the route)
    props["prompt"] = NONEMPTY_INPUT
    props["num_samples"] = {"type": "integer", "minimum": 1, "maximum": MAX_NUM_SAMPLES, "default": 1}
    props["topk_prompt_logprobs"] = {"type": "integer", "minimum": 0, "maximum": MAX_TOPK, "default": 0}
    props["record_stability_info"] = {"const": False, "default": False}  # not offered (a 400 that says why)
    for name in ("topk_sample_logprobs", "prompt_alt_tokens_k"):
        props[name] = {"const": 0, "default": 0}  # not offered yet
    props["target_prompt_logprobs"] = {"anyOf": [{"type": "object", "maxProperties": 0}, {"type": "null"}]}
    # prompt_logprobs_last_n needs prompt_logprobs (and at most the prompt's length - 1)
    schema["if"] = {"required": ["prompt_logprobs_last_n"], "properties": {"prompt_logprobs_last_n": {"type": "integer"}}}
    schema["then"] = {"required": ["prompt_logprobs"], "properties": {"prompt_logprobs": {"const": True},
                      "prompt_logprobs_last_n": {"minimum": 1}}}  # fmt: skip


def _sampling_session(schema: dict, served: Served) -> None:
    # A session samples a base model or a checkpoint (then base_model, if given, must match it).
    schema["anyOf"] = [
        {"required": ["base_model"], "properties": {"base_model": {"type": "string", "enum": served.names}}},
        # base_model, if given, is the checkpoint's (with one model served: that one)
        {"required": ["model_path"], "properties": {"model_path": TINKER_PATH, "base_model": {"anyOf": [{"enum": served.names}, {"type": "null"}]}}},
    ]
    schema["properties"]["model_path"] = NULLABLE_TINKER_PATH


LOADABLE_PATH = {"type": "string", "pattern": f"^tinker://{RUN_ID}/(weights|sampler_weights)/{NAME}$"}  # not exports


def _load_weights(schema: dict, served: Served) -> None:
    schema["properties"]["path"] = LOADABLE_PATH
    # optimizer state is only in weights/ checkpoints (save_state)
    schema["if"] = {"required": ["path"], "properties": {"path": {"pattern": "/sampler_weights/"}}}
    schema["then"] = {"properties": {"optimizer": {"const": False}}}
    schema["properties"]["base_model"] = {"anyOf": [{"type": "string", "enum": served.names}, {"type": "null"}]}
    # Two addressings: a new model (session_id + model_seq_id) or in place (model_id + seq_id).
    schema["anyOf"] = [
        {"required": ["session_id", "model_seq_id"], "properties": {"session_id": {"type": "string"}, "model_seq_id": {"type": "integer"}}},
        {"required": ["model_id", "seq_id"], "properties": {"model_id": {"type": "string"}, "seq_id": {"type": "integer"}}},
    ]


NAME_STR = {"type": "string", "pattern": f"^{NAME}$"}


def _sequenced(schema: dict, served: Served) -> None:
    schema["properties"]["seq_id"] = {"type": "integer", "minimum": 1}  # checked by the route, not the model


def _save_weights(schema: dict, served: Served) -> None:
    schema["required"] = sorted({*schema.get("required", ()), "path"})
    schema["properties"]["path"] = NAME_STR


def _save_for_sampler(schema: dict, served: Served) -> None:
    # A checkpoint name, or the seq id of a new sampling session made from the weights.
    schema["properties"]["path"] = {"anyOf": [NAME_STR, {"type": "null"}]}
    schema["anyOf"] = [
        {"required": ["path"], "properties": {"path": NAME_STR}},
        {"required": ["sampling_session_seq_id"], "properties": {"sampling_session_seq_id": {"type": "integer", "minimum": 0}}},
    ]


def _save_external(schema: dict, served: Served) -> None:
    schema["required"] = sorted({*schema.get("required", ()), "path", "seq_id"})
    props = schema["properties"]
    props["path"] = NAME_STR
    props["seq_id"] = {"type": "integer", "minimum": 1}
    props["age_encryption_recipients"] = {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]}  # not offered


def _copy_weights(schema: dict, served: Served) -> None:
    props = schema["properties"]
    props["source_path"] = TINKER_PATH
    props["ttl_seconds"] = TTL
    props["weights_access_token"] = {"type": "null"}  # copies stay within the caller's checkpoints
    # into a session (session_id with model_seq_id) or a new one in a project, not both
    none = {"type": "null"}
    schema["anyOf"] = [
        {"required": ["session_id", "model_seq_id"], "properties": {"session_id": {"type": "string"}, "model_seq_id": {"type": "integer"},
         "destination_project_id": none}},
        {"required": ["destination_project_id"], "properties": {"destination_project_id": {"type": "string", "pattern": "\\S", "maxLength": 200},
         "session_id": none, "model_seq_id": none}},
    ]  # fmt: skip


def _openai_common(schema: dict, served: Served) -> None:
    props = schema["properties"]
    for name in ("presence_penalty", "frequency_penalty"):
        props[name] = only(0, "number")
    props["logit_bias"] = only({}, "object")
    stop = {"type": "string", "minLength": 1}
    props["stop"] = {"anyOf": [stop, {"type": "array", "items": stop, "maxItems": oai.MAX_STOP_SEQUENCES}, {"type": "null"}]}


def _completion(schema: dict, served: Served) -> None:
    _openai_common(schema, served)
    props = schema["properties"]
    # one prompt or several, each holding at least one token (any non-empty text does)
    tokens = {"type": "array", "items": served.token, "minItems": 1}
    props["prompt"] = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                                 tokens, {"type": "array", "items": tokens, "minItems": 1}]}  # fmt: skip
    props["echo"] = only(False, "boolean")
    props["suffix"] = {"anyOf": [{"type": "string", "maxLength": 0}, {"type": "null"}]}
    props["best_of"] = only(1, "integer")


def _chat(schema: dict, served: Served) -> None:
    _openai_common(schema, served)
    props = schema["properties"]
    props["tools"] = {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]}
    props["tool_choice"] = {"anyOf": [{"type": "string", "enum": ["none", "auto"]}, {"type": "null"}]}
    # top_logprobs needs logprobs: true.
    schema["if"] = {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}}
    schema["then"] = {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}


def _cancel_run() -> dict:
    return {
        "type": "object",
        "properties": {"reason": {"anyOf": [{"type": "string", "maxLength": 500}, {"type": "null"}]}},
        "description": "why the run is cancelled (recorded in its event); optional",
    }


def _fork() -> dict:
    return {
        "type": "object",
        "required": ["step"],
        "additionalProperties": False,
        "properties": {
            "step": {"type": "integer", "minimum": 0, "description": "completed optim_steps to fork after (at most the run's)"},
            "wait_seconds": {"type": "number", "minimum": 0, "maximum": FORK_MAX_WAIT, "default": 60},
        },
    }


def patch_components(components: dict, served: Served) -> None:
    """The parts several bodies share, as the routes check them: token ids in the vocabulary;
    a forward_backward input with at least one datum, each holding a token, a known loss and
    only the config keys that loss uses."""
    if "PromptChunk" in components:
        components["PromptChunk"]["properties"]["tokens"]["items"] = served.token
    if "TensorData" in components:
        components["TensorData"]["allOf"] = TENSOR_RULES
        props = components["TensorData"]["properties"]
        for name, least in (("shape", 0), ("sparse_crow_indices", None), ("sparse_col_indices", None)):
            index = {"type": "integer", "maximum": 2**63 - 1, "minimum": -(2**63) if least is None else least}
            props[name] = {"anyOf": [{"type": "array", "items": index}, {"type": "null"}]}
    if "DatumJSON" in components:
        components["DatumJSON"]["properties"]["model_input"] = NONEMPTY_INPUT
    if "ForwardBackwardInput" in components:
        fb_input = components["ForwardBackwardInput"]
        fb_input["properties"]["data"]["minItems"] = 1
        fb_input["properties"]["loss_fn"] = {"type": "string", "enum": sorted(LOSSES)}
        fb_input["allOf"] = [
            {"if": {"properties": {"loss_fn": {"const": name}}},
             "then": {"properties": {"loss_fn_config": {"anyOf": [{"type": "null"}, {"type": "object", "additionalProperties": False,
                      "properties": {key: {"type": "number"} for key in spec.config_defaults}}]}}}}
            for name, spec in sorted(LOSSES.items())
        ]  # fmt: skip


@dataclass(frozen=True)
class Doc:
    errors: tuple[int, ...] = ()  # besides 400 (bad input), 401 (bad key) and 413 (body over the limit)
    body: Optional[type[BaseModel]] = None  # a JSON body the route reads by hand
    body_schema: Optional[Callable[[], dict]] = None  # a body no model describes
    body_patch: Optional[Callable[[dict, "Served"], None]] = None  # the route's own checks, as schema (given what is served)
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
# One cross_entropy datum of three tokens: what a JSON forward_backward (or forward) carries.
FB_INPUT = {
    "data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
              "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4], "dtype": "int64"}, "weights": {"data": [1.0, 1.0, 1.0], "dtype": "float32"}}}],
    "loss_fn": "cross_entropy",
}  # fmt: skip
MODEL_ID = "00000000-0000-0000-0000-000000000000:train:0"
CKPT = V1 + "/training_runs/{run_id}/checkpoints/{rest}"
CKPT_ID = f"{KIND}/{NAME}"
RUN_PARAM = {"run_id": {"type": "string", "pattern": f"^{RUN_ID}$"}}
# An event stream's schema describes each event (OpenAPI 3.1): its `data`, and what it holds.
def sse(data: dict, description: str) -> dict:
    properties = {"data": data, "id": {"type": "string"}, "event": {"type": "string"}}
    return {"text/event-stream": {"type": "object", "required": ["data"], "properties": properties, "description": description}}


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
RUN_EVENTS = sse({"type": "string", "contentMediaType": "application/json", "contentSchema": RUN_EVENT}, "one stored event of the run each")
NOT_OFFERED = Doc(errors=(404,), never_ok=True, store=False)

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
    ("POST", V1 + "/create_model"): Doc(errors=(404, 409, 429), records=True, body=training.CreateModelRequest, body_patch=_create_model),
    ("POST", V1 + "/get_info"): Doc(errors=(404, 410)),
    ("POST", V1 + "/load_weights"): Doc(errors=SEQUENCED, records=True, body=training.LoadWeightsRequest, body_patch=_load_weights),
    ("POST", V1 + "/forward_backward"): Doc(errors=SEQUENCED, records=True, body=jsonbodies.ForwardBackwardRequest, body_patch=_sequenced, protobuf_body=True,
                                                   example={"model_id": MODEL_ID, "seq_id": 1, "forward_backward_input": FB_INPUT}),
    ("POST", V1 + "/forward"): Doc(errors=SEQUENCED, records=True, body=jsonbodies.ForwardRequest, body_patch=_sequenced,
                                          example={"model_id": MODEL_ID, "seq_id": 1, "forward_input": FB_INPUT}),
    ("POST", V1 + "/optim_step"): Doc(errors=SEQUENCED, records=True, body=training.OptimStepRequest),
    ("POST", V1 + "/save_weights"): Doc(errors=SEQUENCED, records=True, body=training.SaveWeightsRequest, body_patch=_save_weights),
    ("POST", V1 + "/save_weights_for_sampler"): Doc(errors=SEQUENCED, records=True, body=training.SaveWeightsForSamplerRequest, body_patch=_save_for_sampler),
    ("POST", V1 + "/save_weights_external"): Doc(errors=SEQUENCED, records=True, body=rest_wire.SaveWeightsExternalRequest, body_patch=_save_external),
    ("POST", V1 + "/create_sampling_session"): Doc(errors=(404, 409), records=True, body=sampling.CreateSamplingSessionRequest, body_patch=_sampling_session),
    ("GET", V1 + "/samplers/{sampling_session_id}"): Doc(errors=(404,)),
    ("POST", V1 + "/asample"): Doc(errors=SEQUENCED, records=True, body=sampling.SampleRequest, body_patch=_asample),
    # 200: the result (JSON, or protobuf for forward_backward and sample results when the
    # Accept header asks for it); 408: not finished within the long-poll window (try_again).
    ("POST", V1 + "/retrieve_future"): Doc(errors=(404, 408, 410), body=base.FutureRetrieveRequest, ok_content={PROTOBUF: BINARY}),
    ("POST", V1 + "/retrieve_futures"): Doc(errors=(404,), body=futures.FuturesRetrieveRequest, ok_schema=futures.FuturesRetrieveResponse),
    ("POST", V1 + "/cancel_future"): Doc(errors=(404,), records=True, body=futures.CancelFutureRequest),
    ("GET", V1 + "/training_runs"): Doc(params={**PAGE, **SCOPE}),
    ("GET", V1 + "/training_runs/{run_id}"): Doc(errors=(404,), params=SCOPE),
    ("POST", V1 + "/weights_info"): Doc(errors=(404,), body_patch=lambda s, _served: s["properties"].update(tinker_path=TINKER_PATH)),
    ("GET", V1 + "/sessions"): Doc(params={**PAGE, **SCOPE}),
    ("GET", V1 + "/sessions/{session_id}"): Doc(errors=(404,), params=SCOPE),
    ("GET", V1 + "/training_runs/{run_id}/checkpoints"): Doc(errors=(404,)),
    ("GET", V1 + "/checkpoints"): Doc(params=PAGE),
    ("DELETE", CKPT): Doc(errors=(404,), records=True, params={**RUN_PARAM, "rest": {"type": "string", "pattern": f"^{CKPT_ID}(/publish)?$"}}),
    ("POST", CKPT): Doc(errors=(404,), records=True, params={**RUN_PARAM, "rest": {"type": "string", "pattern": f"^{CKPT_ID}/publish$"}}),
    ("PUT", CKPT): Doc(errors=(404,), records=True, params={**RUN_PARAM, "rest": {"type": "string", "pattern": f"^{CKPT_ID}/ttl$"}},
                       body_patch=lambda s, _served: s["properties"].update(ttl_seconds=TTL)),  # fmt: skip
    ("GET", CKPT): Doc(errors=(404,), params={**RUN_PARAM, "rest": {"type": "string", "pattern": f"^external_weights/{NAME}/external_weights_urls$"}}),
    ("POST", V1 + "/copy_weights"): Doc(errors=(404, 409, 429), records=True, body=rest_wire.CopyWeightsRequest, body_patch=_copy_weights),
    # A signed link is its own authorisation: 403 for a bad signature, 410 once expired or deleted.
    ("GET", V1 + "/downloads/{tenant}/{sha256}/{filename}"): Doc(
        errors=(403, 410), authenticated=False, ok_content={"application/octet-stream": BINARY}, ok_not_json=True, store=False
    ),
    ("GET", V1 + "/billing/usage/events"): NOT_OFFERED,
    ("GET", V1 + "/billing/usage/checkpoints/current"): NOT_OFFERED,
    ("GET", V1 + "/audit"): NOT_OFFERED,
    ("PUT", V1 + "/sessions/{session_id}/project"): NOT_OFFERED,
    ("GET", V1 + "/sessions/{session_id}/trace_export"): NOT_OFFERED,
    ("POST", V1 + "/sessions/search"): NOT_OFFERED,
    # OpenAI-compatible: 500 when the sampler fails a sample for a server-side reason.
    ("GET", "/v1/models"): Doc(openai=True),
    ("GET", "/v1/models/{model}"): Doc(errors=(404,), openai=True),
    ("POST", "/v1/completions"): Doc(errors=(404, 409, 429, 500), records=True, body=oai.CompletionRequest, body_patch=_completion, ok_content=STREAM, openai=True),
    ("POST", "/v1/chat/completions"): Doc(errors=(404, 409, 429, 500), records=True, body=oai.ChatCompletionRequest, body_patch=_chat, ok_content=STREAM, openai=True),
    # OpenRL's own API.
    ("GET", OPENRL + "/runs"): Doc(params={**PAGE, "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}, "status": {"type": "string", "enum": list(STATUSES)}}),
    ("GET", OPENRL + "/runs/{run_id}"): Doc(errors=(404,)),
    ("GET", OPENRL + "/runs/{run_id}/metrics"): Doc(
        errors=(404,), params={"after_step": {"type": "integer", "minimum": 0, "maximum": MAX_POSITION}}, ok_content={"application/x-ndjson": {"type": "string"}}, ok_not_json=True
    ),
    ("POST", OPENRL + "/runs/{run_id}/cancel"): Doc(errors=(404, 409), records=True, body_schema=_cancel_run, body_required=False),
    ("GET", OPENRL + "/checkpoints"): Doc(errors=(404,)),
    ("GET", OPENRL + "/checkpoints/archive"): Doc(
        errors=(404, 410), params={"path": TINKER_PATH}, ok_content={"application/x-tar": BINARY}, ok_not_json=True
    ),
    ("DELETE", OPENRL + "/checkpoints"): Doc(errors=(404,), records=True, params={"path": TINKER_PATH}),
    ("GET", OPENRL + "/runs/{run_id}/events"): Doc(
        errors=(404,),
        params={"after": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_POSITION}, {"type": "null"}]},
                "history": {"type": "integer", "minimum": 0, "maximum": MAX_HISTORY}},
        ok_content=RUN_EVENTS, ok_not_json=True,
    ),  # fmt: skip
    ("GET", OPENRL + "/runs/{run_id}/sampling"): Doc(errors=(404,)),
    # 413 also for a body over the route's own 4 KiB; 409: nothing to fork, or a key reused for another step.
    ("POST", OPENRL + "/runs/{run_id}/fork"): Doc(errors=(404, 409, 429), records=True, body_schema=_fork),
    ("GET", OPENRL + "/timeline"): Doc(params={"since": {"type": "number", "minimum": 0}}),
    # The dashboard's static files (left out of the description: no API there).
    ("GET", "/dashboard"): Doc(authenticated=False, store=False),
    ("GET", "/dashboard/{name}"): Doc(errors=(404,), authenticated=False, store=False),
    ("GET", OPENRL + "/sessions"): Doc(params={**PAGE, "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}}),
}
