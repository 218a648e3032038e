"""No tenant-scoped read of the store walks a table that grows with every request.

On SQLite (the embedded store, which has no statistics to plan with) each read the API, the
dashboard and the background loops make for one tenant is run with its statements captured,
and each statement's plan is asked for: none may scan a growing table whole, and none made
for one object may search all of its tenant's rows (a scan is quick on a test's few rows and
slow on a store's millions, so only the plan shows it). Found so: a run's step count was a
grouped count of every tenant's steps, the outbox relay walked every event, the reaper's
sweep every checkpoint, a session listing every run, a session's finished samples and a
run's sampling sessions all of their tenant's.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import pytest

from eventing.store import usage_reads
from eventing.store.feeds import SampleFeed
from eventing.store.run_views import RunViews
from openrl_core import audit_log
from tests.eventing.sqlite_plans import Tracer, plan_of, scanned
from tests.eventing.test_event_store import create_model, session

# Not the outbox: it holds only what the log has not acknowledged yet, and is read whole.
GROWING = (
    "events",
    "futures",
    "submissions",
    "run_steps",
    "checkpoints",
    "removed_checkpoints",
    "training_runs",
    "sampling_sessions",
    "sessions",
)
RUN = "s1:train:0"
NOW = datetime.now(timezone.utc)


def reads(store, projections):
    """(name, call) of every read that is made per tenant or per object."""
    views, feed = RunViews(store.engine), SampleFeed(store.engine, store.codec)
    return [
        ("future", lambda: projections.future("alice", "req-create")),
        ("session", lambda: projections.session("alice", "s1")),
        ("run", lambda: projections.run("alice", RUN)),
        ("checkpoint", lambda: projections.checkpoint("alice", RUN, "weights/final")),
        ("sampling_session", lambda: projections.sampling_session("alice", "s1:sample:0")),
        ("runs_of_session", lambda: projections.runs_of_session("alice", "s1")),
        ("live_checkpoint", lambda: projections.live_checkpoint("alice", RUN, "weights/final", NOW)),
        ("sampling_sessions_of", lambda: projections.sampling_sessions_of("alice", "s1")),
        ("expired_checkpoints", lambda: projections.expired_checkpoints(NOW)),
        ("unpublished", lambda: store.unpublished()),
        ("views.run", lambda: views.run("alice", RUN)),
        ("views.run (operator)", lambda: views.run(None, RUN)),
        ("views.steps", lambda: views.steps(RUN)),
        ("views.fork_request", lambda: views.fork_request("alice", RUN)),
        ("views.open_futures", lambda: views.open_futures("alice", [RUN])),
        ("views.cancelled_futures", lambda: views.cancelled_futures("alice", [RUN])),
        ("views.sampling_sessions_of_run", lambda: views.sampling_sessions_of_run("alice", RUN)),
        ("views.checkpoints of a run", lambda: views.checkpoints("alice", NOW, RUN)),
        ("views.run_events", lambda: views.run_events("alice", [RUN], 0, 100)),
        ("views.finished_samples", lambda: views.finished_samples("alice", ["s1:sample:0"], 10)),
        ("views.tenants_of_runs", lambda: views.tenants_of_runs([RUN])),
        ("views.sessions (their counts)", lambda: views.sessions("alice", 10, 0)),
        ("feed.after", lambda: feed.after("alice", "s1:sample:0", 0)),
        ("feed.pending", lambda: feed.pending("alice", "s1", "s1:sample:0")),
        ("feed.results", lambda: feed.results("alice", ["req-create"])),
        ("usage.token_rows", lambda: usage_reads.token_rows(store.engine, "alice", NOW - timedelta(hours=1), NOW)),
        (
            "usage.stored_rows (the tenant's live checkpoints)",
            lambda: usage_reads.stored_rows(store.engine, "alice", NOW - timedelta(hours=1), NOW),
        ),
        (
            "usage.audit_events",
            lambda: usage_reads.audit_events(
                store, "alice", audit_log.source_types("checkpoints"), NOW - timedelta(hours=1), NOW, 10
            ),
        ),  # fmt: skip
        (
            "usage.current_storage (the tenant's live checkpoints)",
            lambda: usage_reads.current_storage(store.engine, "alice", NOW, None),
        ),
    ]


@pytest.fixture
def sqlite_store(tmp_path):
    from eventing.blobs import BlobStore
    from eventing.codec import Codec
    from eventing.store import database
    from eventing.store.event_store import EventStore
    from eventing.store.queries import Projections

    engine = database.make_engine(f"sqlite:///{tmp_path / 'events.db'}")
    tracer = Tracer(engine)
    database.upgrade(engine)
    store = EventStore(engine, Codec(BlobStore(tmp_path / "blobs"), inline_limit=2048))
    session(store)
    create_model(store)
    yield store, Projections(engine), tracer
    engine.dispose()


# A search by the tenant alone (or with a state every old future has) reads all the
# tenant ever made: right for a page of its sessions, wrong for one run's objects.
TENANT_WIDE = re.compile(r"USING (?:COVERING )?INDEX ix_\w+ \(tenant=\?(?: AND state=\?)?\)$")
# Billing's storage reads every live checkpoint of the tenant (each is stored now), as a
# listing does; their number is what the tenant's storage quota bounds.
LISTINGS = {
    "views.sessions (their counts)",
    "usage.current_storage (the tenant's live checkpoints)",
    "usage.stored_rows (the tenant's live checkpoints)",
}


def test_no_read_of_one_tenants_objects_scans_a_growing_table(sqlite_store):
    store, projections, tracer = sqlite_store
    found = {}
    with store.engine.connect() as conn:
        for name, call in reads(store, projections):
            with tracer.statements() as seen:
                call()
            assert seen, name  # the read reached the database
            scans = [
                (sql.split(" FROM ")[-1][:160], plan) for table in GROWING for sql, plan in scanned(conn, table, seen)
            ]
            if name not in LISTINGS:
                for sql, _params in seen:
                    if sql.startswith("SELECT"):
                        plan = plan_of(conn, sql)
                        scans += [(sql.split(" FROM ")[-1][:160], plan) for step in plan if TENANT_WIDE.search(step)]
            if scans:
                found[name] = scans
    assert not found, "\n".join(f"{name}: {scans}" for name, scans in found.items())


def test_the_step_count_a_run_reads_is_its_own(sqlite_store):
    """The per-run count (a correlated count through run_steps' key) counts that run's
    completed steps only, as the grouped count it replaced did."""
    from sqlalchemy import insert

    from eventing.store import tables as t

    store, _, _ = sqlite_store
    create_model(store, n=1, request_id="req-create-1")
    rows = [dict(model_id=model, step=s, tenant="alice", tokens=1, forward_backward=1, first_request_at=NOW, completed_at=NOW if s < done else None)
            for model, done in ((RUN, 3), ("s1:train:1", 5)) for s in range(6)]  # fmt: skip
    with store.engine.begin() as conn:
        conn.execute(insert(t.run_steps), rows)
    views = RunViews(store.engine)
    assert views.run("alice", RUN).steps == 3 and views.run("alice", "s1:train:1").steps == 5
    listed, total = views.runs("alice", 10, 0)
    assert total == 2 and sorted(row.steps for row in listed) == [3, 5]
