"""The timeslicer client contract, run over both transports: the Unix-socket daemon and the
in-process link. Real threads, real sockets, short leases."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path

import pytest

from functions.timeslicer.client import Fenced, TimeslicerClient, unix_transport
from functions.timeslicer.daemon import Daemon
from functions.timeslicer.local import LocalSlicer
from functions.timeslicer.service import SlicerService
from openrl_core.errors import InvalidRequest
from openrl_core.timeslice import Policy

LEASE = 1.0
DEVICE = "cpu:0"


class UnixRig:
    name = "unix"

    def __init__(self, budget=None, policy=Policy.FIFO):
        self.dir = Path(tempfile.mkdtemp(prefix="ts-"))
        self.path = self.dir / "ts.sock"
        self.budget, self.policy = budget, policy
        self.start()

    def start(self):
        self.service = SlicerService({DEVICE: self.budget}, self.policy, lease_seconds=LEASE, park_timeout=5)
        self.daemon = Daemon(self.service, self.path, http_port=0)
        self.daemon.start_in_thread()

    def restart(self):
        self.daemon.stop()
        time.sleep(0.3)
        self.start()

    def connector(self):
        return unix_transport(str(self.path))

    def close(self):
        self.daemon.stop()


class LocalRig:
    name = "local"

    def __init__(self, budget=None, policy=Policy.FIFO):
        self.service = SlicerService({DEVICE: budget}, policy, lease_seconds=LEASE, park_timeout=5)
        self.slicer = LocalSlicer(self.service)

    def connector(self):
        return self.slicer.connect

    def close(self):
        self.slicer.close()


RIGS = [UnixRig, LocalRig]


@pytest.fixture(params=RIGS, ids=lambda rig: rig.__name__)
def make(request):
    made, clients = [], []

    def build(budget=None, policy=Policy.FIFO):
        rig = request.param(budget, policy)
        made.append(rig)

        def client(name, on_park=None):
            c = TimeslicerClient(rig.connector(), name, on_park)
            clients.append(c)
            return c

        rig.client = client
        return rig

    yield build
    for c in clients:
        c.close()
    for rig in made:
        rig.close()


class RawHolder:
    """A worker that takes a turn and then stops answering (no renewals): a hung holder."""

    def __init__(self, rig):
        self.replies = []
        self.got = threading.Condition()
        self.link = rig.connector()(self._on, lambda: None)

    def _on(self, message):
        with self.got:
            self.replies.append(message)
            self.got.notify_all()

    def ask(self, message, timeout=5.0):
        self.link.send(message)
        deadline = time.monotonic() + timeout
        with self.got:
            while True:
                for reply in self.replies:
                    if reply.get("id") == message.get("id"):
                        return reply
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"no answer to {message}"
                self.got.wait(remaining)


def test_one_holder_at_a_time_across_workers(make):
    rig = make()
    intervals, lock = [], threading.Lock()

    def work(name):
        client = rig.client(name)
        client.register(name, 10, DEVICE)
        for _ in range(15):
            with client.turn(name) as turn:
                start = time.monotonic()
                time.sleep(0.002)
                assert turn.confirm() == turn.lease_id
                with lock:
                    intervals.append((start, time.monotonic(), turn.lease_id))

    threads = [threading.Thread(target=work, args=(f"job{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    intervals.sort()
    assert len(intervals) == 45
    for (s1, e1, _), (s2, e2, _) in zip(intervals, intervals[1:]):
        assert e1 <= s2, "two holders at once"
    leases = [lease for _, _, lease in intervals]
    assert leases == sorted(leases) and len(set(leases)) == 45


def test_renewals_keep_a_long_turn_current(make):
    rig = make()
    client = rig.client("w")
    client.register("long", 1, DEVICE)
    with client.turn("long") as turn:
        time.sleep(3 * LEASE)
        assert turn.lease.valid()
        assert turn.confirm() == turn.lease_id
    assert rig.service.core.expired_leases == 0


def test_a_holder_that_stops_renewing_loses_the_device_and_is_fenced(make):
    rig = make()
    stuck = RawHolder(rig)
    assert stuck.ask({"op": "hello", "id": 1, "worker": "stuck"})["ok"]
    assert stuck.ask({"op": "register", "id": 2, "job": "a", "device": DEVICE, "bytes": 1})["ok"]
    grant = stuck.ask({"op": "acquire", "id": 3, "job": "a"})
    client = rig.client("waiter")
    client.register("b", 1, DEVICE)
    started = time.monotonic()
    with client.turn("b") as turn:
        waited = time.monotonic() - started
        assert LEASE * 0.5 < waited < LEASE + 1.0, waited
        assert turn.lease_id > grant["lease_id"]
    renew = stuck.ask({"op": "renew", "id": 4, "lease_id": grant["lease_id"]})
    assert not renew["ok"] and "fenced" in renew["error"] and renew["code"] == 409
    assert rig.service.core.expired_leases == 1
    revoked = [m for m in stuck.replies if m.get("push") == "revoked"]
    assert revoked and revoked[0]["reason"] == "expired"


def test_confirm_after_a_lost_lease_takes_a_new_one(make):
    rig = make()
    client = rig.client("w")
    client.register("a", 1, DEVICE)
    with client.turn("a") as turn:
        first = turn.lease_id
        turn.lease.revoked = "simulated loss"  # as when the daemon restarted under it
        again = turn.confirm()
        assert again > first and turn.lease_id == again
    status = client.status()["devices"][0]
    assert status["holder"] is None, "the new lease is released with the turn"


def test_an_abandoned_acquire_never_leaves_the_device_held(make):
    rig = make()
    holder, other = rig.client("holder"), rig.client("other")
    holder.register("h", 1, DEVICE)
    other.register("o", 1, DEVICE)
    lease = holder.acquire("h")
    with pytest.raises(TimeoutError):
        other.acquire("o", timeout=0.2)
    holder.release(lease)
    time.sleep(0.2)
    device = holder.status()["devices"][0]
    assert device["holder"] is None and device["waiters"] == []


def test_the_least_recently_served_resident_is_parked_to_make_room(make):
    rig = make(budget=100, policy=Policy.LRS)
    parked = []

    def on_park(job):
        parked.append(job)
        return 0.01, 60

    a, b = rig.client("a", on_park), rig.client("b", on_park)
    a.register("ja", 60, DEVICE)
    b.register("jb", 60, DEVICE)
    with a.turn("ja") as turn:
        assert turn.restore  # nothing resident yet: the worker materialises it
    with b.turn("jb") as turn:
        assert turn.restore and parked == ["ja"]
    with a.turn("ja") as turn:
        assert turn.restore and parked == ["ja", "jb"]
    residents = {r["job"]: r["parked"] for r in a.status()["devices"][0]["residents"]}
    assert residents == {"ja": False, "jb": True}


def test_register_over_the_budget_is_refused_with_the_numbers(make):
    rig = make(budget=1000)
    client = rig.client("w")
    with pytest.raises(InvalidRequest, match="needs 5000 bytes resident but device cpu:0 has a budget of 1000"):
        client.register("big", 5000, DEVICE)
    with pytest.raises(InvalidRequest, match="unknown device"):
        client.register("x", 1, "cuda:3")


def test_a_replacement_takes_the_job_over_and_the_old_worker_is_fenced(make):
    rig = make()
    old, new = rig.client("old"), rig.client("new")
    old.register("model-1", 1, DEVICE)
    lease = old.acquire("model-1")
    new.register("model-1", 1, DEVICE)  # same job id: a replacement worker
    time.sleep(0.1)
    assert lease.revoked == "taken_over"
    with pytest.raises(Fenced):
        old.acquire("model-1")
    with new.turn("model-1") as turn:
        assert turn.lease_id > lease.lease_id


def test_malformed_messages_get_an_error_and_everyone_else_is_served(make):
    rig = make()
    raw = RawHolder(rig)
    bad = [
        {"op": "launch-missiles", "id": 1},
        {"op": "register", "id": 2, "job": "", "device": DEVICE, "bytes": 1},
        {"op": "register", "id": 3, "job": "x", "device": DEVICE, "bytes": "lots"},
        {"op": "acquire", "id": 4, "job": "never-registered"},
        {"op": "release", "id": 5, "lease_id": 12345},
        {"op": "renew", "id": 6},
        {"op": "acquire", "id": 7, "job": "never-registered", "serves": "run-a"},  # not a list
    ]
    for message in bad:
        reply = raw.ask(message)
        assert reply["ok"] is False and reply["error"] and reply["code"] in (400, 404, 409), reply
    client = rig.client("fine")
    client.register("j", 1, DEVICE)
    with client.turn("j", serves=("run-a",)) as turn:  # the groups it carries travel with the acquire
        assert turn.confirm() == turn.lease_id


def test_unix_daemon_answers_lines_that_are_not_json_and_serves_http(make):
    rig = make()
    if rig.name != "unix":
        pytest.skip("socket-level garbage and HTTP exist only on the daemon")
    import socket
    import urllib.request

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(rig.path))
        sock.sendall(b"this is not json\n[1, 2]\n")
        stream = sock.makefile("rb")
        first, second = json.loads(stream.readline()), json.loads(stream.readline())
    assert "not a JSON line" in first["error"] and "JSON object" in second["error"]
    client = rig.client("after-garbage")
    client.register("j", 1, DEVICE)
    with client.turn("j"):
        pass
    port = rig.daemon.bound_http_port
    status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5).read())
    assert status["devices"][0]["device"] == DEVICE and "duty_cycle" in status["devices"][0]
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for series in ("openrl_timeslicer_hold_seconds_count", "openrl_timeslicer_wait_seconds_bucket", "openrl_timeslicer_duty_cycle",
                   "openrl_timeslicer_queue_depth", "openrl_timeslicer_lease_expiries_total", "openrl_timeslicer_fenced_total",
                   "openrl_timeslicer_park_seconds_count", "openrl_timeslicer_switches"):  # fmt: skip
        assert series in metrics, series
    assert urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status == 200
    timeline = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/timeline?since=0", timeout=5).read())[
        "timeline"
    ]
    leases = [e for e in timeline[DEVICE] if e["kind"] == "lease"]
    assert (
        leases
        and leases[-1]["job"] == "j"
        and leases[-1]["reason"] == "released"
        and leases[-1]["end"] >= leases[-1]["start"]
    )


def test_a_restarted_daemon_gets_every_job_back_as_it_is(make):
    rig = make(budget=100)
    parked = []
    client = rig.client("w", lambda job: (parked.append(job), (0.0, 40))[1])
    client.register("one", 40, DEVICE)
    client.register("two", 40, DEVICE)
    with client.turn("one"):
        pass
    if rig.name == "unix":
        rig.restart()
    else:
        rig.slicer.links[0].drop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            residents = {r["job"]: r["parked"] for r in client.status()["devices"][0]["residents"]}
            if residents == {"one": False, "two": True}:
                break
        except Exception:
            pass
        time.sleep(0.1)
    assert residents == {"one": False, "two": True}, "re-registered as they were: one resident, two not yet"
    with client.turn("two") as turn:
        assert turn.restore


def test_a_call_retried_after_a_restart_waits_for_its_jobs_to_be_registered_again(make):
    """The daemon restarts; the worker's next acquire must not reach it before the
    re-registration of its job does. Re-registration is slowed down here so that, without
    the ordering, the acquire would win the race and be refused "not registered"."""
    rig = make()
    registering_again = threading.Event()

    def slow_reregistration(on_message, on_close):
        link = rig.connector()(on_message, on_close)

        class Slow:
            def send(self, message):
                if message.get("op") == "register" and registering_again.is_set():
                    time.sleep(0.3)
                link.send(message)

            def close(self):
                link.close()

        return Slow()

    client = TimeslicerClient(slow_reregistration, "w")
    try:
        client.register("job", 1, DEVICE)
        with client.turn("job"):
            pass
        registering_again.set()
        if rig.name == "unix":
            rig.restart()
        else:
            rig.slicer.links[0].drop()
        with client.turn("job", timeout=10) as turn:
            assert turn.lease.valid()
    finally:
        client.close()
