"""The event envelope and the registry that maps an event type to its payload model.

An `Event` is what every component exchanges: CloudEvents attributes (`id`, `type`,
`source`, `subject`, `time`) plus the OpenRL extensions `tenant`, `key` (the partition
key: a model id keeps one model's events in order) and `lease` (the timeslicer lease a
worker's event was produced under). Payloads are frozen pydantic models;
the registry is the single place that says which payload a type carries, so the codec and
the store can rebuild typed events from bytes.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Optional

from pydantic import BaseModel, ConfigDict

from openrl_core.errors import ServerError
from openrl_core.ids import new_uuid

PREFIX = "ai.openrl"
_REGISTRY: dict[str, type[BaseModel]] = {}


class Payload(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    id: str
    type: str
    source: str
    time: datetime
    tenant: str
    key: Optional[str] = None
    subject: Optional[str] = None
    # The timeslicer lease the worker held when it produced this event (a fencing token).
    lease: Optional[int] = None
    data: BaseModel

    @classmethod
    def stored(cls, id: str, type: str, source: str, time: datetime, tenant: str, key: Optional[str],
               subject: Optional[str], lease: Optional[int], data: BaseModel) -> "Event":  # fmt: skip
        """An event the store wrote, rebuilt without validating it again: every field is
        given, as stored (its payload validated by its own model). What `model_construct`
        makes, without the bookkeeping that cost replay five times the construction itself
        (tests/openrl_core/test_events.py checks the two agree)."""
        event = cls.__new__(cls)
        values = {"id": id, "type": type, "source": source, "time": time, "tenant": tenant, "key": key,
                  "subject": subject, "lease": lease, "data": data}  # fmt: skip
        object.__setattr__(event, "__dict__", values)
        object.__setattr__(event, "__pydantic_fields_set__", _EVENT_FIELDS)
        object.__setattr__(event, "__pydantic_extra__", None)
        object.__setattr__(event, "__pydantic_private__", None)
        return event

    @property
    def family(self) -> str:
        return self.type.split(".")[2]

    @property
    def verb(self) -> str:
        return self.type.split(".")[3]

    @property
    def phase(self) -> str:
        return self.type.split(".")[4]


_EVENT_FIELDS = frozenset(Event.model_fields)


def event_type(family: str, verb: str, phase: str, version: int = 1) -> str:
    return f"{PREFIX}.{family}.{verb}.{phase}.v{version}"


def register(type_: str, payload: type[BaseModel]) -> str:
    existing = _REGISTRY.get(type_)
    if existing is not None and existing is not payload:
        raise ServerError(f"event type {type_} registered twice")
    _REGISTRY[type_] = payload
    return type_


def payload_model(type_: str) -> type[BaseModel]:
    try:
        return _REGISTRY[type_]
    except KeyError:
        raise ServerError(f"unknown event type {type_!r}") from None


def registered_types() -> list[str]:
    return sorted(_REGISTRY)


def new_event(
    type_: str,
    data: BaseModel,
    *,
    tenant: str,
    source: str,
    key: Optional[str] = None,
    subject: Optional[str] = None,
    lease: Optional[int] = None,
) -> Event:
    expected = payload_model(type_)
    if not isinstance(data, expected):
        raise ServerError(f"{type_} carries {expected.__name__}, not {type(data).__name__}")
    return Event(
        id=new_uuid(),
        type=type_,
        source=source,
        time=datetime.now(timezone.utc),
        tenant=tenant,
        key=key,
        subject=subject,
        lease=lease,
        data=data,
    )
