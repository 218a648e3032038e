"""Text for the OpenAI routes: prompts to token ids, sampled token ids back to OpenAI's text.

The sampler knows nothing of text (token ids in, token ids out); this module is the only
place the `/v1` routes meet a tokenizer, loaded once per served model in the gateway
(a tokenizer, never weights). Its rules:

- A chat prompt is the model's own chat template (`apply_chat_template`, with the generation
  prompt), then encoded without adding special tokens: the template already holds them. A
  tokenizer without a chat template is a 400, never a guessed format.
- The text of a completion is built piece by piece, one piece per sampled token, by the
  incremental detokenisation vLLM uses (decode a short window and emit what it added once it
  no longer ends in an incomplete UTF-8 character), so the pieces a stream sends join to
  exactly the text a non-streamed answer holds, and that text equals `tokenizer.decode` of
  the tokens (tests/functions/gateway/test_openai_text.py checks it on multi-byte text).
- OpenAI's stop semantics on top of Tinker's: the sampler keeps the token that stopped a row
  (the EOS token, or the tokens that completed a stop string); OpenAI returns neither. So an
  EOS at the end is dropped, and the text is cut where the first stop string begins,
  together with the pieces (and logprobs) of tokens wholly after the cut.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from functions.compute.models import ModelDirectory, load_tokenizer
from openrl_core.errors import InvalidRequest

Decode = Callable[[Sequence[int]], str]
INCOMPLETE = "\ufffd"  # what a decoder yields for a UTF-8 character cut short


def pieces_of(tokens: Sequence[int], decode: Decode) -> list[str]:
    """One text piece per token; a token that ends inside a character gets "" and the token
    completing it carries the whole character. Pieces join to `decode(tokens)`."""
    pieces: list[str] = []
    prefix = read = 0  # decode from `prefix` (one token of context); text up to `read` is out
    for end in range(1, len(tokens) + 1):
        before = decode(tokens[prefix:read])
        after = decode(tokens[prefix:end])
        if len(after) > len(before) and not after.endswith(INCOMPLETE):
            pieces.append(after[len(before) :])
            prefix, read = read, end
        else:
            pieces.append("")
    if read < len(tokens):  # bytes that never completed a character: flush them as they are
        pieces[-1] += decode(tokens[prefix:])[len(decode(tokens[prefix:read])) :]
    return pieces


@dataclass(frozen=True)
class Completion:
    """One choice's text as OpenAI reports it."""

    tokens: list[int]  # the tokens behind `pieces` (what logprobs report)
    logprobs: list[float]
    pieces: list[str]
    finish_reason: str  # "stop" or "length"
    sampled: int  # every token the sampler generated (usage counts these)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def finish(
    tokens: list[int],
    logprobs: list[float],
    stop_reason: str,
    stops: Optional[list[str]],
    eos_ids: frozenset[int],
    decode: Decode,
) -> Completion:
    sampled = len(tokens)
    if stop_reason == "stop" and tokens and tokens[-1] in eos_ids:
        tokens, logprobs = tokens[:-1], logprobs[:-1]
    pieces = pieces_of(tokens, decode)
    text = "".join(pieces)
    cuts = [text.find(s) for s in stops or () if s in text] if stop_reason == "stop" else []
    if cuts:
        cut, start, kept = min(cuts), 0, 0
        for piece in pieces:
            if start >= cut:
                break
            kept += 1
            start += len(piece)
        pieces = pieces[:kept]
        overflow = sum(len(p) for p in pieces) - cut
        if overflow > 0:
            pieces[-1] = pieces[-1][: len(pieces[-1]) - overflow]
        tokens, logprobs = tokens[:kept], logprobs[:kept]
    return Completion(tokens, logprobs, pieces, "stop" if stop_reason == "stop" else "length", sampled)


class TextCodec:
    """One model's tokenizer, as the OpenAI routes use it."""

    def __init__(self, name: str, tokenizer, eos_ids: frozenset[int]) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        # A fast tokenizer mutates its truncation state inside encode; one call at a time.
        self._lock = threading.Lock()

    def decode(self, tokens: Sequence[int]) -> str:
        # Special tokens stay, as they do in the sampler's stop-string matching.
        with self._lock:
            return self.tokenizer.decode(list(tokens), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self.tokenizer.encode(text, add_special_tokens=True))

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest(
                f"model {self.name!r} has no chat template in its tokenizer, so /v1/chat/completions cannot format "
                "messages for it; use /v1/completions with a prompt you format yourself"
            )
        with self._lock:
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as error:  # the template's own raise_exception, e.g. roles out of order
                raise InvalidRequest(f"the chat template of {self.name!r} refused these messages: {error}") from error
            return list(self.tokenizer.encode(text, add_special_tokens=False))


class TextCodecs:
    """Tokenizers of the served models, loaded on first use and kept (one per canonical model)."""

    def __init__(self, models: ModelDirectory) -> None:
        self.models = models
        self._codecs: dict[str, TextCodec] = {}
        self._lock = threading.Lock()

    def get(self, base_model: str) -> TextCodec:
        files = self.models.files(base_model)
        with self._lock:
            codec = self._codecs.get(files.name)
            if codec is None:
                tokenizer = load_tokenizer(files)
                eos = set(files.eos_token_ids)
                if tokenizer.eos_token_id is not None:
                    eos.add(int(tokenizer.eos_token_id))
                codec = self._codecs[files.name] = TextCodec(files.name, tokenizer, frozenset(eos))
            return codec
