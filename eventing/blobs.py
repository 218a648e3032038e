"""Content-addressed blob store on a local (or shared) filesystem, one tree per tenant.

Blobs hold what is too large for an event: batches, results, adapters, optimizer state.
A blob's name is its SHA-256, so writing the same bytes twice is free and a reference can
never point at changed content; reads verify the hash. Writes go to a temporary file that
is renamed into place, so a reader never sees half a blob; a write the disk has no room
for (ENOSPC, or EDQUOT over a quota) leaves nothing behind and raises `StorageFull`, whose
message says so without naming server paths.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
from pathlib import Path

from openrl_core.errors import NotFound, ServerError, StorageFull
from openrl_core.events.lifecycle import BlobRef
from openrl_core.ids import check_tenant_name

NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def storage_full(exc: OSError, what: str) -> StorageFull:
    reason = "over its quota" if exc.errno == errno.EDQUOT else "full"
    return StorageFull(f"the data disk is {reason}: {what} could not be stored (nothing was kept); retry once space is freed")


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def put(self, tenant: str, data: bytes) -> BlobRef:
        digest = hashlib.sha256(data).hexdigest()
        path = self._path(tenant, digest)
        if not path.exists():
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

    def _path(self, tenant: str, digest: str) -> Path:
        check_tenant_name(tenant)
        return self.root / tenant / digest[:2] / digest
