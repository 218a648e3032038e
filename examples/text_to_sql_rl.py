"""Text-to-SQL with reinforcement learning: SmolLM2-135M-Instruct + LoRA, rewarded by execution.

Uses only the public `tinker` SDK against any Tinker-compatible server (TINKER_BASE_URL,
TINKER_API_KEY); `make recipe-sql` starts `openrl serve` and runs it. Nothing is downloaded:
the recipe builds a small SQLite database (tables `employees`, `departments` and `projects`,
seeded rows, joined on department names) and question/SQL pairs from templates, single-table
ones and joins with aggregates over the joined rows, split so that no held-out query is
trained on. Each prompt shows one
solved training question of the same template (never the question's own query). The reward executes
the model's query: 1 when its result set equals the reference query's, plus 0.1 for a query
that runs and ends in ';'. Each step samples a group of completions per question, takes GRPO-style
advantages (reward minus the group mean), trains with the `importance_sampling` loss on the
sampler's logprobs and publishes the new weights to the next step's sampler. Held-out
execution accuracy (greedy) is measured before and after; the curve goes to
`<out>.jsonl` / `<out>.png`.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import time

import tinker
from curves import CurveLog
from tinker import types

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

DEPARTMENTS = ["Sales", "Marketing", "Finance", "Legal", "Support", "Research", "Design", "Operations"]
CITIES = ["Paris", "Berlin", "Tokyo", "Lima", "Oslo", "Cairo", "Austin", "Seoul"]
FIRST_NAMES = [
    "Ana",
    "Ben",
    "Chen",
    "Dara",
    "Eli",
    "Fay",
    "Gus",
    "Hana",
    "Ivan",
    "Jo",
    "Kai",
    "Lea",
    "Max",
    "Nia",
    "Omar",
    "Pia",
]
PROJECTS = [
    "Apollo",
    "Boreal",
    "Cobalt",
    "Delta",
    "Ember",
    "Falcon",
    "Granite",
    "Harbor",
    "Iris",
    "Juniper",
    "Kestrel",
    "Lumen",
    "Meridian",
    "Nimbus",
    "Orchid",
    "Pulsar",
]
# employees.department and projects.department name a row of departments: the join key.
SCHEMA = [
    "CREATE TABLE departments (name TEXT PRIMARY KEY, floor INTEGER, budget INTEGER);",
    "CREATE TABLE employees (name TEXT, department TEXT REFERENCES departments(name), city TEXT, salary INTEGER, age INTEGER);",
    "CREATE TABLE projects (title TEXT PRIMARY KEY, department TEXT REFERENCES departments(name), hours INTEGER);",
]
# The prompt's schema, in about 30 tokens; budgets are in thousands so numbers stay short.
TABLES = "Tables: employees(name, department, city, salary, age); departments(name, floor, budget); projects(title, department, hours)"

# (question templates, SQL template, slot kinds). Two phrasings per query so the policy must
# read the question, not match one surface form. The join templates go through
# employees.department = departments.name or employees.department = projects.department.
JOIN_ED = "FROM employees e JOIN departments d ON e.department = d.name"
JOIN_EP = "FROM employees e JOIN projects p ON e.department = p.department"
TEMPLATES = [
    (
        ["How many employees work in {dept}?", "Count the employees in the {dept} department."],
        "SELECT COUNT(*) FROM employees WHERE department = '{dept}';",
        ("dept",),
    ),
    (
        ["How many employees live in {city}?", "Count the employees based in {city}."],
        "SELECT COUNT(*) FROM employees WHERE city = '{city}';",
        ("city",),
    ),
    (
        ["List the names of employees in {city}.", "Who lives in {city}?"],
        "SELECT name FROM employees WHERE city = '{city}';",
        ("city",),
    ),
    (
        ["List the names of employees in the {dept} department.", "Who works in {dept}?"],
        "SELECT name FROM employees WHERE department = '{dept}';",
        ("dept",),
    ),
    (
        ["List the names of employees older than {age}.", "Which employees are older than {age}?"],
        "SELECT name FROM employees WHERE age > {age};",
        ("age",),
    ),
    (
        ["List the names of employees younger than {age}.", "Which employees are younger than {age}?"],
        "SELECT name FROM employees WHERE age < {age};",
        ("age",),
    ),
    (
        ["What is the average salary in {dept}?", "Give the mean salary of the {dept} department."],
        "SELECT AVG(salary) FROM employees WHERE department = '{dept}';",
        ("dept",),
    ),
    (
        ["What is the highest salary in {city}?", "What is the top salary paid in {city}?"],
        "SELECT MAX(salary) FROM employees WHERE city = '{city}';",
        ("city",),
    ),
    (
        ["What is the lowest salary in {dept}?", "What is the smallest salary in the {dept} department?"],
        "SELECT MIN(salary) FROM employees WHERE department = '{dept}';",
        ("dept",),
    ),
    (
        ["How many employees earn more than {salary}?", "Count the employees with a salary above {salary}."],
        "SELECT COUNT(*) FROM employees WHERE salary > {salary};",
        ("salary",),
    ),
    (
        ["Which employees work in {dept} and live in {city}?", "List the {dept} employees based in {city}."],
        "SELECT name FROM employees WHERE department = '{dept}' AND city = '{city}';",
        ("dept", "city"),
    ),
    (
        ["How many projects does the {dept} department run?", "Count the projects of the {dept} department."],
        "SELECT COUNT(*) FROM projects WHERE department = '{dept}';",
        ("dept",),
    ),
    # Joins, most with an aggregate over the joined rows.
    (
        ["How many employees work on floor {floor}?", "Count the employees whose department is on floor {floor}."],
        f"SELECT COUNT(*) {JOIN_ED} WHERE d.floor = {{floor}};",
        ("floor",),
    ),
    (
        ["List the names of employees who work on floor {floor}.", "Who works on floor {floor}?"],
        f"SELECT e.name {JOIN_ED} WHERE d.floor = {{floor}};",
        ("floor",),
    ),
    (
        ["What is the average salary on floor {floor}?", "Give the mean salary of the employees on floor {floor}."],
        f"SELECT AVG(e.salary) {JOIN_ED} WHERE d.floor = {{floor}};",
        ("floor",),
    ),
    (
        [
            "How many employees in {city} work in a department with a budget over {budget}?",
            "Count the employees based in {city} whose department's budget is above {budget}.",
        ],
        f"SELECT COUNT(*) {JOIN_ED} WHERE e.city = '{{city}}' AND d.budget > {{budget}};",
        ("city", "budget"),
    ),
    (
        [
            "How many employees work in the department that runs {project}?",
            "Count the employees of the department behind project {project}.",
        ],
        f"SELECT COUNT(*) {JOIN_EP} WHERE p.title = '{{project}}';",
        ("project",),
    ),
    (
        [
            "What is the highest salary in the department that runs {project}?",
            "What is the top salary in the department behind project {project}?",
        ],
        f"SELECT MAX(e.salary) {JOIN_EP} WHERE p.title = '{{project}}';",
        ("project",),
    ),
    (
        [
            "Which projects are run by departments on floor {floor}?",
            "List the projects of the departments on floor {floor}.",
        ],
        "SELECT p.title FROM projects p JOIN departments d ON p.department = d.name WHERE d.floor = {floor};",
        ("floor",),
    ),
]
SLOT_VALUES = {
    "dept": DEPARTMENTS,
    "city": CITIES,
    "age": list(range(25, 61, 5)),
    "salary": list(range(40000, 120001, 10000)),
    "floor": [1, 2, 3, 4],
    "budget": [200, 400, 600, 800],
    "project": PROJECTS,
}


def build_database(seed: int, rows: int = 64) -> sqlite3.Connection:
    """Departments (floor 1-4, budget in thousands), `rows` employees and the projects, seeded."""
    rng = random.Random(seed)
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    for statement in SCHEMA:
        conn.execute(statement)
    for i in range(rows):
        name = f"{FIRST_NAMES[i % len(FIRST_NAMES)]} {chr(65 + i // len(FIRST_NAMES))}."
        conn.execute(
            "INSERT INTO employees VALUES (?, ?, ?, ?, ?)",
            (name, rng.choice(DEPARTMENTS), rng.choice(CITIES), rng.randrange(35000, 125001, 500), rng.randint(22, 64)),
        )
    # Employees are drawn first, so their rows are those of the one-table version for a seed.
    for dept in DEPARTMENTS:
        conn.execute(
            "INSERT INTO departments VALUES (?, ?, ?)", (dept, rng.randint(1, 4), rng.randrange(100, 1000, 50))
        )
    for title in PROJECTS:
        conn.execute(
            "INSERT INTO projects VALUES (?, ?, ?)", (title, rng.choice(DEPARTMENTS), rng.randrange(100, 2001, 50))
        )
    return conn


def run_query(conn: sqlite3.Connection, sql: str):
    """The result set as a sorted list of rows (order-insensitive, floats rounded), or None on any error."""
    # A runaway query (a model can write a cross join of cross joins) is cut off, not waited for.
    budget = [200_000]

    def tick() -> int:
        budget[0] -= 1
        return budget[0] <= 0

    conn.set_progress_handler(tick, 100)
    try:
        rows = conn.execute(sql).fetchmany(1000)
    except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError):
        return None
    finally:
        conn.set_progress_handler(None, 0)
    return sorted((tuple(round(v, 4) if isinstance(v, float) else v for v in row) for row in rows), key=repr)


def make_questions(conn: sqlite3.Connection, seed: int, test_fraction: float) -> tuple[list[dict], list[dict]]:
    """Every template x slot value x phrasing whose reference returns something, split by seed."""
    items = []
    for template, (phrasings, sql_template, slots) in enumerate(TEMPLATES):
        combos = [{}]
        for slot in slots:
            combos = [dict(c, **{slot: v}) for c in combos for v in SLOT_VALUES[slot]]
        for values in combos:
            sql = sql_template.format(**values)
            result = run_query(conn, sql)
            # An empty reference (or a count of 0) would reward many wrong queries by accident.
            if not result or result == [(0,)] or result == [(None,)]:
                continue
            for phrasing in phrasings:
                items.append(
                    {"question": phrasing.format(**values), "sql": sql, "result": result, "template": template}
                )
    # Split by reference query, so the two phrasings of one query land in the same split.
    queries = sorted({item["sql"] for item in items})
    random.Random(seed).shuffle(queries)
    held_out = set(queries[: int(len(queries) * test_fraction)])
    train = [item for item in items if item["sql"] not in held_out]
    test = [item for item in items if item["sql"] in held_out]
    return train, test


def worked_example(item: dict, train: list[dict]) -> dict:
    """A training question of the same template but another query, chosen by the question text.

    Retrieving a similar solved example (as DAIL-SQL and most few-shot text-to-SQL systems do)
    gives the 135M model a 40% start instead of 5% with fixed examples; what it still has to
    learn is to read the question's own values and columns rather than copy the example's.
    """
    same = [other for other in train if other["template"] == item["template"] and other["sql"] != item["sql"]]
    return random.Random(item["question"]).choice(same or train)


def prompt_text(item: dict, train: list[dict]) -> str:
    # ChatML without a system prompt: short prompts are cheap on a CPU, and the trainer's cost
    # and memory grow with every token of every sample. The answer starts "SQL: SELECT"
    # already written, so every sample is a query from its first token.
    shot = worked_example(item, train)
    return (
        f"<|im_start|>user\n{TABLES}\nQ: {shot['question']}\nSQL: {shot['sql']}\nQ: {item['question']}<|im_end|>\n"
        "<|im_start|>assistant\nSQL: SELECT"
    )


def completion_sql(text: str) -> str:
    return "SELECT" + text.split(";")[0] + ";"


def reward(conn: sqlite3.Connection, item: dict, text: str) -> tuple[float, bool]:
    """(reward, correct): 1 for the reference's result set, +0.1 for a query that runs and ends in ';'."""
    result = run_query(conn, completion_sql(text))
    ran = result is not None and text.rstrip().endswith(";")
    correct = result is not None and result == item["result"]
    return float(correct) + 0.1 * ran, correct


def sampling_params(args, temperature: float) -> types.SamplingParams:
    # Stop at the end of the statement or the line: the worked example shows one query per line.
    return types.SamplingParams(max_tokens=args.max_tokens, temperature=temperature, stop=[";", "\n", "<|im_end|>"])


def is_join(item: dict) -> bool:
    return " JOIN " in item["sql"]


def accuracies(items: list[dict], correct: list[bool]) -> dict:
    """Execution accuracy over all items, and over the join and the single-table ones apart."""

    def share(keep) -> float | None:
        picked = [c for item, c in zip(items, correct) if keep(item)]
        return sum(picked) / len(picked) if picked else None

    return {"all": share(lambda _: True), "join": share(is_join), "single_table": share(lambda i: not is_join(i))}


def evaluate(sampler, tokenizer, conn, items: list[dict], train: list[dict], args) -> dict:
    """Greedy execution accuracy (see `accuracies`); every request in flight at once so the server batches them."""
    futures = [
        sampler.sample(
            prompt=types.ModelInput.from_ints(tokenizer.encode(prompt_text(item, train), add_special_tokens=False)),
            num_samples=1,
            sampling_params=sampling_params(args, 0.0),
        )
        for item in items
    ]
    correct = []
    for item, future in zip(items, futures):
        text = tokenizer.decode(future.result().sequences[0].tokens, skip_special_tokens=True)
        correct.append(reward(conn, item, text)[1])
    return accuracies(items, correct)


def shown(accuracy: dict) -> str:
    parts = [f"{accuracy['all']:.1%}"] + [
        f"{name} {accuracy[key]:.1%}"
        for key, name in (("join", "joins"), ("single_table", "single-table"))
        if accuracy[key] is not None
    ]
    return f"{parts[0]} ({', '.join(parts[1:])})"


def group_datums(prompt: list[int], sequences, rewards: list[float]) -> list[types.Datum]:
    """GRPO: advantage = reward - group mean, on every sampled token; prompt positions get 0."""
    mean = sum(rewards) / len(rewards)
    datums = []
    for seq, r in zip(sequences, rewards):
        tokens = prompt + list(seq.tokens)
        n_prompt = len(prompt) - 1
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [0.0] * n_prompt + list(seq.logprobs),
                    "advantages": [0.0] * n_prompt + [r - mean] * len(seq.tokens),
                },
            )
        )
    return datums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", default=BASE_MODEL)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4, help="questions per step")
    parser.add_argument("--group-size", type=int, default=4, help="samples per question")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=40, help="a join query takes up to about 37 tokens")
    parser.add_argument("--train-chunk", type=int, default=16, help="sequences per forward_backward call")
    parser.add_argument("--test-fraction", type=float, default=0.3)
    parser.add_argument("--eval-size", type=int, default=40, help="held-out questions to evaluate (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/text_to_sql", help="writes <out>.jsonl, <out>.png, <out>.summary.json")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    started = time.monotonic()

    conn = build_database(args.seed)
    train, test = make_questions(conn, args.seed, args.test_fraction)
    if args.eval_size:
        test = random.Random(args.seed).sample(test, min(args.eval_size, len(test)))
    print(f"{len(train)} training questions, {len(test)} held out; e.g. {test[0]['question']!r} -> {test[0]['sql']}")

    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=args.base_model, rank=args.rank, seed=args.seed).result()
    tokenizer = training.get_tokenizer()
    sampler = training.save_weights_and_get_sampling_client().result()
    before = evaluate(sampler, tokenizer, conn, test, train, args)
    print(f"held-out execution accuracy before training: {shown(before)}", flush=True)

    log = CurveLog(
        args.out, args.steps, f"Text-to-SQL GRPO, {args.base_model.split('/')[-1]} LoRA r={args.rank}", args.label
    )
    adam = types.AdamParams(learning_rate=args.learning_rate)
    rng = random.Random(args.seed)
    order: list[dict] = []
    for step in range(1, args.steps + 1):
        if len(order) < args.batch_size:
            order += rng.sample(train, len(train))
        batch, order = order[: args.batch_size], order[args.batch_size :]
        step_started = time.monotonic()
        prompts = [tokenizer.encode(prompt_text(item, train), add_special_tokens=False) for item in batch]
        futures = [
            sampler.sample(
                prompt=types.ModelInput.from_ints(p),
                num_samples=args.group_size,
                sampling_params=sampling_params(args, args.temperature),
            )
            for p in prompts
        ]
        datums, rewards, correct = [], [], []
        for item, prompt, future in zip(batch, prompts, futures):
            sequences = future.result().sequences
            scored = [reward(conn, item, tokenizer.decode(s.tokens, skip_special_tokens=True)) for s in sequences]
            group = [r for r, _ in scored]
            rewards += group
            correct += [c for _, c in scored]
            # A group whose samples all scored the same has no advantage to learn from.
            if max(group) > min(group):
                datums += group_datums(prompt, sequences, group)
        sample_s = time.monotonic() - step_started
        loss = None
        if datums:
            # Gradients add up over forward_backward calls until optim_step; sending the batch in
            # pieces bounds the trainer's activation memory (about 3 MB per token for this model).
            pieces = [
                training.forward_backward(datums[i : i + args.train_chunk], "importance_sampling")
                for i in range(0, len(datums), args.train_chunk)
            ]
            training.optim_step(adam).result()
            loss = sum(piece.result().metrics["loss:sum"] for piece in pieces)
            sampler = training.save_weights_and_get_sampling_client().result()
        log.record(
            step,
            reward=sum(rewards) / len(rewards),
            accuracy=sum(correct) / len(correct),
            trained_groups=len(datums) // args.group_size,
            loss=loss,
            sample_s=round(sample_s, 1),
            train_s=round(time.monotonic() - step_started - sample_s, 1),
        )

    after = evaluate(sampler, tokenizer, conn, test, train, args)
    wall = time.monotonic() - started
    print(f"held-out execution accuracy before: {shown(before)}  after: {shown(after)}")
    log.plot(["reward", "accuracy"], smooth=3, ylabel="training reward / accuracy")
    summary = {
        "before": before["all"],
        "after": after["all"],
        "before_join": before["join"],
        "after_join": after["join"],
        "before_single_table": before["single_table"],
        "after_single_table": after["single_table"],
        "test_joins": sum(map(is_join, test)),
        "wall_s": round(wall, 1),
        "steps": args.steps,
        "learning_rate": args.learning_rate,
        "rank": args.rank,
        "group_size": args.group_size,
        "batch_size": args.batch_size,
        "test_questions": len(test),
    }
    with open(args.out + ".summary.json", "w") as handle:
        json.dump(summary, handle)
    print(f"curve: {log.png_path} ({log.jsonl_path}); wall time {wall:.0f} s")
    service.close("success").result()


if __name__ == "__main__":
    main()
