"""Recovery by replay: what a trainer remembers so that a replacement can rebuild its models.

A model's state is its latest durable snapshot plus the training events after it. The
worker therefore never commits a log offset past the oldest event some model still needs:
each slot keeps an *anchor*, the position of the first event its latest durable snapshot
does not cover (its create_model event before the first snapshot). When a snapshot is
durable the anchor moves past everything the snapshot covers. A replacement trainer,
resuming from the committed offsets, restores each model from its snapshot the first
time one of its events arrives; the seq gate then drops the events the snapshot already
reflects and applies the rest, in order, exactly once. On CPU the result is bitwise the
state an uninterrupted trainer would have.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from eventing.bus import Record
from functions.trainer.snapshots import SnapshotJob, SnapshotStore, Snapshotter
from openrl_core.events.recovery import SnapshotTaken
from openrl_core.params import LoraConfig
from openrl_core.seqgate import SeqGate

Position = tuple[str, int, int]  # topic, partition, offset


def position(record: Record) -> Position:
    return (record.topic, record.partition, record.offset)


@dataclass
class ModelSlot:
    tenant: str
    base_model: str
    session_id: str
    lora_config: Optional[LoraConfig] = None
    gate: SeqGate = field(default_factory=SeqGate)
    anchor: Optional[Position] = None  # first event the latest durable snapshot lacks
    pending_seq: Optional[int] = None  # seq_id of the optim_step a snapshot in flight covers
    since_pending: list[Position] = field(default_factory=list)
    steps_since_snapshot: int = 0
    full: bool = False  # a full fine-tuning run (its own weights), not a LoRA adapter
    # For releasing idle runs (`openrl_core.eviction`): when it last ran a request, and whether
    # it is at a clean point (no gradients accumulated since its last optim_step or weight load).
    last_active: float = field(default_factory=time.monotonic)
    clean: bool = True

    def applied(self, where: Position) -> None:
        if self.anchor is None:
            self.anchor = where
        if self.pending_seq is not None:
            self.since_pending.append(where)
        self.last_active = time.monotonic()

    @property
    def covered(self) -> bool:
        """Whether a durable snapshot holds every request this run applied (recovery on)."""
        return self.anchor is None and self.pending_seq is None


class Recovery:
    def __init__(self, store: Optional[SnapshotStore], every_steps: int) -> None:
        self.store = store
        self.every_steps = every_steps if store is not None else 0
        self.snapshotter = Snapshotter(store) if self.every_steps else None

    def after_optim_step(self, model_id: str, slot: ModelSlot, seq_id: int, copy_state: Callable) -> None:
        """Called right after the step at `seq_id` was applied, before anything later runs."""
        slot.steps_since_snapshot += 1
        if not self.every_steps or slot.steps_since_snapshot < self.every_steps or slot.pending_seq is not None:
            return
        self._submit(model_id, slot, seq_id, copy_state)

    def snapshot_now(self, model_id: str, slot: ModelSlot, copy_state: Callable) -> None:
        """A snapshot of everything the run applied so far, before it is released; the caller
        holds the run's state lock and checked that it is at a clean point (`slot.clean`)."""
        if self.snapshotter is None or slot.pending_seq is not None:
            return
        self._submit(model_id, slot, slot.gate.next_seq - 1, copy_state)

    def _submit(self, model_id: str, slot: ModelSlot, through_seq: int, copy_state: Callable) -> None:
        job = SnapshotJob(
            tenant=slot.tenant,
            model_id=model_id,
            session_id=slot.session_id,
            base_model=slot.base_model,
            lora_config=slot.lora_config or LoraConfig(rank=1),
            full_finetune=slot.full,
            next_seq=through_seq + 1,
            encode=copy_state(model_id),  # the copy happens here, on the training thread
        )
        slot.pending_seq, slot.since_pending, slot.steps_since_snapshot = through_seq, [], 0
        self.snapshotter.submit(job)

    def settle(self, slots: dict[str, ModelSlot]) -> list[tuple[str, SnapshotTaken]]:
        """Move anchors past what newly durable snapshots cover; returns those snapshots."""
        if self.snapshotter is None:
            return []
        settled = []
        for tenant, snapshot in self.snapshotter.durable():
            slot = slots.get(snapshot.model_id)
            if slot is None or slot.pending_seq != snapshot.next_seq - 1:
                continue
            slot.anchor = slot.since_pending[0] if slot.since_pending else None
            slot.pending_seq, slot.since_pending = None, []
            settled.append((tenant, snapshot))
        return settled

    def anchors(self, slots: dict[str, ModelSlot]) -> list[Position]:
        """Positions a restart must see again; none when recovery is off (nothing to rebuild from)."""
        if not self.every_steps:
            return []
        return [slot.anchor for slot in slots.values() if slot.anchor is not None]

    def latest(self, tenant: str, model_id: str) -> Optional[SnapshotTaken]:
        return self.store.latest(tenant, model_id) if self.store is not None else None

    def files(self, tenant: str, snapshot: SnapshotTaken) -> dict[str, bytes]:
        return self.store.files(tenant, snapshot)

    def close(self) -> None:
        if self.snapshotter is not None:
            self.snapshotter.drain()
            self.snapshotter.close()
