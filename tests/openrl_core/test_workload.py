"""The worker lifecycle rules as given/when/then tables (pure: the clock is an argument)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from openrl_core.workload import Activity, WorkerSpec, safe_slug, serves, waiting_since, wanted_workers

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
IDLE = timedelta(minutes=15)
BASE = "openrl/tiny-qwen3"


def run(key="s1:train:0", kind="lora", idle_for=timedelta(0), finished=False, pending=0, base=BASE):
    oldest = NOW - idle_for if pending else None
    return Activity("alice", key, kind, base, finished, NOW - idle_for, pending, oldest)


TRAINER, SAMPLER = WorkerSpec("trainer", BASE), WorkerSpec("sampler", BASE)

CASES = [
    # given, then (the workers wanted)
    ("a LoRA run that just sent a request", [run()], {TRAINER}),
    ("a run briefly idle (30 s) keeps its worker", [run(idle_for=timedelta(seconds=30))], {TRAINER}),
    ("a run idle 14 minutes keeps its worker", [run(idle_for=timedelta(minutes=14))], {TRAINER}),
    ("a run idle past the timeout releases it", [run(idle_for=timedelta(minutes=16))], set()),
    ("an idle run with a request in flight keeps it", [run(idle_for=timedelta(hours=2), pending=1)], {TRAINER}),
    ("the last session finished: released at once", [run(finished=True)], set()),
    ("a finished session with a request in flight keeps it", [run(finished=True, pending=2)], {TRAINER}),
    ("one of two runs finished: the worker stays", [run(finished=True), run("s2:train:0")], {TRAINER}),
    ("a sampling session wants the sampler", [run("s1:sample:0", kind="sampling")], {SAMPLER}),
    (
        "a full run gets a trainer of its own",
        [run("s3:train:0", kind="full")],
        {WorkerSpec("trainer", BASE, "s3:train:0")},
    ),
]


@pytest.mark.parametrize("given, activities, expected", CASES, ids=[c[0] for c in CASES])
def test_lifecycle(given, activities, expected):
    assert set(wanted_workers(activities, NOW, IDLE)) == expected


def test_floor_models_keep_their_workers_without_demand_and_say_why():
    wanted = wanted_workers([run()], NOW, IDLE, floor=[BASE])
    assert wanted == {TRAINER: ["floor", "s1:train:0"], SAMPLER: ["floor"]}


def test_names_are_dns_labels_short_enough_for_pods_and_distinct():
    long_run = WorkerSpec("trainer", "Org/" + "x" * 200, model_id="0f" * 40 + ":train:7")
    names = {TRAINER.name, SAMPLER.name, long_run.name, WorkerSpec("trainer", "openrl/tiny_qwen3").name}
    assert len(names) == 4
    for name in names:
        assert len(name) <= 52 and name == name.lower() and not name.endswith("-")
        assert all(c.isalnum() or c == "-" for c in name)
    assert TRAINER.name.startswith("openrl-trainer-openrl-tiny-qwen3-") and TRAINER.kind == "lora"
    assert long_run.kind == "full" and SAMPLER.kind == ""
    assert safe_slug("!!!", 10) == safe_slug("!!!", 10) and len(safe_slug("!!!", 10)) == 6


def test_waiting_since_is_the_oldest_request_of_the_runs_a_worker_serves():
    activities = [
        run("a", pending=1, idle_for=timedelta(minutes=3)),
        run("b", pending=1, idle_for=timedelta(minutes=9)),
        run("c", kind="sampling", pending=1, idle_for=timedelta(minutes=30)),
        run("d", pending=1, idle_for=timedelta(minutes=50), base="other"),
    ]
    assert waiting_since(activities, TRAINER) == NOW - timedelta(minutes=9)
    assert waiting_since(activities, SAMPLER) == NOW - timedelta(minutes=30)
    assert waiting_since([run("a")], TRAINER) is None
    assert not serves(WorkerSpec("trainer", BASE, "x"), run("a"))
