"""CloudEvents codec: `Event` ⇄ CloudEvent ⇄ Kafka binary-mode message (and HTTP binary mode).

Pure functions over frozen messages, built on the `cloudevents` v2 SDK's bindings. In
binary mode the attributes travel as `ce_*` headers, the payload JSON as the value, and the
partition key (the model id) as the message key. Payloads above the inline limit are
stored in the tenant's blob store under their hash and the message carries only the
reference in the `claimcheck` extension (the claim-check pattern), so the log stays small
enough to replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, cast

from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent

from eventing.blobs import BlobStore
from eventing.dedup import Dedup
from openrl_core.errors import ServerError
from openrl_core.events import Event, payload_model
from openrl_core.events.lifecycle import BlobRef

JSON = "application/json"
CLAIM_ATTR = "claimcheck"
CLAIM_SIZE_ATTR = "claimsize"
_CLAIM_SIZE_HEADER = "ce_" + CLAIM_SIZE_ATTR  # binary mode's header for that attribute
# A submission's dedup identity rides along on the log, so the log alone can rebuild the
# store (`openrl replay --from-log`), submissions table included.
DEDUP_KEY_ATTR = "dedupkey"
DEDUP_SHA_ATTR = "dedupsha256"
DEDUP_REFUSED_ATTR = "deduprefused"
LEASE_ATTR = "openrllease"


class _RawJSON(JSONFormat):
    """Keeps the payload as bytes, so pydantic parses it once, directly into the model."""

    def read_data(self, body: bytes, datacontenttype: str | None):  # type: ignore[override]
        return bytes(body) if body else None


_FORMAT = _RawJSON()


@dataclass(frozen=True)
class Message:
    """One log record's content, independent of any Kafka client library.

    `decoded` is the event this process encoded it from, when it still holds it: a log in
    the same process (the embedded one) hands its consumers the very message it appended,
    and decoding that again would only rebuild an equal event (the codec round trip is
    tested). It is never part of the record's content: not compared, not stored, not sent;
    a message read back from bytes (another process, a restart, Kafka) has none."""

    headers: dict[str, bytes]
    key: Optional[bytes]
    value: bytes
    decoded: Optional[Event] = field(default=None, compare=False, repr=False)

    def payload_bytes(self) -> int:
        """The payload's size, inline or claim-checked (the size its decoded event holds)."""
        claimed = self.headers.get(_CLAIM_SIZE_HEADER)
        return len(self.value) + (int(claimed) if claimed else 0)


class Codec:
    def __init__(self, blobs: Optional[BlobStore] = None, inline_limit: int = 256 * 1024) -> None:
        self.blobs = blobs
        self.inline_limit = inline_limit

    def pack(self, event: Event) -> tuple[bytes, Optional[BlobRef]]:
        """The payload inline, or b"" and a blob reference when it is over the limit."""
        data = event.data.model_dump_json().encode()
        if len(data) > self.inline_limit and self.blobs is not None:
            return b"", self.blobs.put(event.tenant, data)
        return data, None

    def unpack(self, tenant: str, type_: str, data: Optional[bytes], claim: Optional[BlobRef]):
        if claim is not None:
            if self.blobs is None:
                raise ServerError("a claim-checked event needs a blob store to decode")
            data = self.blobs.get(tenant, claim)
        return payload_model(type_).model_validate_json(data or b"{}")

    def encode(self, event: Event, dedup: Optional[Dedup] = None) -> Message:
        data, claim = self.pack(event)
        attributes = _attributes(event)
        if claim is not None:
            attributes[CLAIM_ATTR] = claim.sha256
            attributes[CLAIM_SIZE_ATTR] = str(claim.size)
        if dedup is not None:
            attributes[DEDUP_KEY_ATTR] = dedup.key
            attributes[DEDUP_SHA_ATTR] = dedup.payload_sha256
            attributes[DEDUP_REFUSED_ATTR] = "true" if dedup.rejected else "false"
        if not (event.id and event.source and event.type) or event.subject == "" or event.time.tzinfo is None:
            # What the CloudEvents SDK refuses, it refuses here (with its own error).
            message = ce_kafka.to_binary(CloudEvent(attributes, data or None), _FORMAT)
            key = message.key.encode() if isinstance(message.key, str) else message.key
            return Message(headers=message.headers, key=key, value=message.value, decoded=event)
        key = event.key.encode() if event.key is not None else None
        return Message(headers=_binary_headers(attributes), key=key, value=data, decoded=event)

    def decode(self, message: Message) -> Event:
        if message.decoded is not None:
            return message.decoded
        return self._to_event(_from_kafka(message))

    def decode_with_dedup(self, message: Message) -> tuple[Event, Optional[Dedup]]:
        """The event and the dedup identity it was stored under (None: it had none)."""
        cloud_event = _from_kafka(message)
        attributes = cloud_event.get_attributes()
        dedup = None
        if attributes.get(DEDUP_KEY_ATTR):
            refused = attributes.get(DEDUP_REFUSED_ATTR) == "true"
            dedup = Dedup(attributes[DEDUP_KEY_ATTR], attributes[DEDUP_SHA_ATTR], rejected=refused)
        return self._to_event(cloud_event), dedup

    def encode_http(self, event: Event) -> tuple[dict[str, str], bytes]:
        """HTTP binary mode, what a Knative KafkaSource delivers to a consumer function."""
        cloud_event = _from_kafka(self.encode(event))
        http_message = ce_http.to_binary(cloud_event, _FORMAT)
        return dict(http_message.headers), http_message.body

    def decode_http(self, headers: dict[str, str], body: bytes) -> Event:
        cloud_event = ce_http.from_http(ce_http.HTTPMessage(headers=dict(headers), body=body), _FORMAT, CloudEvent)
        return self._to_event(cloud_event)

    def _to_event(self, cloud_event: BaseCloudEvent) -> Event:
        attributes = cloud_event.get_attributes()
        data = cloud_event.get_data()
        claim = attributes.get(CLAIM_ATTR)
        tenant = attributes.get("tenant")
        if not tenant:
            raise ServerError(f"event {attributes.get('id')} has no tenant")
        ref = BlobRef(sha256=claim, size=int(attributes.get(CLAIM_SIZE_ATTR, 0))) if claim else None
        if isinstance(data, str):
            data = data.encode()
        # `_FORMAT` reads the data as bytes (or None), never as the parsed dict the type allows.
        payload = self.unpack(tenant, attributes["type"], cast(Optional[bytes], data), ref)
        return Event(
            id=attributes["id"],
            type=attributes["type"],
            source=attributes["source"],
            time=attributes["time"],
            tenant=tenant,
            key=attributes.get(ce_kafka.PARTITIONKEY_ATTR),
            subject=attributes.get("subject"),
            lease=int(attributes[LEASE_ATTR]) if attributes.get(LEASE_ATTR) else None,
            data=payload,
        )


def _attributes(event: Event) -> dict:
    attributes = {
        "id": event.id,
        "type": event.type,
        "source": event.source,
        "time": event.time,
        "datacontenttype": JSON,
        "tenant": event.tenant,
    }
    if event.subject is not None:
        attributes["subject"] = event.subject
    if event.key is not None:
        attributes[ce_kafka.PARTITIONKEY_ATTR] = event.key
    if event.lease is not None:
        attributes[LEASE_ATTR] = str(event.lease)
    return attributes


def _binary_headers(attributes: dict) -> dict[str, bytes]:
    """The `ce_*` headers cloudevents' Kafka binding (`to_binary`) writes for these
    attributes, in its order, `specversion` last as its CloudEvent adds it. Written here
    because that path, a CloudEvent built and validated by regular expressions and then
    serialized, cost about 11 us an event: every request the gateway appends and every
    completion a worker publishes. Our attributes come from a validated `Event` and fixed
    extension names, so its checks cannot fail on them (an event missing its id, source or
    type, with an empty subject or a naive time, still goes through the SDK, which refuses it). `tests/eventing/test_codec_properties.py`
    compares the two byte for byte."""
    headers: dict[str, bytes] = {}
    for name, value in attributes.items():
        if name == "datacontenttype":
            headers["content-type"] = value.encode()
        elif name == "time":
            text = value.isoformat()
            headers["ce_time"] = (text[:-6] + "Z" if text.endswith("+00:00") else text).encode()
        else:
            headers["ce_" + name] = value.encode()
    headers["ce_specversion"] = b"1.0"
    return headers


def _from_kafka(message: Message) -> BaseCloudEvent:
    return ce_kafka.from_binary(
        ce_kafka.KafkaMessage(headers=message.headers, key=message.key, value=message.value), _FORMAT, CloudEvent
    )
