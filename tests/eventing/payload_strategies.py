"""Hypothesis strategies for every registered event payload, derived from the pydantic models.

`payloads(model)` walks the model's fields (their annotations and `ge`/`gt`/`le`/`lt`/
`pattern` constraints) and draws values of the declared types, so a new event family is
covered without writing a strategy for it. Models with validators beyond field constraints
(`Array`, the value objects) get hand-written strategies that make only valid values; a
drawn payload that still fails validation is rejected, not passed off as a success.
"""

from __future__ import annotations

import types
from datetime import datetime, timezone
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
import numpy as np
from hypothesis import reject
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from openrl_core.params import AdamParams, LoraConfig, SamplingParams
from openrl_core.tensors import Array

json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_leaves,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)


@st.composite
def arrays(draw) -> Array:
    dtype = draw(st.sampled_from(["int64", "int32", "float32"]))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=2)))
    size = int(np.prod(shape)) if shape else 1
    if dtype == "float32":
        values = draw(st.lists(st.floats(width=32, allow_nan=False), min_size=size, max_size=size))
    else:
        bound = 2**31 - 1 if dtype == "int32" else 2**63 - 1
        values = draw(st.lists(st.integers(-bound, bound), min_size=size, max_size=size))
    return Array.from_numpy(np.array(values, dtype=dtype).reshape(shape))


finite = dict(allow_nan=False, allow_infinity=False)
OVERRIDES: dict[Any, st.SearchStrategy] = {
    Array: arrays(),
    LoraConfig: st.builds(
        LoraConfig,
        rank=st.integers(1, 512),
        seed=st.none() | st.integers(0, 2**31),
        train_unembed=st.booleans(),
        train_mlp=st.booleans(),
        train_attn=st.just(True),
    ),  # fmt: skip
    AdamParams: st.builds(
        AdamParams,
        learning_rate=st.floats(0, 1, **finite),
        beta1=st.floats(0, 0.999, **finite),
        beta2=st.floats(0, 0.999, **finite),
        eps=st.floats(1e-12, 1e-3, **finite),
        weight_decay=st.floats(0, 1, **finite),
        grad_clip_norm=st.floats(0, 10, **finite),
    ),  # fmt: skip
    SamplingParams: st.builds(
        SamplingParams,
        max_tokens=st.none() | st.integers(0, 4096),
        seed=st.none() | st.integers(0, 2**63 - 1),
        stop=st.none()
        | st.text(max_size=5)
        | st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=3)
        | st.lists(st.integers(0, 2**31), min_size=1, max_size=3),
        temperature=st.floats(0, 2, **finite),
        top_k=st.just(-1) | st.integers(1, 100),
        top_p=st.floats(0.01, 1, **finite),
    ),  # fmt: skip
    datetime: st.datetimes(timezones=st.just(timezone.utc)),
    Any: json_values,
}


def _bounds(metadata) -> dict:
    bounds: dict = {}
    for item in metadata:
        if isinstance(item, annotated_types.Ge):
            bounds["min_value"] = item.ge
        elif isinstance(item, annotated_types.Gt):
            bounds["min_value"], bounds["exclude_min"] = item.gt, True
        elif isinstance(item, annotated_types.Le):
            bounds["max_value"] = item.le
        elif isinstance(item, annotated_types.Lt):
            bounds["max_value"], bounds["exclude_max"] = item.lt, True
        elif getattr(item, "pattern", None):
            bounds["pattern"] = item.pattern
    return bounds


def values(annotation, metadata=()) -> st.SearchStrategy:
    """Values of one field's declared type within its declared constraints."""
    if annotation in OVERRIDES:
        return OVERRIDES[annotation]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        return st.one_of(*(values(arg, metadata) for arg in args))
    if origin is Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(values(args[0]), max_size=3)
    if origin is tuple:
        return (
            st.tuples(*(values(arg) for arg in args))
            if Ellipsis not in args
            else st.lists(values(args[0]), max_size=3).map(tuple)
        )
    if origin is dict:
        return st.dictionaries(st.text(max_size=12), values(args[1]), max_size=3)
    if annotation is dict:
        return st.dictionaries(st.text(max_size=12), json_values, max_size=3)
    if annotation is type(None):
        return st.none()
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return payloads(annotation)
    bounds = _bounds(metadata)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        low = bounds.get("min_value", -(2**63)) + (1 if bounds.get("exclude_min") else 0)
        high = bounds.get("max_value", 2**63 - 1) - (1 if bounds.get("exclude_max") else 0)
        return st.integers(low, high)
    if annotation is float:
        return st.floats(**{k: v for k, v in bounds.items() if k != "pattern"}, allow_nan=False, allow_infinity=False)
    if annotation is str:
        return st.from_regex(bounds["pattern"], fullmatch=True) if "pattern" in bounds else st.text(max_size=24)
    raise NotImplementedError(f"no strategy for {annotation!r}: add one to OVERRIDES")


def payloads(model: type[BaseModel]) -> st.SearchStrategy:
    if model in OVERRIDES:
        return OVERRIDES[model]

    @st.composite
    def build(draw):
        fields = {}
        for name, info in model.model_fields.items():
            if not info.is_required() and draw(st.booleans()):
                continue  # leave it at its default
            fields[name] = draw(values(info.annotation, info.metadata))
        try:
            return model(**fields)
        except ValidationError:
            reject()

    return build()
