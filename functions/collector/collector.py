"""Mark and sweep over the blob store, so that nothing on disk grows with every step.

A training loop writes blobs every step: adapters for `save_weights_for_sampler` (a new
sampler version per step), snapshots for recovery, full runs' published deltas. Each is
named by a record for a while, then superseded. One pass, per tenant:

1. mark: the digests that records still need (the rules are `openrl_core.retention`):
   checkpoint records' files; live sampling sessions' adapters, and for a full run's
   session its manifest and every file of the manifest's chain; the latest snapshot of
   every model (`pinned`); stored events' claim-checked payloads;
2. sweep: delete every other blob older than the grace period, and temporary files of
   writes that died.

The mark reads the records before listing the blobs, and the grace period covers a blob
written (or re-put, which touches it) after the records were read, so a pass never deletes
what a record made meanwhile names. It runs in the gateway's process (`openrl serve`,
`openrl gateway`), which holds the event store and the blob store, every
`blob_collector_seconds`; two gateways collecting at once delete the same files, harmlessly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from eventing.blobs import BlobStore
from eventing.store.queries import Projections
from functions.compute.weight_sync import session_files
from functions.periodic import Periodic
from openrl_core.retention import StoredBlob, collectable


@dataclass
class Pass:
    """What one pass did."""

    deleted: dict[str, list[str]] = field(default_factory=dict)  # tenant -> digests
    unfinished: int = 0  # temporary files of dead writes removed

    @property
    def count(self) -> int:
        return sum(len(d) for d in self.deleted.values())


class BlobCollector:
    def __init__(
        self,
        projections: Projections,
        blobs: BlobStore,
        keep_sampler_versions: int,
        grace_seconds: float,
        pinned: Sequence[Callable[[str], set[str]]] = (),
    ) -> None:
        """`pinned`: more sources of referenced digests per tenant, such as the trainer's
        latest snapshots (`SnapshotStore.referenced`), which live outside the event store."""
        self.projections = projections
        self.blobs = blobs
        self.pinned = tuple(pinned)
        self.keep_sampler_versions = keep_sampler_versions
        self.grace_seconds = grace_seconds

    def collect(self, now: Optional[float] = None) -> Pass:
        done = Pass()
        for tenant in self.blobs.tenants():
            started = time.time() if now is None else now
            referenced = self.referenced(tenant)
            stored = [StoredBlob(digest, started - mtime) for digest, mtime in self.blobs.stored(tenant)]
            doomed = collectable(stored, referenced, self.grace_seconds)
            # Re-checked at deletion: a put of the same bytes since the listing touched the file.
            deleted = [d for d in doomed if self.blobs.delete_if_older(tenant, d, before=started - self.grace_seconds)]
            if deleted:
                done.deleted[tenant] = deleted
            done.unfinished += self.blobs.remove_unfinished(tenant, before=started - max(self.grace_seconds, 3600))
        return done

    def referenced(self, tenant: str) -> set[str]:
        """The mark: every digest some record of the tenant still needs."""
        digests = self.projections.checkpoint_blobs(tenant) | self.projections.event_claims(tenant)
        for source in self.pinned:
            digests |= source(tenant)
        for row in self.projections.live_samplers(tenant, self.keep_sampler_versions):
            digests |= session_files(lambda ref: self.blobs.get(tenant, ref), row.adapter, row.weights)
        return digests


class CollectorLoop(Periodic):
    """Runs `collect` now and then every `interval_seconds` until `stop` is set."""

    def __init__(self, collector: BlobCollector, interval_seconds: float) -> None:
        self.collector = collector
        super().__init__("collector", self._collect, interval_seconds)

    def _collect(self) -> Optional[str]:
        done = self.collector.collect()
        if done.count or done.unfinished:
            return f"{done.count} unreferenced blob(s), {done.unfinished} unfinished write(s) removed"
        return None
