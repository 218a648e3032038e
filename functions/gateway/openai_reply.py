"""OpenAI answers: a finished job's choices as one response object, or as a stream of chunks.

Both are built from the same `Completion` pieces, so a stream's text joins to exactly the
non-streamed text. A stream sends one chunk per sampled token (a token that only starts a
multi-byte character sends none unless logprobs are asked for), then one per choice with its
`finish_reason` (and, for chat, a first chunk with the role), an optional usage chunk, and
`data: [DONE]`. A sample that fails after the stream's status went out is reported as an
event carrying OpenAI's error object, which the official client raises.
"""

from __future__ import annotations

import json
import time
from typing import AsyncIterator, Awaitable, Optional

from fastapi.responses import StreamingResponse

from functions.gateway import openai_wire as wire
from functions.gateway.openai_text import Completion, TextCodec
from openrl_core.errors import OpenRLError


class Reply:
    """Renders a job's choices as one OpenAI response, or as its stream of chunks."""

    def __init__(
        self, request_id: str, model: str, codec: TextCodec, prompt_tokens: int, logprobs: Optional[int], chat: bool
    ) -> None:
        self.model, self.codec, self.prompt_tokens, self.logprobs, self.chat = (
            model,
            codec,
            prompt_tokens,
            logprobs,
            chat,
        )
        # The first sample's request id, so an answer can be found in the event log.
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id.removeprefix("req-")
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def usage(self, choices: list[Completion]) -> dict:
        return wire.usage(self.prompt_tokens, sum(c.sampled for c in choices))

    def _logprobs(self, choice: Completion, start: int, end: int, offset: int):
        if self.logprobs is None:
            return None
        tokens, lps, pieces = choice.tokens[start:end], choice.logprobs[start:end], choice.pieces[start:end]
        texts = [self.codec.decode([t]) for t in tokens]
        if self.chat:
            return wire.chat_logprobs(texts, lps, self.logprobs)
        return wire.completion_logprobs(texts, lps, pieces, offset)

    def whole(self, choices: list[Completion]) -> dict:
        rendered = []
        for index, choice in enumerate(choices):
            logprobs = self._logprobs(choice, 0, len(choice.tokens), 0)
            if self.chat:
                message = {"role": "assistant", "content": choice.text}
                rendered.append(
                    {"index": index, "message": message, "logprobs": logprobs, "finish_reason": choice.finish_reason}
                )
            else:
                rendered.append(
                    {"index": index, "text": choice.text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
                )
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": rendered,
            "usage": self.usage(choices),
        }

    def chunk(
        self, index: int, piece: Optional[str], logprobs, finish_reason: Optional[str], first: bool = False
    ) -> dict:
        if self.chat:
            delta = {} if piece is None else ({"role": "assistant", "content": piece} if first else {"content": piece})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": piece or "", "logprobs": logprobs, "finish_reason": finish_reason}
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    def chunks(self, choices: list[Completion], include_usage: bool) -> list[dict]:
        out = []
        for index, choice in enumerate(choices):
            if self.chat:
                out.append(self.chunk(index, "", None, None, first=True))
            offset = 0
            for position, piece in enumerate(choice.pieces):
                if piece or self.logprobs is not None:
                    out.append(self.chunk(index, piece, self._logprobs(choice, position, position + 1, offset), None))
                offset += len(piece)
            out.append(self.chunk(index, None, None, choice.finish_reason))
        if include_usage:
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            out.append(
                {
                    "id": self.id,
                    "object": kind,
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": self.usage(choices),
                }
            )
        return out


def stream(reply: Reply, choices: Awaitable[list[Completion]], include_usage: bool) -> StreamingResponse:
    """The answer as server-sent events, sent once `choices` (the finished samples) arrive."""

    async def events() -> AsyncIterator[str]:
        try:
            done = await choices
        except OpenRLError as error:
            # The status went out with the first byte; OpenAI streams report a late error as
            # an event carrying the error object, which the official client raises.
            yield f"data: {json.dumps(wire.error_body(error.http_status, error.detail, getattr(error, 'openai_code', None)))}\n\n"
            return
        for chunk in reply.chunks(done, include_usage):
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
