"""The scheduler's read of the store: one Activity per run and sampling session, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

from eventing.store.demand import pending_request_ids, read_activity, requests_of
from openrl_core.events import new_event
from openrl_core.events import sampling as se
from openrl_core.events import sessions as sess
from tests.functions.audit.scenario import BASE, GATEWAY, T0, Stream


def _append(store, events):
    for event in events:
        store.append(event)


def _sampling_session(stream: Stream, t: float):
    payload = se.SamplingSessionCreated(
        sampling_session_id=stream.sampler, session_id=stream.session, sampling_session_seq_id=0, base_model=BASE
    )
    return stream.emit(se.SAMPLING_SESSION_CREATED, payload, t=t, source=GATEWAY, key=stream.sampler, stream="control")


def test_runs_and_sampling_sessions_with_their_last_request_and_pending_futures(store):
    events, _ = store
    busy = Stream("alice", session="s1")
    busy.session_created(t=0)
    create = busy.create_model("req-create", t=1)
    busy.completed(create, 2, {"model_id": busy.model})
    busy.forward_backward("req-fb", t=30)  # in flight
    _sampling_session(busy, t=31)
    busy.sample("req-sample", t=40)  # in flight
    done = Stream("alice", session="s2")
    done.session_created(t=0)
    finished_create = done.create_model("req-create-2", t=5)
    done.completed(finished_create, 6, {"model_id": done.model})
    finish = new_event(sess.SESSION_FINISHED, sess.SessionFinished(session_id="s2", reason="client"), tenant="alice",
                       source=GATEWAY, key="s2").model_copy(update={"time": T0 + timedelta(seconds=7)})  # fmt: skip
    _append(events, [*busy.events, *done.events, finish])

    activity = {a.key: a for a in read_activity(events.engine)}
    assert set(activity) == {"s1:train:0", "s1:sample:0"}  # s2 finished with nothing in flight
    run, sampler = activity["s1:train:0"], activity["s1:sample:0"]
    assert (run.kind, run.base_model, run.session_finished, run.pending) == ("lora", BASE, False, 1)
    assert run.last_request == T0 + timedelta(seconds=30) == run.oldest_pending
    assert (sampler.kind, sampler.pending, sampler.last_request) == ("sampling", 1, T0 + timedelta(seconds=40))
    assert pending_request_ids(events.engine, "alice", "s1:train:0") == ["req-fb"]

    stored = requests_of(events, "alice", "s1:train:0", ["req-fb", "req-create", "req-unknown"])
    assert [(e.data.request_id, e.verb) for e in stored] == [
        ("req-create", "create_model"),
        ("req-fb", "forward_backward"),
    ]


def test_a_finished_session_with_a_request_in_flight_still_counts(store):
    events, _ = store
    stream = Stream("bob", session="s9")
    stream.session_created(t=0)
    stream.create_model("req-create", t=1)  # never answered
    finish = new_event(sess.SESSION_FINISHED, sess.SessionFinished(session_id="s9", reason="client"), tenant="bob",
                       source=GATEWAY, key="s9")  # fmt: skip
    _append(events, [*stream.events, finish])
    [activity] = read_activity(events.engine)
    assert activity.session_finished and activity.pending == 1 and activity.key == "s9:train:0"
