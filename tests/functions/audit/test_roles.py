"""`audit` and `metrics` as Node roles: the wiring `openrl audit` and `openrl metrics` run."""

from __future__ import annotations

import threading
import urllib.request

import pytest

from functions.audit import read_entries
from functions.serve import ROLES, Node
from openrl_core.catalog import TINY_QWEN3
from openrl_core.settings import Settings
from tests.functions.audit.scenario import Stream


def test_unknown_roles_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown roles"):
        Node(Settings(data_dir=tmp_path), ("gateway", "auditor"))
    assert "audit" not in ROLES and "metrics" not in ROLES  # not part of `openrl serve`


def test_a_node_runs_audit_and_metrics(tmp_path, tiny_files):
    settings = Settings(data_dir=tmp_path, models=[TINY_QWEN3], metrics_port=0, metrics_checkpoint_seconds=0.1)
    node = Node(settings, ("audit", "metrics"))
    stream = Stream("alice", node.runtime.publisher)
    create = stream.create_model("req-create", 0)
    stream.completed(create, 1, {"model_id": stream.model})
    node.start_workers()
    try:
        done = threading.Event()
        for _ in range(200):  # up to 10 s for both consumers to catch up
            served = node.metrics._server is not None
            audited = len(list(read_entries(tmp_path / "audit", "alice"))) == 2
            if served and audited and not node.metrics.metrics.state.open:
                done.set()
                break
            done.wait(0.05)
        assert done.is_set()
        with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics.port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        assert (
            'openrl_requests_completed_total{base_model="openrl/tiny-qwen3",tenant="alice",type="create_model"} 1.0'
            in text
        )
    finally:
        node.stop()
    assert (tmp_path / "metrics" / "state.json").exists()


def test_roles_that_read_no_weights_build_no_model_files(tmp_path):
    cache = tmp_path / "models"
    node = Node(Settings(data_dir=tmp_path / "data", model_cache=cache, models=[TINY_QWEN3]), ("projector", "audit"))
    node.stop()
    assert not cache.exists() or not any(cache.iterdir())
