"""Teach SmolLM2-135M-Instruct Pig Latin with a LoRA adapter, using only the tinker SDK.

Point it at any Tinker-compatible server (TINKER_BASE_URL, TINKER_API_KEY); `make demo`
starts `openrl serve` and runs it. The words come from the model's own tokenizer, the
translations from a fixed rule, so nothing is downloaded. It prints held-out exact-match
accuracy before and after training and writes the loss curve to `<out>.jsonl` and `<out>.png`.

By default the word and its translation are spelled out letter by letter ("Pig Latin: s t r i n g"
-> "i n g s t r a y"), and the learning rate decays linearly to zero. The vocabulary's words are
single tokens, whose spelling a 135M model barely knows; spelled out, the task is moving letters
it can see. Measured with 640 training words (20 steps): 8.3% held-out exact match with the bare
word, 10.0% with only the prompt spelled, 96.7% with both spelled (README.md at 4a6a950, "Recipes").
`--bare-word --constant-lr --train-words 4800` is the first version of this demo (`make demo-long`).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import tinker
from curves import CurveLog
from tinker import types

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


def spell(word: str) -> str:
    return " ".join(word)


def prompt_tokens(tokenizer, word: str, spelled: bool) -> list[int]:
    # ChatML without the template's default system prompt: far fewer tokens than its ~40, so
    # a step on the CPU costs a fraction as much and the answer tokens carry the whole loss.
    shown = spell(word) if spelled else word
    return tokenizer.encode(
        f"<|im_start|>user\nPig Latin: {shown}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )


def make_datum(tokenizer, word: str, spelled: bool) -> types.Datum:
    prompt = prompt_tokens(tokenizer, word, spelled)
    target = spell(pig_latin(word)) if spelled else pig_latin(word)
    answer = tokenizer.encode(target + "<|im_end|>", add_special_tokens=False)
    tokens = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def accuracy(sampler, tokenizer, words: list[str], spelled: bool) -> float:
    """Greedy decoding, all requests in flight at once so the server can batch them."""
    params = types.SamplingParams(max_tokens=24, temperature=0.0)
    futures = [
        sampler.sample(
            prompt=types.ModelInput.from_ints(prompt_tokens(tokenizer, w, spelled)),
            num_samples=1,
            sampling_params=params,
        )
        for w in words
    ]
    correct = 0
    for word, future in zip(words, futures):
        text = tokenizer.decode(future.result().sequences[0].tokens, skip_special_tokens=True).strip()
        # Spelled answers are compared letter for letter: the same word, its spaces dropped.
        correct += (text.replace(" ", "") if spelled else text) == pig_latin(word)
    return correct / len(words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", default=BASE_MODEL)
    # Distinct words seen once each generalise; a few hundred seen many times are memorised
    # (measured with the bare-word prompt: 480 words x 4 epochs reach 10% held-out, 4800 x 1 34%).
    parser.add_argument("--train-words", type=int, default=640)
    parser.add_argument("--test-words", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="peak; decays linearly to 0 over the run")
    parser.add_argument("--constant-lr", action="store_true", help="no decay (the first version of this demo)")
    parser.add_argument(
        "--bare-word", action="store_true", help="the word and its translation as such, not spelled out"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/pig_latin", help="writes <out>.jsonl, <out>.png, <out>.summary.json")
    args = parser.parse_args()
    started = time.monotonic()
    spelled = not args.bare_word

    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=args.base_model, rank=args.rank, seed=args.seed).result()
    tokenizer = training.get_tokenizer()
    words = vocabulary_words(tokenizer, args.train_words + args.test_words, args.seed)
    train, test = words[: args.train_words], words[args.train_words :]
    print(f"{len(train)} training words, {len(test)} held out; e.g. {test[0]} -> {pig_latin(test[0])}")

    before = accuracy(training.save_weights_and_get_sampling_client().result(), tokenizer, test, spelled)
    print(f"held-out exact match before training: {before:.1%}", flush=True)

    data = [make_datum(tokenizer, w, spelled) for w in train]
    rng = random.Random(args.seed)
    steps = args.epochs * (len(data) // args.batch_size)
    log = CurveLog(args.out, steps, f"Pig Latin SFT, {args.base_model.split('/')[-1]} LoRA r={args.rank}")
    step = 0
    for _epoch in range(args.epochs):
        rng.shuffle(data)
        for start in range(0, len(data) - args.batch_size + 1, args.batch_size):
            batch = data[start : start + args.batch_size]
            lr = args.learning_rate * (1.0 if args.constant_lr else 1.0 - step / steps)
            fb = training.forward_backward(batch, "cross_entropy")
            opt = training.optim_step(types.AdamParams(learning_rate=lr))
            output = fb.result()
            opt.result()
            step += 1
            tokens = float(sum(d.loss_fn_inputs["weights"].to_numpy().sum() for d in batch))
            log.record(step, loss=float(output.metrics["loss:sum"]) / tokens, learning_rate=lr)

    after = accuracy(training.save_weights_and_get_sampling_client().result(), tokenizer, test, spelled)
    wall = time.monotonic() - started
    print(f"held-out exact match before: {before:.1%}  after: {after:.1%}")
    log.plot(["loss"], ylabel="loss per target token")
    with open(args.out + ".summary.json", "w") as handle:
        json.dump(
            {
                "before": before,
                "after": after,
                "wall_s": round(wall, 1),
                "steps": steps,
                "train_words": len(train),
                "spelled": spelled,
                "constant_lr": args.constant_lr,
            },
            handle,
        )
    print(f"loss curve: {log.png_path} ({log.jsonl_path}); wall time {wall:.0f} s")
    service.close("success").result()


if __name__ == "__main__":
    main()
