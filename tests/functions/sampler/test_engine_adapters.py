"""LoRA adapters in SamplerEngine on the tiny Qwen3, against plain peft.

Each adapter is built here with `peft.get_peft_model` on a fresh base, given random
non-zero `lora_B` (a fresh LoRA is a no-op), saved with `save_pretrained` and handed to the
engine as bytes. The reference applies the same saved adapter with plain peft
(`PeftModel.from_pretrained`) and decodes greedily with full forward passes, no cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

from functions.compute.models import load_causal_lm
from functions.sampler.engine import SamplerEngine
from functions.sampler.types import SampleJob
from openrl_core.errors import InvalidRequest
from openrl_core.params import SamplingParams

# Adapter b targets the tied lm_head on purpose; peft warns about merging such adapters.
pytestmark = pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")

PROMPT = [9707, 11, 1879, 0, 3555, 374, 279]
OTHER = [40, 1079, 264, 2805, 11, 1221, 4128, 911, 13]
STEPS = 6


def build_adapter(
    files, directory: Path, seed: int, targets: list[str], rank=4, scale=0.1, **config
) -> dict[str, bytes]:
    """`config`: more peft LoraConfig fields (lora_alpha is 8 unless given)."""
    torch.manual_seed(seed)
    config = {"lora_alpha": 8, **config}
    model = get_peft_model(load_causal_lm(files), LoraConfig(r=rank, target_modules=targets, **config))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, scale)
    model.save_pretrained(directory, save_embedding_layers=False)
    return {name: (directory / name).read_bytes() for name in ("adapter_model.safetensors", "adapter_config.json")}


@pytest.fixture(scope="module")
def adapters(tiny_files, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    # Keys shaped like checkpoint paths (dots, slashes); b also adapts the tied lm_head.
    targets = {"a": ["q_proj", "v_proj", "down_proj"], "b": ["o_proj", "up_proj", "lm_head"]}
    return {
        f"tinker://run-1/weights/{name}.{seed}": (
            root / name,
            build_adapter(tiny_files, root / name, seed, targets[name]),
        )
        for seed, name in enumerate(targets, start=1)
    }


@pytest.fixture(scope="module")
def engine(tiny_files, adapters):
    engine = SamplerEngine(tiny_files)
    for key, (_, files) in adapters.items():
        engine.load_adapter(key, files)
    return engine


def greedy_reference(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy decoding with a full forward per token; float64 log-softmax."""
    tokens = list(prompt)
    logprobs = []
    with torch.no_grad():
        for _ in range(steps):
            logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].double(), dim=-1)
            token = int(torch.argmax(logp))
            tokens.append(token)
            logprobs.append(float(logp[token]))
    return tokens[len(prompt) :], logprobs


def greedy(prompt, adapter=None, n=1):
    return SampleJob(prompt, n, SamplingParams(max_tokens=STEPS, temperature=0, stop=[]), adapter=adapter)


def assert_same(sequence, reference):
    tokens, logprobs = reference
    assert sequence.tokens == tokens
    got, expected = (torch.tensor(v, dtype=torch.float64) for v in (sequence.logprobs, logprobs))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_adapter_output_equals_plain_peft(engine, tiny_files, adapters):
    base_reference = greedy_reference(load_causal_lm(tiny_files).eval(), PROMPT, STEPS)
    for key, (directory, _) in adapters.items():
        model = PeftModel.from_pretrained(load_causal_lm(tiny_files), str(directory)).eval()
        reference = greedy_reference(model, PROMPT, STEPS)
        assert reference[0] != base_reference[0]  # the adapter really changes the output
        (result,) = engine.sample([greedy(PROMPT, key)])
        assert_same(result.sequences[0], reference)
    (result,) = engine.sample([greedy(PROMPT)])
    assert_same(result.sequences[0], base_reference)


def test_mixed_batch_equals_each_job_alone(engine, adapters):
    key_a, key_b = adapters
    jobs = [greedy(PROMPT, key_a, n=2), greedy(OTHER), greedy(PROMPT, key_b), greedy(OTHER, key_a), greedy(PROMPT)]
    alone = [engine.sample([job])[0] for job in jobs]
    mixed = engine.sample(jobs)
    for by_itself, together in zip(alone, mixed):
        for a, b in zip(by_itself.sequences, together.sequences):
            assert a.tokens == b.tokens
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    assert mixed[0].sequences[0].tokens != mixed[4].sequences[0].tokens
    # Prompt logprobs in a mixed prefill use each row's own adapter too.
    with_lp = [
        SampleJob(PROMPT, 1, SamplingParams(max_tokens=1), prompt_logprobs=True, adapter=adapter)
        for adapter in (key_a, None)
    ]
    mixed_lp = [r.prompt_logprobs for r in engine.sample(with_lp)]
    alone_lp = [engine.sample([job])[0].prompt_logprobs for job in with_lp]
    torch.testing.assert_close(mixed_lp[0][1:], alone_lp[0][1:], atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed_lp[1][1:], alone_lp[1][1:], atol=1e-5, rtol=0)
    assert mixed_lp[0][1:] != mixed_lp[1][1:]


def test_drop_adapters_back_to_the_base_model(tiny_files, adapters):
    engine = SamplerEngine(tiny_files)
    (base,) = engine.sample([greedy(PROMPT)])
    key_a, key_b = adapters
    engine.load_adapter(key_a, adapters[key_a][1])
    engine.load_adapter(key_b, adapters[key_b][1])
    (with_b,) = engine.sample([greedy(PROMPT, key_b)])
    engine.drop_adapter(key_a)
    assert not engine.has_adapter(key_a) and engine.has_adapter(key_b)
    with pytest.raises(InvalidRequest, match="not loaded"):
        engine.sample([greedy(PROMPT, key_a)])
    assert engine.sample([greedy(PROMPT, key_b)])[0].sequences[0].tokens == with_b.sequences[0].tokens
    engine.drop_adapter(key_b)
    engine.drop_adapter(key_b)  # dropping twice is harmless
    assert engine.sample([greedy(PROMPT)])[0].sequences[0].tokens == base.sequences[0].tokens
    # Loading again after everything was dropped works, and reloading a key replaces it.
    engine.load_adapter(key_a, adapters[key_a][1])
    engine.load_adapter(key_a, adapters[key_b][1])
    assert engine.sample([greedy(PROMPT, key_a)])[0].sequences[0].tokens == with_b.sequences[0].tokens


def test_adapters_that_do_not_fit_are_rejected(tiny_files, adapters, tmp_path):
    engine = SamplerEngine(tiny_files)
    _, files = next(iter(adapters.values()))
    with pytest.raises(InvalidRequest, match="lacks"):
        engine.load_adapter("x", {"adapter_config.json": files["adapter_config.json"]})
    # Keys that match no module would otherwise load as a silent no-op.
    (tmp_path / "w.safetensors").write_bytes(files["adapter_model.safetensors"])
    renamed = {k.replace("layers", "blocks"): v for k, v in load_file(tmp_path / "w.safetensors").items()}
    save_file(renamed, tmp_path / "renamed.safetensors")
    bad = dict(files, **{"adapter_model.safetensors": (tmp_path / "renamed.safetensors").read_bytes()})
    with pytest.raises(InvalidRequest, match="does not fit"):
        engine.load_adapter("x", bad)
    assert not engine.has_adapter("x")
    with pytest.raises(InvalidRequest):
        engine.load_adapter("y", dict(files, **{"adapter_config.json": b"{not json"}))
    assert engine.sample([greedy(PROMPT)])[0].sequences[0].tokens  # the engine still works
