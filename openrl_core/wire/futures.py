"""Future routes beyond retrieve_future: a sampling session's completion feed and cancel.

Shapes follow `tinker/types/futures_retrieve_request.py`, `future_completion.py` and
`internal_client_holder.py::_send_cancel_request` of the 0.38 SDK.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field

from openrl_core.wire.base import WireRequest, WireResponse

# A cloned SamplingClient numbers its samples from `clone_id * CLONE_SEQ_STRIDE`
# (`sampling_client.py`), so a sample's seq_id says which clone sent it.
CLONE_SEQ_STRIDE = 1_000_000_000


# A store position (or a cursor over them) is a 64-bit integer in every store.
MAX_POSITION = 2**63 - 1


class SamplingSessionTarget(WireRequest):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str
    cloned_sampler_id: int = Field(0, ge=0)


class FuturesRetrieveRequest(WireRequest):
    target: SamplingSessionTarget
    # The cursor of the previous answer: completions at or before it were already reported.
    prev_cursor: int = Field(0, ge=0, le=MAX_POSITION)
    # 0: answer at once (the SDK's ack-only poll); None or more: hold up to the long-poll window.
    timeout: Optional[float] = Field(None, ge=0)
    retrieved_request_ids: list[str] = Field(default_factory=list)


class FutureFinished(WireResponse):
    state: Literal["finished"] = "finished"
    request_id: str
    response_payload_uncompressed_size: Optional[int] = None


class FutureFailed(WireResponse):
    state: Literal["failed"] = "failed"
    request_id: str


class FuturesRetrieveResponse(WireResponse):
    completions: list[Union[FutureFinished, FutureFailed]]
    cursor: int


class CancelFutureRequest(WireRequest):
    request_id: str


class CancelFutureResponse(WireResponse):
    """The SDK ignores the body (any 2xx will do); it tells a person what happened."""

    request_id: str
    status: Literal["cancel_requested", "already_finished", "not_cancellable"]
