"""The runs' rows a gateway keeps (eventing/store/known_runs.py), on SQLite and PostgreSQL:
checked against the store's own read after every event of a run's life, and the rules that
keep them right: a change of any column but last_request_time drops the row, a read racing
a change is not kept, another tenant's run is not found, the kept rows are bounded, and
nothing is kept unless followed."""

from __future__ import annotations

from eventing.store.known_runs import IGNORED, KnownRuns
from eventing.store.queries import Projections
from openrl_core.events import sampling as sa
from openrl_core.events import training as te
from openrl_core.events.lifecycle import BlobRef, CheckpointSaved, RequestCompleted, SamplingSessionBound
from openrl_core.params import AdamParams, SamplingParams
from tests.eventing.test_run_projections import RUN, create, fb, optim, put


def look(known: KnownRuns, projections: Projections, tenant: str = "alice"):
    """What `functions/gateway/deps.require_run` does: the kept row, else read and keep it."""
    row = known.get(tenant, RUN)
    if row is None:
        generation = known.generation()
        row = projections.run(tenant, RUN)
        known.put(RUN, row, generation)
    return row


def columns(row) -> dict:
    return {name: value for name, value in row._mapping.items() if name not in IGNORED}


def test_the_kept_row_is_the_stores_after_every_event_of_a_runs_life(store):
    store, projections = store
    store.runs.follow()
    bound = SamplingSessionBound(
        sampling_session_id="s1:sample:0",
        session_id="s1",
        base_model="m",
        adapter={"a": BlobRef(sha256="c" * 64, size=1)},
    )
    saved = CheckpointSaved(run_id=RUN, kind="weights", name="final", files={"a": BlobRef(sha256="b" * 64, size=3)})
    steps = [
        lambda: create(store),
        lambda: fb(store, "f1", at=10, loss=1.0, tokens=1),
        lambda: optim(store, "o1", at=11, lr=1e-3, grad_norm=0.5),
        lambda: put(
            store,
            te.SAVE_WEIGHTS_FOR_SAMPLER["requested"],
            te.SaveWeightsForSamplerRequested(
                request_id="p", model_id=RUN, seq_id=3, sampling_session_id="s1:sample:0"
            ),
            12,
        ),
        lambda: put(
            store,
            te.SAVE_WEIGHTS_FOR_SAMPLER["completed"],
            RequestCompleted(request_id="p", result={}, sampling_session=bound),
            13,
        ),
        lambda: put(
            store,
            sa.SAMPLE["requested"],
            sa.SampleRequested(
                request_id="r",
                sampling_session_id="s1:sample:0",
                seq_id=0,
                base_model="m",
                prompt_tokens=[1],
                num_samples=1,
                sampling_params=SamplingParams(),
                sample_sequence_ids=["r:0"],
            ),
            14,
        ),  # fmt: skip
        lambda: put(
            store,
            te.SAVE_WEIGHTS["requested"],
            te.SaveWeightsRequested(request_id="w", model_id=RUN, seq_id=4, name="final"),
            15,
        ),
        lambda: put(
            store, te.SAVE_WEIGHTS["completed"], RequestCompleted(request_id="w", result={}, checkpoint=saved), 16
        ),
        lambda: put(store, te.RUN_CANCELLED, te.RunCancelled(model_id=RUN, reason="enough", by="operator"), 17),
    ]
    seen_states = []
    for step in steps:
        look(store.runs, projections)  # kept before the event, as a busy gateway would have it
        step()
        kept = look(store.runs, projections)
        assert columns(kept) == columns(projections.run("alice", RUN))
        seen_states.append(kept.state)
    assert seen_states[0] == "ready" and seen_states[-1] == "cancelled"


def test_a_request_keeps_the_row_and_a_state_change_drops_it(store):
    store, projections = store
    store.runs.follow()
    create(store)
    kept = look(store.runs, projections)
    put(
        store,
        te.OPTIM_STEP["requested"],
        te.OptimStepRequested(request_id="o", model_id=RUN, seq_id=1, adam_params=AdamParams()),
        5,
    )  # moves last_request_time only
    assert store.runs.get("alice", RUN) is kept
    put(store, te.RUN_CANCELLED, te.RunCancelled(model_id=RUN), 6)
    assert store.runs.get("alice", RUN) is None
    assert look(store.runs, projections).state == "cancelled"


def test_a_read_that_raced_a_change_is_not_kept(store):
    store, projections = store
    store.runs.follow()
    create(store)
    generation = store.runs.generation()
    before = projections.run("alice", RUN)  # read, then the change commits before it is kept
    put(store, te.RUN_CANCELLED, te.RunCancelled(model_id=RUN), 6)
    store.runs.put(RUN, before, generation)
    assert store.runs.get("alice", RUN) is None
    assert look(store.runs, projections).state == "cancelled"


def test_another_tenants_run_is_not_found_and_nothing_is_kept_unfollowed(store):
    store, projections = store
    create(store)
    assert look(store.runs, projections) is not None
    assert store.runs.get("alice", RUN) is None  # not followed: read every time, as before
    store.runs.follow()
    look(store.runs, projections)
    assert store.runs.get("alice", RUN) is not None and store.runs.get("bob", RUN) is None
    assert look(store.runs, projections, tenant="bob") is None


def test_the_kept_rows_are_bounded_least_recent_first():
    class Row:
        def __init__(self, tenant):
            self.tenant = tenant

    known = KnownRuns(capacity=2)
    known.follow()
    for model_id in ("a", "b"):
        known.put(model_id, Row("t"), known.generation())
    known.get("t", "a")
    known.put("a", known.get("t", "a"), known.generation())  # used again: now the most recent
    known.put("c", Row("t"), known.generation())
    assert [known.get("t", m) is not None for m in ("a", "b", "c")] == [True, False, True]
    known.changed([])  # nothing changed: a read begun before is still kept
    generation = known.generation()
    known.changed(["zzz"])  # something changed, whatever it was
    known.put("d", Row("t"), generation)
    assert known.get("t", "d") is None


def test_a_row_older_than_max_age_is_read_again_and_clear_drops_all(monkeypatch):
    """On PostgreSQL (max_age): a kept row past its age counts as not kept; `clear` (a lost
    LISTEN connection) drops every row and refuses a read begun before it."""
    from eventing.store import known_runs

    class Row:
        tenant = "t"

    now = [1000.0]
    monkeypatch.setattr(known_runs.time, "monotonic", lambda: now[0])
    known = KnownRuns()
    known.follow(max_age=5.0)
    known.put("a", Row(), known.generation())
    now[0] += 4.9
    assert known.get("t", "a") is not None
    now[0] += 0.2
    assert known.get("t", "a") is None
    known.put("a", Row(), known.generation())
    generation = known.generation()
    known.clear()
    assert known.get("t", "a") is None
    known.put("b", Row(), generation)
    assert known.get("t", "b") is None
