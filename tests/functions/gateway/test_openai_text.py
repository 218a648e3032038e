"""The OpenAI routes' text rules on the real Qwen tokenizer: the streamed pieces join to
`tokenizer.decode` of the tokens (multi-byte characters split across tokens included), and
OpenAI's stop semantics (no EOS, text cut before the stop string) with the logprobs kept
for exactly the tokens behind the returned text. References are computed from the
tokenizer and plain string operations, not from the code under test."""

from __future__ import annotations

import pytest

from functions.compute.models import load_tokenizer
from functions.gateway.openai_text import TextCodec, finish, pieces_of

TEXTS = [
    "plain ascii, with  two spaces and\nnewlines\n",
    "naïve café — “quotes” ünïcödé",
    "中文字符和日本語のテキスト",
    "emoji 🤖🧪👩‍🔬 flags 🇫🇷 mixed, rare 𓀀🦩𝔊龘",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_files):
    return load_tokenizer(tiny_files)


@pytest.fixture(scope="module")
def codec(tokenizer, tiny_files):
    return TextCodec("openrl/tiny-qwen3", tokenizer, frozenset(tiny_files.eos_token_ids))


def reference_decode(tokenizer, tokens):
    return tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_the_decoded_text(tokenizer, codec, text):
    tokens = tokenizer.encode(text, add_special_tokens=False)
    pieces = pieces_of(tokens, codec.decode)
    assert len(pieces) == len(tokens)
    assert "".join(pieces) == reference_decode(tokenizer, tokens) == text
    assert all("\ufffd" not in piece for piece in pieces)  # no half characters on the wire


def test_multibyte_characters_split_over_tokens_are_held_back(tokenizer, codec):
    tokens = tokenizer.encode("𓀀", add_special_tokens=False)
    assert len(tokens) > 1  # byte-level BPE splits this emoji, which is what the test needs
    assert pieces_of(tokens, codec.decode) == [""] * (len(tokens) - 1) + ["𓀀"]


def test_a_truncated_character_is_flushed_at_the_end(tokenizer, codec):
    tokens = tokenizer.encode("ok 𓀀", add_special_tokens=False)[:-1]  # stop mid-character (its last byte)
    assert "".join(pieces_of(tokens, codec.decode)) == reference_decode(tokenizer, tokens)


def test_eos_is_dropped_and_length_keeps_everything(tokenizer, codec, tiny_files):
    tokens = tokenizer.encode("hello world", add_special_tokens=False)
    eos = tiny_files.eos_token_ids[0]
    logprobs = [-0.1 * (i + 1) for i in range(len(tokens) + 1)]
    stopped = finish(tokens + [eos], logprobs, "stop", None, codec.eos_ids, codec.decode)
    assert (stopped.text, stopped.tokens, stopped.logprobs) == ("hello world", tokens, logprobs[:-1])
    assert stopped.finish_reason == "stop" and stopped.sampled == len(tokens) + 1
    capped = finish(tokens + [eos], logprobs, "length", None, codec.eos_ids, codec.decode)
    assert capped.finish_reason == "length" and capped.tokens == tokens + [
        eos
    ]  # an EOS that did not stop the row is text


@pytest.mark.parametrize("stops", [["STOP"], ["never", " wor"], ["ld S", "STOP"]])
def test_text_is_cut_where_the_first_stop_string_begins(tokenizer, codec, stops):
    text = "hello world STOP"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    logprobs = [float(-i) for i in range(len(tokens))]
    done = finish(tokens, logprobs, "stop", stops, codec.eos_ids, codec.decode)
    expected = text[: min(text.find(s) for s in stops if s in text)]
    assert done.text == expected
    # The kept tokens are those whose text starts before the cut, with their own logprobs.
    starts = [len(reference_decode(tokenizer, tokens[:i])) for i in range(len(tokens))]
    kept = sum(1 for start in starts if start < len(expected))
    assert done.tokens == tokens[:kept] and done.logprobs == logprobs[:kept]
    assert done.sampled == len(tokens)


def test_chat_prompt_is_the_template_and_no_template_is_refused(tokenizer, codec, tiny_files):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    expected = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert reference_decode(tokenizer, codec.chat_prompt(messages)) == expected
    bare = load_tokenizer(tiny_files)
    bare.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        TextCodec("plain", bare, codec.eos_ids).chat_prompt(messages)
