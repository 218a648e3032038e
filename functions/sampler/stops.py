"""When a generated row must stop: stop token ids, end-of-sequence, stop strings.

A `StopRule` is built once per job from its `SamplingParams` and the model's EOS ids, and
asked after every new token whether that token ends the row. Rules only read the row's
generated tokens (never the prompt: a stop string already in the prompt must not end
generation at once), and the token that triggers a stop is kept in the output, as the
cookbook's renderers expect (protocol §9.4).

Stop strings are matched on decoded text, but only on the decoded tail of the row: a
string of b UTF-8 bytes is completed by at most b tokens (every token carries at least one
byte), so decoding the last b + 2 tokens finds every new occurrence; the extra tokens
absorb decoders that drop a leading space or split a multi-byte character at the start of
the slice. The rule is checked after every token, so the first step at which a string
appears in the tail is the step whose token completed it. Cost per step is one decode of a
few tokens, independent of how long the row has grown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from openrl_core.errors import InvalidRequest
from openrl_core.params import SamplingParams

Decode = Callable[[Sequence[int]], str]

# Tokens decoded beyond the longest stop string's byte length; see the module docstring.
TAIL_MARGIN_TOKENS = 2


@dataclass(frozen=True)
class StopRule:
    token_ids: frozenset[int]
    strings: tuple[str, ...]
    tail_tokens: int  # how many trailing tokens to decode; 0 when there are no strings

    @classmethod
    def from_params(cls, params: SamplingParams, eos_token_ids: Iterable[int]) -> "StopRule":
        """None stops at EOS; a list adds its stops to EOS; [] stops at nothing."""
        strings = tuple(params.stop_strings())
        if any(s == "" for s in strings):
            raise InvalidRequest("stop strings must be non-empty")
        ids = set(params.stop_token_ids())
        if params.stops_at_eos:
            ids.update(eos_token_ids)
        tail = max((len(s.encode("utf-8")) for s in strings), default=0)
        return cls(frozenset(ids), strings, tail + TAIL_MARGIN_TOKENS if strings else 0)

    @property
    def never_stops(self) -> bool:
        return not self.token_ids and not self.strings

    def is_stop(self, generated: Sequence[int], decode: Decode) -> bool:
        """Whether the last token of `generated` ends the row."""
        if not generated:
            return False
        if generated[-1] in self.token_ids:
            return True
        if not self.strings:
            return False
        text = decode(generated[-self.tail_tokens :])
        return any(s in text for s in self.strings)


def make_decoder(tokenizer) -> Decode:
    """Decode keeping special tokens, so a stop string such as "<|im_end|>" can match."""

    def decode(tokens: Sequence[int]) -> str:
        return tokenizer.decode(list(tokens), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    return decode
