"""Holders that die or freeze, as separate processes against a real daemon: kill -9 frees the
device at once, SIGSTOP loses the lease at its deadline and leaves the holder fenced."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from functions.local_server import REPO
from functions.timeslicer.client import TimeslicerClient, unix_transport
from functions.timeslicer.daemon import Daemon
from functions.timeslicer.service import SlicerService

LEASE = 2.0
HOLDER = """
import sys, time
from functions.timeslicer.client import TimeslicerClient, unix_transport
client = TimeslicerClient(unix_transport(sys.argv[1]), "holder")
client.register("held-job", 1, "cpu:0")
with client.turn("held-job") as turn:
    first = turn.lease_id
    print("holding", first, flush=True)
    time.sleep(float(sys.argv[2]))      # SIGSTOP arrives in here
    print("resumed valid=%s" % turn.lease.valid(), flush=True)
    again = turn.confirm()
    print("confirmed", again, flush=True)
reply = client._call({"op": "renew", "lease_id": first}, retry=False)
print("old-renew", reply.get("ok"), reply.get("error", ""), flush=True)
"""


@pytest.fixture
def daemon():
    path = Path(tempfile.mkdtemp(prefix="ts-")) / "ts.sock"
    service = SlicerService({"cpu:0": None}, lease_seconds=LEASE)
    d = Daemon(service, path)
    d.start_in_thread()
    yield d
    d.stop()


def start_holder(path, sleep):
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), str(sleep)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
    line = child.stdout.readline()
    assert line.startswith("holding"), line
    return child, int(line.split()[1])


def test_a_holder_killed_with_sigkill_frees_the_device_for_the_next_waiter_at_once(daemon):
    child, lease = start_holder(daemon.socket_path, 60)
    waiter = TimeslicerClient(unix_transport(str(daemon.socket_path)), "waiter")
    waiter.register("waiting-job", 1, "cpu:0")
    child.send_signal(signal.SIGKILL)
    child.wait()
    started = time.monotonic()
    with waiter.turn("waiting-job", timeout=LEASE) as turn:
        assert time.monotonic() - started < LEASE  # within the lease deadline: the closed socket says it
        assert turn.lease_id > lease
    assert all(r["job"] != "held-job" for r in waiter.status()["devices"][0]["residents"]), "its jobs died with it"
    waiter.close()


def test_a_stopped_holder_loses_its_lease_at_the_deadline_and_is_fenced_after(daemon):
    child, lease = start_holder(daemon.socket_path, 0.5)
    child.send_signal(signal.SIGSTOP)
    try:
        waiter = TimeslicerClient(unix_transport(str(daemon.socket_path)), "waiter")
        waiter.register("waiting-job", 1, "cpu:0")
        started = time.monotonic()
        turn_cm = waiter.turn("waiting-job", timeout=3 * LEASE)
        turn = turn_cm.__enter__()
        waited = time.monotonic() - started
        assert LEASE * 0.5 < waited < LEASE + 1.0, waited
        assert turn.lease_id > lease
        child.send_signal(signal.SIGCONT)
        line = child.stdout.readline()
        assert line.strip() == "resumed valid=False", line  # it knows: its clock passed the deadline
        time.sleep(0.3)
        turn_cm.__exit__(None, None, None)  # only now can the resumed holder get a new lease
        confirmed = int(child.stdout.readline().split()[1])
        assert confirmed > turn.lease_id > lease, "its work is published under a new lease, never the stale one"
        old = child.stdout.readline().split(maxsplit=2)
        assert old[:2] == ["old-renew", "False"] and "fenced" in old[2]
        assert daemon.service.core.expired_leases == 1
        waiter.close()
    finally:
        child.send_signal(signal.SIGCONT)
        child.wait(timeout=30)
