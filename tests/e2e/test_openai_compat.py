"""The OpenAI-compatible endpoint against a real `openrl serve`, driven by the official
`openai` client: completions and chat completions, streamed and not, `/v1/models`, a LoRA
checkpoint trained through the tinker SDK as `model`, tenancy, and the client's usual
exceptions for bad keys, unknown models and bad arguments.

The independent references are the tinker SDK's own sample of the same prompt tokens
(greedy, so the two must pick the same tokens) and the tokenizer loaded straight from the
model directory (for prompt token counts, the chat template and decoding)."""

from __future__ import annotations

import openai
import pytest
import tinker
from tinker import types
from transformers import AutoTokenizer

from tests.e2e.conftest import API_KEY, OTHER_KEY

pytestmark = pytest.mark.e2e
MODEL = "openrl/tiny-qwen3"
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def tokenizer(tiny_files):
    return AutoTokenizer.from_pretrained(tiny_files.path)


def client(server, key=API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def decode(tokenizer, tokens):
    return tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def sdk_greedy(model_input_tokens, max_tokens, base_model=MODEL, model_path=None):
    """The tinker SDK's greedy sample of these prompt tokens: (tokens, logprobs)."""
    service = tinker.ServiceClient()
    if model_path:
        sampler = service.create_sampling_client(model_path=model_path).result()
    else:
        sampler = service.create_sampling_client(base_model=base_model).result()
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    sequence = sampler.sample(types.ModelInput.from_ints(model_input_tokens), 1, params).result().sequences[0]
    return list(sequence.tokens), list(sequence.logprobs)


def test_greedy_completion_equals_the_tinker_sdk_sample_and_streams_the_same_text(sdk_env, tokenizer):
    oai = client(sdk_env)
    prompt_tokens = tokenizer.encode(PROMPT)
    answer = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
    reference_tokens, reference_logprobs = sdk_greedy(prompt_tokens, 8)
    choice = answer.choices[0]
    eos = tokenizer.eos_token_id
    stopped = reference_tokens[-1] == eos and len(reference_tokens) < 8
    kept = reference_tokens[:-1] if stopped else reference_tokens
    assert choice.text == decode(tokenizer, kept)
    assert choice.finish_reason == ("stop" if stopped else "length")
    assert choice.logprobs.token_logprobs == pytest.approx(reference_logprobs[: len(kept)], abs=1e-4)
    assert [list(top.values())[0] for top in choice.logprobs.top_logprobs] == choice.logprobs.token_logprobs
    assert choice.logprobs.tokens == [decode(tokenizer, [t]) for t in kept]
    assert answer.usage.prompt_tokens == len(prompt_tokens)
    assert answer.usage.completion_tokens == len(reference_tokens)
    assert answer.usage.total_tokens == len(prompt_tokens) + len(reference_tokens)

    # Streamed, with the prompt as token ids this time: the same request, the same text.
    stream = oai.completions.create(
        model=MODEL,
        prompt=prompt_tokens,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.model_dump() == answer.usage.model_dump()


def test_seeded_sampling_n_choices_stop_strings_and_prompt_lists(sdk_env):
    oai = client(sdk_env)
    seeded = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9, seed=11, n=3)
    first = oai.completions.create(**seeded)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len({c.text for c in first.choices}) > 1  # n samples, not one repeated
    streamed = list(oai.completions.create(**seeded, stream=True))  # a second sample with the same seed
    for index, choice in enumerate(first.choices):
        assert "".join(c.choices[0].text for c in streamed if c.choices[0].index == index) == choice.text

    greedy = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = greedy.strip()[3:6]  # a string the greedy text holds, past its first characters
    assert stop and stop in greedy
    cut = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "never-there"]
    ).choices[0]
    assert (cut.text, cut.finish_reason) == (greedy[: greedy.find(stop)], "stop")

    batch = oai.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == greedy[: len(batch.choices[0].text)]


def test_chat_completion_uses_the_chat_template_and_streams_the_same_text(sdk_env, tokenizer):
    oai = client(sdk_env)
    templated = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_tokens = tokenizer.encode(templated, add_special_tokens=False)
    answer = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    reference_tokens, reference_logprobs = sdk_greedy(prompt_tokens, 10)
    stopped = reference_tokens[-1] == tokenizer.eos_token_id and len(reference_tokens) < 10
    kept = reference_tokens[:-1] if stopped else reference_tokens
    choice = answer.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == decode(tokenizer, kept)
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx(reference_logprobs[: len(kept)], abs=1e-4)
    assert all(e.top_logprobs[0].token == e.token for e in choice.logprobs.content)
    assert answer.usage.prompt_tokens == len(prompt_tokens) and answer.usage.completion_tokens == len(reference_tokens)

    chunks = list(
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason

    seeded = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0.8, seed=5, n=2)
    streamed = list(oai.chat.completions.create(**seeded, stream=True))
    whole = oai.chat.completions.create(**seeded)
    for index, c in enumerate(whole.choices):
        assert (
            "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices[0].index == index)
            == c.message.content
        )


def train_one_step(service, model=MODEL):
    training = service.create_lora_training_client(base_model=model, rank=4, seed=3).result()
    tokens = training.get_tokenizer().encode(PROMPT)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return training.save_weights_for_sampler("openai-step1").result().path


def test_a_lora_sampler_checkpoint_is_a_model_of_its_tenant_only(sdk_env, tokenizer):
    path = train_one_step(tinker.ServiceClient(api_key=API_KEY))
    alice, bob = client(sdk_env), client(sdk_env, OTHER_KEY)
    listed = [m.id for m in alice.models.list()]
    assert MODEL in listed and path in listed
    assert MODEL in [m.id for m in bob.models.list()] and path not in [m.id for m in bob.models.list()]

    tuned = alice.completions.create(model=path, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0).choices[0]
    base = alice.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0).choices[0]
    reference_tokens, reference_logprobs = sdk_greedy(tokenizer.encode(PROMPT), 6, model_path=path)
    assert tuned.logprobs.token_logprobs == pytest.approx(
        reference_logprobs[: len(tuned.logprobs.token_logprobs)], abs=1e-4
    )
    assert (tuned.text, tuned.logprobs.token_logprobs) != (
        base.text,
        base.logprobs.token_logprobs,
    )  # the adapter is applied

    with pytest.raises(openai.NotFoundError) as theirs:
        bob.completions.create(model=path, prompt=PROMPT, max_tokens=2)
    missing = path.replace("openai-step1", "no-such-checkpoint")
    with pytest.raises(openai.NotFoundError) as nowhere:
        alice.completions.create(model=missing, prompt=PROMPT, max_tokens=2)
    # Another tenant's checkpoint answers exactly like one that does not exist.
    assert theirs.value.body == {**nowhere.value.body, "message": nowhere.value.body["message"].replace(missing, path)}
    assert theirs.value.code == "model_not_found"


def test_chat_completion_on_a_sampler_checkpoint_path_samples_through_its_adapter(sdk_env, tokenizer):
    """`model` = tinker://<run>/sampler_weights/<name>: the chat template's prompt, sampled
    greedily through the adapter, is exactly the tinker SDK's sample on that path; streamed
    alike; not the base model's; and another tenant's key cannot use it."""
    path = train_one_step(tinker.ServiceClient(api_key=API_KEY))
    assert path.startswith("tinker://") and "/sampler_weights/" in path
    oai = client(sdk_env)
    prompt_tokens = tokenizer.encode(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    answer = oai.chat.completions.create(model=path, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True)
    reference_tokens, reference_logprobs = sdk_greedy(prompt_tokens, 8, model_path=path)
    stopped = reference_tokens[-1] == tokenizer.eos_token_id and len(reference_tokens) < 8
    kept = reference_tokens[:-1] if stopped else reference_tokens
    choice = answer.choices[0]
    assert answer.model == path
    assert choice.message.content == decode(tokenizer, kept) and choice.finish_reason == (
        "stop" if stopped else "length"
    )
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx(reference_logprobs[: len(kept)], abs=1e-4)
    assert answer.usage.prompt_tokens == len(prompt_tokens) and answer.usage.completion_tokens == len(reference_tokens)
    base_tokens, base_logprobs = sdk_greedy(prompt_tokens, 8)
    assert (reference_tokens, reference_logprobs) != (base_tokens, base_logprobs)  # the adapter is applied

    chunks = list(oai.chat.completions.create(model=path, messages=MESSAGES, max_tokens=8, temperature=0, stream=True))
    assert {c.model for c in chunks} == {path}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    with pytest.raises(openai.NotFoundError):
        client(sdk_env, OTHER_KEY).chat.completions.create(model=path, messages=MESSAGES, max_tokens=2)


def test_bad_key_unknown_model_and_bad_arguments_raise_the_clients_exceptions(sdk_env):
    with pytest.raises(openai.AuthenticationError):
        client(sdk_env, "tml-not-a-key").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client(sdk_env, "tml-not-a-key").models.list()
    oai = client(sdk_env)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.chat.completions.create(model="no/such-model", messages=MESSAGES, max_tokens=2)
    bad_arguments = [
        ("temperature", dict(temperature=5)),
        ("Extra inputs", dict(extra_body={"frobnicate": True})),
        ("max_tokens", dict(extra_body={"max_tokens": "many"})),
        ("context length", dict(max_tokens=100_000)),
        ("n", dict(n=0)),
        ("presence_penalty", dict(presence_penalty=0.5)),
    ]
    for needle, arguments in bad_arguments:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match=needle):
                oai.completions.create(model=MODEL, prompt="hi", **{"max_tokens": 2, **arguments}, stream=stream)
    with pytest.raises(openai.BadRequestError, match="tools"):
        oai.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=2,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
    with pytest.raises(openai.BadRequestError, match="role"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}], max_tokens=2)
