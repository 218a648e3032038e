"""RL with a verifiable reward (RLVR) on arithmetic: the classic loop, with nothing but the tinker SDK.

Each step: sample N rollouts per problem from the current weights, score each with a reward a
program can check (the last integer in the reply equals the sum), turn the rewards into
advantages (reward minus the group's mean), `forward_backward` with `importance_sampling` on the
sampler's own logprobs, `optim_step`, publish the weights for the next step's sampler. Point it
at any Tinker-compatible server (TINKER_BASE_URL, TINKER_API_KEY); `make recipe-rlvr` starts
`openrl serve` and runs it. The reward curve goes to `<out>.jsonl` and `<out>.png`; greedy
accuracy on a fixed set of problems is printed before and after (with 1-digit sums there are
only 100 problems, so that set is not held out from training).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time

import tinker
from curves import CurveLog
from tinker import types

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def make_problem(rng: random.Random, digits: int) -> tuple[str, int]:
    a, b = rng.randrange(10 ** (digits - 1), 10**digits), rng.randrange(10 ** (digits - 1), 10**digits)
    return f"{a} + {b}", a + b


def prompt_tokens(tokenizer, problem: str) -> list[int]:
    # One solved turn first (ChatML, no system prompt): it shows the answer format, a bare number.
    return tokenizer.encode(
        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n7<|im_end|>\n"
        f"<|im_start|>user\nWhat is {problem}?<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )


def score(text: str, answer: int) -> float:
    """The verifiable reward: 1 when the last integer in the reply is the answer ("12 + 7 = 19" counts)."""
    found = re.findall(r"-?\d+", text.replace(",", ""))
    return float(bool(found) and int(found[-1]) == answer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", default=BASE_MODEL)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--problems", type=int, default=8, help="problems per step")
    parser.add_argument("--rollouts", type=int, default=8, help="samples per problem (N)")
    # SmolLM2-135M gets about 15% of 1-digit sums right and almost no 2-digit ones: RL needs
    # a group in which some rollouts succeed to have anything to learn from.
    parser.add_argument("--digits", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--eval-problems", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/rlvr_arithmetic")
    args = parser.parse_args()
    started = time.monotonic()
    rng = random.Random(args.seed)
    evaluation = [make_problem(random.Random(10_000 + i), args.digits) for i in range(args.eval_problems)]

    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=args.base_model, rank=args.rank, seed=args.seed).result()
    tokenizer = training.get_tokenizer()
    stop = ["\n", "<|im_end|>"]

    def accuracy(sampler) -> float:
        greedy = types.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop=stop)
        futures = [
            sampler.sample(types.ModelInput.from_ints(prompt_tokens(tokenizer, p)), 1, greedy) for p, _ in evaluation
        ]
        return sum(
            score(tokenizer.decode(f.result().sequences[0].tokens, skip_special_tokens=True), a)
            for f, (_, a) in zip(futures, evaluation)
        ) / len(evaluation)

    sampler = training.save_weights_and_get_sampling_client().result()
    before = accuracy(sampler)
    print(f"greedy accuracy on the evaluation problems before: {before:.1%}", flush=True)
    log = CurveLog(
        args.out,
        args.steps,
        f"RLVR arithmetic ({args.digits}-digit sums), {args.base_model.split('/')[-1]} LoRA r={args.rank}",
    )
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=stop)
    adam = types.AdamParams(learning_rate=args.learning_rate)

    for step in range(1, args.steps + 1):
        # 1. sample N rollouts per problem from the current weights (all in flight at once)
        problems = [make_problem(rng, args.digits) for _ in range(args.problems)]
        prompts = [prompt_tokens(tokenizer, p) for p, _ in problems]
        futures = [sampler.sample(types.ModelInput.from_ints(p), args.rollouts, params) for p in prompts]
        data, rewards = [], []
        for prompt, (_, answer), future in zip(prompts, problems, futures):
            rollouts = future.result().sequences
            # 2. score them with the verifiable reward
            group = [score(tokenizer.decode(r.tokens, skip_special_tokens=True), answer) for r in rollouts]
            rewards += group
            # 3. advantages: reward minus the group mean (a group that all agree teaches nothing)
            mean = sum(group) / len(group)
            if all(r == mean for r in group):
                continue
            for rollout, r in zip(rollouts, group):
                tokens = prompt + list(rollout.tokens)
                pad = [0.0] * (len(prompt) - 1)
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": tokens[1:],
                            "logprobs": pad + list(rollout.logprobs),
                            "advantages": pad + [r - mean] * len(rollout.tokens),
                        },
                    )
                )
        # 4. forward_backward with importance_sampling, 5. optim_step, then publish for sampling
        loss = None
        if data:
            # In pieces of 16 sequences (gradients add up until optim_step): bounds trainer memory.
            pieces = [
                training.forward_backward(data[i : i + 16], "importance_sampling") for i in range(0, len(data), 16)
            ]
            training.optim_step(adam).result()
            loss = sum(piece.result().metrics["loss:sum"] for piece in pieces)
            sampler = training.save_weights_and_get_sampling_client().result()
        log.record(step, reward=sum(rewards) / len(rewards), trained_rollouts=len(data), loss=loss)

    after = accuracy(sampler)
    wall = time.monotonic() - started
    print(f"greedy accuracy on the evaluation problems before: {before:.1%}  after: {after:.1%}")
    log.plot(["reward"], smooth=3, ylabel="mean reward of the step's rollouts")
    with open(args.out + ".summary.json", "w") as handle:
        json.dump({"before": before, "after": after, "wall_s": round(wall, 1), "steps": args.steps}, handle)
    print(f"reward curve: {log.png_path} ({log.jsonl_path}); wall time {wall:.0f} s")
    service.close("success").result()


if __name__ == "__main__":
    main()
