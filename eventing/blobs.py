"""Content-addressed blob store on a local (or shared) filesystem, one tree per tenant.

Blobs hold what is too large for an event: batches, results, adapters, optimizer state.
A blob's name is its SHA-256, so writing the same bytes twice is free and a reference can
never point at changed content; reads verify the hash. Writes go to a temporary file that
is renamed into place, so a reader never sees half a blob; a write the disk has no room
for (ENOSPC, or EDQUOT over a quota) leaves nothing behind and raises `StorageFull`, whose
message says so without naming server paths.

Blobs nothing references are collected (`functions/collector`), but never one younger
than a grace period, by its modification time: so `put` of bytes already stored touches
the file, and a blob a writer has just (re)used is not swept before its record is stored.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

from openrl_core.errors import NotFound, ServerError, StorageFull
from openrl_core.events.lifecycle import BlobRef
from openrl_core.ids import check_tenant_name

NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def storage_full(exc: OSError, what: str) -> StorageFull:
    reason = "over its quota" if exc.errno == errno.EDQUOT else "full"
    return StorageFull(
        f"the data disk is {reason}: {what} could not be stored (nothing was kept); retry once space is freed"
    )


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def put(self, tenant: str, data: bytes) -> BlobRef:
        digest = hashlib.sha256(data).hexdigest()
        path = self._path(tenant, digest)
        try:
            os.utime(path)  # already stored: now counts as just written (see the docstring)
        except FileNotFoundError:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            except OSError as exc:
                raise (storage_full(exc, f"a blob of {len(data)} bytes") if exc.errno in NO_ROOM else exc) from None
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, path)
            except BaseException as exc:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                if isinstance(exc, OSError) and exc.errno in NO_ROOM:
                    raise storage_full(exc, f"a blob of {len(data)} bytes") from None
                raise
        return BlobRef(sha256=digest, size=len(data))

    def get(self, tenant: str, ref: BlobRef) -> bytes:
        path = self._path(tenant, ref.sha256)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise NotFound(f"blob {ref.sha256[:12]} not found") from None
        if hashlib.sha256(data).hexdigest() != ref.sha256:
            raise ServerError(f"blob {ref.sha256[:12]} is corrupted")
        return data

    def exists(self, tenant: str, ref: BlobRef) -> bool:
        return self._path(tenant, ref.sha256).exists()

    def delete(self, tenant: str, ref: BlobRef) -> None:
        self._path(tenant, ref.sha256).unlink(missing_ok=True)

    def delete_if_older(self, tenant: str, digest: str, before: float) -> bool:
        """Delete a blob last written before `before` (unix time); whether it was deleted."""
        path = self._path(tenant, digest)
        try:
            if path.stat().st_mtime > before:
                return False
            path.unlink()
        except FileNotFoundError:
            return False
        return True

    def tenants(self) -> list[str]:
        """Tenants that have a blob tree."""
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    def stored(self, tenant: str) -> Iterator[tuple[str, float]]:
        """(digest, modification time) of every blob of a tenant."""
        check_tenant_name(tenant)
        for shard in sorted((self.root / tenant).glob("??")):
            for path in shard.iterdir():
                if path.name.startswith(".tmp-"):
                    continue
                try:
                    yield path.name, path.stat().st_mtime
                except FileNotFoundError:  # deleted meanwhile
                    continue

    def remove_unfinished(self, tenant: str, before: float) -> int:
        """Delete temporary files of writes that died (last modified before `before`)."""
        check_tenant_name(tenant)
        removed = 0
        for path in (self.root / tenant).glob("??/.tmp-*"):
            try:
                if path.stat().st_mtime < before:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    def _path(self, tenant: str, digest: str) -> Path:
        check_tenant_name(tenant)
        return self.root / tenant / digest[:2] / digest
