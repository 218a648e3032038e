"""The torch sampler's own LoRA application against peft's PeftModel, on the tiny Qwen3 and SmolLM2.

Adapters are built with peft (`build_adapter`: random non-zero `lora_B`, `save_pretrained`)
and handed to the engine as bytes. The reference loads the same files with
`peft.PeftModel.from_pretrained` on a fresh copy of the base and runs each row alone, greedily,
with a full forward per token (no cache, no batch), in float64 log-softmax. The engine runs
the base model and both adapters in one batch, with their rows interleaved.

Precision: on the tiny model (float32) logprobs agree within 1e-5. On SmolLM2 in float32 they
are held to 3e-4 (tokens identical): float32 alone puts SmolLM2's logprobs up to ~1e-4 from
the float64-softmax reference even for a base-model row that no adapter touches (measured
with one torch thread, as `make test` runs: 7.2e-6 for a prompt logprob of the row alone,
1.23e-4 for the same row inside the interleaved 9-row batch below, where the GEMMs' blocking
differs with the row count; a 49,152-entry log-softmax over 30 layers of rounding), and
peft's own float32 mixed batch is as far off as this engine. So LoRA's arithmetic is checked exactly on
SmolLM2 in float64, one padded pass against peft's mixed batch (measured ~1e-14 apart).
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from functions.compute.models import load_causal_lm
from functions.compute.shared_weights import load_frozen, shares_weights
from functions.sampler.engine import Piece, SamplerEngine, by_adapter
from functions.sampler.lora import LoraAdapters, row_runs
from functions.sampler.types import SampleJob
from openrl_core.errors import InvalidRequest
from openrl_core.params import SamplingParams
from tests.functions.sampler.test_engine_adapters import build_adapter

pytestmark = pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")

PROMPT = [9707, 11, 1879, 0, 3555, 374, 279]
OTHER = [40, 1079, 264, 2805, 11, 1221, 4128, 911, 13]
STEPS = 4
TOLERANCE = 1e-5
ATTN, MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
# wide: rank 8, every group and the (tied) lm_head; narrow: rank 2, attention only, rsLoRA.
ADAPTERS = {
    "wide": dict(targets=ATTN + MLP + ["lm_head"], rank=8, lora_alpha=32),
    "narrow": dict(targets=["q_proj", "v_proj", "o_proj"], rank=2, lora_alpha=16, use_rslora=True),
}


# model -> the float32 logprob tolerance against peft (see the module docstring).
CASES = {"tiny": TOLERANCE, "smol": 3e-4}


@pytest.fixture(scope="module")
def tiny_case(tiny_files, tmp_path_factory):
    return make_case("tiny", tiny_files, tmp_path_factory)


@pytest.fixture(scope="module")
def smol_case(smol_files, tmp_path_factory):
    return make_case("smol", smol_files, tmp_path_factory)


@pytest.fixture(params=list(CASES))
def case(request):
    return request.getfixturevalue(f"{request.param}_case")


def make_case(model_name, files, tmp_path_factory):
    """(model name, tolerance, files, adapters by name: (directory, files), an engine with
    both loaded, references by adapter and prompt)."""
    root = tmp_path_factory.mktemp(f"lora-{model_name}")
    adapters = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items(), start=1):
        spec = dict(spec)
        # SmolLM2 is pretrained: a smaller update keeps its output sensible, and still changes it.
        scale = 0.1 if model_name == "tiny" else 0.02
        adapters[name] = (
            root / name,
            build_adapter(files, root / name, seed, spec.pop("targets"), scale=scale, **spec),
        )
    engine = SamplerEngine(files, share_base=True)
    for name, (_, adapter_files) in adapters.items():
        engine.load_adapter(name, adapter_files)
    references = {}
    for adapter in (None, *adapters):
        model = load_causal_lm(files).eval()
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(adapters[adapter][0])).eval()
        references[adapter] = {prompt: reference(model, list(prompt)) for prompt in (tuple(PROMPT), tuple(OTHER))}
    return model_name, CASES[model_name], files, adapters, engine, references


def reference(model, prompt: list[int]) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens and logprobs with a full forward per token, and the prompt's logprobs."""
    tokens, logprobs = list(prompt), []
    with torch.no_grad():
        logp_T_V = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
        prompt_lps = logp_T_V[:-1].gather(1, torch.tensor(prompt[1:]).view(-1, 1)).view(-1).tolist()
        for _ in range(STEPS):
            logp_V = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].double(), dim=-1)
            token = int(torch.argmax(logp_V))
            tokens.append(token)
            logprobs.append(float(logp_V[token]))
    return tokens[len(prompt) :], logprobs, prompt_lps


def greedy(prompt, adapter=None, n=1, prompt_logprobs=False):
    params = SamplingParams(max_tokens=STEPS, temperature=0, stop=[])
    return SampleJob(prompt, n, params, prompt_logprobs=prompt_logprobs, adapter=adapter)


def worst(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want)
    return max(abs(a - b) for a, b in zip(got, want))


def check(jobs, results, references, tolerance: float) -> None:
    for job, result in zip(jobs, results):
        tokens, logprobs, prompt_lps = references[job.adapter][tuple(job.prompt_tokens)]
        for sequence in result.sequences:
            assert sequence.tokens == tokens, job.adapter
            assert worst(sequence.logprobs, logprobs) < tolerance, job.adapter
        if job.prompt_logprobs:
            assert result.prompt_logprobs[0] is None
            assert worst(result.prompt_logprobs[1:], prompt_lps) < tolerance, job.adapter


def test_each_row_alone_equals_peft(case):
    _, tolerance, _, adapters, engine, references = case
    base = references[None][tuple(PROMPT)][0]
    assert all(references[name][tuple(PROMPT)][0] != base for name in adapters)  # each really changes the output
    jobs = [
        greedy(prompt, adapter, prompt_logprobs=True) for adapter in (None, *adapters) for prompt in (PROMPT, OTHER)
    ]
    check(jobs, [engine.sample([job])[0] for job in jobs], references, tolerance)


def test_base_and_two_adapters_in_one_batch_equal_peft_row_by_row(case):
    _, tolerance, _, _, engine, references = case
    # Interleaved: the engine must group each adapter's rows itself; some rows want prompt
    # logprobs (a prefill that projects every prompt position through lm_head and its LoRA).
    jobs = [
        greedy(PROMPT, "wide", n=2, prompt_logprobs=True), greedy(OTHER), greedy(PROMPT, "narrow", prompt_logprobs=True),
        greedy(OTHER, "wide"), greedy(PROMPT, prompt_logprobs=True), greedy(OTHER, "narrow", n=3),
    ]  # fmt: skip
    check(jobs, engine.sample(jobs), references, tolerance)


def test_one_padded_pass_equals_peft_mixed_batch(case):
    """The LoRA of each row, with rows interleaved (runs of one row), against peft's own
    mixed-adapter batch over the same padded input: every real position's log-softmax
    (tiny in float32; SmolLM2 in float64, see the module docstring)."""
    model_name, _, files, adapters, _, _ = case
    dtype, tolerance = (torch.float32, TOLERANCE) if model_name == "tiny" else (torch.float64, 1e-9)
    (wide_dir, wide_files), (narrow_dir, narrow_files) = adapters["wide"], adapters["narrow"]
    model = load_causal_lm(files, dtype=dtype).eval()
    lora = LoraAdapters(model, files.name)
    lora.load("wide", wide_files)
    lora.load("narrow", narrow_files)
    peft = PeftModel.from_pretrained(load_causal_lm(files, dtype=dtype).eval(), str(wide_dir), adapter_name="wide")
    peft.load_adapter(str(narrow_dir), adapter_name="narrow")
    peft.eval()
    rows = [("wide", OTHER), (None, PROMPT), ("narrow", OTHER), ("wide", PROMPT), ("narrow", PROMPT), (None, OTHER)]
    width = max(len(prompt) for _, prompt in rows)
    ids_B_T = torch.zeros(len(rows), width, dtype=torch.long)
    mask_B_T = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (_, prompt) in enumerate(rows):
        ids_B_T[i, width - len(prompt) :] = torch.tensor(prompt)
        mask_B_T[i, width - len(prompt) :] = 1
    inputs = dict(input_ids=ids_B_T, attention_mask=mask_B_T, position_ids=(mask_B_T.cumsum(-1) - 1).clamp(min=0))
    with torch.no_grad():
        names = [name or "__base__" for name, _ in rows]
        want_B_T_V = torch.log_softmax(peft(**inputs, adapter_names=names).logits.double(), dim=-1)
        with lora.applied([name for name, _ in rows]):
            got_B_T_V = torch.log_softmax(model(**inputs).logits.double(), dim=-1)
    real = mask_B_T.bool()
    assert (got_B_T_V[real] - want_B_T_V[real]).abs().max() < tolerance


def test_the_base_model_stays_plain_shared_and_unwritten(case):
    _, _, files, _, engine, _ = case
    snapshot = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    engine.sample([greedy(PROMPT, "wide"), greedy(PROMPT), greedy(OTHER, "narrow")])
    model = engine.model
    assert all(type(m).__module__.startswith(("transformers", "torch")) for m in model.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # only during a pass
    assert all(torch.equal(p, snapshot[name]) for name, p in model.named_parameters())
    assert shares_weights(model, load_frozen(files))


def test_a_reloaded_adapter_samples_bitwise_as_before(tiny_case):
    """An evicted adapter that comes back (its files fetched again: new bytes) gives a seeded
    request the same bits, one row or several."""
    _, _, _, adapters, engine, _ = tiny_case
    jobs = [
        SampleJob(OTHER, n, SamplingParams(max_tokens=STEPS, temperature=1.0, seed=11), adapter="again") for n in (1, 3)
    ]
    results = []
    for _ in range(3):
        engine.load_adapter("again", {name: bytes(bytearray(raw)) for name, raw in adapters["wide"][1].items()})
        results.append([[(s.tokens, s.logprobs) for s in engine.sample([job])[0].sequences] for job in jobs])
        engine.drop_adapter("again")
    assert results[0] == results[1] == results[2]


def test_row_runs_merge_neighbours_and_leave_base_rows_out():
    assert row_runs([]) == []
    assert row_runs([None, None]) == []
    assert row_runs(["a", "a", None, "a", "b", "b"]) == [(0, 2, "a"), (3, 4, "a"), (4, 6, "b")]


def test_a_wave_is_grouped_by_adapter_in_order_of_first_use():
    jobs = [greedy(PROMPT, "a"), greedy(PROMPT), greedy(PROMPT, "b"), greedy(PROMPT, "a"), greedy(PROMPT)]
    pieces = [Piece(job, 0, 1) for job in range(5)]
    assert [p.job for p in by_adapter(pieces, jobs)] == [0, 3, 1, 4, 2]


def rewritten(files: dict[str, bytes], config=None, tensors=None) -> dict[str, bytes]:
    """The adapter's files with `config(dict)` / `tensors(dict)` applied to a copy of each."""
    out = dict(files)
    if config is not None:
        loaded = json.loads(files["adapter_config.json"])
        config(loaded)
        out["adapter_config.json"] = json.dumps(loaded).encode()
    if tensors is not None:
        loaded = load_safetensors(files["adapter_model.safetensors"])
        tensors(loaded)
        out["adapter_model.safetensors"] = save_safetensors(loaded)
    return out


def _wider(tensors):
    key = next(k for k in tensors if ".lora_A." in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 1)


def _drop_b(tensors):
    for key in [k for k in tensors if ".lora_B." in k]:
        del tensors[key]


BAD = [
    (dict(config=lambda c: c.update(peft_type="IA3")), "is IA3, only LoRA is supported"),
    (dict(config=lambda c: c.pop("peft_type")), "unreadable adapter_config.json"),
    (dict(config=lambda c: c.update(r="4")), "unreadable adapter_config.json: r must be"),
    (dict(config=lambda c: c.update(lora_alpha=None)), "unreadable adapter_config.json: lora_alpha must be"),
    (dict(config=lambda c: c.update(r=4)), r"lora_A.weight has shape \[8, \d+\], expected \[4, \d+\] \(r=4\)"),
    (dict(tensors=_wider), "has shape"),
    (dict(tensors=_drop_b), "does not fit .*missing .*lora_B"),
    (dict(config=lambda c: c.update(target_modules=["q_proj"])), "does not fit .*unexpected .*lora_A"),
    (dict(config=lambda c: c.update(target_modules=["c_attn"])), "match no Linear layer"),
    (dict(config=lambda c: c.update(use_dora=True)), "uses use_dora, which this sampler does not apply"),
    (dict(config=lambda c: c.update(bias="all")), "uses bias"),
    (dict(tensors=lambda t: t.update({"base_model.model.lm_head.weight": torch.zeros(2, 2)})), "unexpected"),
]


@pytest.mark.parametrize("change, message", BAD)
def test_adapters_that_do_not_fit_are_refused_and_change_nothing(tiny_case, change, message):
    """Checks on the files, whatever the model: on the tiny one."""
    _, _, _, adapters, engine, _ = tiny_case
    files = adapters["wide"][1]
    (before,) = engine.sample([greedy(PROMPT, "wide")])
    with pytest.raises(InvalidRequest, match=message):
        engine.load_adapter("wide", rewritten(files, **change))  # a failed reload keeps the old one
    with pytest.raises(InvalidRequest, match=message):
        engine.load_adapter("new", rewritten(files, **change))
    assert not engine.has_adapter("new")
    assert engine.sample([greedy(PROMPT, "wide")])[0].sequences[0].tokens == before.sequences[0].tokens


def test_unreadable_files_are_refused(tiny_case):
    _, _, _, adapters, engine, _ = tiny_case
    files = dict(adapters["narrow"][1], **{"adapter_model.safetensors": b"not safetensors"})
    with pytest.raises(InvalidRequest, match="unreadable adapter_model.safetensors"):
        engine.load_adapter("x", files)
    with pytest.raises(InvalidRequest, match="unreadable adapter_config.json"):
        engine.load_adapter("x", dict(adapters["narrow"][1], **{"adapter_config.json": b"[1]"}))
    assert not engine.has_adapter("x")
