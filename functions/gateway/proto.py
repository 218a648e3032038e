"""Protobuf bodies ⇄ domain objects: forward_backward requests in, results out.

Decoding follows the SDK's encoder (`tinker/proto/request_conv.py`): token chunks are
little-endian int32, tensors dense row-major or 2-D CSR with unlisted entries 0. Encoding
follows its decoder (`response_conv.py`): one `ArrayRecord` per run of datums whose
outputs share a trailing shape, byte offsets into a concatenated buffer, NaN for prompt
positions without a logprob, -99999 for padding in top-k rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
from google.protobuf.message import DecodeError

from functions.gateway import proto_schema as pb
from openrl_core.datum import Datum
from openrl_core.errors import InvalidRequest
from openrl_core.stability import Provenance, Span
from openrl_core.tensors import Array, dense_from_csr

_DTYPES = {
    pb.DTYPE["DTYPE_FLOAT32"]: np.dtype("<f4"),
    pb.DTYPE["DTYPE_INT64"]: np.dtype("<i8"),
    pb.DTYPE["DTYPE_INT32"]: np.dtype("<i4"),
}
TOPK_PAD_LOGPROB = -99999.0


@dataclass(frozen=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, Any]
    forward_only: bool
    data: list[Datum]


def parse_forward_backward(body: bytes):
    """Only the envelope: enough to know the model and seq_id before the data is checked."""
    try:
        return pb.ForwardBackwardRequest.FromString(body)
    except DecodeError as exc:
        raise InvalidRequest(f"forward_backward body is not a valid ForwardBackwardRequest protobuf: {exc}") from None


def decode_forward_backward(request) -> ForwardBackwardCall:
    config: dict[str, Any] = dict(request.loss_fn_config)
    # v2 carries every number the legacy map does, plus strings: it wins where both exist.
    for key, value in request.loss_fn_config_v2.items():
        config[key] = value.number if value.WhichOneof("value") == "number" else value.text
    data = [_datum(index, datum) for index, datum in enumerate(request.data)]
    return ForwardBackwardCall(
        model_id=request.model_id,
        seq_id=request.seq_id,
        loss_fn=request.loss_fn,
        loss_fn_config=config,
        forward_only=request.forward_only,
        data=data,
    )


def _datum(index: int, datum) -> Datum:
    pieces = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidRequest(
                f"data[{index}].model_input has a {kind or 'empty'} chunk; only text models are served"
            )
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise InvalidRequest(f"data[{index}].model_input token bytes are not a whole number of int32 values")
        pieces.append(np.frombuffer(raw, dtype="<i4"))
    tokens = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)
    inputs = {
        name: tensor_to_numpy(tensor, f"data[{index}].loss_fn_inputs[{name!r}]")
        for name, tensor in datum.loss_fn_inputs.items()
    }
    return Datum(tokens_N=tokens, loss_fn_inputs=inputs, provenance=_provenance(datum))


def _provenance(datum) -> Optional[Provenance]:
    """The datum's provenance spans (the SDK sends both lists or neither); None without."""
    if not datum.model_input_spans and not datum.loss_fn_input_spans:
        return None
    return Provenance(
        model_input=tuple(_span(span) for span in datum.model_input_spans),
        targets=tuple(_span(span) for span in datum.loss_fn_input_spans),
    )


def _span(span) -> Span:
    kind = span.WhichOneof("span")
    if kind is None:
        raise InvalidRequest("a provenance span names neither prompt_tokens nor sampled_tokens")
    run = getattr(span, kind)
    return Span("prompt" if kind == "prompt_tokens" else "sampled", run.sequence_id, int(run.offset), int(run.length))


def tensor_to_numpy(tensor, where: str) -> np.ndarray:
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        raise InvalidRequest(f"{where} has unsupported dtype {tensor.dtype}; expected FLOAT32 or INT64")
    shape = [int(d) for d in tensor.shape]
    encoding = tensor.WhichOneof("encoding")
    if encoding == "sparse_csr":
        csr = tensor.sparse_csr
        values = _buffer(csr.values, dtype, where + ".values")
        crow = _buffer(csr.crow_indices, np.dtype("<i8"), where + ".crow_indices")
        col = _buffer(csr.col_indices, np.dtype("<i8"), where + ".col_indices")
        return dense_from_csr(values, crow, col, shape)
    values = _buffer(tensor.dense, dtype, where)
    if not shape:
        shape = [values.size]
    if int(np.prod(shape)) != values.size:
        raise InvalidRequest(f"{where} has {values.size} values but shape {shape}")
    return values.reshape(shape)


def _buffer(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise InvalidRequest(f"{where} byte length {len(raw)} is not a multiple of {dtype.itemsize}")
    return np.frombuffer(raw, dtype=dtype).copy()


# -- results -----------------------------------------------------------------------------------


def encode_forward_backward_output(result: dict[str, Any]) -> bytes:
    output = pb.ForwardBackwardOutput(loss_fn_output_type=result.get("loss_fn_output_type", "ArrayRecord"))
    for key, value in result.get("metrics", {}).items():
        output.metrics[key] = float(value)
    outputs = [
        {name: Array.model_validate(a).to_numpy() for name, a in datum.items()} for datum in result["loss_fn_outputs"]
    ]
    for run in _runs_of_same_layout(outputs):
        record = output.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(run))
        for name in run[0]:
            arrays = [datum[name] for datum in run]
            batched = record.fields[name]
            batched.dtype = pb.DTYPE["DTYPE_INT64"] if arrays[0].dtype.kind == "i" else pb.DTYPE["DTYPE_FLOAT32"]
            wire = np.dtype("<i8") if arrays[0].dtype.kind == "i" else np.dtype("<f4")
            chunks = [np.ascontiguousarray(a, dtype=wire).tobytes() for a in arrays]
            batched.data = b"".join(chunks)
            batched.offsets = np.cumsum([0] + [len(c) for c in chunks], dtype="<i8").tobytes()
            batched.trailing_shape.extend(arrays[0].shape[1:])
    return output.SerializeToString()


def _runs_of_same_layout(outputs: list[dict[str, np.ndarray]]) -> list[list[dict[str, np.ndarray]]]:
    runs: list[list[dict[str, np.ndarray]]] = []
    for datum in outputs:
        layout = {name: value.shape[1:] for name, value in datum.items()}
        if runs and {name: value.shape[1:] for name, value in runs[-1][0].items()} == layout:
            runs[-1].append(datum)
        else:
            runs.append([datum])
    return runs


def encode_sample_response(result: dict[str, Any]) -> bytes:
    response = pb.SampleResponse()
    for sequence in result["sequences"]:
        out = response.sequences.add(stop_reason=pb.STOP_REASON[sequence["stop_reason"]])
        out.tokens = np.asarray(sequence["tokens"], dtype="<i4").tobytes()
        out.logprobs = np.asarray(sequence["logprobs"], dtype="<f4").tobytes()
        if sequence.get("topk_logprobs") is not None:
            _topk(out.topk_sampled_logprobs, sequence["topk_logprobs"])
    prompt_logprobs: Optional[list] = result.get("prompt_logprobs")
    if prompt_logprobs is not None:
        response.prompt_logprobs = np.asarray(
            [np.nan if value is None else value for value in prompt_logprobs], dtype="<f4"
        ).tobytes()
    topk = result.get("topk_prompt_logprobs")
    if topk and max((len(row) for row in topk if row), default=0):
        _topk(response.topk_prompt_logprobs, topk)
    if result.get("target_prompt_logprobs") is not None:
        _tensor(response.target_prompt_logprobs, result["target_prompt_logprobs"])
    if result.get("prompt_alt_tokens") is not None:
        _tensor(response.prompt_alt_tokens.tokens, result["prompt_alt_tokens"]["tokens"])
        _tensor(response.prompt_alt_tokens.logprobs, result["prompt_alt_tokens"]["logprobs"])
    return response.SerializeToString()


def _topk(message, rows: list) -> None:
    """A `TopkLogprobs`: dense [length, k] matrices, padded past a short row (id 0, -99999)."""
    k = max((len(row) for row in rows if row), default=0)
    ids = np.zeros((len(rows), k), dtype="<i4")
    lps = np.full((len(rows), k), TOPK_PAD_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or []):
            ids[i, j], lps[i, j] = token, logprob
    message.token_ids = ids.tobytes()
    message.logprobs = lps.tobytes()
    message.k = k
    message.length = len(rows)


def _tensor(message, tensor: dict[str, Any]) -> None:
    """A wire TensorData (dense or CSR) as a proto `Tensor`, the inverse of the SDK's
    `_tensor_data_from_proto`."""
    integer = tensor["dtype"] == "int64"
    message.dtype = pb.DTYPE["DTYPE_INT64"] if integer else pb.DTYPE["DTYPE_FLOAT32"]
    message.shape.extend(tensor["shape"])
    values = np.asarray(tensor["data"], dtype="<i8" if integer else "<f4").tobytes()
    if tensor.get("sparse_crow_indices") is None:
        message.dense = values
        return
    message.sparse_csr.values = values
    message.sparse_csr.crow_indices = np.asarray(tensor["sparse_crow_indices"], dtype="<i8").tobytes()
    message.sparse_csr.col_indices = np.asarray(tensor["sparse_col_indices"], dtype="<i8").tobytes()


def forward_backward_output_json(result: dict[str, Any]) -> dict[str, Any]:
    """The JSON form older SDKs (before protobuf results) accept: TensorData is
    `{"data": [flat], "dtype": "int64"|"float32", "shape"}`, the only two dtypes they know."""
    outputs = []
    for datum in result["loss_fn_outputs"]:
        converted = {}
        for name, value in datum.items():
            array = Array.model_validate(value).to_numpy()
            dtype = "int64" if array.dtype.kind == "i" else "float32"
            flat = array.ravel().astype(dtype).tolist()
            converted[name] = {"data": flat, "dtype": dtype, "shape": list(array.shape)}
        outputs.append(converted)
    return {
        "loss_fn_output_type": result.get("loss_fn_output_type", "ArrayRecord"),
        "loss_fn_outputs": outputs,
        "metrics": result.get("metrics", {}),
    }


def sample_response_json(result: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "sample",
        "sequences": result["sequences"],
        "prompt_logprobs": result.get("prompt_logprobs"),
        "topk_prompt_logprobs": result.get("topk_prompt_logprobs"),
        # SDK 0.38's scoring fields (only present when asked; an SDK that reads JSON results
        # predates them and never asks)
        **{key: result[key] for key in ("target_prompt_logprobs", "prompt_alt_tokens") if key in result},
    }
