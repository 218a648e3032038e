"""Projection property: folding any interleaving of the streams' events gives one result.

The log keeps one key's events in order (a model's, a sampling session's, a session's,
a copy's run) and promises nothing across keys: the projector may see them interleaved in
any way. Generated histories (requests that start, complete, fail or never finish; late
and contradictory terminal events; redelivered events; checkpoints saved, published,
given a TTL, deleted, expired and copied; sampling sessions and their samples, some
cancelled; runs cancelled, by their owner or an operator, with requests still open,
requests that raced the cancellation and a second cancellation; forks of a run, completed,
failed or cancelled while being built) are appended to a fresh store once stream by stream
and once in a random interleaving that respects each stream's order; every projection
table must come out the same, row for row.

A cancelled run's own sampling sessions (bound by save_weights_for_sampler) take no samples
here: whether a sample that raced the cancellation ends CANCELLED or COMPLETED depends on
which of the two streams the projector folds first (the cancellation closes the session
and ends its open futures; a completion folded after that is absorbed). That is the one
cross-stream order the fold does not absorb.
"""

from __future__ import annotations

import hashlib
import itertools
import shutil
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import event as note
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from eventing.blobs import BlobStore
from eventing.codec import Codec
from eventing.store import database
from eventing.store import tables as t
from eventing.store.event_store import EventStore
from openrl_core.events import Event
from openrl_core.events import checkpoints as ce
from openrl_core.events import sampling as sa
from openrl_core.events import sessions as se
from openrl_core.events import training as te
from openrl_core.events.lifecycle import (
    BlobRef,
    CheckpointSaved,
    RequestCompleted,
    RequestFailed,
    RequestStarted,
    SamplingSessionBound,
)  # fmt: skip
from openrl_core.params import AdamParams, LoraConfig, SamplingParams

T0 = datetime(2031, 1, 1, tzinfo=timezone.utc)
BASE = "openrl/tiny-qwen3"
# Only the projections: the events table's positions record arrival order by design.
ARRIVAL_ORDER_TABLES = {"events", "outbox", "submissions"}


def ref(text: str) -> BlobRef:
    return BlobRef(sha256=hashlib.sha256(text.encode()).hexdigest(), size=len(text))


class Stream:
    """One key's events in log order; times are unique and increase along the stream."""

    def __init__(self, tenant: str, key: str, number: int) -> None:
        self.tenant, self.key, self.number = tenant, key, number
        self.events: list[Event] = []

    def add(self, type_: str, payload) -> Event:
        event = Event(
            id=f"{self.key}#{len(self.events)}", type=type_, source="/property", tenant=self.tenant, key=self.key,
            time=T0 + timedelta(seconds=self.number * 100_000 + len(self.events)), data=payload,
        )  # fmt: skip
        self.events.append(event)
        return event


@st.composite
def lifecycle(draw, stream: Stream, family: dict, requested, completed: dict | None = None) -> str:
    """requested [started] then completed, failed or nothing; sometimes a contradicting late
    terminal event. Returns how it ended."""
    stream.add(family["requested"], requested)
    rid = requested.request_id
    if draw(st.booleans()):
        stream.add(family["started"], RequestStarted(request_id=rid))
    outcome = draw(st.sampled_from(["completed", "completed", "failed", "open"]))
    done = RequestCompleted(request_id=rid, result={"ok": True, "n": draw(st.integers(0, 9))}, **(completed or {}))
    failed = RequestFailed(request_id=rid, error="boom", category=draw(st.sampled_from(["user", "server"])))
    if outcome == "completed":
        stream.add(family["completed"], done)
    elif outcome == "failed":
        stream.add(family["failed"], failed)
    if outcome != "open" and draw(st.booleans()):  # late: the first result must win
        stream.add(
            family["failed"] if outcome == "completed" else family["completed"],
            failed if outcome == "completed" else done,
        )
    return outcome


@st.composite
def model_streams(draw, tenant: str, session_id: str, index: int, numbers) -> list[Stream]:
    model_id = f"{session_id}:train:{index}"
    stream = Stream(tenant, model_id, next(numbers))
    extra: list[Stream] = []
    rid = itertools.count()
    create = te.CreateModelRequested(
        request_id=f"{model_id}/r{next(rid)}", session_id=session_id, model_id=model_id, model_seq_id=index,
        base_model=BASE, lora_config=LoraConfig(rank=draw(st.integers(1, 8))),
    )  # fmt: skip
    draw(lifecycle(stream, te.CREATE_MODEL, create))
    saved: dict[str, CheckpointSaved] = {}
    cancelled = draw(st.booleans())  # decided first: a cancelled run's bound sessions take no samples (docstring)
    completed_steps = 0
    for seq in range(1, draw(st.integers(0, 7)) + 1):
        request_id = f"{model_id}/r{next(rid)}"
        op = draw(st.sampled_from(["fwdbwd", "optim", "save", "sampler", "bind", "export", "manage", "copy", "fork"]))
        if op == "fwdbwd":
            draw(
                lifecycle(
                    stream,
                    te.FORWARD_BACKWARD,
                    te.ForwardBackwardRequested(
                        request_id=request_id, model_id=model_id, seq_id=seq, loss_fn="cross_entropy", data=[]
                    ),
                )
            )
        elif op == "optim":
            payload = te.OptimStepRequested(
                request_id=request_id, model_id=model_id, seq_id=seq, adam_params=AdamParams()
            )
            completed_steps += draw(lifecycle(stream, te.OPTIM_STEP, payload)) == "completed"
        elif op == "fork":
            extra.append(draw(fork_stream(tenant, model_id, draw(st.integers(0, completed_steps)), seq, numbers)))
        elif op in ("save", "sampler", "export"):
            kind, family, payload_type = {
                "save": ("weights", te.SAVE_WEIGHTS, te.SaveWeightsRequested),
                "sampler": ("sampler_weights", te.SAVE_WEIGHTS_FOR_SAMPLER, te.SaveWeightsForSamplerRequested),
                "export": ("external_weights", te.SAVE_WEIGHTS_EXTERNAL, te.SaveWeightsExternalRequested),
            }[op]
            name = draw(st.sampled_from(["a", "b"]))  # repeats replace a same-named checkpoint
            expires = draw(st.none() | st.integers(-5, 5).map(lambda h: T0 + timedelta(days=400, hours=h)))
            checkpoint = CheckpointSaved(
                run_id=model_id, kind=kind, name=name, files={"adapter": ref(f"{request_id}")}, expires_at=expires,
            )  # fmt: skip
            if (
                draw(
                    lifecycle(
                        stream,
                        family,
                        payload_type(request_id=request_id, model_id=model_id, seq_id=seq, name=name),
                        {"checkpoint": checkpoint},
                    )
                )
                == "completed"
            ):
                saved[checkpoint.checkpoint_id] = checkpoint
        elif op == "bind":
            ss_id = f"{session_id}:sample:{index * 100 + seq}"
            bound = SamplingSessionBound(
                sampling_session_id=ss_id, session_id=session_id, base_model=BASE, adapter={"adapter": ref(ss_id)}
            )
            payload = te.SaveWeightsForSamplerRequested(
                request_id=request_id, model_id=model_id, seq_id=seq, sampling_session_id=ss_id
            )
            if (
                draw(lifecycle(stream, te.SAVE_WEIGHTS_FOR_SAMPLER, payload, {"sampling_session": bound}))
                == "completed"
                and not cancelled
            ):
                extra.append(draw(sample_stream(tenant, ss_id, numbers, created=False)))
        elif op == "manage" and saved:
            checkpoint = saved[draw(st.sampled_from(sorted(saved)))]
            action = draw(st.sampled_from(["publish", "unpublish", "ttl", "delete", "expire", "expire-stale"]))
            key = dict(run_id=model_id, checkpoint_id=checkpoint.checkpoint_id)
            if action in ("publish", "unpublish"):
                stream.add(
                    ce.CHECKPOINT_PUBLISHED if action == "publish" else ce.CHECKPOINT_UNPUBLISHED,
                    ce.CheckpointVisibility(**key),
                )
            elif action == "ttl":
                stream.add(
                    ce.CHECKPOINT_TTL_SET, ce.CheckpointTtlSet(**key, ttl_seconds=60, expires_at=T0 + timedelta(days=1))
                )
            else:
                # the reaper's view of the expiry may be stale: then the expiry is ignored
                expires = checkpoint.expires_at if action != "expire-stale" else T0 - timedelta(days=3)
                type_ = ce.CHECKPOINT_DELETED if action == "delete" else ce.CHECKPOINT_EXPIRED
                stream.add(type_, ce.CheckpointRemoved(**key, files=checkpoint.files, expires_at=expires))
        elif op == "copy" and saved:
            extra.append(draw(copy_stream(tenant, saved[draw(st.sampled_from(sorted(saved)))], numbers)))
    if cancelled:
        draw(cancel(stream))
    return [stream, *extra]


@st.composite
def cancel(draw, stream: Stream) -> None:
    """The run cancelled somewhere after its creation was requested: what follows in its
    stream is the trainer's late work and requests that raced the cancellation; sometimes a
    second cancellation (which changes nothing)."""
    model_id = stream.key
    for _ in range(draw(st.sampled_from([1, 1, 2]))):
        payload = te.RunCancelled(
            model_id=model_id,
            reason=draw(st.sampled_from(["cancelled", "diverged"])),
            by=draw(st.sampled_from(["owner", "operator"])),
        )
        at = draw(st.integers(1, len(stream.events)))
        stream.add(te.RUN_CANCELLED, payload)  # its time and id come from the end of the stream...
        stream.events.insert(at, stream.events.pop())  # ...then it moves to its place
    # times and ids must still increase along the stream, as the log's would
    stream.events = [event.model_copy(update={"id": f"{model_id}#{i}", "time": T0 + timedelta(seconds=stream.number * 100_000 + i)})
                     for i, event in enumerate(stream.events)]  # fmt: skip


@st.composite
def fork_stream(draw, tenant: str, parent_id: str, step: int, parent_seq_id: int, numbers) -> Stream:
    """A fork of `parent_id` after `step` completed optim_steps: its own session and run,
    keyed by the fork's id; built (the completion carries its weights/ checkpoint), failed,
    or left open; sometimes cancelled while being built or after."""
    number = next(numbers)
    model_id = f"fork-{number}:train:0"
    stream = Stream(tenant, model_id, number)
    name = f"forked-at-step-{step}"
    checkpoint = CheckpointSaved(run_id=model_id, kind="weights", name=name, files={"adapter": ref(f"fork-{number}")})
    payload = te.ForkRequested(
        request_id=f"{model_id}/fork", model_id=model_id, session_id=f"fork-{number}", parent_id=parent_id, step=step,
        parent_seq_id=parent_seq_id, base_model=BASE, lora_config=LoraConfig(rank=4), project_id=draw(st.sampled_from([None, "p1"])),
        checkpoint_name=name,
    )  # fmt: skip
    draw(lifecycle(stream, te.FORK, payload, {"checkpoint": checkpoint}))
    if draw(st.booleans()):
        draw(cancel(stream))
    return stream


@st.composite
def copy_stream(draw, tenant: str, source: CheckpointSaved, numbers) -> Stream:
    number = next(numbers)
    to_project = draw(st.booleans())
    session_id = f"copy-{number}"
    run_id = f"{session_id}:train:0"
    stream = Stream(tenant, run_id, number)
    checkpoint = source.model_copy(update={"run_id": run_id})
    stream.add(ce.CHECKPOINT_COPIED, ce.CheckpointCopied(
        request_id=f"copy-{number}", source_path=source.tinker_path, checkpoint=checkpoint, session_id=session_id,
        base_model=BASE, lora_config=LoraConfig(rank=4), destination="project" if to_project else "session",
        new_session_project_id="p1" if to_project else None,
    ))  # fmt: skip
    if draw(st.booleans()):
        key = dict(run_id=run_id, checkpoint_id=checkpoint.checkpoint_id)
        stream.add(ce.CHECKPOINT_DELETED, ce.CheckpointRemoved(**key, files=checkpoint.files))
    return stream


@st.composite
def sample_stream(draw, tenant: str, ss_id: str, numbers, created: bool = True) -> Stream:
    stream = Stream(tenant, ss_id, next(numbers))
    if created:
        session_id = ss_id.split(":", 1)[0]
        stream.add(
            sa.SAMPLING_SESSION_CREATED,
            sa.SamplingSessionCreated(
                sampling_session_id=ss_id, session_id=session_id, sampling_session_seq_id=0, base_model=BASE
            ),
        )
    for n in range(draw(st.integers(0, 3))):
        rid = f"{ss_id}/s{n}"
        payload = sa.SampleRequested(
            request_id=rid, sampling_session_id=ss_id, seq_id=n, base_model=BASE, prompt_tokens=[1, 2], num_samples=1,
            sampling_params=SamplingParams(), sample_sequence_ids=[],
        )  # fmt: skip
        if draw(st.booleans()):  # cancelled: it matters only if it was still open
            stream.add(sa.SAMPLE["requested"], payload)
            stream.add(sa.SAMPLE_CANCEL_REQUESTED, sa.SampleCancelRequested(request_id=rid, sampling_session_id=ss_id))
            stream.add(sa.SAMPLE_CANCELLED, sa.SampleCancelled(request_id=rid))
            if draw(st.booleans()):
                stream.add(sa.SAMPLE["completed"], RequestCompleted(request_id=rid, result={"late": True}))
        else:
            draw(lifecycle(stream, sa.SAMPLE, payload))
    return stream


@st.composite
def session_streams(draw, tenant: str, session_id: str, numbers) -> list[Stream]:
    stream = Stream(tenant, session_id, next(numbers))
    stream.add(se.SESSION_CREATED, se.SessionCreated(session_id=session_id, tags=["p"]))
    for _ in range(draw(st.integers(0, 2))):
        stream.add(se.SESSION_HEARTBEAT, se.SessionHeartbeat(session_id=session_id))
    if draw(st.booleans()):
        stream.add(se.SESSION_FINISHED, se.SessionFinished(session_id=session_id, reason="closed"))
    streams = [stream]
    for index in range(draw(st.integers(1, 2))):
        streams += draw(model_streams(tenant, session_id, index, numbers))
    if draw(st.booleans()):
        streams.append(draw(sample_stream(tenant, f"{session_id}:sample:9", numbers)))
    return streams


@st.composite
def histories(draw) -> list[list[Event]]:
    numbers = itertools.count()
    streams: list[Stream] = []
    for tenant, session_id in (("alice", "sa"), ("bob", "sb")):
        streams += draw(session_streams(tenant, session_id, numbers))
    events = [list(s.events) for s in streams]
    # at-least-once delivery: an event comes again later in its own stream
    for stream in events:
        for _ in range(draw(st.integers(0, 2))):
            if stream:
                again = stream[draw(st.integers(0, len(stream) - 1))]
                at = draw(st.integers(stream.index(again) + 1, len(stream)))
                stream.insert(at, again)
    return events


@st.composite
def interleaving(draw, streams: list[list[Event]]) -> list[Event]:
    """A uniformly random merge that keeps each stream's own order."""
    labels = draw(st.permutations([i for i, stream in enumerate(streams) for _ in stream]))
    cursors = [iter(stream) for stream in streams]
    return [next(cursors[i]) for i in labels]


@pytest.fixture(scope="module")
def fresh_store(tmp_path_factory):
    """A factory of empty, migrated SQLite stores: migrated once, then copied per example."""
    root = tmp_path_factory.mktemp("projections")
    template = root / "template.db"
    engine = database.make_engine(f"sqlite:///{template}")
    database.upgrade(engine)
    engine.dispose()  # the last connection's close folds the WAL into the file
    counter = itertools.count()
    engines = []

    def make() -> EventStore:
        path = root / f"store-{next(counter)}.db"
        shutil.copyfile(template, path)
        engine = database.make_engine(f"sqlite:///{path}")
        engines.append(engine)
        return EventStore(engine, Codec(BlobStore(root / "blobs")))

    yield make
    for engine in engines:
        engine.dispose()


def fold(store: EventStore, events: list[Event]) -> dict[str, list]:
    for event in events:
        store.append(event)
    with store.engine.connect() as conn:
        tables = {
            name: sorted((tuple(row) for row in conn.execute(select(table))), key=repr)
            for name, table in t.metadata.tables.items()
            if name not in ARRIVAL_ORDER_TABLES
        }
        stored = sorted(conn.execute(select(t.events.c.id)).scalars())
    store.engine.dispose()
    return {"stored event ids": stored, **tables}


@settings(max_examples=60, deadline=None)
@given(histories().flatmap(lambda streams: st.tuples(st.just(streams), interleaving(streams))))
def test_any_interleaving_of_the_streams_folds_to_one_result(fresh_store, drawn):
    streams, merged = drawn
    in_order = fold(fresh_store(), [event for stream in streams for event in stream])
    assert in_order["futures"] and in_order["training_runs"]  # the histories are not empty
    events = {event.type for stream in streams for event in stream}
    note(f"cancelled: {te.RUN_CANCELLED in events}, forked: {te.FORK['requested'] in events}")
    assert fold(fresh_store(), merged) == in_order
