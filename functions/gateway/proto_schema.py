"""The `tinker_public` protobuf schema, declared here and built at import time.

The SDK sends `/forward_backward` bodies and expects `ForwardBackwardOutput` and
`SampleResponse` results as protobuf. Rather than vendoring generated code, the schema is
declared below as data and turned into message classes with `descriptor_pb2` and
`message_factory`: no protoc, no generated-code version pinning. Field names, numbers and
types mirror the SDK's `tinker_public.proto`; `tests/functions/gateway/test_proto.py`
compares this descriptor with the one inside the installed SDK, field by field.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "tinker_public"
F = descriptor_pb2.FieldDescriptorProto
SCALARS = {
    "double": F.TYPE_DOUBLE, "float": F.TYPE_FLOAT, "int64": F.TYPE_INT64, "int32": F.TYPE_INT32,
    "uint32": F.TYPE_UINT32, "bool": F.TYPE_BOOL, "string": F.TYPE_STRING, "bytes": F.TYPE_BYTES,
}  # fmt: skip

ENUMS = {
    "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"],
    "DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
}

# Each field: (name, number, type, modifier). type: a scalar, "enum:X", a message name, or
# "map:<key>,<value>". modifier: "", "repeated", "optional" (proto3 optional) or "oneof:<name>".
MESSAGES: dict[str, list[tuple[str, int, str, str]]] = {
    "SampleResponse": [
        ("sequences", 1, "SampledSequence", "repeated"),
        ("prompt_logprobs", 2, "bytes", "optional"),
        ("topk_prompt_logprobs", 3, "TopkLogprobs", "optional"),
        ("prompt_cache_hit_tokens", 4, "int32", ""),
        ("target_prompt_logprobs", 5, "Tensor", "optional"),
        ("prompt_alt_tokens", 6, "PromptAltTokens", "optional"),
    ],
    "PromptAltTokens": [("tokens", 1, "Tensor", ""), ("logprobs", 2, "Tensor", "")],
    "SampledSequence": [
        ("stop_reason", 1, "enum:StopReason", ""),
        ("tokens", 2, "bytes", ""),
        ("logprobs", 3, "bytes", "optional"),
        ("topk_sampled_logprobs", 4, "TopkLogprobs", "optional"),
    ],
    "TopkLogprobs": [
        ("token_ids", 1, "bytes", ""),
        ("logprobs", 2, "bytes", ""),
        ("k", 3, "uint32", ""),
        ("length", 4, "uint32", ""),
    ],
    "SparseCsr": [("values", 1, "bytes", ""), ("crow_indices", 2, "bytes", ""), ("col_indices", 3, "bytes", "")],
    "Tensor": [
        ("dense", 1, "bytes", "oneof:encoding"),
        ("sparse_csr", 2, "SparseCsr", "oneof:encoding"),
        ("dtype", 3, "enum:DType", ""),
        ("shape", 4, "int64", "repeated"),
    ],
    "BatchedTensor": [
        ("data", 1, "bytes", ""),
        ("offsets", 2, "bytes", ""),
        ("dtype", 3, "enum:DType", ""),
        ("trailing_shape", 4, "int64", "repeated"),
    ],
    "ArrayRecord": [
        ("type_tag", 1, "string", ""),
        ("fields", 2, "map:string,BatchedTensor", ""),
        ("num_datums", 3, "int64", ""),
    ],
    "ForwardBackwardOutput": [
        ("loss_fn_output_type", 1, "string", ""),
        ("loss_fn_outputs", 2, "ArrayRecord", "repeated"),
        ("metrics", 3, "map:string,double", ""),
    ],
    "ForwardBackwardRequest": [
        ("model_id", 1, "string", ""),
        ("seq_id", 2, "int32", ""),
        ("data", 3, "Datum", "repeated"),
        ("loss_fn", 4, "string", ""),
        ("loss_fn_config", 5, "map:string,double", ""),
        ("forward_only", 6, "bool", ""),
        ("loss_fn_config_v2", 7, "map:string,LossConfigValue", ""),
    ],
    "LossConfigValue": [("number", 1, "double", "oneof:value"), ("text", 2, "string", "oneof:value")],
    "Datum": [
        ("model_input", 1, "Chunk", "repeated"),
        ("loss_fn_inputs", 2, "map:string,Tensor", ""),
        ("model_input_spans", 3, "ProvenanceSpan", "repeated"),
        ("loss_fn_input_spans", 4, "ProvenanceSpan", "repeated"),
    ],
    "ProvenanceSpan": [
        ("prompt_tokens", 1, "PromptProvenanceSpan", "oneof:span"),
        ("sampled_tokens", 2, "SampledProvenanceSpan", "oneof:span"),
    ],
    "PromptProvenanceSpan": [("sequence_id", 1, "string", ""), ("offset", 2, "int64", ""), ("length", 3, "int64", "")],
    "SampledProvenanceSpan": [("sequence_id", 1, "string", ""), ("offset", 2, "int64", ""), ("length", 3, "int64", "")],
    "Chunk": [
        ("encoded_text", 1, "EncodedTextChunk", "oneof:chunk"),
        ("image", 2, "ImageChunk", "oneof:chunk"),
        ("dmel", 3, "DmelChunk", "oneof:chunk"),
    ],
    "EncodedTextChunk": [("tokens", 1, "bytes", "")],
    "ImageChunk": [
        ("data", 1, "bytes", ""),
        ("format", 2, "string", ""),
        ("expected_tokens", 3, "int32", "optional"),
        ("override_dimensions", 4, "ImageDimensions", "optional"),
    ],
    "ImageDimensions": [("width", 1, "uint32", ""), ("height", 2, "uint32", "")],
    "DmelChunk": [("dmel", 1, "bytes", "")],
}


def _set_type(field: descriptor_pb2.FieldDescriptorProto, type_: str) -> None:
    if type_ in SCALARS:
        field.type = SCALARS[type_]
    elif type_.startswith("enum:"):
        field.type = F.TYPE_ENUM
        field.type_name = f".{PACKAGE}.{type_[5:]}"
    else:
        field.type = F.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{type_}"


def _message(name: str, fields: list[tuple[str, int, str, str]]) -> descriptor_pb2.DescriptorProto:
    message = descriptor_pb2.DescriptorProto(name=name)
    oneofs: dict[str, int] = {}
    synthetic: list[tuple[descriptor_pb2.FieldDescriptorProto, str]] = []
    for field_name, number, type_, modifier in fields:
        field = message.field.add(name=field_name, number=number, json_name=_camel(field_name))
        field.label = F.LABEL_REPEATED if modifier == "repeated" else F.LABEL_OPTIONAL
        if type_.startswith("map:"):
            key, value = type_[4:].split(",")
            entry = message.nested_type.add(name=_camel(field_name, upper=True) + "Entry")
            entry.options.map_entry = True
            _set_type(entry.field.add(name="key", number=1, label=F.LABEL_OPTIONAL, json_name="key"), key)
            _set_type(entry.field.add(name="value", number=2, label=F.LABEL_OPTIONAL, json_name="value"), value)
            field.label = F.LABEL_REPEATED
            field.type = F.TYPE_MESSAGE
            field.type_name = f".{PACKAGE}.{name}.{entry.name}"
            continue
        _set_type(field, type_)
        if modifier.startswith("oneof:"):
            oneof = modifier[6:]
            if oneof not in oneofs:
                oneofs[oneof] = len(message.oneof_decl)
                message.oneof_decl.add(name=oneof)
            field.oneof_index = oneofs[oneof]
        elif modifier == "optional":
            synthetic.append((field, "_" + field_name))
    # proto3 `optional` is a synthetic one-field oneof; protobuf wants those declared last.
    for field, oneof in synthetic:
        field.proto3_optional = True
        field.oneof_index = len(message.oneof_decl)
        message.oneof_decl.add(name=oneof)
    return message


def _camel(name: str, upper: bool = False) -> str:
    parts = name.split("_")
    head = parts[0].capitalize() if upper else parts[0]
    return head + "".join(part.capitalize() for part in parts[1:])


def build_file() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto(name="openrl/tinker_public.proto", package=PACKAGE, syntax="proto3")
    for enum_name, values in ENUMS.items():
        enum = file.enum_type.add(name=enum_name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    for name, fields in MESSAGES.items():
        file.message_type.append(_message(name, fields))
    return file


# A private pool: the SDK may be imported in the same process (tests) with its own
# `tinker_public` package in the default pool.
_POOL = descriptor_pool.DescriptorPool()
_FILE = _POOL.Add(build_file())
_CLASSES = message_factory.GetMessages([build_file()], pool=_POOL)

ForwardBackwardRequest = _CLASSES[f"{PACKAGE}.ForwardBackwardRequest"]
ForwardBackwardOutput = _CLASSES[f"{PACKAGE}.ForwardBackwardOutput"]
SampleResponse = _CLASSES[f"{PACKAGE}.SampleResponse"]
Tensor = _CLASSES[f"{PACKAGE}.Tensor"]
DTYPE = {name: number for number, name in enumerate(ENUMS["DType"])}
STOP_REASON = {"stop": 0, "length": 1}
