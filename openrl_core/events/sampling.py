"""Sampling events: independent requests, keyed by sampling session, in no required order."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from openrl_core.events.base import Payload, event_type, register
from openrl_core.events.lifecycle import BlobRef, register_lifecycle
from openrl_core.params import SamplingParams

FAMILY = "sampling"


class SamplingSessionCreated(Payload):
    sampling_session_id: str
    session_id: str
    sampling_session_seq_id: int
    base_model: str
    model_path: Optional[str] = None
    adapter: Optional[dict[str, BlobRef]] = None
    weights: Optional[BlobRef] = None  # a full run's published weights (their manifest)


class SampleRequested(Payload):
    request_id: str
    sampling_session_id: str
    seq_id: int
    base_model: str
    # The adapter's files, resolved by the gateway from the session, so a sampler needs no
    # database: it loads (and caches by content hash) whatever the event names.
    adapter: Optional[dict[str, BlobRef]] = None
    # A full fine-tuning run's weights instead: the manifest of their publication chain.
    weights: Optional[BlobRef] = None
    # The training run whose weights these are (None on a base model), so a sampler keeps
    # only a run's newest few versions loaded, as storage keeps only their files.
    run_id: Optional[str] = None
    prompt_tokens: list[int]
    num_samples: int = Field(ge=1)
    sampling_params: SamplingParams
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(0, ge=0)
    prompt_logprobs_last_n: Optional[int] = None
    # SDK 0.38's scoring fields, checked by the gateway (`openrl_core.prompt_targets`): top-k
    # at each sampled position, the request's target ids (its wire TensorData, kept in its
    # layout to answer in kind), k draws at each prompt position.
    topk_sample_logprobs: int = Field(0, ge=0)
    target_prompt_logprobs: Optional[dict[str, Any]] = None
    prompt_alt_tokens_k: int = Field(0, ge=0)
    sample_sequence_ids: list[str]
    # Keep StableReinforce's per-sequence records in the completion (openrl_core.stability).
    record_stability_info: bool = False


SAMPLING_SESSION_CREATED = register(event_type(FAMILY, "create_sampling_session", "completed"), SamplingSessionCreated)
SAMPLE = register_lifecycle(FAMILY, "sample", SampleRequested)


class SampleCancelRequested(Payload):
    """The client abandoned this sample. Only the sampler knows whether it has started, so the
    gateway asks; the request and its cancel share the sampling session's key (one partition),
    so the sampler always sees the request first."""

    request_id: str
    sampling_session_id: str


class SampleCancelled(Payload):
    """The sampler dropped a sample before running it: its future ends CANCELLED."""

    request_id: str
    reason: str = "cancelled by the client before it started"


SAMPLE_CANCEL_REQUESTED = register(event_type(FAMILY, "sample", "cancel_requested"), SampleCancelRequested)
SAMPLE_CANCELLED = register(event_type(FAMILY, "sample", "cancelled"), SampleCancelled)
