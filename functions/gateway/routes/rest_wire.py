"""Wire models of the REST family (runs, checkpoints, sessions, exports, copies).

Names and shapes are exactly the tinker SDK's (`tinker/types/checkpoint.py`,
`training_run.py`, `cursor.py`, `weights_info_response.py`, `copy_weights_request.py`,
`get_session_response.py`, `save_weights_external_request.py`), and so is the one
conversion from projection rows to them. The SDK validates responses strictly, so every
`user_metadata` leaves as `{str: str}`: a value that is not a string travels as its JSON.
(These belong with the other wire models in `openrl_core/wire/` once that package takes them.)
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal, Optional

from pydantic import Field

from eventing.store.projections import utc
from openrl_core.errors import InvalidRequest
from openrl_core.ids import CHECKPOINT_TYPE
from openrl_core.wire.base import WireRequest, WireResponse

# What the SDK documents for every ttl_seconds: 1 hour to 10 years.
MIN_TTL_SECONDS = 3600
MAX_TTL_SECONDS = 10 * 366 * 24 * 3600


class Cursor(WireResponse):
    offset: int
    limit: int
    total_count: int


class Checkpoint(WireResponse):
    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler", "external"]
    time: datetime
    tinker_path: str
    size_bytes: Optional[int] = None
    public: bool = False
    user_metadata: Optional[dict[str, str]] = None
    expires_at: Optional[datetime] = None


class CheckpointsListResponse(WireResponse):
    checkpoints: list[Checkpoint]
    cursor: Optional[Cursor] = None


class TrainingRun(WireResponse):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool = False
    lora_rank: Optional[int] = None
    last_request_time: datetime
    last_checkpoint: Optional[Checkpoint] = None
    last_sampler_checkpoint: Optional[Checkpoint] = None
    user_metadata: Optional[dict[str, str]] = None


class TrainingRunsResponse(WireResponse):
    training_runs: list[TrainingRun]
    cursor: Cursor


class WeightsInfoRequest(WireRequest):
    tinker_path: str


class WeightsInfoResponse(WireResponse):
    base_model: str
    optimizer_config: dict[str, Any] = Field(default_factory=lambda: {"type": "adamw"})
    is_lora: bool
    lora_rank: Optional[int] = None
    train_unembed: Optional[bool] = None
    train_mlp: Optional[bool] = None
    train_attn: Optional[bool] = None


class TtlRequest(WireRequest):
    ttl_seconds: Optional[int] = None


class SaveWeightsExternalRequest(WireRequest):
    model_id: str
    path: Optional[str] = None
    seq_id: Optional[int] = Field(None, ge=1)
    ttl_seconds: Optional[int] = Field(None, ge=1)
    age_encryption_recipients: Optional[list[str]] = None


class ExternalWeightsUrlsResponse(WireResponse):
    urls: dict[str, str]
    expires: datetime


class CopyWeightsRequest(WireRequest):
    source_path: str
    session_id: Optional[str] = None
    model_seq_id: Optional[int] = Field(None, ge=0)
    destination_project_id: Optional[str] = None
    ttl_seconds: Optional[int] = None
    weights_access_token: Optional[str] = None


class CopyWeightsResponse(WireResponse):
    tinker_path: str


class ListSessionsResponse(WireResponse):
    sessions: list[str]


class GetSessionResponse(WireResponse):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: Optional[dict[str, str]] = None
    display_name: Optional[str] = None


def string_metadata(metadata: Optional[dict[str, Any]]) -> Optional[dict[str, str]]:
    if metadata is None:
        return None
    return {str(k): v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in metadata.items()}


def checkpoint_of(row) -> Checkpoint:
    """A checkpoints-table row as the SDK's Checkpoint."""
    return Checkpoint(
        checkpoint_id=row.checkpoint_id,
        checkpoint_type=CHECKPOINT_TYPE[row.kind],
        time=utc(row.created_at),
        tinker_path=row.tinker_path,
        size_bytes=row.size_bytes,
        public=bool(row.public),
        user_metadata=string_metadata(row.user_metadata),
        expires_at=utc(row.expires_at),
    )


def cursor(offset: int, limit: int, total: int) -> Cursor:
    return Cursor(offset=offset, limit=limit, total_count=total)


def check_ttl(ttl_seconds: Optional[int]) -> Optional[int]:
    if ttl_seconds is not None and not MIN_TTL_SECONDS <= ttl_seconds <= MAX_TTL_SECONDS:
        raise InvalidRequest(
            f"ttl_seconds must be between {MIN_TTL_SECONDS} (1 hour) and {MAX_TTL_SECONDS} (10 years), got {ttl_seconds}"
        )
    return ttl_seconds


MAX_PAGE = 1000
# An offset past any table; larger ones overflow the databases' 64-bit integers (a 500).
MAX_OFFSET = 2**31 - 1


def check_page(limit: int, offset: int) -> None:
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequest(f"limit must be between 1 and {MAX_PAGE}, got {limit}")
    if offset < 0:
        raise InvalidRequest(f"offset must not be negative, got {offset}")
    if offset > MAX_OFFSET:
        raise InvalidRequest(f"offset must be at most {MAX_OFFSET}, got {offset}")


def check_scope(access_scope: str) -> None:
    """Both scopes read the caller's own objects: this server shares nothing across tenants."""
    if access_scope not in ("owned", "accessible"):
        raise InvalidRequest(f"access_scope must be 'owned' or 'accessible', got {access_scope!r}")
