"""Sampling routes: sampling sessions and asample."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import ConfigDict, Field

from openrl_core.params import SamplingParams
from openrl_core.wire.base import JsonObject, WireRequest, WireResponse


class CreateSamplingSessionRequest(WireRequest):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: Optional[str] = None
    model_path: Optional[str] = None


class CreateSamplingSessionResponse(WireResponse):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str


class GetSamplerResponse(WireResponse):
    sampler_id: str
    base_model: str
    model_path: Optional[str] = None


def _text_chunk(schema: dict[str, Any]) -> None:
    """What the gateway serves, for its OpenAPI description: text chunks, with their tokens
    (the SDK's other chunk types are refused by the routes with a 400)."""
    schema["properties"]["type"] = {"const": "encoded_text", "default": "encoded_text"}
    schema["properties"]["tokens"] = {"type": "array", "items": {"type": "integer"}}
    schema["required"] = ["tokens"]


class PromptChunk(WireRequest):
    model_config = ConfigDict(extra="ignore", frozen=True, json_schema_extra=_text_chunk)

    type: str = "encoded_text"
    tokens: Optional[list[int]] = None


class ModelInput(WireRequest):
    chunks: list[PromptChunk]


class SampleRequest(WireRequest):
    sampling_session_id: Optional[str] = None
    seq_id: Optional[int] = None
    num_samples: int = 1
    prompt: ModelInput
    sampling_params: SamplingParams
    prompt_logprobs: Optional[bool] = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: Optional[int] = None
    target_prompt_logprobs: Optional[JsonObject] = None
    record_stability_info: bool = False
    base_model: Optional[str] = None
    model_path: Optional[str] = None
