"""The distributed deployment: gateway, projector, trainer and sampler as separate processes
over a real Kafka-protocol broker (noida-db) and PostgreSQL, driven by the real SDK.

Faults that must lose nothing: the trainer killed mid-run (its replacement restores the
latest snapshot and replays: the final weights and optimizer state are bitwise those of an
uninterrupted run), the gateway restarted with futures pending, the broker restarted
mid-run, the projector killed and restarted (the store catches up with no duplicates)."""

from __future__ import annotations

import threading

import pytest
import tinker
from sqlalchemy import func, select
from tinker import types

from eventing.store import tables
from tests.e2e.cluster import KEY, MODEL, Cluster
from tests.e2e.test_sdk_walkthrough import make_batch, walkthrough

pytestmark = [pytest.mark.e2e, pytest.mark.kafka, pytest.mark.postgres]
STEPS = 6
ADAM = types.AdamParams(learning_rate=5e-3)


@pytest.fixture
def cluster(tmp_path, pg_url):
    with Cluster(tmp_path, pg_url).running() as cluster:
        yield cluster


def service(cluster: Cluster) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=cluster.url, api_key=KEY)


def run(service_client, steps=STEPS, during=None, name="final"):
    """Submit every step back to back; call `during(i)` once step i's result is in."""
    training = service_client.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
    batch = make_batch(training.get_tokenizer())
    pending = [(training.forward_backward(batch, "cross_entropy"), training.optim_step(ADAM)) for _ in range(steps)]
    losses = []
    for i, (fb, opt) in enumerate(pending):
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
        if during is not None:
            during(i)
    path = training.save_state(name).result().path
    return losses, path


def test_the_sdk_walkthrough_runs_distributed_and_the_store_and_the_log_each_rebuild_it(cluster):
    walkthrough(service(cluster))
    for source in ([], ["--from-log"]):
        replayed = cluster.cli("replay", *source)
        assert replayed.returncode == 0 and "projections match" in replayed.stdout, replayed.stdout + replayed.stderr


def test_a_killed_trainer_is_replaced_and_the_run_is_bitwise_the_uninterrupted_one(cluster):
    client = service(cluster)
    reference_losses, reference = run(client, name="reference")

    def crash(i):
        if i == 2:  # a snapshot (every 2 steps) exists; later steps are in flight
            cluster.workers["trainer"].kill()
            cluster.start_role("trainer").wait_ready()

    losses, path = run(client, during=crash)
    assert losses == reference_losses  # every future completed, with the same numbers
    assert cluster.checkpoint_files(path) == cluster.checkpoint_files(reference)  # weights and optimizer, bitwise
    assert "restored" in cluster.workers["trainer"].log_tail()


def test_futures_pending_across_a_gateway_restart_stay_retrievable(cluster):
    client = service(cluster)
    port = cluster.gateway.port

    def restart_gateway(i):
        if i == 0:
            cluster.gateway.kill()
            cluster.start_gateway(port=port)

    losses, _ = run(client, during=restart_gateway)
    assert len(losses) == STEPS and losses[0] > losses[-1]


def test_a_broker_restart_loses_no_event_and_applies_none_twice(cluster):
    client = service(cluster)
    reference_losses, reference = run(client, name="reference")

    def restart_broker(i):
        if i == 1:
            cluster.broker.restart()

    losses, path = run(client, during=restart_broker)
    assert losses == reference_losses
    assert cluster.checkpoint_files(path) == cluster.checkpoint_files(reference)


def test_a_restarted_projector_catches_up_without_duplicates(cluster):
    client = service(cluster)
    restarted = threading.Event()

    def restart_projector(i):
        if i == 1:
            cluster.workers["projector"].kill()
            cluster.start_role("projector").wait_ready()
            restarted.set()

    losses, _ = run(client, during=restart_projector)
    assert restarted.is_set() and len(losses) == STEPS
    events = tables.events
    duplicates = cluster.query(
        select(events.c.subject, func.count())
        .where(events.c.type.like("%.completed.v1"), events.c.subject.is_not(None))
        .group_by(events.c.subject)
        .having(func.count() > 1)
    )
    assert duplicates == []
    pending = cluster.query(
        select(func.count()).select_from(tables.futures).where(tables.futures.c.state.in_(("pending", "running")))
    )
    assert pending == [(0,)]
