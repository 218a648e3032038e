"""OpenAI wire models: the request bodies of `/v1/completions` and `/v1/chat/completions`,
the error body, and the response and chunk shapes, with OpenAI's names.

Requests are strict, as OpenAI's own API is: an argument it does not know, or a value of the
wrong type, is a 400 that names it (OpenAI answers "Unrecognized request argument
supplied"), never silently ignored. Arguments OpenAI has and this server does not honour
(penalties, logit_bias, tools, echo, suffix, best_of > 1) are accepted only at their neutral
value and otherwise refused by `unsupported`, so a client never gets an answer that quietly
differs from what it asked for.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from openrl_core.errors import NotFound

PREFIX = "/v1/"  # under it, errors leave in OpenAI's shape and keys come as Bearer

# OpenAI's own limits for these arguments.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
MAX_STOP_SEQUENCES = 4


def _integral(value: Any) -> Any:
    """14.0 is the integer 14 in JSON (and in JSON Schema); strict mode alone would refuse it."""
    if isinstance(value, list):
        return [_integral(item) for item in value]
    return int(value) if isinstance(value, float) and value.is_integer() else value


INTEGER_FIELDS = ("max_tokens", "n", "seed", "logprobs", "best_of", "max_completion_tokens", "top_logprobs", "prompt")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None


class SamplingArgs(_Strict):
    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    n: Optional[int] = Field(None, ge=1, le=128)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None  # an end-user id for abuse tracking; nothing to do with it here

    @field_validator(*INTEGER_FIELDS, mode="before", check_fields=False)
    @classmethod
    def _integral_numbers(cls, value: Any) -> Any:
        return _integral(value)

    def stop_strings(self) -> Optional[list[str]]:
        """None stops at end-of-sequence only; strings add to it (EOS always stops)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return stops or None

    def common_unsupported(self) -> list[str]:
        refused = []
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                refused.append(f"{name} (only 0)")
        if self.logit_bias:
            refused.append("logit_bias (only empty)")
        return refused


class CompletionRequest(SamplingArgs):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def unsupported(self) -> list[str]:
        refused = self.common_unsupported()
        if self.echo:
            refused.append("echo (only false)")
        if self.suffix:
            refused.append("suffix (only null)")
        if self.best_of not in (None, 1):
            refused.append("best_of (only 1)")
        return refused


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(SamplingArgs):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None

    def unsupported(self) -> list[str]:
        refused = self.common_unsupported()
        if self.tools:
            refused.append("tools (only none)")
        if self.tool_choice not in (None, "none", "auto"):
            refused.append("tool_choice (only 'none' or 'auto', and no tools)")
        return refused

    def token_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- errors ---------------------------------------------------------------------------------


class ModelNotFound(NotFound):
    """An unknown `model`: OpenAI's 404 with code `model_not_found`."""

    openai_code = "model_not_found"


def error_body(status: int, message: str, code: Optional[str] = None) -> dict[str, Any]:
    """OpenAI's error object; the official client picks its exception class by the status."""
    kind = "server_error" if status >= 500 else ("authentication_error" if status == 401 else "invalid_request_error")
    code = code or ("invalid_api_key" if status == 401 else None)
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


# -- responses ------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(texts: list[str], logprobs: list[float], pieces: list[str], offset: int) -> dict[str, Any]:
    """The legacy completions shape; `top_logprobs` holds only the sampled token."""
    offsets = []
    for piece in pieces:
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": texts,
        "token_logprobs": logprobs,
        "top_logprobs": [{text: logprob} for text, logprob in zip(texts, logprobs)],
        "text_offset": offsets,
    }


def chat_logprobs(texts: list[str], logprobs: list[float], top: int) -> dict[str, Any]:
    """The chat shape; `top_logprobs` holds the sampled token when any are asked for."""
    content = []
    for text, logprob in zip(texts, logprobs):
        entry = {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        content.append({**entry, "top_logprobs": [entry] if top > 0 else []})
    return {"content": content, "refusal": None}


def model_card(model_id: str, created: int, owned_by: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}
