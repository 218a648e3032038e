"""CloudEvents codec: round trips in Kafka and HTTP binary mode, and the claim check."""

import numpy as np
import pytest

from eventing.blobs import BlobStore
from eventing.codec import Codec, Message
from openrl_core.datum import Datum, DatumRecord
from openrl_core.errors import ServerError
from openrl_core.events import new_event
from openrl_core.events.training import FORWARD_BACKWARD, OPTIM_STEP, ForwardBackwardRequested, OptimStepRequested
from openrl_core.params import AdamParams


def optim_event():
    payload = OptimStepRequested(
        request_id="req-1", model_id="s:train:0", seq_id=2, adam_params=AdamParams(learning_rate=3e-4)
    )
    return new_event(OPTIM_STEP["requested"], payload, tenant="alice", source="/test", key="s:train:0", subject="req-1")


def big_event(n=5000):
    datum = Datum(np.arange(n, dtype=np.int64), {"target_tokens": np.arange(n, dtype=np.int64)})
    payload = ForwardBackwardRequested(
        request_id="req-2",
        model_id="s:train:0",
        seq_id=1,
        loss_fn="cross_entropy",
        data=[DatumRecord.from_datum(datum)],
    )
    return new_event(FORWARD_BACKWARD["requested"], payload, tenant="alice", source="/test", key="s:train:0")


def test_kafka_binary_mode_layout(tmp_path):
    message = Codec(BlobStore(tmp_path)).encode(optim_event())
    assert message.key == b"s:train:0"  # the partition key is the model id
    assert message.headers["ce_type"] == b"ai.openrl.training.optim_step.requested.v1"
    assert message.headers["ce_specversion"] == b"1.0"
    assert message.headers["content-type"] == b"application/json"
    assert message.headers["ce_tenant"] == b"alice"
    assert b'"learning_rate":0.0003' in message.value


def test_round_trip_is_exact(tmp_path):
    codec = Codec(BlobStore(tmp_path))
    event = optim_event()
    assert codec.decode(codec.encode(event)) == event
    headers, body = codec.encode_http(event)
    assert headers["ce-type"] == event.type
    assert codec.decode_http(headers, body) == event


def test_the_lease_travels_as_a_cloudevent_extension(tmp_path):
    codec = Codec(BlobStore(tmp_path))
    event = optim_event().model_copy(update={"lease": 117707261820993536})
    message = codec.encode(event)
    assert message.headers["ce_openrllease"] == b"117707261820993536"
    assert codec.decode(message) == event
    headers, body = codec.encode_http(event)
    assert headers["ce-openrllease"] == "117707261820993536" and codec.decode_http(headers, body) == event
    assert "ce_openrllease" not in codec.encode(optim_event()).headers


def test_large_payloads_travel_by_reference(tmp_path):
    blobs = BlobStore(tmp_path)
    codec = Codec(blobs, inline_limit=4096)
    event = big_event()
    message = codec.encode(event)
    assert message.value == b"" and len(message.headers["ce_claimcheck"]) == 64
    assert codec.decode(message) == event
    read_back = Message(message.headers, message.key, message.value)  # as from the log's file
    assert codec.decode(read_back) == event
    # a reader without the blob store cannot pretend to have the payload
    with pytest.raises(ServerError):
        Codec(None).decode(read_back)


def test_tampered_claim_is_detected(tmp_path):
    blobs = BlobStore(tmp_path)
    codec = Codec(blobs, inline_limit=1024)
    message = codec.encode(big_event())
    digest = message.headers["ce_claimcheck"].decode()
    path = tmp_path / "alice" / digest[:2] / digest
    data = path.read_bytes()
    path.write_bytes(data.replace(b"cross_entropy", b"cross_entrop_"))
    with pytest.raises(ServerError, match="corrupted"):
        codec.decode(Message(message.headers, message.key, message.value))


def test_topic_names_are_per_tenant_and_work_streams_per_base_model():
    from eventing import topics

    name = topics.topic("alice", "training", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert name.startswith("openrl.alice.training.huggingfacetb-smollm2-135m-instruct-")
    assert topics.tenant_of(name) == "alice"
    import re

    assert re.match(topics.pattern("training"), name)
    assert re.match(topics.pattern("training", ["HuggingFaceTB/SmolLM2-135M-Instruct"]), name)
    assert not re.match(topics.pattern("training", ["openrl/tiny-qwen3"]), name)
    assert not re.match(topics.pattern("sampling"), name)
    assert re.match(topics.everything(), name) and re.match(topics.everything(), topics.topic("bob", "control"))
    assert topics.model_slug("a/b") != topics.model_slug("a-b")  # distinct names, distinct topics


def test_a_message_this_process_encoded_decodes_to_its_event_and_compares_by_content():
    codec = Codec(None)
    event = optim_event()
    message = codec.encode(event)
    assert codec.decode(message) is event  # the embedded log hands consumers this very message
    read_back = Message(message.headers, message.key, message.value)
    assert read_back.decoded is None and read_back == message  # `decoded` is no part of the content
    assert codec.decode(read_back) == event and codec.decode(read_back) is not event
