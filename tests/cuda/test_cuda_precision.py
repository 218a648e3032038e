"""bf16 training, the memory model and FSDP2 on a CUDA device (scripts/device-check runs these).

- `auto` precision on CUDA is bf16; LoRA and full runs in bf16 on the GPU follow the float32
  CPU reference within the tolerances of tests/functions/trainer/test_precision.py (bf16's
  own rounding dominates; cuBLAS's bf16 kernels round differently from the CPU's, so the same
  bounds must hold, not the same bits);
- the memory model's resident bytes are exactly what torch allocates on the device, and its
  peak for one pass is within 35% of `torch.cuda.max_memory_allocated` (the numbers are
  printed: the device-check log is where docs/memory.md's coefficients get checked on a GPU);
- a one-rank FSDP2 run over NCCL matches the unsharded engine on the same device.
"""

from __future__ import annotations

import os

import pytest
import torch

from functions.trainer.engine import TrainerEngine
from functions.trainer.full import FullFinetuneEngine
from functions.trainer.precision import Precision
from openrl_core import memory
from openrl_core.params import AdamParams, LoraConfig
from tests.functions.trainer.conftest import sft_batch
from tests.functions.trainer.test_precision import assert_close_to_reference, full_steps, lora_steps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/device-check)")

CUDA = "cuda"


def test_auto_is_bf16_on_cuda(tiny_files):
    engine = TrainerEngine(tiny_files, device=CUDA, precision=Precision.resolve("auto", CUDA))
    assert {p.dtype for p in engine._base.parameters()} == {torch.bfloat16}


def test_lora_bf16_on_cuda_follows_float32_on_cpu(tiny_files):
    bf16 = lora_steps(tiny_files, Precision("bfloat16"), device=CUDA)
    assert_close_to_reference(bf16, lora_steps(tiny_files, Precision("float32")), lr=1e-3)


def test_full_bf16_on_cuda_follows_float32_on_cpu(tiny_files):
    bf16 = full_steps(tiny_files, Precision("bfloat16"), device=CUDA)
    assert_close_to_reference(bf16, full_steps(tiny_files, Precision("float32")), lr=1e-4)


@pytest.mark.parametrize("kind", ["lora", "full"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_memory_model_against_the_device_allocator(smol_files, kind, checkpointing):
    shape = memory.shape_of("HuggingFaceTB/SmolLM2-135M-Instruct")
    rows, tokens = 8, 256
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    policy = Precision("bfloat16", checkpointing)
    if kind == "lora":
        engine = TrainerEngine(smol_files, device=CUDA, precision=policy)
        engine.create_adapter("m", LoraConfig(rank=32, seed=1))
        step = lambda: engine.forward_backward("m", sft_batch(0, [tokens] * rows), "cross_entropy", None, False)  # noqa: E731
    else:
        engine = FullFinetuneEngine(smol_files, device=CUDA, precision=policy)
        engine.create("m")
        step = lambda: engine.forward_backward("m", sft_batch(0, [tokens] * rows), "cross_entropy", None, False)  # noqa: E731
    step()  # gradients exist now: resident state complete
    resident = torch.cuda.memory_allocated() - before
    torch.cuda.reset_peak_memory_stats()
    step()
    peak = torch.cuda.max_memory_allocated() - before
    want = memory.estimate(shape, kind, "bfloat16", memory.Batch(rows, tokens), 1, checkpointing, 32)
    print(f"\nmemory {kind} bf16 checkpointing={checkpointing}: resident {resident} (model {want.resident}), "
          f"peak {peak} (model {want.peak})")  # fmt: skip
    assert resident == pytest.approx(want.resident, rel=0.02)
    assert peak == pytest.approx(want.peak, rel=0.35)


def test_one_rank_fsdp_over_nccl_matches_the_unsharded_engine(tiny_files):
    import torch.distributed as dist

    from functions.trainer.fsdp import ShardedFullRun, init_process_group

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_process_group(0, 1, "127.0.0.1", 29655, backend="nccl")
    try:
        run = ShardedFullRun(tiny_files, device=CUDA, precision=Precision("float32"))
        engine = FullFinetuneEngine(tiny_files, device=CUDA)
        engine.create("r")
        for step in range(2):
            batch = sft_batch(step, [5, 17, 33])
            have = run.forward_backward(batch, "cross_entropy", None).metrics["loss:sum"]
            want = engine.forward_backward("r", batch, "cross_entropy", None, False).metrics["loss:sum"]
            assert have == pytest.approx(want, rel=1e-5)
            run.optim_step(AdamParams(learning_rate=1e-4))
            engine.optim_step("r", AdamParams(learning_rate=1e-4))
        weights, want = run.gathered_weights(), engine.weights("r")
        worst = max(float((weights[k] - want[k]).abs().max()) for k in want)
        assert worst <= 2 * 1e-4 * 2
    finally:
        dist.destroy_process_group()
