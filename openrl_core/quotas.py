"""Per-tenant quotas: the limits, what a request costs against them, and whether it fits.

Pure: the gateway reads a tenant's usage from the store's projections and hands it here as
numbers; this module decides. Four limits, each unset (no limit) by default:

| limit | counts | a request costs |
|---|---|---|
| `requests_in_flight` | the tenant's futures not yet completed, failed or cancelled | 1 per future it makes |
| `queued_training_tokens` | tokens of its unfinished forward / forward_backward requests | its datums' tokens |
| `sampling_tokens_per_minute` | sampling tokens submitted in the last `WINDOW_SECONDS` (sliding) | prompt + max_tokens x num_samples |
| `checkpoint_bytes` | sizes of its live (unexpired) checkpoints | a save is admitted while usage < limit |

A request fits when, for every limit it touches, usage + cost <= limit. One whose cost alone
exceeds a limit never fits: that is a plain 400 (retrying cannot help), not a 429. A save's
size is unknown until the trainer writes it, so the storage rule admits saves while the
tenant is under its limit, and the save that crosses it is the last until space frees.

`retry_after` is when the refused request could first fit: exactly, for the sliding window
(the moment enough old tokens leave it) and for storage with an expiring checkpoint (its
expiry); otherwise a short fixed wait, because capacity frees as the tenant's own work
finishes, which nothing here can predict.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from openrl_core.errors import InvalidRequest, OpenRLError
from openrl_core.events.sampling import SampleRequested
from openrl_core.events.training import ForwardBackwardRequested
from openrl_core.quantity import parse_bytes

LimitName = Literal["requests_in_flight", "queued_training_tokens", "sampling_tokens_per_minute", "checkpoint_bytes"]
LIMITS: tuple[LimitName, ...] = (
    "requests_in_flight",
    "queued_training_tokens",
    "sampling_tokens_per_minute",
    "checkpoint_bytes",
)
WINDOW_SECONDS = 60.0
# Capacity held by in-flight work frees as it finishes: ask the client back soon (the SDK
# honours a Retry-After up to 60 s, then falls back to its own backoff).
BUSY_RETRY_SECONDS = 1
# Storage frees only when the tenant deletes a checkpoint (or one expires): ask back later.
STORAGE_RETRY_SECONDS = 60
UNITS = {
    "requests_in_flight": "requests in flight",
    "queued_training_tokens": "queued training tokens",
    "sampling_tokens_per_minute": "sampling tokens in the last minute",
    "checkpoint_bytes": "bytes of live checkpoints",
}


def setting_name(limit: LimitName, tenant: str, overridden: bool) -> str:
    """The setting an operator changes to move this tenant's limit."""
    if overridden:
        return f"tenant_quotas[{tenant!r}][{limit!r}] (OPENRL_TENANT_QUOTAS)"
    return f"quota_{limit} (OPENRL_QUOTA_{limit.upper()})"


class Quotas(BaseModel):
    """One tenant's limits; None is no limit."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    requests_in_flight: Optional[int] = Field(default=None, ge=1)
    queued_training_tokens: Optional[int] = Field(default=None, ge=1)
    sampling_tokens_per_minute: Optional[int] = Field(default=None, ge=1)
    checkpoint_bytes: Optional[int] = Field(default=None, ge=1)

    @field_validator("checkpoint_bytes", mode="before")
    @classmethod
    def _bytes(cls, value):
        return parse_bytes(value) if isinstance(value, str) else value

    @functools.cached_property
    def any(self) -> bool:
        # Asked on every submission (twice); the model is frozen, so the answer is kept.
        return any(getattr(self, name) is not None for name in LIMITS)


def limits_for(defaults: Quotas, overrides: dict[str, dict], tenant: str) -> tuple[Quotas, frozenset[str]]:
    """The tenant's limits (its override of a limit, even None, wins over the default) and
    which of them come from its override."""
    own = overrides.get(tenant) or {}
    unknown = sorted(set(own) - set(LIMITS))
    if unknown:
        raise InvalidRequest(f"tenant_quotas[{tenant!r}] names unknown limits {unknown}; known: {list(LIMITS)}")
    merged = {**defaults.model_dump(), **own}
    return Quotas.model_validate(merged), frozenset(own)


@dataclass(frozen=True)
class Cost:
    """What one submission adds (a multi-prompt OpenAI request sums its samples)."""

    requests: int = 0
    training_tokens: int = 0
    sampling_tokens: int = 0
    saves_checkpoint: bool = False
    checkpoint_bytes: int = 0  # known up front only for a copy

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(
            self.requests + other.requests,
            self.training_tokens + other.training_tokens,
            self.sampling_tokens + other.sampling_tokens,
            self.saves_checkpoint or other.saves_checkpoint,
            self.checkpoint_bytes + other.checkpoint_bytes,
        )


def sampling_tokens(prompt_tokens: int, max_tokens: int, num_samples: int) -> int:
    """Prompt + every sample's generation budget: what the sampler may have to produce."""
    return prompt_tokens + max_tokens * num_samples


def request_tokens(payload: object) -> Optional[int]:
    """The tokens a request event is charged, from the event alone, so the projection that
    records them (and a replay of it) needs nothing else. The gateway writes a sample's
    max_tokens into its event explicitly (an older event without one counts its prompt)."""
    if isinstance(payload, ForwardBackwardRequested):
        return sum(math.prod(datum.tokens.shape) for datum in payload.data)
    if isinstance(payload, SampleRequested):
        budget = payload.sampling_params.max_tokens or 0
        return sampling_tokens(len(payload.prompt_tokens), budget, payload.num_samples)
    return None


@dataclass(frozen=True)
class Usage:
    requests_in_flight: int = 0
    queued_training_tokens: int = 0
    # (submitted at, tokens) of the tenant's samples in the current window, any order.
    sampling_window: Sequence[tuple[float, int]] = ()
    checkpoint_bytes: int = 0
    next_checkpoint_expiry: Optional[float] = None  # earliest expires_at of a live checkpoint


class QuotaExceeded(OpenRLError):
    """A 429: the request is fine but the tenant is over a limit now; retrying later works.
    Not a UserError, on purpose: a refusal that consumes the request's seq_id (as user errors
    do) would turn the SDK's retry, which resends that seq_id, into a conflict."""

    category = "user"
    http_status = 429

    def __init__(self, detail: str, limit: LimitName, retry_after: int) -> None:
        super().__init__(detail)
        self.limit = limit
        self.retry_after = retry_after


def window_wait(
    entries: Sequence[tuple[float, int]], limit: int, cost: int, now: float, window: float = WINDOW_SECONDS
) -> float:
    """Seconds from `now` until `cost` more tokens fit under `limit` in the sliding window
    (0: they fit now). An entry submitted at `at` leaves the window at `at + window`.
    The caller makes sure `cost <= limit`, so the wait is finite."""
    live = sorted((at, tokens) for at, tokens in entries if at > now - window)
    used = sum(tokens for _, tokens in live)
    if used + cost <= limit:
        return 0.0
    for at, tokens in live:  # oldest first: the order they leave the window
        used -= tokens
        if used + cost <= limit:
            return max(at + window - now, 0.0)
    return 0.0  # not reached while cost <= limit


def check(
    limits: Quotas, usage: Usage, cost: Cost, now: float, *, tenant: str = "", overridden: frozenset[str] = frozenset()
) -> None:
    """Raise QuotaExceeded for the first limit the request does not fit under now, or
    InvalidRequest when it could never fit; return when it fits every limit."""

    def name(limit: LimitName) -> str:
        return setting_name(limit, tenant, limit in overridden)

    def never(limit: LimitName, amount: int, what: str) -> None:
        raise InvalidRequest(
            f"this request's {amount} {what} exceed the tenant's whole {limit} limit of {getattr(limits, limit)} "
            f"(setting {name(limit)}): it can never be admitted; split it"
        )

    def over(limit: LimitName, used: int, amount: int, retry: float) -> None:
        seconds = max(1, math.ceil(retry))
        adds = f"this request adds {amount}" if amount else "no save is admitted at or over the limit"
        raise QuotaExceeded(
            f"quota exceeded: the {limit} limit is {getattr(limits, limit)} (setting {name(limit)}); the tenant has "
            f"{used} {UNITS[limit]} and {adds}; retry after {seconds} s",
            limit,
            seconds,
        )

    if cost.requests and limits.requests_in_flight is not None:
        if cost.requests > limits.requests_in_flight:
            never("requests_in_flight", cost.requests, "requests")
        if usage.requests_in_flight + cost.requests > limits.requests_in_flight:
            over("requests_in_flight", usage.requests_in_flight, cost.requests, BUSY_RETRY_SECONDS)
    if cost.training_tokens and limits.queued_training_tokens is not None:
        if cost.training_tokens > limits.queued_training_tokens:
            never("queued_training_tokens", cost.training_tokens, "training tokens")
        if usage.queued_training_tokens + cost.training_tokens > limits.queued_training_tokens:
            over("queued_training_tokens", usage.queued_training_tokens, cost.training_tokens, BUSY_RETRY_SECONDS)
    if cost.sampling_tokens and limits.sampling_tokens_per_minute is not None:
        limit = limits.sampling_tokens_per_minute
        if cost.sampling_tokens > limit:
            never("sampling_tokens_per_minute", cost.sampling_tokens, "sampling tokens")
        wait = window_wait(usage.sampling_window, limit, cost.sampling_tokens, now)
        if wait > 0:
            used = sum(tokens for at, tokens in usage.sampling_window if at > now - WINDOW_SECONDS)
            over("sampling_tokens_per_minute", used, cost.sampling_tokens, wait)
    if (cost.saves_checkpoint or cost.checkpoint_bytes) and limits.checkpoint_bytes is not None:
        limit = limits.checkpoint_bytes
        if cost.checkpoint_bytes > limit:
            never("checkpoint_bytes", cost.checkpoint_bytes, "checkpoint bytes")
        full = usage.checkpoint_bytes >= limit if cost.saves_checkpoint else False
        if full or usage.checkpoint_bytes + cost.checkpoint_bytes > limit:
            expiry = usage.next_checkpoint_expiry
            retry = expiry - now if expiry is not None and expiry > now else STORAGE_RETRY_SECONDS
            over("checkpoint_bytes", usage.checkpoint_bytes, cost.checkpoint_bytes, min(retry, STORAGE_RETRY_SECONDS))
