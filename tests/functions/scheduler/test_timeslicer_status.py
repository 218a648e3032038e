"""The scheduler's reader of a timeslicer's /status, against the real daemon with real worker
clients holding, waiting and parking (and a plain HTTP server for answers no daemon gives)."""

from __future__ import annotations

import threading
import time

import pytest

from functions.scheduler.timeslicer_status import TimeslicerStatusError, fetch_status, parse_status
from tests.functions.scheduler.node_timeslicer import NodeTimeslicer
from tests.functions.scheduler.standin_timeslicer import StandinTimeslicer

GiB = 1 << 30
BUDGETS = {"cuda:0": 6 * GiB, "cuda:1": 6 * GiB}


def test_reads_the_real_daemons_status_over_http():
    with NodeTimeslicer("127.0.0.1", "gpu-a", BUDGETS) as node:
        ours, other = node.worker("openrl-trainer-x-0"), node.worker("someone-else")
        ours.register("openrl-trainer-x-0/model/m1", 2 * GiB, "cuda:0")
        other.register("someone-else/model/m2", GiB, "cuda:0")
        other.register("someone-else/model/parked-one", 3 * GiB, "cuda:0")  # registered, never run: not resident
        with ours.turn("openrl-trainer-x-0/model/m1"):
            pass
        lease = other.acquire("someone-else/model/m2")
        threading.Thread(target=lambda: ours.acquire("openrl-trainer-x-0/model/m1", timeout=5), daemon=True).start()
        time.sleep(0.3)
        status = fetch_status(node.url)
        other.release(lease)
    assert status.node == "gpu-a" and status.policy == "lrs"
    first, second = status.devices
    assert (first.index, first.budget_bytes, first.resident_bytes) == (0, 6 * GiB, 3 * GiB)
    assert first.holder.lease_id == lease.lease_id and first.holder.job == "someone-else/model/m2"
    assert [w.job for w in first.waiters] == ["openrl-trainer-x-0/model/m1"] and first.waiters[0].waiting_seconds > 0.2
    assert first.foreign_bytes({"openrl-trainer-x-0"}) == GiB  # parked residents hold no device memory
    assert second.residents == [] and second.holder is None


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"node": "n", "policy": "round-robin", "devices": []}', "policy"),
        ('{"node": "n", "policy": "fifo", "devices": [{"device": "gpu0", "budget_bytes": 1, "resident_bytes": 0}]}',
         "is not '<kind>:<index>'"),
        ('{"node": "n", "policy": "fifo", "devices": {"cuda:0": 1}}', "devices"),
        ("not json", "body"),
    ],
)  # fmt: skip
def test_anything_else_is_refused_with_what_is_wrong(body, message):
    with pytest.raises(TimeslicerStatusError, match="not a timeslicer status") as caught:
        parse_status(body)
    assert message in caught.value.detail


def test_an_unreachable_or_failing_daemon_is_a_typed_error():
    with NodeTimeslicer("127.0.0.1", "gpu-a", BUDGETS) as node:
        url = node.url
        with pytest.raises(TimeslicerStatusError, match="answered 404"):
            fetch_status(node.url + "/nowhere")
    with pytest.raises(TimeslicerStatusError, match="unreachable"):
        fetch_status(url, timeout=0.5)


def test_fields_a_newer_daemon_adds_are_ignored_and_a_device_without_budget_is_read():
    body = {"node": "n", "policy": "fifo", "uptime_seconds": 3, "devices": [
        {"device": "cpu:0", "budget_bytes": None, "resident_bytes": 0, "duty_cycle": 0.5, "residents": [
            {"job": "w/base/x", "bytes": 1, "parked": False, "parkable": False, "worker": "w"}]}]}  # fmt: skip
    with StandinTimeslicer("127.0.0.1", body) as server:
        status = fetch_status(server.url)
    assert status.devices[0].budget_bytes is None and status.devices[0].residents[0].job == "w/base/x"
