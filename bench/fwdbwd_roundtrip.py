"""SDK forward_backward + optim_step round trip vs. a direct in-process peft step, same batch.

Side by side in one run, alternating A/B so machine drift hits both: (A) the tinker SDK
against `openrl serve` (HTTP → gateway → event store → log → trainer → log → projector →
long-poll), (B) the same LoRA step done directly with transformers + peft + torch AdamW in
this process. Prints the median of each and the median of the per-pair ratios A/B.
Target (issue 10): at most 1.05, on the default and on the tiny model (`--model openrl/tiny-qwen3 --seq 32 --rank 8`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def make_batch(vocab: int, batch: int, seq: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, min(vocab, 20000), size=seq + 1).tolist() for _ in range(batch)]


class DirectPeft:
    def __init__(self, files, rank: int, lr: float, device: str = "cpu") -> None:
        from peft import LoraConfig, get_peft_model

        from functions.compute.models import load_causal_lm

        base = load_causal_lm(files, device=device)
        self.device = device
        self.model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=lr,
            betas=(0.9, 0.95),
            eps=1e-12,
            weight_decay=0.0,
        )

    def step(self, sequences) -> float:
        tokens = torch.tensor([s[:-1] for s in sequences], device=self.device)
        targets = torch.tensor([s[1:] for s in sequences], device=self.device)
        logits = self.model(input_ids=tokens).logits
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        loss = -logprobs.sum()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()  # .item() waits for the device: the step is done when this returns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu", help="torch device of both sides: cpu or cuda")
    args = parser.parse_args()

    import tinker
    from tinker import types

    from functions.compute.models import materialize
    from functions.local_server import LocalServer
    from openrl_core.catalog import BUILTIN

    files = materialize(BUILTIN[args.model])
    sequences = make_batch(files.vocab_size, args.batch, args.seq)
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * args.seq},
        )
        for s in sequences
    ]
    adam = types.AdamParams(learning_rate=1e-4)
    direct = DirectPeft(files, args.rank, 1e-4, args.device)
    key = "tml-bench"
    with (
        tempfile.TemporaryDirectory() as data_dir,
        LocalServer(data_dir, [args.model], key, extra_env={"OPENRL_DEVICE": args.device}) as server,
    ):
        client = tinker.ServiceClient(base_url=server.url, api_key=key)
        training = client.create_lora_training_client(base_model=args.model, rank=args.rank, seed=0).result()

        def sdk_step() -> float:
            fb = training.forward_backward(data, "cross_entropy")
            opt = training.optim_step(adam)
            loss = fb.result().metrics["loss:sum"]
            opt.result()
            return loss

        sdk_step(), direct.step(sequences)  # warm-up: first-touch allocations, lazy loads
        sdk_times, direct_times = [], []
        for _ in range(args.rounds):
            started = time.perf_counter()
            sdk_step()
            sdk_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            direct.step(sequences)
            direct_times.append(time.perf_counter() - started)
        client.close("success").result()
    ratios = [a / b for a, b in zip(sdk_times, direct_times)]
    print(
        f"model {args.model} on {args.device}, LoRA rank {args.rank}, batch {args.batch} x {args.seq} tokens, {args.rounds} paired rounds"
    )
    print(f"SDK forward_backward+optim_step round trip: median {statistics.median(sdk_times) * 1000:.0f} ms")
    print(f"direct in-process peft step:                median {statistics.median(direct_times) * 1000:.0f} ms")
    print(f"ratio SDK/direct: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
