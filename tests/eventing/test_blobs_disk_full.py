"""The blob store and the snapshot pointers on a full disk (a real size-limited tmpfs, see
tests/small_disk.py): a clear `StorageFull` (507) error, no half-written or temporary file
left behind, every blob that exists still reads back whole, and the previous snapshot
pointer still names a complete snapshot."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

import pytest

from eventing.blobs import BlobStore
from functions.trainer.snapshots import SnapshotStore
from openrl_core.errors import StorageFull
from openrl_core.events.recovery import SnapshotTaken
from openrl_core.params import LoraConfig
from tests.small_disk import fill, small_disk


def all_files(root):
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != "filler")


def snapshot(blobs: BlobStore, next_seq: int, data: bytes) -> SnapshotTaken:
    return SnapshotTaken(
        model_id="m", session_id="s", base_model="openrl/tiny-qwen3", lora_config=LoraConfig(rank=4),
        next_seq=next_seq, files={"adapter": blobs.put("alice", data)}, taken_at=datetime.now(timezone.utc),
    )  # fmt: skip


def test_a_full_disk_is_a_clear_error_and_leaves_no_partial_blob_or_pointer(tmp_path):
    with small_disk(tmp_path / "disk", "512k") as disk:
        blobs = BlobStore(disk / "blobs")
        pointers = SnapshotStore(disk / "snapshots", blobs)
        kept = snapshot(blobs, 3, b"first adapter")
        pointers.write("alice", kept)
        fill(disk)

        with pytest.raises(StorageFull) as refused:
            blobs.put("alice", b"x" * 200_000)
        assert refused.value.http_status == 507 and "data disk is full" in refused.value.detail
        assert str(disk) not in refused.value.detail  # no server path in what a tenant reads
        with pytest.raises(StorageFull):
            pointers.write("alice", kept.model_copy(update={"next_seq": 5}))

        assert not [p for p in all_files(disk) if p.name.startswith(".tmp-")]
        for path in all_files(disk / "blobs"):  # every blob there is whole: its name is its hash
            assert hashlib.sha256(path.read_bytes()).hexdigest() == path.name
        latest = pointers.latest("alice", "m")
        assert latest == kept and pointers.files("alice", latest) == {"adapter": b"first adapter"}

        (disk / "filler").unlink()  # space again: the same write succeeds
        ref = blobs.put("alice", b"x" * 200_000)
        assert blobs.get("alice", ref) == b"x" * 200_000
