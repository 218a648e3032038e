"""Shared accelerators in the distributed deployment: trainer and sampler processes take turns
through one node timeslicer daemon (its own process) over its Unix socket, on noida-db and
PostgreSQL. Faults that must lose nothing and double nothing:

- a full fine-tuning run's trainer killed with kill -9 mid-run: its replacement restores
  the latest snapshot (weights and AdamW state) and replays; the run's final state is
  bitwise that of an uninterrupted run;
- the timeslicer daemon killed and restarted mid-run: the workers re-register and the run
  finishes bitwise as if nothing happened;
- the trainer stopped with SIGSTOP while it holds the device: the sampler gets the device
  once the lease lapses, a replacement trainer takes the run over, and the stopped one,
  resumed, publishes nothing (every applied event of the run carries a lease no lower than
  the ones before it, and the weights are bitwise the uninterrupted run's).
"""

from __future__ import annotations

import signal
import time

import pytest
import tinker
from sqlalchemy import select
from tinker import types

from eventing.store import tables
from tests.e2e.cluster import KEY, MODEL, Cluster
from tests.e2e.test_sdk_walkthrough import make_batch

pytestmark = [pytest.mark.e2e, pytest.mark.kafka, pytest.mark.postgres]
STEPS = 6
ADAM = types.AdamParams(learning_rate=1e-4)
FULL = {"openrl.full_finetune": "true"}


@pytest.fixture
def cluster(tmp_path, pg_url):
    with Cluster(tmp_path, pg_url, timeslicer=True, extra_env={"OPENRL_LEASE_SECONDS": "2"}).running() as cluster:
        yield cluster


def full_run(client, name, during=None, steps=STEPS):
    training = client.create_lora_training_client(base_model=MODEL, user_metadata=FULL).result()
    batch = make_batch(training.get_tokenizer())
    pending = [(training.forward_backward(batch, "cross_entropy"), training.optim_step(ADAM)) for _ in range(steps)]
    losses = []
    for i, (fb, opt) in enumerate(pending):
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
        if during is not None:
            during(i)
    return training, losses, training.save_state(name).result().path


def leases_never_go_back(cluster, model_id):
    rows = cluster.query(
        select(tables.events.c.lease_id, tables.events.c.fenced)
        .where(tables.events.c.key == model_id, tables.events.c.lease_id.is_not(None))
        .order_by(tables.events.c.position)
    )
    applied = [lease for lease, fenced in rows if not fenced]
    return applied == sorted(applied), rows


def test_a_killed_full_finetuning_trainer_is_replaced_and_the_run_is_bitwise_the_uninterrupted_one(cluster):
    client = tinker.ServiceClient(base_url=cluster.url, api_key=KEY)
    _, reference_losses, reference = full_run(client, "reference")

    def crash(i):
        if i == 2:  # a snapshot (every 2 steps) of weights and moments exists; later steps are queued
            cluster.workers["trainer"].kill()
            cluster.start_role("trainer").wait_ready()

    training, losses, path = full_run(client, "final", during=crash)
    assert losses == reference_losses
    files = cluster.checkpoint_files(path)
    assert set(files) >= {"model.safetensors", "optimizer.safetensors", "openrl_full.json"}
    assert files == cluster.checkpoint_files(reference)  # float32 weights and AdamW moments, bitwise
    assert "restored" in cluster.workers["trainer"].log_tail()
    assert leases_never_go_back(cluster, training.model_id)[0]


def test_a_restarted_timeslicer_daemon_loses_no_step_and_doubles_none(cluster):
    client = tinker.ServiceClient(base_url=cluster.url, api_key=KEY)
    _, reference_losses, reference = full_run(client, "reference")

    def restart_daemon(i):
        if i == 1:
            cluster.workers["timeslicer"].kill()
            cluster.start_timeslicer()

    training, losses, path = full_run(client, "final", during=restart_daemon)
    assert losses == reference_losses
    assert cluster.checkpoint_files(path) == cluster.checkpoint_files(reference)
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(training.get_tokenizer().encode("Two plus two"))
    assert (
        len(
            sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=3)).result().sequences
        )
        == 2
    )
    status = cluster.cli("timeslicer", "status", "--json", "--socket", str(cluster.socket))
    assert status.returncode == 0, status.stderr
    assert "re-registered" in cluster.workers["trainer"].log_tail() + cluster.workers["sampler"].log_tail()


def test_a_stopped_trainer_loses_the_device_and_its_replacement_finishes_the_run(cluster, tmp_path):
    client = tinker.ServiceClient(base_url=cluster.url, api_key=KEY)
    _, reference_losses, reference = full_run(client, "reference")
    base_sampler = client.create_sampling_client(base_model=MODEL).result()
    prompt = types.ModelInput.from_ints([1, 2, 3, 4])
    observed = {}

    def stop_trainer(i):
        if i != 1:
            return
        old = cluster.workers["trainer"]
        old.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            # The sampler needs the device too: it gets it at the latest when the stopped
            # trainer's lease (2 s) lapses.
            sample = base_sampler.sample(
                prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=2)
            ).result()
            observed["sample_seconds"] = time.monotonic() - started
            observed["sampled"] = len(sample.sequences)
            replacement = cluster.start_role("trainer")  # same instance id: takes the partitions and the jobs over
            replacement.wait_ready()
        finally:
            old.process.send_signal(signal.SIGCONT)
        observed["old"] = old

    training, losses, path = full_run(client, "final", during=stop_trainer)
    assert observed["sampled"] == 1 and observed["sample_seconds"] < 30
    assert losses == reference_losses
    assert cluster.checkpoint_files(path) == cluster.checkpoint_files(reference)
    ordered, rows = leases_never_go_back(cluster, training.model_id)
    assert ordered, rows
    time.sleep(2)  # let the resumed trainer try whatever it was doing
    observed["old"].kill()
    assert cluster.checkpoint_files(path) == cluster.checkpoint_files(reference)
    assert leases_never_go_back(cluster, training.model_id)[0]
    # every request of the run answered exactly once (a second answer would be a second row)
    answered = cluster.query(select(tables.futures.c.state).where(tables.futures.c.model_id == training.model_id))
    assert answered and all(state == "completed" for (state,) in answered)
