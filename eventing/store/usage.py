"""A tenant's quota usage, read from the projections (never from one process's memory).

Why the store and not an in-memory counter: every gateway replica shares the store, so each
sees the usage the others admitted; a restarted gateway has nothing to rebuild; and a
future moves to a terminal state in the same transaction that stores its completion, so
"in flight" is exactly the futures whose completion is not yet stored. The reads stay
cheap because each is bounded by the limit it checks: the unfinished futures of a tenant
(index on tenant, state) number at most its in-flight limit, its futures of the last minute
(index on tenant, created_at) at most what its sampling rate admits, and its live
checkpoints at most what its storage limit holds. Only the limits set for the tenant are
read, so a tenant without limits costs no query at all.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import func, or_, select
from sqlalchemy.engine import Engine

from eventing.store import tables as t
from eventing.store.projections import utc
from openrl_core.futures import TERMINAL, FutureState
from openrl_core.quotas import WINDOW_SECONDS, Quotas, Usage

UNFINISHED = [state.value for state in FutureState if state not in TERMINAL]
TRAINING_KINDS = ("forward_backward",)  # /forward is a forward_backward with forward_only set
SAMPLING_KINDS = ("sample",)


def tenant_usage(engine: Engine, tenant: str, limits: Quotas, now: datetime) -> Usage:
    futures, checkpoints = t.futures.c, t.checkpoints.c
    in_flight = queued = stored = 0
    window: list[tuple[float, int]] = []
    next_expiry = None
    with engine.connect() as conn:
        if limits.requests_in_flight is not None or limits.queued_training_tokens is not None:
            rows = conn.execute(
                select(futures.kind, func.count(), func.coalesce(func.sum(futures.tokens), 0))
                .where(futures.tenant == tenant, futures.state.in_(UNFINISHED))
                .group_by(futures.kind)
            ).all()
            in_flight = sum(int(count) for _kind, count, _tokens in rows)
            queued = sum(int(tokens) for kind, _count, tokens in rows if kind in TRAINING_KINDS)
        if limits.sampling_tokens_per_minute is not None:
            since = now - timedelta(seconds=WINDOW_SECONDS)
            rows = conn.execute(
                select(futures.created_at, futures.tokens).where(
                    futures.tenant == tenant, futures.created_at > since, futures.kind.in_(SAMPLING_KINDS)
                )
            ).all()
            window = [(utc(at).timestamp(), int(tokens or 0)) for at, tokens in rows]
        if limits.checkpoint_bytes is not None:
            live = or_(checkpoints.expires_at.is_(None), checkpoints.expires_at > now)
            total, earliest = conn.execute(
                select(func.coalesce(func.sum(checkpoints.size_bytes), 0), func.min(checkpoints.expires_at)).where(
                    checkpoints.tenant == tenant, live
                )
            ).one()
            stored = int(total)
            next_expiry = utc(earliest).timestamp() if earliest is not None else None
    return Usage(
        requests_in_flight=in_flight,
        queued_training_tokens=queued,
        sampling_window=window,
        checkpoint_bytes=stored,
        next_checkpoint_expiry=next_expiry,
    )
