"""One FSDP2 rank of a sharded full run killed with kill -9 in the distributed deployment
(noida-db, PostgreSQL, a trainer process with `OPENRL_TRAINER_FULL_SHARDS=2`, gloo ranks on
CPU): the trainer notices, kills its other rank and exits (code 70); its replacement restores
the run's latest sharded snapshot and replays the requests after it. Nothing is lost or
doubled: the losses and the final checkpoint (every shard file, by sha256) are bitwise those
of an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import tinker

from functions.trainer.sharded import EXIT_RANK_LOST
from tests.e2e.cluster import KEY, Cluster
from tests.e2e.test_distributed_shared import full_run

pytestmark = [pytest.mark.e2e, pytest.mark.kafka, pytest.mark.postgres]


@pytest.fixture
def cluster(tmp_path, pg_url):
    with Cluster(tmp_path, pg_url, extra_env={"OPENRL_TRAINER_FULL_SHARDS": "2"}).running() as cluster:
        yield cluster


def ranks_of(pid: int) -> list[int]:
    """The trainer's FSDP rank processes: its children started by multiprocessing's spawn."""
    children = [c for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    return sorted(int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())


def test_a_killed_rank_ends_its_trainer_and_the_replacement_finishes_the_run_bitwise(cluster):
    client = tinker.ServiceClient(base_url=cluster.url, api_key=KEY)
    _, reference_losses, reference = full_run(client, "reference")
    killed = {}

    def crash(i):
        if i == 2:  # a snapshot (every 2 steps) of the shards exists; later steps are queued
            trainer = cluster.workers["trainer"].process
            ranks = ranks_of(trainer.pid)
            assert len(ranks) == 2, ranks
            os.kill(ranks[1], signal.SIGKILL)
            killed["exit"] = trainer.wait(timeout=60)
            cluster.start_role("trainer").wait_ready()

    _, losses, path = full_run(client, "final", during=crash)
    assert killed["exit"] == EXIT_RANK_LOST
    assert losses == reference_losses
    files = cluster.checkpoint_files(path)
    assert set(files) == {"shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors",
                          "openrl_full.json", "optimizer.json"}  # fmt: skip
    assert files == cluster.checkpoint_files(reference)  # weights and AdamW moments, bitwise
    assert "restored" in cluster.workers["trainer"].log_tail()
