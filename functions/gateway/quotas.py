"""Admission against the tenant's quotas: check the store's usage, then append, nothing between.

Every submission that makes a future passes here (`submit.submit`); so do checkpoint copies,
which add stored bytes. A refused submission raises `QuotaExceeded` (a 429 with Retry-After)
before anything is stored: no event, no dedup row, and so no consumed seq_id. That matters:
the SDK retries a 429 with the same seq_id (the training client holds its later requests
until this one is accepted; the sampling client loops on it), and the retry must be free to
succeed once capacity frees. A retry of a submission already stored is never refused: it
gets its first future back, as without quotas.

Usage comes from the projections (`eventing/store/usage.py`), shared by every replica. Within
one gateway process the check and the append run under the tenant's lock, so two concurrent
requests cannot both take the last slot (the OpenAI routes submit from a thread pool, the
Tinker routes from the event loop). Replicas do not share that lock: two of them admitting
for one tenant at the same instant can overshoot a limit by one request each; exactness
across replicas would need a store-side lock on every submission, which this trades away.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Iterator, Optional

from eventing.dedup import Dedup
from eventing.store.usage import tenant_usage
from openrl_core.events.sampling import SampleRequested
from openrl_core.events.training import (
    ForwardBackwardRequested,
    SaveWeightsExternalRequested,
    SaveWeightsForSamplerRequested,
    SaveWeightsRequested,
)
from openrl_core.quotas import Cost, QuotaExceeded, Usage, check, request_tokens

log = logging.getLogger(__name__)


class Admission:
    """One lock per tenant, held across a submission's check and append."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = defaultdict(threading.Lock)

    def lock(self, tenant: str) -> threading.Lock:
        with self._guard:
            return self._locks[tenant]


def cost_of(payload: object) -> Cost:
    """What a future-making request event costs: one request in flight, plus its tokens or
    the checkpoint it will save."""
    tokens = request_tokens(payload) or 0
    return Cost(
        requests=1,
        training_tokens=tokens if isinstance(payload, ForwardBackwardRequested) else 0,
        sampling_tokens=tokens if isinstance(payload, SampleRequested) else 0,
        saves_checkpoint=isinstance(payload, (SaveWeightsRequested, SaveWeightsExternalRequested))
        or (isinstance(payload, SaveWeightsForSamplerRequested) and payload.name is not None),
    )


def check_fits_at_all(ctx, tenant: str, cost: Cost) -> None:
    """Raise InvalidRequest (a 400, which for a training request consumes its seq_id like any
    refusal) when the request is bigger than one of the tenant's whole limits."""
    limits, overridden = ctx.settings.quotas(tenant)
    if limits.any:
        check(limits, Usage(), cost, datetime.now(timezone.utc).timestamp(), tenant=tenant, overridden=overridden)


def limited(ctx, tenant: str, cost: Optional[Cost]) -> bool:
    """Whether admitting `cost` needs the check (and so the tenant's lock) at all."""
    return cost is not None and ctx.settings.quotas(tenant)[0].any


@contextmanager
def admitted(ctx, tenant: str, cost: Optional[Cost], dedup: Optional[Dedup] = None) -> Iterator[None]:
    """Run the body (the append) only if `cost` fits the tenant's limits now; raise
    QuotaExceeded (429) or InvalidRequest (never fits) otherwise."""
    if not limited(ctx, tenant, cost) or (dedup is not None and ctx.store.submitted(tenant, dedup)):
        yield  # no limits, or a retry of a stored submission: it gets its first answer back
        return
    limits, overridden = ctx.settings.quotas(tenant)
    with ctx.admission.lock(tenant):
        now = datetime.now(timezone.utc)
        usage = tenant_usage(ctx.store.engine, tenant, limits, now)
        try:
            check(limits, usage, cost, now.timestamp(), tenant=tenant, overridden=overridden)
        except QuotaExceeded as refused:
            # The operator's view of who is being held back, and by which limit.
            log.info("quota: tenant %s refused (429, %s, retry after %d s)", tenant, refused.limit, refused.retry_after)
            raise
        yield
