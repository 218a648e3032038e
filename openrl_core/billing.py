"""Billing usage (`AdminClient.get_billing_usage`) as pure arithmetic over rows the store read.

A self-hosted server prices nothing, so every cost and rate is None; the quantities are
real. The store hands over two kinds of rows (`eventing/store/usage_reads.py`):

- `TokenRow`: one UTC hour's tokens of one kind for one (model, session), already summed by
  the database. Kinds: `training` (forward_backward, forward-only included: the datum
  tokens it was sent), `sampling_prefill` (a sample's prompt, once per request however
  many samples it asked for; never cached: there is no prefill cache to bill apart) and
  `sampling_sample` (the tokens the sampler returned, over every sequence). A request counts
  in the hour it completed, and only if it completed (failed and cancelled ones are free).
- `StoredRow`: one checkpoint's stored interval, [saved_at, end), where end is when it was
  deleted, expired (its `expires_at`, even if the reaper removed it later) or replaced by a
  same-named save, whichever came first; open while it is live.

`buckets` turns them into the SDK's events: per hour and attribution (base model, session,
project), one event per token kind, a `checkpoint` event counting the saves made in that
hour, and a `storage` event of gigabyte-hours: the checkpoint's bytes / 1e9 (decimal
gigabytes, `GIGABYTE`) times the hours of the bucket it was stored, up to `now` for the
current hour. Ordered by bucket, then by descending quantity (token count, then checkpoint
count, then gigabyte-hours), then by attribution, so equal inputs give equal answers.

`check_window` holds the SDK's documented rules for the window: both ends on a UTC hour,
`starting_on` not in the future, `ending_before` after it and at most 14 days after it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Optional

from openrl_core.errors import InvalidRequest

GIGABYTE = 1e9  # bytes in the storage unit: decimal gigabytes, as storage is billed
HOUR = timedelta(hours=1)
MAX_WINDOW = timedelta(days=14)
TOKEN_KINDS = ("training", "sampling_prefill", "sampling_sample")
_ORDER = {"training": 0, "sampling_prefill": 1, "sampling_sample": 2, "checkpoint": 3, "storage": 4}

Attribution = tuple[Optional[str], Optional[str], Optional[str]]  # base_model, session_id, project_id


@dataclass(frozen=True)
class TokenRow:
    hour: datetime  # the UTC hour the tokens were used in (its start)
    kind: str  # one of TOKEN_KINDS
    tokens: int
    base_model: Optional[str]
    session_id: Optional[str]
    project_id: Optional[str]


@dataclass(frozen=True)
class StoredRow:
    saved_at: datetime
    removed_at: Optional[datetime]  # deleted, or replaced by a save of the same name
    expires_at: Optional[datetime]
    size_bytes: int
    base_model: Optional[str]
    session_id: Optional[str]
    project_id: Optional[str]

    @property
    def end(self) -> Optional[datetime]:
        ends = [moment for moment in (self.removed_at, self.expires_at) if moment is not None]
        return min(ends) if ends else None


def _field_time(name: str, value: Optional[str]) -> datetime:
    if value is None or value == "":
        raise InvalidRequest(f"{name} is required: an RFC 3339 time on a UTC hour, e.g. 2026-07-13T00:00:00Z")
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidRequest(
            f"{name} must be an RFC 3339 time, e.g. 2026-07-13T00:00:00Z; got {value[:60]!r}"
        ) from None
    # A naive time is UTC: the SDK serialises a naive datetime without an offset.
    moment = moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)
    if (moment.minute, moment.second, moment.microsecond) != (0, 0, 0):
        raise InvalidRequest(f"{name} must be aligned to a UTC hour boundary; got {value[:60]!r}")
    return moment


def check_window(starting_on: Optional[str], ending_before: Optional[str], now: datetime) -> tuple[datetime, datetime]:
    """The window [starting_on, ending_before) in UTC, or a 400 naming the field at fault."""
    start = _field_time("starting_on", starting_on)
    end = _field_time("ending_before", ending_before)
    if start > now:
        raise InvalidRequest(f"starting_on must not be in the future; got {start.isoformat()}")
    if end <= start:
        raise InvalidRequest("ending_before must be after starting_on")
    if end - start > MAX_WINDOW:
        raise InvalidRequest(f"ending_before must be at most 14 days after starting_on; got {end - start}")
    return start, end


def hour_of(moment: datetime) -> datetime:
    moment = moment.astimezone(timezone.utc)
    return moment.replace(minute=0, second=0, microsecond=0)


def _hours(start: datetime, end: datetime):
    hour = hour_of(start)
    while hour < end:
        yield hour
        hour += HOUR


def buckets(start: datetime, end: datetime, now: datetime, tokens: list[TokenRow], stored: list[StoredRow]) -> list[dict[str, Any]]:  # fmt: skip
    """The window's usage events (`BillingUsageEvent` as JSON-ready dicts, costs None)."""
    token_sums: dict[tuple[datetime, str, Attribution], int] = defaultdict(int)
    for row in tokens:
        if start <= row.hour < end and row.tokens > 0:
            token_sums[(row.hour, row.kind, (row.base_model, row.session_id, row.project_id))] += row.tokens
    saves: dict[tuple[datetime, Attribution], int] = defaultdict(int)
    gb_hours: dict[tuple[datetime, Attribution], float] = defaultdict(float)
    horizon = min(end, now)
    for row in stored:
        who = (row.base_model, row.session_id, row.project_id)
        if start <= row.saved_at < end:
            saves[(hour_of(row.saved_at), who)] += 1
        stored_until = min(row.end or horizon, horizon)
        if row.size_bytes <= 0 or stored_until <= max(row.saved_at, start):
            continue
        for hour in _hours(max(row.saved_at, start), stored_until):
            seconds = (min(stored_until, hour + HOUR) - max(row.saved_at, start, hour)).total_seconds()
            if seconds > 0:
                gb_hours[(hour, who)] += row.size_bytes / GIGABYTE * seconds / 3600.0
    out: list[tuple[tuple, dict[str, Any]]] = []
    for (hour, kind, who), count in token_sums.items():
        out.append(_event(hour, kind, who, {"type": kind, "token_count": count, **_cached(kind)}, count))
    for (hour, who), count in saves.items():
        out.append(_event(hour, "checkpoint", who, {"type": "checkpoint", "count": count}, count))
    for (hour, who), amount in gb_hours.items():
        out.append(_event(hour, "storage", who, {"type": "storage", "free": False, "gigabyte_hours": amount}, amount))
    out.sort(key=lambda pair: pair[0])
    return [event for _key, event in out]


def _cached(kind: str) -> dict[str, Any]:
    return {"cached": False} if kind == "sampling_prefill" else {}


def _event(hour: datetime, kind: str, who: Attribution, info: dict[str, Any], quantity: float) -> tuple[tuple, dict]:
    base_model, session_id, project_id = who
    event = {
        "bucket_start": hour.isoformat(),
        "bucket_end": (hour + HOUR).isoformat(),
        "base_model": base_model,
        "session_id": session_id,
        "project_id": project_id,
        "estimated_cost_usd": None,
        "effective_rate_usd_per_million_tokens": None,
        "effective_rate_usd_per_gigabyte_month": None,
        "event_info": info,
    }
    # Token kinds compete on their count; then checkpoints, then storage, each by quantity.
    group = 0 if kind in TOKEN_KINDS else _ORDER[kind]
    key = (hour, group, -quantity, _ORDER[kind], base_model or "", session_id or "", project_id or "")
    return key, event


# -- what a future counts, from its events alone (the projection records it; a replay redoes it)


def prefill_tokens(payload: object) -> Optional[int]:
    """A sample request's prompt tokens (None for any other request)."""
    prompt = getattr(payload, "prompt_tokens", None)
    return len(prompt) if isinstance(prompt, list) and hasattr(payload, "num_samples") else None


def sampled_tokens(result: Any) -> int:
    """The tokens a sample's completion returned, over every sequence."""
    sequences = result.get("sequences") if isinstance(result, dict) else None
    if not isinstance(sequences, list):
        return 0
    return sum(len(s["tokens"]) for s in sequences if isinstance(s, dict) and isinstance(s.get("tokens"), list))
