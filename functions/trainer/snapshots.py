"""Automatic snapshots of a model's training state, written off the training thread.

Every N optim_steps the worker copies the adapter and optimizer (the only part that holds
training up) and hands the copy here. A background thread encodes it, puts the files in
the blob store, then atomically replaces the model's pointer file, and only then reports
the snapshot durable, so the worker may commit log offsets past the events it covers.
A replacement trainer reads the pointer (`latest`) to restore the model, then the log
redelivers the events after it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import tempfile
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

from eventing.blobs import NO_ROOM, BlobStore, storage_full
from openrl_core.events.recovery import SnapshotTaken
from openrl_core.params import LoraConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotJob:
    tenant: str
    model_id: str
    session_id: str
    base_model: str
    lora_config: LoraConfig
    next_seq: int
    encode: Callable[[], dict[str, bytes]]
    full_finetune: bool = False


class SnapshotStore:
    """Latest-snapshot pointers, one small JSON file per model, next to the blob store."""

    def __init__(self, root: Path, blobs: BlobStore) -> None:
        self.root = Path(root)
        self.blobs = blobs

    def _pointer(self, tenant: str, model_id: str) -> Path:
        return self.root / tenant / (hashlib.sha256(model_id.encode()).hexdigest()[:32] + ".json")

    def write(self, tenant: str, snapshot: SnapshotTaken) -> None:
        path = self._pointer(tenant, snapshot.model_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        except OSError as exc:
            raise (storage_full(exc, "a snapshot pointer") if exc.errno in NO_ROOM else exc) from None
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(snapshot.model_dump_json())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException as exc:  # the previous pointer stays; no half-written file is left
            if os.path.exists(tmp):
                os.unlink(tmp)
            if isinstance(exc, OSError) and exc.errno in NO_ROOM:
                raise storage_full(exc, "a snapshot pointer") from None
            raise

    def latest(self, tenant: str, model_id: str) -> Optional[SnapshotTaken]:
        path = self._pointer(tenant, model_id)
        if not path.exists():
            return None
        snapshot = SnapshotTaken.model_validate_json(path.read_text())
        return snapshot if snapshot.model_id == model_id else None

    def files(self, tenant: str, snapshot: SnapshotTaken) -> dict[str, bytes]:
        return {name: self.blobs.get(tenant, ref) for name, ref in snapshot.files.items()}

    def referenced(self, tenant: str) -> set[str]:
        """Digests of the files the tenant's latest snapshots hold: all recovery needs (older
        snapshots' files are left to the blob collector). A pointer being replaced is read
        as either its old or its new content (`write` renames), both whole."""
        digests: set[str] = set()
        folder = self.root / tenant
        if not folder.is_dir():
            return digests
        for path in folder.glob("*.json"):
            try:
                snapshot = SnapshotTaken.model_validate_json(path.read_text())
            except FileNotFoundError:
                continue
            digests.update(ref.sha256 for ref in snapshot.files.values())
        return digests


class Snapshotter:
    """One background writer; `durable()` hands finished snapshots back to the worker thread."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self._jobs: queue.Queue[Optional[SnapshotJob]] = queue.Queue()
        self._done: queue.Queue[tuple[str, SnapshotTaken]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="snapshots", daemon=True)
        self._thread.start()

    def submit(self, job: SnapshotJob) -> None:
        self._jobs.put(job)

    def durable(self) -> list[tuple[str, SnapshotTaken]]:
        finished = []
        while True:
            try:
                finished.append(self._done.get_nowait())
            except queue.Empty:
                return finished

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every submitted snapshot is written (tests, shutdown)."""
        marker = threading.Event()
        self._jobs.put(SnapshotJob("", "", "", "", LoraConfig(rank=1), 0, lambda: (marker.set(), {})[1]))
        marker.wait(timeout)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if not job.tenant:
                job.encode()
                continue
            try:
                files = {name: self.store.blobs.put(job.tenant, data) for name, data in job.encode().items()}
                snapshot = SnapshotTaken(
                    model_id=job.model_id,
                    session_id=job.session_id,
                    base_model=job.base_model,
                    lora_config=job.lora_config,
                    full_finetune=job.full_finetune,
                    next_seq=job.next_seq,
                    files=files,
                    taken_at=datetime.now(timezone.utc),
                )
                self.store.write(job.tenant, snapshot)
                self._done.put((job.tenant, snapshot))
            except Exception:  # a failed snapshot only delays the next commit; training goes on
                log.exception("snapshot of %s failed", job.model_id)
