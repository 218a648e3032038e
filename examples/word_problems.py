"""Grade-school math word problems of GSM8K's shape, generated offline, with a checkable answer.

Each problem is a short story with one to three arithmetic steps (add, take away, groups of,
share equally, then a second or third step on the result) and an integer answer; the reward
is 1 when the last number in the model's reply is that answer (GSM8K's own grading, which
reads the final number). Nothing is downloaded: `make_problem(rng)` draws a template, names,
items and numbers from `rng`, so a seed fixes the whole stream. `split(seed, n_eval)` gives a
held-out set and a training stream that never yields a held-out problem's text.

The numbers are small (answers below 200) because the model is SmolLM2-135M-Instruct on a
CPU: it must get some problems right for group-relative advantages to have a signal.
"""

from __future__ import annotations

import random
import re
from typing import Callable, Iterator

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Finn", "Grace", "Hugo", "Isla", "Jack", "Lena", "Milo", "Nora", "Omar"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "stamps", "cards", "beads"]
CONTAINERS = ["bags", "boxes", "jars", "packs", "baskets"]

# A problem is (question, worked answer line, answer). The worked line ("3 + 4 = 7") is what
# the one solved example in the prompt shows; the model's own line is graded by its last number.
Problem = tuple[str, str, int]


def _add(rng: random.Random, name: str, item: str) -> Problem:
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    return (
        f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?",
        f"{a} + {b} = {a + b}",
        a + b,
    )


def _take(rng: random.Random, name: str, item: str) -> Problem:
    a = rng.randint(10, 40)
    b = rng.randint(1, a - 1)
    return (
        f"{name} had {a} {item} and gave {b} of them to a friend. How many {item} does {name} have left?",
        f"{a} - {b} = {a - b}",
        a - b,
    )


def _groups(rng: random.Random, name: str, item: str) -> Problem:
    a, b, box = rng.randint(2, 9), rng.randint(2, 9), rng.choice(CONTAINERS)
    return (
        f"{name} buys {a} {box} of {item}. Each of the {box} holds {b} {item}. How many {item} does {name} buy?",
        f"{a} * {b} = {a * b}",
        a * b,
    )


def _share(rng: random.Random, name: str, item: str) -> Problem:
    each, friends = rng.randint(2, 9), rng.randint(2, 6)
    total = each * friends
    return (
        f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?",
        f"{total} / {friends} = {each}",
        each,
    )


def _add_then_take(rng: random.Random, name: str, item: str) -> Problem:
    a, b = rng.randint(5, 30), rng.randint(2, 20)
    c = rng.randint(1, a + b - 1)
    return (
        f"{name} has {a} {item}, finds {b} more, then gives away {c}. How many {item} does {name} have now?",
        f"{a} + {b} - {c} = {a + b - c}",
        a + b - c,
    )


def _groups_then_add(rng: random.Random, name: str, item: str) -> Problem:
    a, b, c, box = rng.randint(2, 6), rng.randint(2, 9), rng.randint(1, 15), rng.choice(CONTAINERS)
    return (
        f"{name} has {a} {box} with {b} {item} in each, and {c} loose {item}. How many {item} does {name} have in all?",
        f"{a} * {b} + {c} = {a * b + c}",
        a * b + c,
    )


def _two_people(rng: random.Random, name: str, item: str) -> Problem:
    other = rng.choice([n for n in NAMES if n != name])
    a, more = rng.randint(3, 25), rng.randint(2, 15)
    return (
        f"{name} has {a} {item}. {other} has {more} more {item} than {name}. How many {item} do they have together?",
        f"{a} + {a} + {more} = {2 * a + more}",
        2 * a + more,
    )


TEMPLATES: list[Callable[[random.Random, str, str], Problem]] = [
    _add, _take, _groups, _share, _add_then_take, _groups_then_add, _two_people,
]  # fmt: skip


def make_problem(rng: random.Random) -> Problem:
    return rng.choice(TEMPLATES)(rng, rng.choice(NAMES), rng.choice(ITEMS))


def split(seed: int, n_eval: int) -> tuple[list[Problem], Callable[[random.Random], Iterator[Problem]]]:
    """A held-out set (fixed by `seed`) and a factory of training streams that skip its questions."""
    rng = random.Random(f"held-out-{seed}")
    held_out: list[Problem] = []
    seen: set[str] = set()
    while len(held_out) < n_eval:
        problem = make_problem(rng)
        if problem[0] not in seen:
            seen.add(problem[0])
            held_out.append(problem)

    def stream(rng: random.Random) -> Iterator[Problem]:
        while True:
            problem = make_problem(rng)
            if problem[0] not in seen:
                yield problem

    return held_out, stream


# One solved problem first (ChatML, as SmolLM2-Instruct's chat template writes it): it shows
# the answer format, one line of arithmetic ending in the result.
EXAMPLE = ("Sam has 4 pens. Sam gets 3 more. How many pens does Sam have now?", "4 + 3 = 7")


def prompt_text(question: str) -> str:
    return (
        f"<|im_start|>user\n{EXAMPLE[0]}<|im_end|>\n<|im_start|>assistant\n{EXAMPLE[1]}<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )


def score(text: str, answer: int) -> float:
    """1 when the last number in the reply is the answer ("3 * 4 = 12" counts), else 0."""
    found = re.findall(r"-?\d+", text.replace(",", ""))
    return float(bool(found) and int(found[-1]) == answer)
