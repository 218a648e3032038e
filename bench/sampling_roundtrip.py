"""SDK sampling through `openrl serve` against plain HF `generate` in this process, same batch.

(A) the tinker SDK: P prompts submitted at once with `sample(num_samples=N)`, through the
gateway, the event log, the sampler worker's batched engine and back through the long-poll;
(B) `model.generate(do_sample=True, num_return_sequences=N)` on the same padded batch.
Both generate exactly M tokens per sample (stop=[] / min_new_tokens=M). Runs alternate
A/B; prints medians and the median per-pair ratio SDK/HF. Target: at most 1.0.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from sampler_vs_hf_generate import QUESTIONS

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import tinker
    from tinker import types

    from functions.compute.models import load_causal_lm, load_tokenizer, materialize
    from functions.local_server import LocalServer
    from openrl_core.catalog import BUILTIN

    files = materialize(BUILTIN[MODEL])
    tokenizer = load_tokenizer(files)
    tokenizer.padding_side = "left"
    chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(args.prompts)]
    prompts = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"]) for c in chats]
    model = load_causal_lm(files).eval()
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    key = "tml-bench"

    def hf() -> int:
        with torch.inference_mode():
            out = model.generate(**batch, do_sample=True, num_return_sequences=args.samples, max_new_tokens=args.tokens,
                                 min_new_tokens=args.tokens, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        return out[:, batch["input_ids"].shape[1] :].numel()

    with tempfile.TemporaryDirectory() as data_dir, LocalServer(data_dir, [MODEL], key) as server:
        service = tinker.ServiceClient(base_url=server.url, api_key=key)
        sampler = service.create_sampling_client(base_model=MODEL).result()
        params = types.SamplingParams(max_tokens=args.tokens, stop=[], temperature=1.0)

        def sdk() -> int:
            futures = [
                sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=args.samples, sampling_params=params)
                for p in prompts
            ]
            return sum(len(s.tokens) for f in futures for s in f.result().sequences)

        expected = args.prompts * args.samples * args.tokens
        assert sdk() == expected and hf() == expected  # warm-up, and both do the same work
        sdk_times, hf_times = [], []
        for _ in range(args.rounds):
            for fn, times in ((sdk, sdk_times), (hf, hf_times)):
                started = time.perf_counter()
                fn()
                times.append(time.perf_counter() - started)
        service.close("success").result()
    ratios = [a / b for a, b in zip(sdk_times, hf_times)]
    print(
        f"{MODEL}: {args.prompts} prompts x {args.samples} samples x {args.tokens} tokens, {args.rounds} paired rounds"
    )
    print(f"SDK sample via openrl serve: median {statistics.median(sdk_times):.3f} s")
    print(f"HF generate in-process:      median {statistics.median(hf_times):.3f} s")
    print(f"ratio SDK/HF: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
