"""Event-store fixtures: the same tests run on SQLite and on the local PostgreSQL server."""

from __future__ import annotations

import pytest

from eventing.blobs import BlobStore
from eventing.codec import Codec
from eventing.store import database
from eventing.store.event_store import EventStore
from eventing.store.queries import Projections
from tests.eventing.brokers import NoidaBroker, TansuBroker


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'events.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def store(store_url, tmp_path):
    engine = database.make_engine(store_url)
    database.upgrade(engine)
    codec = Codec(BlobStore(tmp_path / "blobs"), inline_limit=2048)
    yield EventStore(engine, codec), Projections(engine)
    engine.dispose()


# -- Kafka-protocol brokers for the EventBus contract suite --------------------------------
# One broker of each kind per test session (tests isolate themselves with their own topic
# and group names); stopped in the finalizer, so also when a test fails or errors.


@pytest.fixture(scope="session")
def noida_broker(tmp_path_factory):
    broker = NoidaBroker(tmp_path_factory.mktemp("noida")).start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def tansu_broker(tmp_path_factory):
    broker = TansuBroker(tmp_path_factory.mktemp("tansu")).start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def own_noida_broker(tmp_path):
    """A noida-db broker for one test that restarts it, so no other test sees the restart."""
    broker = NoidaBroker(tmp_path / "noida").start()
    try:
        yield broker
    finally:
        broker.stop()
