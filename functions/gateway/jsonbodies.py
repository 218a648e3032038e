"""JSON forward / forward_backward bodies, as SDKs before protobuf send them.

tinker 0.22.x sends JSON unless `/client/config` turns on `proto_write_fwdbwd`, and uses
`POST /forward` for `TrainingClient.forward` unless `fwd_via_fwdbwd` is also on:

    /forward_backward  {"forward_backward_input": {"data": [Datum], "loss_fn", "loss_fn_config"?}, "model_id", "seq_id"}
    /forward           {"forward_input": <the same>, "model_id", "seq_id"}

with a Datum `{"model_input": {"chunks": [{"tokens": [...], "type": "encoded_text"}]},
"loss_fn_inputs": {name: TensorData}}` and TensorData `{"data": [flat numbers], "dtype":
"int64"|"float32", "shape"?: [...], "sparse_crow_indices"?, "sparse_col_indices"?}` (2-D CSR:
`data` holds only the listed values, the rest are 0). Both decode into the same
`ForwardBackwardCall` as the protobuf body, so everything after decoding is shared.

The envelope (model_id, seq_id) is read first and on its own: a body whose data is bad is
then refused through its seq_id (see `submit.py`) instead of stalling the model.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, Field, ValidationError

from functions.gateway.errors import describe_validation
from functions.gateway.proto import ForwardBackwardCall
from openrl_core.datum import Datum
from openrl_core.errors import InvalidRequest
from openrl_core.tensors import dense_from_csr, numpy_dtype
from openrl_core.wire.base import WireRequest
from openrl_core.wire.sampling import ModelInput


class TensorData(WireRequest):
    data: list[Union[int, float]]
    dtype: Literal["int64", "float32"]
    shape: Optional[list[int]] = None
    sparse_crow_indices: Optional[list[int]] = None
    sparse_col_indices: Optional[list[int]] = None


class DatumJSON(WireRequest):
    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = Field(default_factory=dict)


class ForwardBackwardInput(WireRequest):
    data: list[DatumJSON]
    loss_fn: str
    loss_fn_config: Optional[dict[str, float]] = None


class ForwardBackwardRequest(WireRequest):
    forward_backward_input: ForwardBackwardInput
    model_id: str
    seq_id: int


class ForwardRequest(WireRequest):
    forward_input: ForwardBackwardInput
    model_id: str
    seq_id: int


class Envelope(WireRequest):
    model_id: str
    seq_id: int


def parse_envelope(body: bytes, route: str) -> Envelope:
    try:
        return Envelope.model_validate_json(body)
    except ValidationError as exc:
        raise InvalidRequest(f"{route} body: {describe_validation(exc.errors())}") from None


def decode(body: bytes, forward_only: bool) -> ForwardBackwardCall:
    """The whole body; InvalidRequest (naming the bad field) for anything malformed."""
    model: type[BaseModel] = ForwardRequest if forward_only else ForwardBackwardRequest
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation(exc.errors())) from None
    call_input = request.forward_input if forward_only else request.forward_backward_input
    return ForwardBackwardCall(
        model_id=request.model_id,
        seq_id=request.seq_id,
        loss_fn=call_input.loss_fn,
        loss_fn_config=dict(call_input.loss_fn_config or {}),
        forward_only=forward_only,
        data=[_datum(index, datum) for index, datum in enumerate(call_input.data)],
    )


def _datum(index: int, datum: DatumJSON) -> Datum:
    tokens: list[int] = []
    for position, chunk in enumerate(datum.model_input.chunks):
        if chunk.type != "encoded_text":
            raise InvalidRequest(
                f"data[{index}].model_input.chunks[{position}] is a {chunk.type!r} chunk; only text models are served"
            )
        if chunk.tokens is None:
            raise InvalidRequest(
                f"data[{index}].model_input.chunks[{position}] is an encoded_text chunk without tokens"
            )
        tokens.extend(chunk.tokens)
    inputs = {
        name: tensor_to_numpy(tensor, f"data[{index}].loss_fn_inputs[{name!r}]")
        for name, tensor in datum.loss_fn_inputs.items()
    }
    return Datum(tokens_N=_int64(tokens, f"data[{index}].model_input"), loss_fn_inputs=inputs)


# Values are bounded as the OpenAPI description states them (openapi_routes.TENSOR_RULES):
# under 2**63 in magnitude for int64 (ints and whole floats alike), float32's range for float32.
INT64_BOUND = 2**63
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _int64(values: list, where: str) -> np.ndarray:
    if any(abs(v) >= INT64_BOUND for v in values):
        raise InvalidRequest(f"{where} holds a value outside int64")
    return np.asarray(values, dtype=np.int64)


def tensor_to_numpy(tensor: TensorData, where: str) -> np.ndarray:
    try:
        return _tensor(tensor, where)
    except OverflowError:  # a shape or an index past int64: numpy cannot even hold it
        raise InvalidRequest(f"{where} holds a shape or index outside int64") from None


def _tensor(tensor: TensorData, where: str) -> np.ndarray:
    dtype = numpy_dtype(tensor.dtype)
    floats = any(isinstance(v, float) for v in tensor.data)
    values = np.asarray(tensor.data, dtype=np.float64) if floats else _int64(tensor.data, where)
    if dtype.kind == "i" and values.dtype.kind == "f":
        if not np.all(np.isfinite(values)) or np.any(values != np.round(values)):
            raise InvalidRequest(f"{where} is int64 but holds non-integer values")
        if np.any(np.abs(values) >= INT64_BOUND):
            raise InvalidRequest(f"{where} holds a value outside int64")
    if dtype.kind == "f" and values.size and float(np.max(np.abs(values))) > FLOAT32_MAX:
        raise InvalidRequest(f"{where} holds a value outside float32")
    values = values.astype(dtype)
    sparse = (tensor.sparse_crow_indices, tensor.sparse_col_indices)
    if any(part is not None for part in sparse):
        if None in sparse or tensor.shape is None:
            raise InvalidRequest(
                f"{where} is sparse: it needs shape, sparse_crow_indices and sparse_col_indices together"
            )
        return dense_from_csr(values, tensor.sparse_crow_indices, tensor.sparse_col_indices, tensor.shape)
    shape = tensor.shape if tensor.shape is not None else [values.size]
    if any(d < 0 for d in shape) or int(np.prod(shape)) != values.size:
        raise InvalidRequest(f"{where} has {values.size} values but shape {shape}")
    return values.reshape(shape)
