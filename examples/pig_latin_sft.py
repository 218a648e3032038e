"""Teach SmolLM2-135M-Instruct Pig Latin with a LoRA adapter, using only the tinker SDK.

Point it at any Tinker-compatible server (TINKER_BASE_URL, TINKER_API_KEY); `make demo`
starts `openrl serve` and runs it. The words come from the model's own tokenizer, the
translations from a fixed rule, so nothing is downloaded. It prints held-out exact-match
accuracy before and after training and saves the loss curve as a PNG.
"""

from __future__ import annotations

import argparse
import random
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402
from tqdm import tqdm  # noqa: E402

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
VOWELS = "aeiou"


def pig_latin(word: str) -> str:
    """Move the leading consonant cluster to the end and add "ay"; vowel-initial words add "way"."""
    if word[0] in VOWELS:
        return word + "way"
    for i, letter in enumerate(word):
        if letter in VOWELS or (letter == "y" and i > 0):
            return word[i:] + word[:i] + "ay"
    return word + "ay"


def vocabulary_words(tokenizer, count: int, seed: int) -> list[str]:
    """Whole lower-case words that are single tokens of the model's vocabulary."""
    words = set()
    for token in tokenizer.get_vocab():
        text = tokenizer.convert_tokens_to_string([token])
        if text.startswith(" ") and text[1:].isalpha() and text[1:].islower() and 4 <= len(text) - 1 <= 7:
            words.add(text[1:])
    ordered = sorted(words)
    random.Random(seed).shuffle(ordered)
    return ordered[:count]


def prompt_tokens(tokenizer, word: str) -> list[int]:
    # ChatML without the template's default system prompt: 14 tokens instead of ~40, so a
    # step on the CPU costs a third as much and the answer tokens carry the whole loss.
    return tokenizer.encode(f"<|im_start|>user\nPig Latin: {word}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def make_datum(tokenizer, word: str) -> types.Datum:
    prompt = prompt_tokens(tokenizer, word)
    answer = tokenizer.encode(pig_latin(word) + "<|im_end|>", add_special_tokens=False)
    tokens = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def accuracy(sampler, tokenizer, words: list[str]) -> float:
    """Greedy decoding, all requests in flight at once so the server can batch them."""
    params = types.SamplingParams(max_tokens=16, temperature=0.0)
    futures = [
        sampler.sample(prompt=types.ModelInput.from_ints(prompt_tokens(tokenizer, w)), num_samples=1, sampling_params=params)
        for w in words
    ]
    correct = 0
    for word, future in zip(words, futures):
        text = tokenizer.decode(future.result().sequences[0].tokens, skip_special_tokens=True).strip()
        correct += text == pig_latin(word)
    return correct / len(words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    # Thousands of distinct words seen once each generalise; a few hundred seen many times
    # are memorised (measured: 480 words x 4 epochs reach 10% held-out, 4800 x 1 reach 34%).
    parser.add_argument("--train-words", type=int, default=4800)
    parser.add_argument("--test-words", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="out/pig_latin_loss.png")
    args = parser.parse_args()
    started = time.monotonic()

    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=args.rank, seed=args.seed).result()
    tokenizer = training.get_tokenizer()
    words = vocabulary_words(tokenizer, args.train_words + args.test_words, args.seed)
    train, test = words[: args.train_words], words[args.train_words :]
    print(f"{len(train)} training words, {len(test)} held out; e.g. {test[0]} -> {pig_latin(test[0])}")

    before = accuracy(training.save_weights_and_get_sampling_client().result(), tokenizer, test)
    print(f"held-out exact match before training: {before:.1%}")

    data = [make_datum(tokenizer, w) for w in train]
    adam = types.AdamParams(learning_rate=args.learning_rate)
    rng = random.Random(args.seed)
    steps = args.epochs * (len(data) // args.batch_size)
    losses: list[float] = []
    with tqdm(total=steps, desc="training", unit="step") as bar:
        for _epoch in range(args.epochs):
            rng.shuffle(data)
            for start in range(0, len(data) - args.batch_size + 1, args.batch_size):
                batch = data[start : start + args.batch_size]
                fb = training.forward_backward(batch, "cross_entropy")
                opt = training.optim_step(adam)
                output = fb.result()
                opt.result()
                tokens = sum(sum(d.loss_fn_inputs["weights"].to_numpy()) for d in batch)
                losses.append(output.metrics["loss:sum"] / tokens)
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
                bar.update()

    after = accuracy(training.save_weights_and_get_sampling_client().result(), tokenizer, test)
    print(f"held-out exact match after training:  {after:.1%}")

    import os

    os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
    plt.figure(figsize=(6, 3.5))
    plt.plot(range(1, len(losses) + 1), losses)
    plt.xlabel("step")
    plt.ylabel("loss per target token")
    plt.title(f"Pig Latin SFT, {BASE_MODEL.split('/')[-1]} LoRA r={args.rank}")
    plt.tight_layout()
    plt.savefig(args.plot, dpi=120)
    print(f"loss curve: {args.plot}")
    print(f"wall time: {time.monotonic() - started:.0f} s")
    service.close("success").result()


if __name__ == "__main__":
    main()
