"""CloudEvents codec properties: every registered event type survives Kafka and HTTP binary
mode unchanged, with generated payloads and envelopes; above the inline limit the payload
travels by claim check and comes back byte for byte.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventing.blobs import BlobStore
from eventing.codec import CLAIM_ATTR, Codec
from eventing.dedup import Dedup
from openrl_core.events import Event, payload_model, registered_types
from tests.eventing.payload_strategies import payloads

TENANT_NAMES = st.from_regex(r"[a-z0-9][a-z0-9-]{0,39}", fullmatch=True)
ids = st.text(min_size=1, max_size=40)


def events(type_: str):
    return st.builds(
        Event,
        id=ids,
        type=st.just(type_),
        source=ids,
        time=st.datetimes(timezones=st.just(timezone.utc)),
        tenant=TENANT_NAMES,
        key=st.none() | ids,
        subject=st.none() | ids,
        lease=st.none() | st.integers(0, 2**63 - 1),
        data=payloads(payload_model(type_)),
    )


@pytest.fixture(scope="module")
def blobs(tmp_path_factory):
    return BlobStore(tmp_path_factory.mktemp("blobs"))


def test_every_registered_type_is_covered():
    assert len(registered_types()) > 30  # the catalogue is imported, not an empty registry


@pytest.mark.parametrize("type_", registered_types())
def test_round_trip_of_every_event_type(type_, blobs):
    codec = Codec(blobs)

    @settings(max_examples=15)
    @given(events(type_))
    def round_trip(event):
        assert codec.decode(codec.encode(event)) == event
        headers, body = codec.encode_http(event)
        assert codec.decode_http(headers, body) == event

    round_trip()


@settings(max_examples=60)
@given(st.sampled_from(registered_types()).flatmap(events), st.sampled_from([8, 64, 512, 1 << 20]))
def test_claim_check_above_the_inline_limit(blobs, event, limit):
    codec = Codec(blobs, inline_limit=limit)
    inline = event.data.model_dump_json().encode()
    message = codec.encode(event)
    if len(inline) > limit:
        # the log carries only the reference; the blob is the payload under its own hash
        assert message.value == b""
        digest = message.headers[f"ce_{CLAIM_ATTR}"].decode()
        assert digest == hashlib.sha256(inline).hexdigest()
        assert blobs.get(event.tenant, codec.pack(event)[1]) == inline
    else:
        assert message.value == inline and f"ce_{CLAIM_ATTR}" not in message.headers
    assert codec.decode(message) == event
    headers, body = codec.encode_http(event)
    assert codec.decode_http(headers, body) == event


def sdk_message(codec: Codec, event: Event, dedup):
    """What the CloudEvents SDK's Kafka binding makes of the same attributes: the reference
    the codec's own header writing must equal."""
    from cloudevents.core.bindings import kafka as ce_kafka
    from cloudevents.core.v1.event import CloudEvent

    from eventing import codec as codec_module

    data, claim = codec.pack(event)
    attributes = codec_module._attributes(event)
    if claim is not None:
        attributes[codec_module.CLAIM_ATTR] = claim.sha256
        attributes[codec_module.CLAIM_SIZE_ATTR] = str(claim.size)
    if dedup is not None:
        attributes[codec_module.DEDUP_KEY_ATTR] = dedup.key
        attributes[codec_module.DEDUP_SHA_ATTR] = dedup.payload_sha256
        attributes[codec_module.DEDUP_REFUSED_ATTR] = "true" if dedup.rejected else "false"
    return ce_kafka.to_binary(CloudEvent(attributes, data or None), codec_module._FORMAT)


dedups = st.none() | st.builds(
    Dedup, st.text(min_size=1, max_size=30), st.from_regex(r"[0-9a-f]{64}", fullmatch=True), st.booleans()
)
offsets = st.sampled_from([timezone.utc, timezone(timedelta(hours=-5)), timezone(timedelta(hours=5, minutes=30))])


@settings(max_examples=200)
@given(st.sampled_from(registered_types()).flatmap(events), dedups, st.sampled_from([8, 1 << 20]), offsets)
def test_binary_headers_are_the_sdks_byte_for_byte(blobs, event, dedup, limit, offset):
    """The codec writes Kafka binary mode's headers itself (the SDK's path cost ~11 us an
    event): the same headers in the same order (the log stores them as JSON text), the same
    key and value as cloudevents' `to_binary`, claim-checked or not, with a dedup identity
    or not, in UTC or another offset."""
    event = event.model_copy(update={"time": event.time.astimezone(offset)})
    codec = Codec(blobs, inline_limit=limit)
    ours, reference = codec.encode(event, dedup), sdk_message(codec, event, dedup)
    assert list(ours.headers.items()) == list(reference.headers.items())
    assert ours.key == (reference.key.encode() if isinstance(reference.key, str) else reference.key)
    assert ours.value == reference.value


@pytest.mark.parametrize(
    "broken",
    [{"id": ""}, {"source": ""}, {"subject": ""}, {"time": datetime(2026, 1, 1)}],
    ids=["id", "source", "subject", "naive-time"],
)
def test_an_event_the_sdk_refuses_is_still_refused(blobs, broken):
    from cloudevents.core.exceptions import CloudEventValidationError

    type_ = registered_types()[0]
    fields = dict(
        id="e1",
        type=type_,
        source="/x",
        time=datetime.now(timezone.utc),
        tenant="t",
        key=None,
        subject=None,
        lease=None,
    )
    event = Event.stored(**{**fields, **broken}, data=payload_model(type_).model_construct())
    with pytest.raises(CloudEventValidationError):
        Codec(blobs).encode(event)
