"""Our protobuf schema against the installed SDK's: same descriptor, and each side's
encoder decodes with the other's decoder."""

import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from tinker import types
from tinker.proto import request_conv, response_conv
from tinker.proto import tinker_public_pb2 as sdk_pb

from functions.gateway import proto, proto_schema
from openrl_core.errors import InvalidRequest
from openrl_core.tensors import Array


def _fields(message):
    return sorted(
        (f.name, f.number, f.type, f.label, f.type_name.split(".")[-1], f.proto3_optional,
         message.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None)
        for f in message.field
    )  # fmt: skip


def test_descriptor_matches_the_sdk_field_by_field():
    theirs = descriptor_pb2.FileDescriptorProto()
    sdk_pb.DESCRIPTOR.CopyToProto(theirs)
    by_name = {m.name: m for m in theirs.message_type}
    ours = proto_schema.build_file()
    assert {e.name: [(v.name, v.number) for v in e.value] for e in ours.enum_type} == {
        e.name: [(v.name, v.number) for v in e.value] for e in theirs.enum_type
    }
    for message in ours.message_type:
        assert _fields(message) == _fields(by_name[message.name]), message.name
        assert {n.name: _fields(n) for n in message.nested_type} == {
            n.name: _fields(n) for n in by_name[message.name].nested_type
        }
    # every message the SDK exchanges in a request or result is declared here
    assert {"ForwardBackwardRequest", "ForwardBackwardOutput", "SampleResponse"} <= {m.name for m in ours.message_type}


def sdk_request(datums, loss_fn="cross_entropy", config=None):
    fb_input = types.ForwardBackwardInput(data=datums, loss_fn=loss_fn, loss_fn_config=config)
    request = types.ForwardBackwardRequest(forward_backward_input=fb_input, model_id="s:train:0", seq_id=7)
    return request_conv.forward_backward_request_to_proto(request).SerializeToString()


def test_sdk_request_decodes_dense_sparse_and_multi_chunk():
    import torch

    targets = torch.zeros(4, 3, dtype=torch.int64)
    targets[1, 2] = 9
    dense = types.Datum(
        model_input=types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=[1, 2]), types.EncodedTextChunk(tokens=[3])]
        ),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [0.0, -1.5, 2.0]},
    )
    sparse = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": targets},  # the SDK sends a mostly-zero 2-D tensor as CSR
    )
    message = proto.parse_forward_backward(sdk_request([dense, sparse], "ppo", {"clip_low_threshold": 0.7}))
    assert message.data[1].loss_fn_inputs["target_tokens"].WhichOneof("encoding") == "sparse_csr"
    call = proto.decode_forward_backward(message)
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 7, "ppo", False)
    assert call.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)}
    assert call.data[0].tokens_N.tolist() == [1, 2, 3]
    assert call.data[0].loss_fn_inputs["weights"].tolist() == [0.0, -1.5, 2.0]
    assert np.array_equal(call.data[1].loss_fn_inputs["target_tokens"], targets.numpy())


def test_csr_tensors_from_the_wire():
    message = proto_schema.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([1, 2], dtype="<i4").tobytes()
    tensor = datum.loss_fn_inputs["weights"]
    tensor.dtype = proto_schema.DTYPE["DTYPE_FLOAT32"]
    tensor.shape.extend([2, 2])
    tensor.sparse_csr.values = np.array([3.0], dtype="<f4").tobytes()
    tensor.sparse_csr.crow_indices = np.array([0, 0, 1], dtype="<i8").tobytes()
    tensor.sparse_csr.col_indices = np.array([1], dtype="<i8").tobytes()
    call = proto.decode_forward_backward(message)
    assert call.data[0].loss_fn_inputs["weights"].tolist() == [[0.0, 0.0], [0.0, 3.0]]


@pytest.mark.parametrize("body", [b"\xff\xff\xff", b"\x0a\x05ab"])
def test_garbage_is_a_clear_400(body):
    with pytest.raises(InvalidRequest, match="not a valid ForwardBackwardRequest"):
        proto.parse_forward_backward(body)


def test_forward_backward_output_decodes_in_the_sdk():
    lp = [
        np.array([-1.0, -2.0, -3.0], dtype=np.float32),
        np.array([-0.5], dtype=np.float32),
        np.array([[-1.0, -2.0]], dtype=np.float32),
    ]
    result = {
        "loss_fn_outputs": [{"logprobs": Array.from_numpy(a).model_dump()} for a in lp],
        "metrics": {"loss:sum": 6.5},
    }
    output = response_conv.deserialize_forward_backward_output(proto.encode_forward_backward_output(result))
    assert output.metrics == {"loss:sum": 6.5}
    got = [o["logprobs"].to_numpy() for o in output.loss_fn_outputs]
    assert len(got) == 3
    for a, b in zip(got, lp):
        assert a.shape == b.shape and np.array_equal(a, b)


def test_sample_response_decodes_in_the_sdk():
    result = {
        "sequences": [
            {"tokens": [5, 6], "logprobs": [-0.1, -0.2], "stop_reason": "stop"},
            {"tokens": [7], "logprobs": [-1.0], "stop_reason": "length"},
        ],
        "prompt_logprobs": [None, -1.5, -2.5],
        "topk_prompt_logprobs": [None, [[3, -0.5], [4, -1.0]], [[9, -0.25]]],
    }
    response = response_conv.deserialize_sample_response(proto.encode_sample_response(result))
    assert [s.tokens for s in response.sequences] == [[5, 6], [7]]
    assert [s.stop_reason for s in response.sequences] == ["stop", "length"]
    assert response.sequences[0].logprobs == pytest.approx([-0.1, -0.2])
    assert response.prompt_logprobs[0] is None and response.prompt_logprobs[1:] == pytest.approx([-1.5, -2.5])
    assert response.topk_prompt_logprobs[0] is None
    assert response.topk_prompt_logprobs[1] == [(3, -0.5), (4, -1.0)]
    assert response.topk_prompt_logprobs[2] == [(9, -0.25)]
