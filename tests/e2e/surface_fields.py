"""The request fields and loss functions of the installed SDK, against what the server takes:
the second half of `docs/compatibility.md` (rendered by `test_sdk_surface.render`).

Rows come from the SDK's own types, by reflection: every pydantic field of every
`tinker.types.*Request` (and of the value types they carry: SamplingParams, AdamParams,
DimuonParams, LoraConfig, the optimizer configs), and every value of `tinker.types.LossFnType`.
What the server does with each is read from the server's code, not written here:

- a field is `read` when the gateway's wire model of the same name declares it
  (`openrl_core.wire.*`, the REST wire models, `openrl_core.params`), `not read` when that
  model exists and lacks it (pydantic ignores an unknown field); a type with no model of
  that name is decoded by hand (forward_backward's body in functions/gateway/proto.py and
  jsonbodies.py, optimizer configs by openrl_core.params) or belongs to a refused method;
- a declared field can still be refused for some values: those are the entries of
  `REFUSED`, each with a probe that sends such a value and must get a 400 whose detail names
  the field (`test_sdk_surface.test_refused_field_is_a_clear_400`), so an entry that the server
  starts serving fails that test until it is removed here;
- a loss is `served` when the trainer's loss registry (`openrl_core.losses.LOSSES`) has it,
  `client-side` for `custom` (forward_backward_custom), else `refused`, and each refused loss
  is probed the same way.
"""

from __future__ import annotations

import inspect
import typing
from typing import Callable, get_args

import tinker
from pydantic import BaseModel
from tinker import types

from functions.gateway.routes import rest_wire
from openrl_core import losses, params
from openrl_core.wire import base, futures, sampling, session_search, sessions, training

VALUE_TYPES = ("SamplingParams", "AdamParams", "DimuonParams", "LoraConfig", "AdamOptimizerConfig",
               "DimuonOptimizerConfig")  # fmt: skip
SERVER_MODULES = (training, sampling, sessions, futures, base, session_search, rest_wire, params)


def sdk_types() -> list[type[BaseModel]]:
    found = []
    for name in sorted(dir(types)):
        cls = getattr(types, name)
        if inspect.isclass(cls) and issubclass(cls, BaseModel) and (name.endswith("Request") or name in VALUE_TYPES):
            found.append(cls)
    return found


def server_model(name: str):
    for module in SERVER_MODULES:
        cls = getattr(module, name, None)
        if inspect.isclass(cls) and issubclass(cls, BaseModel):
            return cls
    return None


def wire_names(info) -> list[str]:
    """The names a field also goes by on the wire (its validation AliasChoices)."""
    alias = info.validation_alias
    choices = getattr(alias, "choices", None) or ([alias] if isinstance(alias, str) else [])
    return [c for c in choices if isinstance(c, str)]


# (SDK type, field) -> (what the server answers, a probe: (route, JSON body) sending a value it
# refuses). Empty: every request field of SDK 0.38 is served. A field refused again gets an entry
# here with a probe (a function of the surface World giving the route and a JSON body).
REFUSED: dict[tuple[str, str], tuple[str, Callable]] = {}


def loss_names() -> list[str]:
    return list(get_args(types.LossFnType)) if get_args(types.LossFnType) else list(typing.get_args(types.LossFnType))


def loss_status(name: str) -> str:
    if name in losses.LOSSES:
        return "served"
    if name == "custom":
        return "client-side (forward_backward_custom: forward logprobs, then a cross-entropy-shaped backward)"
    return "refused (400 naming the loss)"


def refused_losses() -> list[str]:
    return [name for name in loss_names() if loss_status(name).startswith("refused")]


def render_fields() -> list[str]:
    lines = [
        "",
        "## Request fields",
        "",
        f"Every field of the request types (and their value types) of `tinker` {tinker.__version__}, from the",
        "SDK's own pydantic models. `read`: the gateway's wire model of that name declares it (or one of",
        "the names the SDK sends it under); `not read`: that model lacks it and ignores it. Types with no",
        "wire model of their name are decoded by hand (forward_backward's body, optimizer configs) or",
        "belong to a method the table above marks refused. A refusal is probed by `test_sdk_surface.py`",
        "(a 400 naming the field). Generated with the table above.",
        "",
        "| SDK type | field | server | refused values |",
        "|---|---|---|---|",
    ]
    for cls in sdk_types():
        served = server_model(cls.__name__)
        for field, info in cls.model_fields.items():
            names = [field, *wire_names(info)]
            if served is None:
                status = "no wire model of this name (see the method's row)"
            elif field in served.model_fields:
                status = "read"
            elif any(name in served.model_fields for name in names):
                status = "read, as " + " / ".join(f"`{n}`" for n in names[1:] if n in served.model_fields)
            else:
                status = "not read"
            refused = REFUSED.get((cls.__name__, field), ("",))[0]
            lines.append(f"| `{cls.__name__}` | `{field}` | {status} | {refused} |")
    lines += [
        "",
        "## Loss functions",
        "",
        "Every value of `tinker.types.LossFnType`, against the trainer's loss registry (`openrl_core/losses.py`).",
        "",
        "| loss_fn | server | loss_fn_inputs |",
        "|---|---|---|",
    ]
    for name in loss_names():
        spec = losses.LOSSES.get(name)
        inputs = ", ".join(f"`{k}`" for k in spec.required) + (
            " (optional " + ", ".join(f"`{k}`" for k in spec.optional) + ")" if spec.optional else ""
        ) if spec else ""  # fmt: skip
        lines.append(f"| `{name}` | {loss_status(name)} | {inputs} |")
    return lines
