"""PostgreSQL away for a while under the distributed deployment: nothing lost, nothing doubled,
and the service resumes by itself.

Every process of the deployment reaches the (shared, so not ours to stop) PostgreSQL server
through a TCP proxy the test cuts for several seconds while a LoRA run is mid-step:

- a request that needs the store meanwhile is a 503 with `Retry-After` and a message saying
  the event store is unreachable (not a 500, not a hang);
- a step submitted through the SDK during the outage completes once the database is back (the
  SDK retries the 503s by itself, deduplicated by seq_id); one completed while it was away
  reaches the store (the projector retries its batch);
- the run ends bitwise the same run without the outage, its steps are counted once each,
  no future is left pending, and `openrl replay` finds the projections match.
"""

from __future__ import annotations

import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
import tinker
from sqlalchemy import func, select
from tinker import types

from eventing.store import tables
from tests.e2e.cluster import KEY, MODEL, Cluster
from tests.e2e.test_sdk_walkthrough import make_batch
from tests.eventing.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.e2e, pytest.mark.kafka, pytest.mark.postgres]
ADAM = types.AdamParams(learning_rate=5e-3)
OUTAGE_SECONDS = 8.0


@pytest.fixture
def rig(tmp_path, pg_url):
    where = urlsplit(pg_url.replace("postgresql+psycopg://", "postgresql://", 1))
    proxy = TcpProxy(where.hostname, where.port or 5432)
    with Cluster(tmp_path, proxy.url_for(pg_url)).running() as cluster:
        try:
            yield cluster, proxy
        finally:
            proxy.restore()  # before the cluster stops, as its roles need the store to shut down cleanly
        proxy.close()


def three_steps(training, batch, during=None) -> tuple[list[float], str]:
    losses = []
    for step in range(3):
        fb, opt = training.forward_backward(batch, "cross_entropy"), training.optim_step(ADAM)
        if during is not None:
            during(step)
        losses.append(fb.result(timeout=180).metrics["loss:sum"])
        opt.result(timeout=180)
    return losses, training.save_state(f"final-{training.model_id[:8]}").result(timeout=180).path


def test_postgres_down_answers_503_retry_after_loses_nothing_and_the_run_resumes_by_itself(rig):
    cluster, proxy = rig
    client = tinker.ServiceClient(base_url=cluster.url, api_key=KEY)
    reference = client.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
    batch = make_batch(reference.get_tokenizer())
    reference_losses, reference_path = three_steps(reference, batch)

    training = client.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
    seen = {}

    def outage(step):
        if step != 1:
            return
        proxy.cut()  # step 1's requests are on the log: their completions meet a store that is away
        began = time.monotonic()
        # A read of the store (the run's own lookup is kept in memory, eventing/store/known_runs.py).
        answer = httpx.get(cluster.url + "/api/openrl/v1/runs", headers={"X-API-Key": KEY}, timeout=30)
        seen["answer"] = (answer.status_code, answer.headers.get("retry-after"), answer.text)
        threading.Timer(max(0.0, OUTAGE_SECONDS - (time.monotonic() - began)), proxy.restore).start()

    losses, path = three_steps(training, batch, during=outage)  # step 2 is sent while the store is away
    status, retry_after, body = seen["answer"]
    assert status == 503 and retry_after is not None and int(retry_after) > 0, seen
    assert "event store is unreachable" in body
    assert proxy.refused > 0  # the deployment did try the database while it was away
    assert losses == reference_losses
    assert cluster.checkpoint_files(path) == cluster.checkpoint_files(reference_path)  # weights and optimizer, bitwise

    steps = cluster.query(
        select(tables.run_steps.c.step).where(
            tables.run_steps.c.model_id == training.model_id, tables.run_steps.c.completed_at.is_not(None)
        )
    )
    assert sorted(step for (step,) in steps) in ([1, 2, 3], [0, 1, 2])
    open_futures = cluster.query(
        select(func.count()).select_from(tables.futures).where(tables.futures.c.state.in_(("pending", "running")))
    )
    assert open_futures == [(0,)]
    replayed = cluster.cli("replay")
    assert replayed.returncode == 0 and "projections match" in replayed.stdout, replayed.stdout + replayed.stderr
