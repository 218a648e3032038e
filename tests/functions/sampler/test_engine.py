"""SamplerEngine on the pretrained SmolLM2 against plain transformers computations.

References are independent of the engine: HF `generate` on each prompt alone (no padding,
no shared cache), and a plain full forward pass of prompt + generated tokens without a KV
cache, turned into float64 log-softmax.
"""

from __future__ import annotations

import pytest
import torch

from functions.compute.models import load_causal_lm, load_tokenizer
from functions.sampler.engine import SamplerEngine
from functions.sampler.types import SampleJob
from openrl_core.errors import InvalidRequest
from openrl_core.params import SamplingParams

PARIS = "The capital of France is Paris.<|im_end|>"


@pytest.fixture(scope="module")
def engine(smol_files):
    return SamplerEngine(smol_files)


@pytest.fixture(scope="module")
def reference_model(smol_files):
    return load_causal_lm(smol_files).eval()


@pytest.fixture(scope="module")
def tokenizer(smol_files):
    return load_tokenizer(smol_files)


@pytest.fixture(scope="module")
def chat(tokenizer):
    def encode(question: str) -> list[int]:
        messages = [{"role": "user", "content": question}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])

    return encode


def full_forward_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i >= 1, float64, one plain forward, no cache."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(tokens[1:]).view(-1, 1)).squeeze(1), logprobs


def test_greedy_batch_equals_hf_generate_on_each_prompt(engine, reference_model, chat):
    prompts = [
        chat("What is the capital of France?"),
        chat("Name three colours of the rainbow, then explain why the sky is blue."),
    ]
    prompts.append(prompts[1][:9])  # a short raw prefix: pads heavily against the others
    jobs = [SampleJob(p, 1, SamplingParams(max_tokens=24, temperature=0.0)) for p in prompts]
    results = engine.sample(jobs)
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            out = reference_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24)
        expected = out[0, len(prompt) :].tolist()
        (sequence,) = result.sequences
        assert sequence.tokens == expected
        assert sequence.stop_reason == ("stop" if expected[-1] == 2 else "length")


def test_sampled_and_prompt_logprobs_equal_a_full_forward(engine, reference_model, chat):
    prompts = [chat("Tell me a short story about a fox."), chat("Hi!")]
    # Filtering and temperature change what is drawn, never the reported logprobs.
    fox = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=1)
    hi = SamplingParams(max_tokens=9, temperature=1.2, top_k=20, seed=2)
    jobs = [
        SampleJob(prompts[0], 3, fox, prompt_logprobs=True, topk_prompt_logprobs=3),
        SampleJob(prompts[1], 2, hi, prompt_logprobs=True, prompt_logprobs_last_n=4),
    ]
    results = engine.sample(jobs)
    for job, result in zip(jobs, results):
        assert len(result.sequences) == job.num_samples
        for sequence in result.sequences:
            assert len(sequence.tokens) == len(sequence.logprobs) > 0
            expected, _ = full_forward_logprobs(reference_model, job.prompt_tokens + sequence.tokens)
            got = torch.tensor(sequence.logprobs, dtype=torch.float64)
            torch.testing.assert_close(got, expected[len(job.prompt_tokens) - 1 :], atol=1e-4, rtol=0)
        expected, logprobs_T_V = full_forward_logprobs(reference_model, job.prompt_tokens)
        n = len(job.prompt_tokens)
        first = 1 if job.prompt_logprobs_last_n is None else n - job.prompt_logprobs_last_n
        assert len(result.prompt_logprobs) == n
        assert all(v is None for v in result.prompt_logprobs[:first])
        got = torch.tensor(result.prompt_logprobs[first:], dtype=torch.float64)
        torch.testing.assert_close(got, expected[first - 1 :], atol=1e-4, rtol=0)
    topk = results[0].topk_prompt_logprobs
    assert topk[0] is None and len(topk) == len(prompts[0])
    _, logprobs_T_V = full_forward_logprobs(reference_model, prompts[0])
    values, ids = torch.topk(logprobs_T_V[:-1], 3, dim=-1)
    for i in range(1, len(prompts[0])):
        assert [t for t, _ in topk[i]] == ids[i - 1].tolist()
        got = torch.tensor([v for _, v in topk[i]], dtype=torch.float64)
        torch.testing.assert_close(got, values[i - 1], atol=1e-4, rtol=0)
    assert results[1].topk_prompt_logprobs is None


def test_eos_stop_is_kept_and_reported(engine, chat, tokenizer):
    job = SampleJob(chat("What is the capital of France?"), 1, SamplingParams(max_tokens=30, temperature=0))
    (result,) = engine.sample([job])
    (sequence,) = result.sequences
    assert tokenizer.decode(sequence.tokens) == PARIS
    assert sequence.stop_reason == "stop" and sequence.tokens[-1] == 2
    assert result.prompt_logprobs is None and result.topk_prompt_logprobs is None


def test_stop_string_ends_at_the_completing_token(engine, chat, tokenizer):
    prompt = chat("What is the capital of France?")
    jobs = [
        SampleJob(prompt, 1, SamplingParams(max_tokens=30, temperature=0, stop=["is Par"])),
        SampleJob(prompt, 1, SamplingParams(max_tokens=30, temperature=0, stop=["France"])),
    ]
    paris, france = (r.sequences[0] for r in engine.sample(jobs))
    assert tokenizer.decode(paris.tokens) == "The capital of France is Paris"
    assert tokenizer.decode(france.tokens) == "The capital of France"
    assert paris.stop_reason == france.stop_reason == "stop"


def test_stop_token_ids_max_tokens_and_no_stop(engine, chat, tokenizer):
    prompt = chat("What is the capital of France?")
    (period,) = tokenizer.encode(".", add_special_tokens=False)
    jobs = [
        SampleJob(prompt, 1, SamplingParams(max_tokens=30, temperature=0, stop=[period])),
        SampleJob(prompt, 1, SamplingParams(max_tokens=3, temperature=0)),
        SampleJob(prompt, 1, SamplingParams(max_tokens=12, temperature=0, stop=[])),
        SampleJob(prompt, 2, SamplingParams(max_tokens=0, temperature=0), prompt_logprobs=True),
    ]
    by_id, short, unstopped, empty = engine.sample(jobs)
    assert tokenizer.decode(by_id.sequences[0].tokens) == "The capital of France is Paris."
    assert by_id.sequences[0].stop_reason == "stop"
    assert tokenizer.decode(short.sequences[0].tokens) == "The capital of"
    assert short.sequences[0].stop_reason == "length"
    # stop=[] runs through <|im_end|> to max_tokens.
    assert tokenizer.decode(unstopped.sequences[0].tokens).startswith(PARIS)
    assert len(unstopped.sequences[0].tokens) == 12 and unstopped.sequences[0].stop_reason == "length"
    assert [(s.tokens, s.stop_reason) for s in empty.sequences] == [([], "length")] * 2
    assert empty.prompt_logprobs[0] is None and len(empty.prompt_logprobs) == len(prompt)


def test_one_token_prompt_and_unbounded_max_tokens(engine, smol_files):
    job = SampleJob([1], 1, SamplingParams(max_tokens=2, temperature=0), prompt_logprobs=True)
    (result,) = engine.sample([job])
    assert result.prompt_logprobs == [None] and len(result.sequences[0].tokens) == 2
    near_full = [1] * (smol_files.max_context - 2)
    engine.validate(SampleJob(near_full, 1, SamplingParams(stop=[])))


@pytest.mark.parametrize(
    "job, message",
    [
        (SampleJob([], 1, SamplingParams()), "at least one token"),
        (SampleJob([1, 49152], 1, SamplingParams()), "token ids"),
        (SampleJob([1, -1], 1, SamplingParams()), "token ids"),
        (SampleJob([1], 0, SamplingParams()), "num_samples"),
        (SampleJob([1], 5000, SamplingParams()), "num_samples"),
        (SampleJob([1] * 8000, 1, SamplingParams(max_tokens=200)), "exceeds the model context"),
        (SampleJob([1] * 8192, 1, SamplingParams()), "no room"),
        (SampleJob([1, 2], 1, SamplingParams(), topk_prompt_logprobs=100_000), "topk_prompt_logprobs"),
        (SampleJob([1, 2, 3], 1, SamplingParams(), prompt_logprobs=True, prompt_logprobs_last_n=3), "last_n"),
        (SampleJob([1, 2, 3], 1, SamplingParams(), prompt_logprobs=True, prompt_logprobs_last_n=0), "last_n"),
        (SampleJob([1, 2, 3], 1, SamplingParams(), prompt_logprobs_last_n=1), "requires prompt_logprobs"),
        (SampleJob([1], 1, SamplingParams(), adapter="nope"), "not loaded"),
        (SampleJob([1], 1, SamplingParams(stop=[""])), "non-empty"),
    ],
)
def test_invalid_jobs_are_rejected_with_a_reason(engine, job, message):
    with pytest.raises(InvalidRequest, match=message):
        engine.validate(job)
    with pytest.raises(InvalidRequest):
        engine.sample([job])
