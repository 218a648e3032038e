"""Training events: one model's requests, keyed by model id so they stay in order.

Every payload carries the `request_id` of the future it resolves and, except create_model,
the SDK's `seq_id`: the trainer applies a model's events strictly in seq_id order.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from openrl_core.datum import DatumRecord
from openrl_core.events.base import Payload, event_type, register
from openrl_core.events.lifecycle import BlobRef, register_lifecycle
from openrl_core.events.recovery import SnapshotTaken
from openrl_core.params import AdamParams, DimuonParams, LoraConfig

FAMILY = "training"


class CreateModelRequested(Payload):
    request_id: str
    session_id: str
    model_id: str
    model_seq_id: int
    base_model: str
    lora_config: LoraConfig
    user_metadata: Optional[dict[str, Any]] = None
    optimizer_config: dict[str, Any] = Field(default_factory=lambda: {"type": "adamw"})
    # Every weight trains (its own float32 copy); lora_config is then only what the SDK sent.
    full_finetune: bool = False


class ForwardBackwardRequested(Payload):
    request_id: str
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float] = Field(default_factory=dict)
    forward_only: bool = False
    data: list[DatumRecord]


class OptimStepRequested(Payload):
    request_id: str
    model_id: str
    seq_id: int
    adam_params: AdamParams
    # Set for a model created with the Dimuon optimizer; adam_params is then unused.
    dimuon_params: Optional[DimuonParams] = None

    @property
    def params(self) -> AdamParams | DimuonParams:
        return self.dimuon_params or self.adam_params


class SaveWeightsRequested(Payload):
    request_id: str
    model_id: str
    seq_id: int
    name: str
    ttl_seconds: Optional[int] = None
    overwrite: bool = False
    user_metadata: Optional[dict[str, Any]] = None


class SaveWeightsForSamplerRequested(Payload):
    request_id: str
    model_id: str
    seq_id: int
    # Named save: a sampler checkpoint. Unnamed: a new sampling session bound to the weights.
    name: Optional[str] = None
    sampling_session_id: Optional[str] = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    ttl_seconds: Optional[int] = None
    user_metadata: Optional[dict[str, Any]] = None


class SaveWeightsExternalRequested(Payload):
    """Export the adapter as plain PEFT files (an `external_weights/<name>` checkpoint)."""

    request_id: str
    model_id: str
    seq_id: int
    name: str
    ttl_seconds: Optional[int] = None
    # age recipients (checked by the gateway); every file is stored encrypted to them as `<name>.age`.
    age_encryption_recipients: Optional[list[str]] = None


class LoadWeightsRequested(Payload):
    request_id: str
    model_id: str
    # None: create-via-load, the model's first event; else an in-place load at that seq_id.
    seq_id: Optional[int] = None
    path: str
    files: dict[str, BlobRef]
    with_optimizer: bool
    # Set for create-via-load: the model to create before loading.
    session_id: Optional[str] = None
    base_model: Optional[str] = None
    lora_config: Optional[LoraConfig] = None
    user_metadata: Optional[dict[str, Any]] = None
    full_finetune: bool = False
    # Create-via-load without the checkpoint's optimizer state: the optimizer to start with.
    optimizer_config: Optional[dict[str, Any]] = None


class RunCancelled(Payload):
    """The run was cancelled (by its owner or an operator): its unfinished futures fail, its
    sampling sessions close, the trainer drops its state, and the gateway refuses any later
    request for it. Keyed by model id on the run's training topic, so the trainer sees it
    after every request of the run sent before it."""

    model_id: str
    reason: str = "cancelled"
    by: Literal["owner", "operator"] = "owner"


class Replayed(Payload):
    """A logged request carried inside another event: its type and its payload as stored."""

    type: str
    data: dict[str, Any]


class ForkRequested(Payload):
    """A new run (`model_id`, in a session of its own) whose weights and optimizer state are
    `parent_id`'s right after its `step`-th completed optim_step (seq_id `parent_seq_id`).

    The gateway resolved the history, so the event says how to rebuild it on its own:
    restore `snapshot` (the parent's latest at or before the step) or else start as
    `origin` (the parent's creation: create_model, create-via-load, or its own fork), then
    re-apply `replay` in order. The trainer then saves the state, with the optimizer, as
    the fork's `weights/<checkpoint_name>` checkpoint. Keyed by the fork's id on its
    training topic, like create_model; the record of the fork (parent and step) that the
    projections and replay read.
    """

    request_id: str
    model_id: str
    session_id: str
    parent_id: str
    step: int = Field(ge=0)
    parent_seq_id: int = Field(ge=0)
    base_model: str
    lora_config: LoraConfig  # the parent's; a placeholder for full fine-tuning
    full_finetune: bool = False
    user_metadata: Optional[dict[str, Any]] = None
    project_id: Optional[str] = None
    snapshot: Optional[SnapshotTaken] = None
    snapshot_step: int = 0
    origin: Optional[Replayed] = None  # set when there is no snapshot
    replay: list[Replayed] = Field(default_factory=list)
    checkpoint_name: str


class SeqSkipped(Payload):
    """The gateway refused this seq_id; the trainer must not wait for it."""

    model_id: str
    seq_id: int
    reason: str


CREATE_MODEL = register_lifecycle(FAMILY, "create_model", CreateModelRequested)
FORWARD_BACKWARD = register_lifecycle(FAMILY, "forward_backward", ForwardBackwardRequested)
OPTIM_STEP = register_lifecycle(FAMILY, "optim_step", OptimStepRequested)
SAVE_WEIGHTS = register_lifecycle(FAMILY, "save_weights", SaveWeightsRequested)
SAVE_WEIGHTS_FOR_SAMPLER = register_lifecycle(FAMILY, "save_weights_for_sampler", SaveWeightsForSamplerRequested)
LOAD_WEIGHTS = register_lifecycle(FAMILY, "load_weights", LoadWeightsRequested)
SAVE_WEIGHTS_EXTERNAL = register_lifecycle(FAMILY, "save_weights_external", SaveWeightsExternalRequested)
# The fork's four phases: its completion carries the saved state's checkpoint.
FORK = register_lifecycle(FAMILY, "fork", ForkRequested)
SEQ_SKIPPED = register(event_type(FAMILY, "seq", "skipped"), SeqSkipped)
RUN_CANCELLED = register(event_type(FAMILY, "run", "cancelled"), RunCancelled)

SEQUENCED_REQUESTS = {
    FORWARD_BACKWARD["requested"],
    OPTIM_STEP["requested"],
    SAVE_WEIGHTS["requested"],
    SAVE_WEIGHTS_FOR_SAMPLER["requested"],
    LOAD_WEIGHTS["requested"],
    SAVE_WEIGHTS_EXTERNAL["requested"],
}
