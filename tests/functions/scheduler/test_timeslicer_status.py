"""The scheduler's reader of a timeslicer's /status, against a loopback stand-in of the daemon (see standin_timeslicer)."""

from __future__ import annotations

import pytest

from functions.scheduler.timeslicer_status import TimeslicerStatusError, fetch_status, parse_status
from tests.functions.scheduler.standin_timeslicer import StandinTimeslicer, device

GiB = 1 << 30
STATUS = {
    "node": "gpu-a",
    "policy": "lrs",
    "devices": [
        device(0, 6 * GiB, residents=[{"job": "openrl-trainer-x-0", "bytes": 2 * GiB, "parked": False},
                                      {"job": "someone-else", "bytes": GiB, "parked": False},
                                      {"job": "parked-one", "bytes": 3 * GiB, "parked": True}],
               holder={"job": "someone-else", "lease_id": 41, "deadline": 1234.5},
               waiters=[{"job": "openrl-trainer-x-0", "waiting_seconds": 0.25}]),
        device(1, 6 * GiB),
    ],
}  # fmt: skip


def test_reads_the_status_over_http():
    with StandinTimeslicer("127.0.0.1", STATUS) as daemon:
        status = fetch_status(daemon.url)
    assert status.node == "gpu-a" and status.policy == "lrs"
    first, second = status.devices
    assert (first.index, first.budget_bytes, first.resident_bytes) == (0, 6 * GiB, 3 * GiB)
    assert first.holder.lease_id == 41 and first.waiters[0].waiting_seconds == 0.25
    assert first.foreign_bytes({"openrl-trainer-x-0"}) == GiB  # parked residents hold no device memory
    assert second.residents == [] and second.holder is None


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"node": "n", "policy": "round-robin", "devices": []}', "policy"),
        ('{"node": "n", "policy": "fifo", "devices": [{"device": "gpu0", "budget_bytes": 1, "resident_bytes": 0}]}',
         "is not '<kind>:<index>'"),
        ('{"node": "n", "policy": "fifo", "devices": [], "extra": 1}', "extra"),
        ("not json", "body"),
    ],
)  # fmt: skip
def test_anything_else_is_refused_with_what_is_wrong(body, message):
    with pytest.raises(TimeslicerStatusError, match="not a timeslicer status") as caught:
        parse_status(body)
    assert message in caught.value.detail


def test_an_unreachable_or_failing_daemon_is_a_typed_error():
    with StandinTimeslicer("127.0.0.1", STATUS) as daemon:
        url = daemon.url
    with pytest.raises(TimeslicerStatusError, match="unreachable"):
        fetch_status(url, timeout=0.5)
    with StandinTimeslicer("127.0.0.1", STATUS) as daemon:
        with pytest.raises(TimeslicerStatusError, match="answered 404"):
            fetch_status(daemon.url + "/nowhere")
