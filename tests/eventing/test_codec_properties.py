"""CloudEvents codec properties: every registered event type survives Kafka and HTTP binary
mode unchanged, with generated payloads and envelopes; above the inline limit the payload
travels by claim check and comes back byte for byte.
"""

from __future__ import annotations

import hashlib
from datetime import timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventing.blobs import BlobStore
from eventing.codec import CLAIM_ATTR, Codec
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
