"""Wire models of the AdminClient's answers: the audit log, billing usage, current storage.

Names and shapes as `tinker.types.AuditLogResponse`, `BillingUsageResponse` and
`CurrentCheckpointStorageUsageResponse` (SDK 0.38) have them. Every cost and rate is None
here, on purpose: a self-hosted server prices nothing (`openrl_core.billing`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field

from openrl_core.wire.base import WireResponse


class AuditLogEntry(WireResponse):
    timestamp: datetime
    event: str  # `<resource>_<action>` (openrl_core.audit_log)
    event_details: dict[str, Any] = {}
    model_id: Optional[str] = None
    tinker_path: Optional[str] = None
    purpose: Optional[str] = None


class AuditLogResponse(WireResponse):
    entries: list[AuditLogEntry]


class TrainingBillingEvent(WireResponse):
    type: Literal["training"] = "training"
    token_count: int


class SamplingPrefillBillingEvent(WireResponse):
    type: Literal["sampling_prefill"] = "sampling_prefill"
    cached: bool
    token_count: int


class SamplingSampleBillingEvent(WireResponse):
    type: Literal["sampling_sample"] = "sampling_sample"
    token_count: int


class CheckpointBillingEvent(WireResponse):
    type: Literal["checkpoint"] = "checkpoint"
    count: int


class StorageBillingEvent(WireResponse):
    type: Literal["storage"] = "storage"
    free: bool = False
    gigabyte_hours: float


BillingEventInfo = Annotated[
    Union[
        TrainingBillingEvent,
        SamplingPrefillBillingEvent,
        SamplingSampleBillingEvent,
        CheckpointBillingEvent,
        StorageBillingEvent,
    ],
    Field(discriminator="type"),
]


class BillingUsageEvent(WireResponse):
    bucket_start: datetime
    bucket_end: datetime
    base_model: Optional[str] = None
    user_id: Optional[str] = None
    user_name: Optional[str] = None
    session_id: Optional[str] = None
    project_id: Optional[str] = None
    estimated_cost_usd: Optional[float] = None
    effective_rate_usd_per_million_tokens: Optional[float] = None
    effective_rate_usd_per_gigabyte_month: Optional[float] = None
    event_info: BillingEventInfo


class BillingUsageSession(WireResponse):
    user_metadata: Optional[dict[str, str]] = None


class BillingUsageResponse(WireResponse):
    data: list[BillingUsageEvent]
    sessions: dict[str, BillingUsageSession] = {}
    cost_data_through: Optional[datetime] = None


class CurrentCheckpointStorageUsageItem(WireResponse):
    project_id: Optional[str] = None
    org_user_urn: Optional[str] = None
    user_email: Optional[str] = None
    user_name: Optional[str] = None
    checkpoint_count: int
    size_bytes: int
    size_gigabytes: float
    estimated_monthly_cost_usd: Optional[float] = None


class CurrentCheckpointStorageUsageResponse(WireResponse):
    effective_rate_usd_per_gigabyte_month: Optional[float] = None
    data: list[CurrentCheckpointStorageUsageItem]
