"""The chaos soak, short form: four tenants' RL loops on the distributed deployment (noida-db,
PostgreSQL, one process per role) while a seeded chaos loop SIGKILLs and restarts a random role
or restarts the broker every few seconds. What must hold is in tests/e2e/chaos_soak.py; the
long form is `make chaos`, which runs this test first (`-m chaos` picks it alone).
"""

from __future__ import annotations

import pytest

from tests.e2e.chaos_soak import ENV, KEYS, soak
from tests.e2e.cluster import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.kafka, pytest.mark.postgres, pytest.mark.chaos]


@pytest.fixture
def cluster(tmp_path, pg_url):
    with Cluster(tmp_path, pg_url, extra_env=ENV, keys=KEYS).running() as cluster:
        yield cluster


def test_four_rl_loops_under_chaos_lose_nothing_double_nothing_and_end_bitwise_the_quiet_run(cluster):
    report = soak(cluster, steps=4, seed=7, interval=(1.0, 3.0), max_faults=5)
    print(report)
    assert report["fault_count"] == 5, report  # each kind of fault once: trainer, sampler, projector, gateway, broker
    assert report["distinct_final_states"] == 4, report
    assert report["problems"] == [], cluster.logs()
