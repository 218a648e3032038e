"""The timeslicer's rules as given/when/then tables: no sockets, no threads, no clock."""

from __future__ import annotations

import random

import pytest

from openrl_core.errors import Conflict, InvalidRequest, NotFound
from openrl_core.timeslice import AskPark, Grant, LeaseEnded, Policy, Refused, Timeslicer

GIB = 1 << 30


def grants(effects):
    return [e for e in effects if isinstance(e, Grant)]


def parks(effects):
    return [e for e in effects if isinstance(e, AskPark)]


def slicer(budget=None, policy=Policy.FIFO, **kw):
    return Timeslicer({"cpu:0": budget}, policy=policy, **kw)


def test_one_holder_at_a_time_and_fifo_order():
    ts = slicer()
    for job in "abc":
        ts.register("w", job, "cpu:0", 10, True, True, now=0)
    first = grants(ts.acquire("w", "a", "r1", now=1))
    assert [g.job for g in first] == ["a"]
    assert grants(ts.acquire("w", "b", "r2", now=2)) == []
    assert grants(ts.acquire("w", "c", "r3", now=3)) == []
    nxt = grants(ts.release("w", first[0].lease_id, now=4))
    assert [g.job for g in nxt] == ["b"] and nxt[0].waited == 2
    nxt2 = grants(ts.release("w", nxt[0].lease_id, now=5))
    assert [g.job for g in nxt2] == ["c"]
    assert nxt2[0].lease_id > nxt[0].lease_id > first[0].lease_id


def test_lease_ids_never_go_below_the_floor_and_only_grow():
    floor = [1000]
    ts = slicer(lease_floor=lambda: floor[0])
    ts.register("w", "a", "cpu:0", 1, True, True, 0)
    g1 = grants(ts.acquire("w", "a", "r", 0))[0]
    assert g1.lease_id == 1000
    floor[0] = 5  # a clock that went backwards
    ts.release("w", g1.lease_id, 1)
    g2 = grants(ts.acquire("w", "a", "r", 1))[0]
    assert g2.lease_id == 1001


def test_a_released_or_expired_lease_is_fenced():
    ts = slicer(lease_seconds=2)
    ts.register("w", "a", "cpu:0", 1, True, True, 0)
    ts.register("v", "b", "cpu:0", 1, True, True, 0)
    lease = grants(ts.acquire("w", "a", "r", 0))[0].lease_id
    assert ts.renew("w", lease, 1) == 2  # renewed at 1: deadline 3
    ts.acquire("v", "b", "r", 1)
    assert grants(ts.tick(2.9)) == []
    effects = ts.tick(3.0)
    assert [e.reason for e in effects if isinstance(e, LeaseEnded)] == ["expired"]
    assert [g.job for g in grants(effects)] == ["b"]
    assert ts.expired_leases == 1
    with pytest.raises(Conflict, match="fenced"):
        ts.renew("w", lease, 3.1)
    with pytest.raises(Conflict, match="fenced"):
        ts.release("w", lease, 3.1)
    assert not ts.is_current(lease)


def test_disconnect_frees_the_device_at_once():
    ts = slicer()
    ts.register("dead", "a", "cpu:0", 1, True, True, 0)
    ts.register("live", "b", "cpu:0", 1, True, True, 0)
    ts.acquire("dead", "a", "r", 0)
    ts.acquire("live", "b", "r", 0)
    effects = ts.disconnect("dead", 0.5)
    assert [e.reason for e in effects if isinstance(e, LeaseEnded)] == ["disconnected"]
    assert [g.job for g in grants(effects)] == ["b"]
    assert "a" not in ts.jobs


def test_cancelled_acquire_leaves_nothing_waiting():
    ts = slicer()
    ts.register("w", "a", "cpu:0", 1, True, True, 0)
    ts.register("w", "b", "cpu:0", 1, True, True, 0)
    lease = grants(ts.acquire("w", "a", "r1", 0))[0].lease_id
    ts.acquire("w", "b", "r2", 0)
    ts.cancel("w", "r2", 1)
    assert grants(ts.release("w", lease, 2)) == []
    assert ts.status(2)[0]["holder"] is None and ts.status(2)[0]["waiters"] == []


def test_register_refuses_a_job_over_budget_with_the_numbers():
    ts = slicer(budget=100)
    ts.register("w", "base", "cpu:0", 60, False, True, 0)  # never parks
    with pytest.raises(InvalidRequest, match="needs 50 bytes.*budget of 100.*60 of them"):
        ts.register("w", "big", "cpu:0", 50, True, False, 0)
    with pytest.raises(InvalidRequest, match="unknown device"):
        ts.register("w", "x", "cuda:7", 1, True, False, 0)
    with pytest.raises(InvalidRequest, match="non-negative"):
        ts.register("w", "x", "cpu:0", -1, True, False, 0)


def test_least_recently_served_resident_parks_when_the_next_does_not_fit():
    ts = slicer(budget=100)
    for job in ("a", "b", "c"):
        ts.register("w", job, "cpu:0", 40, True, False, 0)
    for t, job in enumerate(("a", "b")):
        lease = grants(ts.acquire("w", job, f"r{job}", t))[0]
        assert lease.restore  # first turn: the worker materialises its state
        ts.release("w", lease.lease_id, t + 0.5)
    effects = ts.acquire("w", "c", "rc", 3)  # a (served at 0.5) and b (1.5) resident: 80 + 40 > 100
    assert parks(effects) == [AskPark("w", "a", "cpu:0")] and grants(effects) == []
    effects = ts.parked("w", "a", 3.2)
    assert [(g.job, g.restore) for g in grants(effects)] == [("c", True)]
    status = ts.status(3.3)[0]
    assert status["resident_bytes"] == 80
    assert {r["job"]: r["parked"] for r in status["residents"]} == {"a": True, "b": False, "c": False}


def test_a_job_that_never_answers_a_park_is_skipped_after_the_timeout():
    ts = slicer(budget=100, park_timeout=5)
    for job in ("a", "b", "c"):
        ts.register("w" + job, job, "cpu:0", 40, True, True if job != "c" else False, 0)
    ts.jobs["a"].last_served, ts.jobs["b"].last_served = 1, 2
    assert parks(ts.acquire("wc", "c", "r", 3)) == [AskPark("wa", "a", "cpu:0")]
    effects = ts.tick(8)  # a is stopped: give up on it, ask the next one
    assert parks(effects) == [AskPark("wb", "b", "cpu:0")]
    assert [g.job for g in grants(ts.parked("wb", "b", 8.5))] == ["c"]


def test_when_no_room_can_be_made_a_resident_waiter_is_served_meanwhile():
    ts = slicer(budget=100, park_timeout=1)
    ts.register("stopped", "a", "cpu:0", 60, True, True, 0)
    ts.register("w", "b", "cpu:0", 30, False, True, 0)  # never parks
    ts.register("w", "c", "cpu:0", 50, True, False, 0)
    assert parks(ts.acquire("w", "c", "rc", 1)) == [AskPark("stopped", "a", "cpu:0")]
    ts.acquire("w", "b", "rb", 1.5)
    effects = ts.tick(2.5)  # a never answers; c cannot fit; b is resident and fits
    assert [g.job for g in grants(effects)] == ["b"]


def test_non_parkable_jobs_are_never_asked_to_park():
    ts = slicer(budget=100)
    ts.register("w", "base", "cpu:0", 70, False, True, 0)
    ts.register("w", "x", "cpu:0", 30, True, False, 0)
    ts.register("w", "y", "cpu:0", 30, True, False, 0)
    g = grants(ts.acquire("w", "x", "r", 0))[0]
    ts.release("w", g.lease_id, 1)
    assert parks(ts.acquire("w", "y", "r", 2)) == [AskPark("w", "x", "cpu:0")]


def test_lrs_serves_the_least_recently_served_and_aging_prevents_starvation():
    ts = slicer(policy=Policy.LRS, aging_seconds=10)
    for job in ("a", "b", "hog"):
        ts.register("w", job, "cpu:0", 1, True, True, 0)
    ts.jobs["a"].last_served, ts.jobs["b"].last_served = 5, 3
    hog = grants(ts.acquire("w", "hog", "h", 6))[0]
    ts.acquire("w", "a", "ra", 6.1)
    ts.acquire("w", "b", "rb", 6.2)
    assert [g.job for g in grants(ts.release("w", hog.lease_id, 7))] == ["b"]  # b served longer ago than a
    # FIFO would have served a (it asked first)
    fifo = slicer(policy=Policy.FIFO)
    for job in ("a", "b", "hog"):
        fifo.register("w", job, "cpu:0", 1, True, True, 0)
    h = grants(fifo.acquire("w", "hog", "h", 6))[0]
    fifo.acquire("w", "a", "ra", 6.1)
    fifo.acquire("w", "b", "rb", 6.2)
    assert [g.job for g in grants(fifo.release("w", h.lease_id, 7))] == ["a"]


def test_aging_puts_a_long_waiter_first_under_lrs():
    ts = slicer(policy=Policy.LRS, aging_seconds=10)
    ts.register("w", "old", "cpu:0", 1, True, True, 0)
    ts.register("w", "fresh", "cpu:0", 1, True, True, 0)
    ts.register("w", "holder", "cpu:0", 1, True, True, 0)
    ts.jobs["old"].last_served = 100  # served recently: LRS alone would put it last
    h = grants(ts.acquire("w", "holder", "h", 100))[0]
    ts.acquire("w", "old", "ro", 100)
    ts.acquire("w", "fresh", "rf", 105)
    assert [g.job for g in grants(ts.release("w", h.lease_id, 111))] == ["old"]


def test_takeover_fences_the_old_owner():
    ts = slicer()
    ts.register("old", "model-1", "cpu:0", 1, True, True, 0)
    lease = grants(ts.acquire("old", "model-1", "r", 0))[0].lease_id
    effects = ts.register("new", "model-1", "cpu:0", 1, True, False, 1)
    assert [e.reason for e in effects if isinstance(e, LeaseEnded)] == ["taken_over"]
    with pytest.raises(Conflict, match="fenced"):
        ts.renew("old", lease, 1.1)
    with pytest.raises(Conflict, match="taken over"):
        ts.acquire("old", "model-1", "r2", 1.2)
    assert grants(ts.acquire("new", "model-1", "r3", 1.3))[0].lease_id > lease


def test_waiters_of_a_dropped_job_are_refused():
    ts = slicer()
    ts.register("w", "a", "cpu:0", 1, True, True, 0)
    ts.register("w", "b", "cpu:0", 1, True, True, 0)
    ts.acquire("w", "a", "ra", 0)
    ts.acquire("w", "b", "rb", 0)
    effects = ts.unregister("w", "b", 1)
    assert effects == [Refused("w", "rb", "job 'b' is gone (unregistered)")]


def test_errors_name_the_problem():
    ts = slicer()
    with pytest.raises(NotFound, match="not registered"):
        ts.acquire("w", "nope", "r", 0)
    ts.register("w", "a", "cpu:0", 1, True, True, 0)
    ts.acquire("w", "a", "r", 0)
    with pytest.raises(Conflict, match="already holds"):
        ts.acquire("w", "a", "r2", 0)


@pytest.mark.parametrize("policy", list(Policy))
def test_random_schedules_keep_the_invariants(policy):
    """Many random interleavings: one holder, budget respected at every grant, ids grow,
    and every waiter of a live job is eventually served."""
    rng = random.Random(7)
    for trial in range(40):
        budget = rng.choice([None, 100, 150])
        ts = Timeslicer({"d": budget}, policy=policy, lease_seconds=5, aging_seconds=20, park_timeout=3)
        owners = {f"j{i}": f"o{i % 3}" for i in range(5)}
        for job, owner in owners.items():
            ts.register(owner, job, "d", rng.randint(10, 90), True, False, 0)
        now, held, last_id, served = 0.0, None, 0, set()
        waiting = set()
        for _ in range(300):
            now += rng.random()
            op = rng.random()
            effects = []
            if op < 0.4:
                job = rng.choice(list(owners))
                if job not in waiting and (held is None or held[0] != job):
                    effects = ts.acquire(owners[job], job, f"{job}@{now}", now)
                    waiting.add(job)
            elif op < 0.7 and held is not None:
                effects = ts.release(owners[held[0]], held[1], now)
                held = None
            else:
                effects = ts.tick(now)
            for effect in effects:
                if isinstance(effect, AskPark):
                    effects += ts.parked(effect.owner, effect.job, now)
            for effect in effects:
                if isinstance(effect, LeaseEnded) and held is not None and effect.lease_id == held[1]:
                    held = None
                if isinstance(effect, Grant):
                    assert held is None, "two holders"
                    assert effect.lease_id > last_id
                    last_id = effect.lease_id
                    held = (effect.job, effect.lease_id)
                    waiting.discard(effect.job)
                    served.add(effect.job)
                    if budget is not None:
                        assert ts.status(now)[0]["resident_bytes"] <= budget
        assert served, trial


def test_affinity_keeps_a_runs_next_request_ahead_and_waits_briefly_for_it():
    ts = slicer(policy=Policy.FIFO, affinity_seconds=0.5, quantum_seconds=10)
    ts.register("trainer", "t/model/run-a", "cpu:0", 1, True, True, 0, group="run-a")
    ts.register("sampler", "s/run/run-a", "cpu:0", 1, True, True, 0, group="run-a")
    ts.register("trainer", "t/model/run-b", "cpu:0", 1, True, True, 0, group="run-b")
    first = grants(ts.acquire("trainer", "t/model/run-a", "r1", 0))[0]
    ts.acquire("trainer", "t/model/run-b", "r2", 0.1)  # run-b waits first...
    assert grants(ts.release("trainer", first.lease_id, 1.0)) == []  # ...but run-a's next request is expected
    assert grants(ts.tick(1.2)) == []
    nxt = grants(ts.acquire("sampler", "s/run/run-a", "r3", 1.3))  # it comes: its sampler, same run
    assert [g.job for g in nxt] == ["s/run/run-a"]
    # the run goes away (grading): after the affinity window the others are served
    assert grants(ts.release("sampler", nxt[0].lease_id, 1.4)) == []
    assert [g.job for g in grants(ts.tick(1.95))] == ["t/model/run-b"]


def test_affinity_does_not_wait_for_a_run_whose_only_owner_has_moved_on_to_another():
    ts = slicer(policy=Policy.FIFO, affinity_seconds=0.5, quantum_seconds=10)
    for run in ("a", "b"):
        ts.register("trainer", f"t/model/run-{run}", "cpu:0", 1, True, True, 0, group=f"run-{run}")
    first = grants(ts.acquire("trainer", "t/model/run-a", "r1", 0))[0]
    assert grants(ts.release("trainer", first.lease_id, 1.0)) == []
    # The trainer (run-a's only owner) now asks for run-b: it has moved on, nobody else can
    # send run-a's next request, so run-b is served at once instead of after the window.
    [second] = grants(ts.acquire("trainer", "t/model/run-b", "r2", 1.01))
    assert second.job == "t/model/run-b"
    # With a sampler job in run-b's group, run-b's next request may still come from it: the
    # device waits for the window even though the trainer has moved on to run-a.
    ts.register("sampler", "s/run/run-b", "cpu:0", 1, True, True, 1.1, group="run-b")
    assert grants(ts.release("trainer", second.lease_id, 1.5)) == []
    assert grants(ts.acquire("trainer", "t/model/run-a", "r3", 1.51)) == []
    assert [g.job for g in grants(ts.tick(2.05))] == ["t/model/run-a"]


def test_a_waiter_carrying_the_runs_work_is_its_next_request_and_is_served_at_once():
    # A LoRA run's samples run on the sampler's shared base job, which belongs to no run: the
    # batch names the runs it serves, and the device does not idle waiting for what waits.
    ts = slicer(policy=Policy.FIFO, affinity_seconds=0.5, quantum_seconds=10)
    ts.register("trainer", "t/model/run-a", "cpu:0", 1, True, True, 0, group="run-a")
    ts.register("sampler", "s/base/smol", "cpu:0", 1, False, True, 0)
    first = grants(ts.acquire("trainer", "t/model/run-a", "r1", 0))[0]
    assert grants(ts.release("trainer", first.lease_id, 1.0)) == []
    [nxt] = grants(ts.acquire("sampler", "s/base/smol", "r2", 1.01, serves=("run-a", "run-c")))
    assert nxt.job == "s/base/smol"
    # one carrying other runs' work only is still held back for the window
    second = grants(ts.acquire("trainer", "t/model/run-a", "r3", 1.1))
    assert second == []
    [again] = grants(ts.release("sampler", nxt.lease_id, 1.2))
    assert again.job == "t/model/run-a"
    assert grants(ts.release("trainer", again.lease_id, 1.3)) == []
    assert grants(ts.acquire("sampler", "s/base/smol", "r4", 1.31, serves=("run-b",))) == []
    assert [g.job for g in grants(ts.tick(1.85))] == ["s/base/smol"]


def test_affinity_ends_with_the_quantum_and_never_passes_an_aged_waiter():
    ts = slicer(policy=Policy.FIFO, affinity_seconds=1.0, quantum_seconds=3, aging_seconds=5)
    ts.register("w", "a", "cpu:0", 1, True, True, 0, group="A")
    ts.register("w", "b", "cpu:0", 1, True, True, 0, group="B")
    lease = grants(ts.acquire("w", "a", "r", 0))[0]
    ts.acquire("w", "b", "rb", 0.5)
    served = []
    for t in (1.0, 2.0, 3.0):  # run A keeps coming back
        ts.release("w", lease.lease_id, t)
        lease = grants(ts.acquire("w", "a", f"r{t}", t + 0.01))
        if not lease:
            break
        lease = lease[0]
        served.append(t)
    assert served == [1.0, 2.0], "A's streak ends once it has held the device for the quantum"
    aged = slicer(policy=Policy.FIFO, affinity_seconds=1.0, quantum_seconds=100, aging_seconds=2)
    aged.register("w", "a", "cpu:0", 1, True, True, 0, group="A")
    aged.register("w", "b", "cpu:0", 1, True, True, 0, group="B")
    lease = grants(aged.acquire("w", "a", "r", 0))[0]
    aged.acquire("w", "b", "rb", 0.1)
    # b has waited 2.9 s, past aging: served at once, no waiting for A's next request
    assert [g.job for g in grants(aged.release("w", lease.lease_id, 3.0))] == ["b"]


def test_one_turn_can_serve_several_jobs_of_one_owner_all_made_resident():
    ts = slicer(budget=100)
    for job in ("a", "b", "c"):
        ts.register("w", job, "cpu:0", 40, True, False, 0)
    lone = grants(ts.acquire("w", "c", "r0", 0))[0]
    ts.release("w", lone.lease_id, 1)
    effects = ts.acquire("w", "a", "r1", 2, also=("b",))  # c is resident: 40 + 80 > 100
    assert parks(effects) == [AskPark("w", "c", "cpu:0")] and grants(effects) == []
    grant = grants(ts.parked("w", "c", 3))[0]
    assert grant.job == "a" and ts.jobs["a"].resident and ts.jobs["b"].resident
    with pytest.raises(Conflict, match="already holds or waits"):
        ts.acquire("w", "b", "r2", 3.5)
    ts.release("w", grant.lease_id, 4)
    assert ts.jobs["b"].last_served == 4, "every job of the turn counts as served"
    with pytest.raises(Conflict, match="taken over"):
        ts.register("v", "x", "cpu:0", 1, True, False, 5) or ts.acquire("w", "a", "r3", 5, also=("x",))
