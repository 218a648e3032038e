"""The appender on a real SQLite store and a real embedded log: concurrent submissions share
one store transaction and one log commit; what could not be published waits in the outbox."""

from __future__ import annotations

import threading

from eventing.appender import Appender
from eventing.blobs import BlobStore
from eventing.bus import EventPublisher
from eventing.codec import Codec
from eventing.dedup import Dedup
from eventing.embedded_log import EmbeddedLog
from eventing.store import database
from eventing.store.event_store import EventStore
from openrl_core.events import new_event
from openrl_core.events import sessions as se
from openrl_core.events import training as te
from openrl_core.params import AdamParams

TOPIC = "openrl.alice.control"


def setup(tmp_path):
    engine = database.make_engine(f"sqlite:///{tmp_path / 'events.db'}")
    database.upgrade(engine)
    codec = Codec(BlobStore(tmp_path / "blobs"))
    store = EventStore(engine, codec)
    log = EmbeddedLog(tmp_path / "log.db")
    return store, log, Appender(store, EventPublisher(log, codec))


def created(sid: str):
    return new_event(se.SESSION_CREATED, se.SessionCreated(session_id=sid), tenant="alice", source="/test", key=sid)


def drain(log: EmbeddedLog) -> list[bytes]:
    consumer = log.consumer("check", topics=[TOPIC])
    values = [r.message.key for r in consumer.poll(max_records=100, timeout=0.2)]
    consumer.close()
    return values


def test_concurrent_appends_share_a_batch_and_all_land_in_store_and_log(tmp_path):
    store, log, appender = setup(tmp_path)
    batches: list[int] = []
    write = appender._group._write_batch
    appender._group._write_batch = lambda items: (batches.append(len(items)), write(items))[1]
    outcomes: dict[int, object] = {}
    with appender._group.writing():  # a batch in progress: the others queue behind it
        threads = [
            threading.Thread(target=lambda n=n: outcomes.__setitem__(n, appender.append(created(f"s{n}"), TOPIC)))
            for n in range(10)
        ]
        for thread in threads:
            thread.start()
        while len(appender._group._queue) < 10:
            threading.Event().wait(0.01)
    for thread in threads:
        thread.join(10)
    assert batches == [10]
    assert all(outcome.stored for outcome in outcomes.values())
    assert sorted(drain(log)) == sorted(f"s{n}".encode() for n in range(10))
    assert store.unpublished() == []  # every outbox row cleared once the log had the event
    log.close()


def test_an_event_the_log_refused_waits_in_the_outbox_and_a_retry_publishes_it(tmp_path):
    store, log, appender = setup(tmp_path)
    log.close()  # the log is gone: the store takes the event, the log cannot

    def step(request_id: str):
        payload = te.OptimStepRequested(request_id=request_id, model_id="s1", seq_id=1, adam_params=AdamParams())
        return new_event(te.OPTIM_STEP["requested"], payload, tenant="alice", source="/test", key="s1")

    event = step("r1")
    dedup = Dedup.of("seq:s1:1", b"body")
    try:
        appender.append(event, TOPIC, dedup)
        raise AssertionError("publishing to a closed log must fail")
    except Exception as exc:
        assert "closed" in str(exc)
    assert [e.id for e, _topic, _dedup in store.unpublished()] == [event.id]
    reopened = EmbeddedLog(tmp_path / "log.db")
    appender = Appender(store, EventPublisher(reopened, store.codec))
    again = appender.append(step("r1-retry"), TOPIC, dedup)  # the SDK's retry: same identity
    assert not again.stored and again.duplicate_of == "r1"  # the first future, now published
    assert drain(reopened) == [b"s1"] and store.unpublished() == []
    reopened.close()


def test_the_relay_does_not_republish_a_batch_that_is_being_published(tmp_path):
    """Between a batch's store commit and its publish its rows sit in the outbox; a relay
    pass then must wait for the batch, not publish those rows a second time."""
    store, log, appender = setup(tmp_path)
    publish = appender.publisher.publish_many
    relay_done = threading.Event()
    relayed: list[int] = []

    def relay():
        relayed.append(appender.republish_outbox())
        relay_done.set()

    def publish_with_a_relay_pass_meanwhile(items):
        assert [e.id for e, _t, _d in store.unpublished()] == [
            event.id for _topic, event, _dedup in items
        ]  # committed, unpublished
        threading.Thread(target=relay).start()
        relay_done.wait(0.5)  # time enough for a relay that does not wait to publish its copy
        return publish(items)

    appender.publisher.publish_many = publish_with_a_relay_pass_meanwhile
    appender.append(created("s1"), TOPIC)
    assert relay_done.wait(5) and relayed == [0]  # it ran once the batch was done, and found nothing
    assert drain(log) == [b"s1"] and store.unpublished() == []
    log.close()


def test_a_published_batchs_outbox_rows_go_with_the_next_batch_and_are_never_published_again(tmp_path):
    """With another batch queued, a published batch's outbox rows are deleted by that batch's
    transaction instead of one of their own; until then neither the relay nor `close`
    publishes them again, and both delete them."""
    store, log, appender = setup(tmp_path)
    transactions: list[list[str]] = []
    append_many, mark = store.append_many, store.mark_published_many
    store.append_many = lambda items, published=(): (
        transactions.append(list(published)),
        append_many(items, published=published),
    )[1]
    alone: list[list[str]] = []
    store.mark_published_many = lambda ids: (alone.append(list(ids)), mark(ids))[1]
    queued = [True]
    appender._group.queued = lambda: queued[0]  # another batch waiting, or not

    first = created("s1")
    appender.append(first, TOPIC)
    assert alone == [] and [e.id for e, _t, _d in store.unpublished()] == [first.id]  # its row waits
    queued[0] = False
    appender.append(created("s2"), TOPIC)  # the next batch: its transaction takes s1's row
    assert transactions[-1] == [first.id] and len(alone) == 1 and store.unpublished() == []

    queued[0] = True
    third = created("s3")
    appender.append(third, TOPIC)
    assert appender.republish_outbox() == 0  # the relay deletes the waiting row, publishes nothing
    assert alone[-1] == [third.id] and store.unpublished() == []
    appender.append(created("s4"), TOPIC)
    appender.close()  # what waits is deleted on the way out
    assert store.unpublished() == []
    assert sorted(drain(log)) == [b"s1", b"s2", b"s3", b"s4"]  # each on the log once
    log.close()


def test_a_batch_that_failed_keeps_the_rows_it_was_to_delete(tmp_path):
    store, log, appender = setup(tmp_path)
    appender._group.queued = lambda: True
    first = created("s1")
    appender.append(first, TOPIC)
    append_many = store.append_many
    store.append_many = lambda items, published=(): (_ for _ in ()).throw(RuntimeError("the database is away"))
    try:
        appender.append(created("s2"), TOPIC)
        raise AssertionError("the store's failure must reach the caller")
    except RuntimeError:
        pass
    store.append_many = append_many
    assert [e.id for e, _t, _d in store.unpublished()] == [first.id]  # not deleted: still to do
    assert appender.republish_outbox() == 0 and store.unpublished() == []
    assert drain(log) == [b"s1"]
    log.close()
