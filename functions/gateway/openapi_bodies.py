"""What the gateway's routes check of their JSON bodies, written as JSON Schema for their
OpenAPI description (`openapi_routes.ROUTES`, `openapi.py`): the `tinker://` path grammar,
each route's own rules as a patch of its wire model's schema (given what is `Served`: model
names, the vocabulary), and the shared parts (`patch_components`: prompt chunks, tensors,
forward_backward inputs). A request valid by these is one the route accepts, but for the few
rules no JSON Schema can state (a sum over a list, a length against another field, the
store's state), which tests/functions/gateway/fuzz_hooks.py lists with their reasons.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from functions.compute.age_export import MAX_RECIPIENTS
from functions.gateway import openai_wire as oai
from functions.gateway.routes import rest_wire
from functions.gateway.routes.openrl_forks import MAX_WAIT as FORK_MAX_WAIT
from functions.gateway.routes.sampling import MAX_NUM_SAMPLES, MAX_TOPK
from functions.gateway.sampling_fields import MAX_TOPK_SAMPLE
from openrl_core.finetune import FULL_FINETUNE_KEY
from openrl_core.ids import CHECKPOINT_KINDS
from openrl_core.losses import LOSSES

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
TTL = {
    "anyOf": [
        {"type": "integer", "minimum": rest_wire.MIN_TTL_SECONDS, "maximum": rest_wire.MAX_TTL_SECONDS},
        {"type": "null"},
    ]
}
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
    return {
        "anyOf": [
            {"type": kind, "const": value} if kind != "object" else {"type": "object", "maxProperties": 0},
            {"type": "null"},
        ]
    }


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
NONEMPTY_INPUT = {
    "allOf": [{"$ref": "#/components/schemas/ModelInput"}],
    "properties": {"chunks": {"contains": {"properties": {"tokens": {"minItems": 1}}}}},
}


# openrl_core.params.check_optimizer_config: AdamW or Dimuon v1, nothing else (Dimuon for LoRA only)
ADAMW_CONFIG = {"type": "object", "additionalProperties": False, "properties": {"type": {"const": "adamw"}}}
DIMUON_CONFIG = {"type": "object", "additionalProperties": False, "required": ["type"],
                 "properties": {"type": {"const": "dimuon"}, "version": {"const": 1}}}  # fmt: skip
OPTIMIZER_CONFIG = {"anyOf": [ADAMW_CONFIG, DIMUON_CONFIG, {"type": "null"}]}


def create_model_rules(schema: dict, served: Served) -> None:
    """A LoRA run needs its lora_config; a full fine-tuning run (user_metadata flag "true")
    takes none, or one that leaves every weight trained. (A server whose settings make some
    base models full fine-tuning by default takes no lora_config flags for them; not stated.)"""
    props = schema["properties"]
    props["base_model"] = {"type": "string", "enum": served.names}
    flag = {"type": "string", "enum": ["true", "false"]}
    props["user_metadata"] = {"anyOf": [{"type": "object", "properties": {FULL_FINETUNE_KEY: flag}}, {"type": "null"}]}
    full = {"required": ["user_metadata"], "properties": {"user_metadata": {"type": "object", "required": [FULL_FINETUNE_KEY],
            "properties": {FULL_FINETUNE_KEY: {"const": "true"}}}}}  # fmt: skip
    every_weight = {
        "type": "object",
        "properties": {name: {"const": True} for name in ("train_attn", "train_mlp", "train_unembed")},
    }
    props["optimizer_config"] = OPTIMIZER_CONFIG
    full_props = {**full["properties"], "lora_config": {"anyOf": [every_weight, {"type": "null"}]},
                  "optimizer_config": {"anyOf": [ADAMW_CONFIG, {"type": "null"}]}}  # fmt: skip
    schema["anyOf"] = [
        {
            "required": ["lora_config"],
            "properties": {"lora_config": {"$ref": "#/components/schemas/LoraConfig"}},
            "not": full,
        },
        {**full, "properties": full_props},
    ]


def asample_rules(schema: dict, served: Served) -> None:
    # asample samples in a session it was given; the SDK's direct base_model form is refused.
    schema["required"] = sorted({*schema.get("required", ()), "sampling_session_id"})
    props = schema["properties"]
    props["sampling_session_id"] = {"type": "string"}
    # a prompt holds at least one token (some chunk has one); its total with max_tokens must fit
    # the model's context, which no JSON Schema can sum (stated here, checked by the route)
    props["prompt"] = NONEMPTY_INPUT
    props["num_samples"] = {"type": "integer", "minimum": 1, "maximum": MAX_NUM_SAMPLES, "default": 1}
    props["topk_prompt_logprobs"] = {"type": "integer", "minimum": 0, "maximum": MAX_TOPK, "default": 0}
    props["topk_sample_logprobs"] = {"type": "integer", "minimum": 0, "maximum": MAX_TOPK_SAMPLE, "default": 0}
    # len(prompt) x k is bounded too (by the widest top-k's cost), which the route checks
    props["prompt_alt_tokens_k"] = {"type": "integer", "minimum": 0, "default": 0}
    # int64 ids, [len(prompt) - 1, K] (the route checks the rows against the prompt), dense or CSR
    # ids in the vocabulary or -1 (asks for nothing), at least one of them an id
    ids = {"type": "array", "items": {"anyOf": [{"const": -1}, served.token]}, "contains": served.token}
    indices = {"anyOf": [{"type": "array", "items": {"type": "integer", "minimum": 0}}, {"type": "null"}]}
    target = {
        "type": "object",
        "required": ["data", "dtype", "shape"],
        "properties": {"data": ids, "dtype": {"const": "int64"},
                       "shape": {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 2, "maxItems": 2},
                       "sparse_crow_indices": indices, "sparse_col_indices": indices},
    }  # fmt: skip
    props["target_prompt_logprobs"] = {"anyOf": [target, {"type": "null"}]}
    # prompt_logprobs_last_n needs prompt_logprobs (and at most the prompt's length - 1)
    schema["if"] = {
        "required": ["prompt_logprobs_last_n"],
        "properties": {"prompt_logprobs_last_n": {"type": "integer"}},
    }
    schema["then"] = {"required": ["prompt_logprobs"], "properties": {"prompt_logprobs": {"const": True},
                      "prompt_logprobs_last_n": {"minimum": 1}}}  # fmt: skip


def sampling_session_rules(schema: dict, served: Served) -> None:
    # A session samples a base model or a checkpoint (then base_model, if given, must match it).
    schema["anyOf"] = [
        {"required": ["base_model"], "properties": {"base_model": {"type": "string", "enum": served.names}}},
        # base_model, if given, is the checkpoint's (with one model served: that one)
        {
            "required": ["model_path"],
            "properties": {
                "model_path": TINKER_PATH,
                "base_model": {"anyOf": [{"enum": served.names}, {"type": "null"}]},
            },
        },
    ]
    schema["properties"]["model_path"] = NULLABLE_TINKER_PATH


LOADABLE_PATH = {"type": "string", "pattern": f"^tinker://{RUN_ID}/(weights|sampler_weights)/{NAME}$"}  # not exports


def load_weights_rules(schema: dict, served: Served) -> None:
    schema["properties"]["path"] = LOADABLE_PATH
    schema["properties"]["optimizer_config"] = OPTIMIZER_CONFIG
    # optimizer state is only in weights/ checkpoints (save_state)
    schema["if"] = {"required": ["path"], "properties": {"path": {"pattern": "/sampler_weights/"}}}
    schema["then"] = {"properties": {"optimizer": {"const": False}}}
    schema["properties"]["base_model"] = {"anyOf": [{"type": "string", "enum": served.names}, {"type": "null"}]}
    # Two addressings: a new model (session_id + model_seq_id) or in place (model_id + seq_id).
    schema["anyOf"] = [
        {
            "required": ["session_id", "model_seq_id"],
            "properties": {"session_id": {"type": "string"}, "model_seq_id": {"type": "integer"}},
        },
        {
            "required": ["model_id", "seq_id"],
            "properties": {"model_id": {"type": "string"}, "seq_id": {"type": "integer"}},
        },
    ]


NAME_STR = {"type": "string", "pattern": f"^{NAME}$"}


def sequenced_rules(schema: dict, served: Served) -> None:
    schema["properties"]["seq_id"] = {"type": "integer", "minimum": 1}  # checked by the route, not the model


def project_rules(schema: dict, served: Served) -> None:
    # session_rest.PROJECT_ID: printable, not blank, at most 200 characters
    schema["required"] = ["project_id"]
    schema["properties"]["project_id"] = {"type": "string", "maxLength": 200,
                                          "pattern": "^[^\\x00-\\x1f\\x7f]*\\S[^\\x00-\\x1f\\x7f]*$"}  # fmt: skip


def save_weights_rules(schema: dict, served: Served) -> None:
    schema["required"] = sorted({*schema.get("required", ()), "path"})
    schema["properties"]["path"] = NAME_STR


def save_for_sampler_rules(schema: dict, served: Served) -> None:
    # A checkpoint name, or the seq id of a new sampling session made from the weights.
    schema["properties"]["path"] = {"anyOf": [NAME_STR, {"type": "null"}]}
    schema["anyOf"] = [
        {"required": ["path"], "properties": {"path": NAME_STR}},
        {
            "required": ["sampling_session_seq_id"],
            "properties": {"sampling_session_seq_id": {"type": "integer", "minimum": 0}},
        },
    ]


def save_external_rules(schema: dict, served: Served) -> None:
    schema["required"] = sorted({*schema.get("required", ()), "path", "seq_id"})
    props = schema["properties"]
    props["path"] = NAME_STR
    props["seq_id"] = {"type": "integer", "minimum": 1}
    # age keys: a native X25519 key (bech32, whose checksum no pattern states) or an SSH public key
    key = {"type": "string", "pattern": r"^(age1[02-9ac-hj-np-z]{58}|ssh-(ed25519|rsa) [A-Za-z0-9+/=]+( .*)?)$"}
    recipients = {"type": "array", "items": key, "minItems": 1, "maxItems": MAX_RECIPIENTS}
    props["age_encryption_recipients"] = {"anyOf": [recipients, {"type": "null"}]}


def copy_weights_rules(schema: dict, served: Served) -> None:
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


def openai_common_rules(schema: dict, served: Served) -> None:
    props = schema["properties"]
    for name in ("presence_penalty", "frequency_penalty"):
        props[name] = only(0, "number")
    props["logit_bias"] = only({}, "object")
    stop = {"type": "string", "minLength": 1}
    props["stop"] = {
        "anyOf": [stop, {"type": "array", "items": stop, "maxItems": oai.MAX_STOP_SEQUENCES}, {"type": "null"}]
    }


def completion_rules(schema: dict, served: Served) -> None:
    openai_common_rules(schema, served)
    props = schema["properties"]
    # one prompt or several, each holding at least one token (any non-empty text does)
    tokens = {"type": "array", "items": served.token, "minItems": 1}
    props["prompt"] = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                                 tokens, {"type": "array", "items": tokens, "minItems": 1}]}  # fmt: skip
    props["echo"] = only(False, "boolean")
    props["suffix"] = {"anyOf": [{"type": "string", "maxLength": 0}, {"type": "null"}]}
    props["best_of"] = only(1, "integer")


def chat_rules(schema: dict, served: Served) -> None:
    openai_common_rules(schema, served)
    props = schema["properties"]
    props["tools"] = {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]}
    props["tool_choice"] = {"anyOf": [{"type": "string", "enum": ["none", "auto"]}, {"type": "null"}]}
    # top_logprobs needs logprobs: true.
    schema["if"] = {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}}
    schema["then"] = {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}


def cancel_run_rules() -> dict:
    return {
        "type": ["object", "null"],  # no body, or JSON null, is no reason
        "properties": {"reason": {"anyOf": [{"type": "string", "maxLength": 500}, {"type": "null"}]}},
        "description": "why the run is cancelled (recorded in its event); optional",
    }


def fork_rules() -> dict:
    return {
        "type": "object",
        "required": ["step"],
        "additionalProperties": False,
        "properties": {
            "step": {
                "type": "integer",
                "minimum": 0,
                "description": "completed optim_steps to fork after (at most the run's)",
            },
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
        # The JSON body (older SDKs) has no provenance spans, which stable_reinforce needs on
        # every datum: that loss comes only in the protobuf body SDK 0.38 sends.
        json_losses = {name: spec for name, spec in LOSSES.items() if name != "stable_reinforce"}
        fb_input["properties"]["loss_fn"] = {"type": "string", "enum": sorted(json_losses)}
        fb_input["allOf"] = [
            {"if": {"properties": {"loss_fn": {"const": name}}},
             "then": {"properties": {"loss_fn_config": {"anyOf": [{"type": "null"}, {"type": "object", "additionalProperties": False,
                      "properties": {key: {"type": "number"} for key in spec.config_defaults}}]}}}}
            for name, spec in sorted(json_losses.items())
        ]  # fmt: skip


# One cross_entropy datum of three tokens: what a JSON forward_backward (or forward) carries.
FB_INPUT = {
    "data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
              "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4], "dtype": "int64"}, "weights": {"data": [1.0, 1.0, 1.0], "dtype": "float32"}}}],
    "loss_fn": "cross_entropy",
}  # fmt: skip
MODEL_ID = "00000000-0000-0000-0000-000000000000:train:0"
