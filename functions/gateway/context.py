"""Everything a gateway request handler needs, built once per process.

`emit` is the gateway's only way to change state: append the event (with its dedup key)
to the store, then put it on the log, then clear its outbox row (`eventing.appender`, which
group-commits concurrent requests' events). If the process dies in between,
`republish_outbox` on the next start finishes the job.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any, Optional

from eventing import topics
from eventing.appender import Appender
from eventing.bus import EventPublisher
from eventing.store.event_store import Appended, Dedup, EventStore
from eventing.store.queries import Projections
from functions.compute.models import ModelDirectory
from functions.gateway.offload import Offload
from functions.gateway.quotas import Admission
from functions.gateway.waiters import FutureWaiters
from openrl_core.events import Event
from openrl_core.settings import Settings

SOURCE = "/openrl/gateway"


@dataclass
class GatewayContext:
    settings: Settings
    store: EventStore
    projections: Projections
    publisher: EventPublisher
    models: ModelDirectory
    waiters: FutureWaiters = field(default_factory=FutureWaiters)
    admission: Admission = field(default_factory=Admission)  # per-tenant quota locks (functions/gateway/quotas.py)
    key_tenants: dict[str, str] = field(default_factory=dict)  # sha256(key) -> tenant
    operator_key_hash: Optional[str] = None  # sha256 of settings.operator_api_key
    # The store's wake-up channel (LISTEN/NOTIFY on PostgreSQL): reaches every gateway replica.
    notifier: Optional[Any] = None
    appender: Appender = field(init=False)
    blocking: Offload = field(init=False)  # `await ctx.blocking(fn, *args)`: fn in a gateway thread

    def __post_init__(self) -> None:
        self.appender = Appender(self.store, self.publisher)
        self.blocking = Offload(self.settings.gateway_threads)

    @classmethod
    def hash_key(cls, api_key: str) -> str:
        return hashlib.sha256(api_key.encode()).hexdigest()

    def tenant_for_key(self, api_key: str) -> Optional[str]:
        """The tenant of an API key, or None. The key's digest is compared with every
        configured digest, each in constant time and without stopping at a match, so how long
        the answer takes says nothing about which key, or how much of one, was right."""
        digest = self.hash_key(api_key)
        tenant = None
        for known, owner in self.key_tenants.items():
            if hmac.compare_digest(known, digest):
                tenant = owner
        return tenant

    def emit(self, event: Event, topic: Optional[str] = None, dedup: Optional[Dedup] = None) -> Appended:
        """Store, then publish: to `topic` when a worker must act, else to the tenant's
        control stream, so the log carries every event (audit, metrics and replay read it)."""
        return self.appender.append(event, topic or topics.topic(event.tenant, "control"), dedup)

    def announce(self, ids: list[str]) -> None:
        """Wake the long-polls watching these ids in every gateway replica: this one at once,
        the others through the notifier (a retrieve_futures held on another replica must hear
        of a sample submitted here, or it notices only when its long-poll window ends)."""
        self.waiters.notify(ids)
        if self.notifier is not None:
            self.notifier.notify(ids)

    def close(self) -> None:
        """Write what the appender holds queued, then let the threads go."""
        self.appender.close()
        self.blocking.close()

    def republish_outbox(self) -> int:
        return self.appender.republish_outbox()
