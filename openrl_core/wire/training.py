"""Training routes: create_model, get_info, optim_step, saves and loads.

forward_backward arrives as protobuf and is decoded in the gateway (`functions/gateway/proto.py`).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from openrl_core.params import AdamParams, LoraConfig
from openrl_core.wire.base import JsonObject, WireRequest, WireResponse


class CreateModelRequest(WireRequest):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    lora_config: Optional[LoraConfig] = None
    user_metadata: Optional[JsonObject] = None
    optimizer_config: Optional[JsonObject] = None


class GetInfoRequest(WireRequest):
    model_id: str


class ModelData(WireResponse):
    arch: Optional[str] = None
    model_name: str
    tokenizer_id: Optional[str] = None


class GetInfoResponse(WireResponse):
    type: Literal["get_info"] = "get_info"
    model_data: ModelData
    model_id: str
    is_lora: Optional[bool] = None
    lora_rank: Optional[int] = None
    model_name: Optional[str] = None
    optimizer_config: dict[str, Any] = Field(default_factory=lambda: {"type": "adamw"})


class OptimStepRequest(WireRequest):
    model_id: str
    seq_id: int = Field(ge=1)
    adam_params: Optional[AdamParams] = None
    optimizer_params: Optional[JsonObject] = None


class SaveWeightsRequest(WireRequest):
    model_id: str
    seq_id: int = Field(ge=1)
    path: Optional[str] = None
    ttl_seconds: Optional[int] = Field(None, ge=1)
    overwrite: bool = False
    user_metadata: Optional[JsonObject] = None


class SaveWeightsForSamplerRequest(WireRequest):
    model_id: str
    seq_id: int = Field(ge=1)
    path: Optional[str] = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    sampling_session_seq_id: Optional[int] = Field(None, ge=0)
    ttl_seconds: Optional[int] = Field(None, ge=1)
    user_metadata: Optional[JsonObject] = None


class LoadWeightsRequest(WireRequest):
    path: str
    optimizer: bool = False
    # In-place (legacy) addressing.
    model_id: Optional[str] = None
    seq_id: Optional[int] = Field(None, ge=1)
    # Create-via-load addressing.
    session_id: Optional[str] = None
    model_seq_id: Optional[int] = Field(None, ge=0)
    base_model: Optional[str] = None
    user_metadata: Optional[JsonObject] = None
    optimizer_config: Optional[JsonObject] = None
    weights_access_token: Optional[str] = None
