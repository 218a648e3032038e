"""vLLM on CUDA: full-run weights copied into the running engine in place, sleep and wake.

Skipped without a CUDA device or without a vLLM environment (`OPENRL_VLLM_ENV`, else
`.venv-vllm`; the lent GPU image has none unless it ships vLLM, so scripts/device-check runs
this only where one exists). Not yet run on any GPU. What must hold:
- after weight sync changes a few tensors of the torch copy, `weights_changed(names)` copies
  only those into the engine (no reload): greedy tokens and logprobs equal those of a full
  reload of the same weights, within bf16 tolerance (2e-2), and the in-place update is
  timed against the full reload (target: at most 0.05 x; printed);
- `park` (vLLM sleep, level 1) frees device memory that `restore` takes back, and sampling
  after waking gives the same greedy tokens as before parking, with and without a LoRA
  adapter loaded before the sleep (the sampler worker lets the timeslicer park its base
  engine when `can_sleep`, adapters and all).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from functions.sampler.types import SampleJob
from functions.sampler.vllm_engine import DEFAULT_ENV, VllmEngine, VllmOptions
from openrl_core.params import SamplingParams

VLLM_ENV = Path(os.environ.get("OPENRL_VLLM_ENV") or DEFAULT_ENV)
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/device-check)"),
    pytest.mark.skipif(not (VLLM_ENV / "bin" / "python").exists(), reason=f"no vLLM environment at {VLLM_ENV}"),
]
PROMPT = [9707, 11, 1879, 0, 3555, 374, 279]


def greedy():
    return SampleJob(PROMPT, 1, SamplingParams(max_tokens=8, temperature=0, stop=[]))


@pytest.fixture(scope="module")
def engine(smol_files):
    options = VllmOptions(env=VLLM_ENV, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, max_lora_rank=8)
    engine = VllmEngine(smol_files, options)
    yield engine
    engine.close()


def test_changed_tensors_are_copied_in_place_like_a_full_reload(engine):
    names = [n for n, _ in engine.model.named_parameters() if ".layers.3." in n or n.endswith("norm.weight")]
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        params = dict(engine.model.named_parameters())
        for name in names:
            params[name].add_(torch.randn(params[name].shape, generator=generator) * 0.02)
    engine.weights_changed(names)
    assert engine.in_place
    started = time.perf_counter()
    engine._update_in_place(sorted(engine._changed))
    in_place_s = time.perf_counter() - started
    patched = engine.sample([greedy()])[0].sequences[0]
    started = time.perf_counter()
    engine._reload_full_state()
    reload_s = time.perf_counter() - started
    reloaded = engine.sample([greedy()])[0].sequences[0]
    print(f"\nvLLM in-place update of {len(names)} tensors {in_place_s:.3f} s, full reload {reload_s:.3f} s, "
          f"ratio {in_place_s / reload_s:.3f}")  # fmt: skip
    assert patched.tokens == reloaded.tokens
    assert max(abs(a - b) for a, b in zip(patched.logprobs, reloaded.logprobs)) < 2e-2


def test_park_frees_device_memory_and_restore_serves_the_same(engine):
    before = engine.sample([greedy()])[0].sequences[0]
    free_awake, _ = torch.cuda.mem_get_info()
    seconds, nbytes = engine.park()
    free_asleep, _ = torch.cuda.mem_get_info()
    assert engine.asleep and nbytes == engine.weight_bytes
    assert free_asleep - free_awake >= engine.weight_bytes // 2, (free_awake, free_asleep)
    woke_s, _ = engine.restore()
    print(f"\nvLLM sleep level 1: {seconds:.3f} s, wake {woke_s:.3f} s, freed {free_asleep - free_awake} bytes")
    after = engine.sample([greedy()])[0].sequences[0]
    assert after.tokens == before.tokens


def test_an_adapter_loaded_before_a_sleep_serves_the_same_after_it(engine, smol_files, tmp_path):
    from tests.functions.sampler.test_engine_adapters import build_adapter

    assert engine.can_sleep
    engine.load_adapter("a", build_adapter(smol_files, tmp_path / "a", 1, ["q_proj", "v_proj"], rank=8))
    job = SampleJob(PROMPT, 1, SamplingParams(max_tokens=8, temperature=0, stop=[]), adapter="a")
    before = engine.sample([job, greedy()])
    engine.park()
    engine.restore()
    after = engine.sample([job, greedy()])
    assert [r.sequences[0].tokens for r in after] == [r.sequences[0].tokens for r in before]
