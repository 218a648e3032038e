"""Recovery events: the trainer's snapshots of a model's state.

A snapshot is taken right after an optim_step (no gradients pending), so it holds exactly
the adapter, the optimizer moments and the next seq_id to apply. A replacement trainer
restores the latest one and replays the model's training events after it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Optional

from openrl_core.events.base import Payload, event_type, register
from openrl_core.events.lifecycle import BlobRef
from openrl_core.params import LoraConfig


class SnapshotTaken(Payload):
    model_id: str
    session_id: str
    base_model: str
    lora_config: LoraConfig  # a placeholder for full fine-tuning runs
    full_finetune: bool = False
    next_seq: int  # the first seq_id not reflected in the snapshot
    files: dict[str, BlobRef]
    taken_at: datetime
    user_metadata: Optional[dict] = None


SNAPSHOT_TAKEN = register(event_type("training", "snapshot", "completed"), SnapshotTaken)
