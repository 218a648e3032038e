"""A worker's link to its node's timeslicer: register jobs, take turns, park when asked.

`TimeslicerClient` is what the trainer and sampler hold. `turn(job)` acquires a lease,
yields it, and releases it; `Lease.confirm()` at the end of the work says under which
lease the effect may be published (the same one if it is still current, else a new one
taken for the same job), or raises `Fenced` if the job now belongs to another worker.

Threads the compute cannot block: a renewal thread keeps every held lease alive (every
third of its lifetime), and a park thread runs the worker's `on_park(job)` when the daemon
asks, then reports the seconds and bytes it moved. If the link drops (the daemon
restarted), every held lease is marked lost, the client reconnects with backoff and
registers its jobs again as they are (resident or parked), and calls in flight are retried
on the new link; an acquire interrupted by a timeout or exception is cancelled, and a grant
that raced the cancel is released at once, so an abandoned acquire never holds the device.

Transports (`connect(on_message, on_close) -> Link`): `unix_transport(path)` to the
`openrl timeslicer` daemon, or `LocalSlicer.connect` for a private in-process one.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import socket
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Protocol

from openrl_core.errors import Conflict, OpenRLError, ServerError

log = logging.getLogger(__name__)
# A lease is treated as lost this long before the daemon's deadline, so a publish never
# relies on the last moments of a lease the daemon may be expiring.
SAFETY_MARGIN = 0.25


class Fenced(Conflict):
    """The job was taken over by another worker: drop its state, publish nothing."""


class LinkLost(ServerError):
    pass


class Link(Protocol):
    def send(self, message: dict) -> None: ...

    def close(self) -> None: ...


Connector = Callable[[Callable[[dict], None], Callable[[], None]], Link]
ParkHandler = Callable[[str], tuple[float, int]]  # job -> (seconds, bytes moved)


class Lease:
    def __init__(self, client: "TimeslicerClient", reply: dict) -> None:
        self.client = client
        self.lease_id = int(reply["lease_id"])
        self.job = str(reply["job"])
        self.device = str(reply["device"])
        self.restore = bool(reply["restore"])
        self.lease_seconds = float(reply["lease_seconds"])
        self.granted_at = time.monotonic()
        self.deadline = self.granted_at + self.lease_seconds - SAFETY_MARGIN
        self.renew_at = self.granted_at + self.lease_seconds / 3
        self.revoked: Optional[str] = None
        self.released = False
        self.also: tuple[str, ...] = ()
        self.serves: tuple[str, ...] = ()

    def valid(self) -> bool:
        return self.revoked is None and not self.released and time.monotonic() < self.deadline


class Turn:
    """What `TimeslicerClient.turn` yields: the lease the work runs under, and `confirm()`."""

    def __init__(self, client: "TimeslicerClient", lease: Lease) -> None:
        self.client = client
        self.lease = lease

    @property
    def restore(self) -> bool:
        return self.lease.restore

    @property
    def lease_id(self) -> int:
        return self.lease.lease_id

    def confirm(self) -> int:
        """The lease id to stamp on the work's events, asked after the work is done: this
        lease if the daemon says it is still current, else a fresh lease for the same job
        (the work touched only this worker's own state, so it stands). Raises `Fenced` if
        the job now belongs to another worker: then nothing may be published."""
        lease = self.lease
        if lease.valid():
            reply = self.client._call({"op": "validate", "lease_id": lease.lease_id}, retry=False)
            if reply.get("ok") and reply.get("current"):
                return lease.lease_id
            lease.revoked = lease.revoked or "not current"
        log.warning(
            "timeslicer: lease %s of %s was lost (%s); taking a new one", lease.lease_id, lease.job, lease.revoked
        )
        self.client.release(lease)
        self.lease = self.client.acquire(
            lease.job, also=getattr(lease, "also", ()), serves=getattr(lease, "serves", ())
        )
        return self.lease.lease_id


class _Call:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: Optional[dict] = None
        self.lost = False
        self.abandoned = False


class TimeslicerClient:
    def __init__(
        self,
        connect: Connector,
        worker: str,
        on_park: Optional[ParkHandler] = None,
        reconnect_seconds: float = 120.0,
    ) -> None:
        self._connect = connect
        self.worker = worker
        self.on_park = on_park
        self.reconnect_seconds = reconnect_seconds
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._calls: dict[int, _Call] = {}
        self._leases: dict[int, Lease] = {}
        self._jobs: dict[str, dict] = {}  # job -> its register message (resident kept current)
        self._connected = threading.Event()
        self._closed = False
        self._link: Optional[Link] = None
        self.info: dict = {}
        self._parks: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._first_open()
        self._threads = [
            threading.Thread(target=self._renew_loop, name=f"timeslicer-renew-{worker}", daemon=True),
            threading.Thread(target=self._park_loop, name=f"timeslicer-park-{worker}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- public ----------------------------------------------------------------------------

    @property
    def devices(self) -> dict:
        return dict(self.info.get("devices", {}))

    def register(
        self,
        job: str,
        nbytes: int,
        device: str,
        parkable: bool = True,
        resident: bool = False,
        group: Optional[str] = None,
    ) -> None:
        """`group`: the training run the job belongs to (its turns are kept together)."""
        message = {"op": "register", "job": job, "device": device, "bytes": int(nbytes), "parkable": parkable,
                   "resident": resident, "group": group}  # fmt: skip
        self._check(self._call(dict(message)))
        with self._lock:
            self._jobs[job] = message

    def unregister(self, job: str) -> None:
        with self._lock:
            self._jobs.pop(job, None)
        reply = self._call({"op": "unregister", "job": job})
        if not reply.get("ok") and reply.get("code") != 404:
            self._check(reply)

    def registered(self, job: str) -> bool:
        with self._lock:
            return job in self._jobs

    def acquire(
        self, job: str, timeout: Optional[float] = None, also: tuple[str, ...] = (), serves: tuple[str, ...] = ()
    ) -> Lease:
        """A lease on `job`'s device; `also`: more of this worker's jobs the same turn serves;
        `serves`: the job groups (runs) whose work the turn carries, for the daemon's affinity."""
        deadline = None if timeout is None else time.monotonic() + timeout
        message = {"op": "acquire", "job": job, "also": list(also)}
        if serves:
            message["serves"] = list(serves)
        while True:
            reply = self._call(dict(message), deadline=deadline, cancellable=True)
            if reply.get("lost"):
                continue  # the link dropped while waiting: ask again on the new one
            if not reply.get("ok"):
                if reply.get("code") == 409 and (
                    "taken over" in reply.get("error", "") or "gone" in reply.get("error", "")
                ):
                    raise Fenced(reply["error"])
                self._check(reply)
            lease = Lease(self, reply)
            lease.also, lease.serves = tuple(also), tuple(serves)
            with self._lock:
                self._leases[lease.lease_id] = lease
                for name in (job, *also):
                    if name in self._jobs:
                        self._jobs[name]["resident"] = True
            self._wake.set()  # the renewal thread plans around the new lease
            return lease

    def release(self, lease: Lease) -> None:
        with self._lock:
            self._leases.pop(lease.lease_id, None)
            if lease.released:
                return
            lease.released = True
        # Sent even for a lease believed lost: the daemon may still hold it (a revocation this
        # worker assumed), and releasing a lease that really ended is refused harmlessly.
        reply = self._call({"op": "release", "lease_id": lease.lease_id}, retry=False)
        if not reply.get("ok") and not reply.get("lost") and lease.revoked is None:
            log.info("timeslicer: release of lease %s: %s", lease.lease_id, reply.get("error"))

    @contextmanager
    def turn(
        self, job: str, timeout: Optional[float] = None, also: tuple[str, ...] = (), serves: tuple[str, ...] = ()
    ) -> Iterator[Turn]:
        turn = Turn(self, self.acquire(job, timeout, also, serves))
        try:
            yield turn
        finally:
            self.release(turn.lease)

    def report_restored(self, job: str, seconds: float, nbytes: int) -> None:
        self._call({"op": "restored", "job": job, "seconds": float(seconds), "bytes": int(nbytes)}, retry=False)

    def status(self) -> dict:
        return self._check(self._call({"op": "status"}))["status"]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            link, self._link = self._link, None
        self._parks.put(None)
        self._wake.set()
        if link is not None:
            link.close()

    # -- background threads ------------------------------------------------------------------

    def _renew_loop(self) -> None:
        """Renew each held lease a third of the way into its life; sleep until the next is due
        (or a new lease arrives), so no lease is ever renewed late because of another's timing."""
        while not self._closed:
            with self._lock:
                leases = [lease for lease in self._leases.values() if lease.valid()]
            for lease in leases:
                if time.monotonic() < lease.renew_at:
                    continue
                sent = time.monotonic()
                reply = self._call(
                    {"op": "renew", "lease_id": lease.lease_id}, retry=False, deadline=sent + lease.lease_seconds
                )
                if reply.get("ok"):
                    lease.deadline = sent + float(reply["lease_seconds"]) - SAFETY_MARGIN
                    lease.renew_at = sent + float(reply["lease_seconds"]) / 3
                elif not reply.get("lost"):
                    lease.revoked = lease.revoked or reply.get("error", "renew refused")
            with self._lock:
                due = [lease.renew_at for lease in self._leases.values() if lease.valid()]
            self._wake.wait(timeout=max(0.005, min(due, default=time.monotonic() + 1.0) - time.monotonic()))
            self._wake.clear()

    def _park_loop(self) -> None:
        while True:
            job = self._parks.get()
            if job is None:
                return
            seconds, nbytes = 0.0, 0
            if self.on_park is not None:
                try:
                    seconds, nbytes = self.on_park(job)
                except Exception:
                    log.exception("timeslicer: parking %s failed; it stays resident", job)
                    continue
            with self._lock:
                if job in self._jobs:
                    self._jobs[job]["resident"] = False
            self._call({"op": "parked", "job": job, "seconds": float(seconds), "bytes": int(nbytes)}, retry=False)

    # -- the link --------------------------------------------------------------------------

    def _open(self) -> None:
        link = self._connect(self._on_message, self._on_close)
        with self._lock:
            self._link = link
        # Other callers wait on `_connected` until the jobs are registered again: an acquire
        # retried on the new link must not reach a restarted daemon before its job does
        # (it would be refused "not registered", a user-visible failure of a healthy step).
        hello = self._call({"op": "hello", "worker": self.worker}, retry=False, opening=True)
        self.info = self._check(hello)
        with self._lock:
            jobs = [dict(message) for message in self._jobs.values()]
        for message in jobs:  # after a daemon restart: the jobs as they are now
            reply = self._call(message, retry=False, opening=True)
            if reply.get("lost"):
                raise LinkLost("the timeslicer link dropped while re-registering")
            if not reply.get("ok"):
                log.error("timeslicer: re-registering %s failed: %s", message["job"], reply.get("error"))
        with self._lock:
            if self._link is link:
                self._connected.set()

    def _first_open(self) -> None:
        """Connect, waiting for a daemon that is not up yet (pods start in any order)."""
        delay, give_up = 0.05, time.monotonic() + self.reconnect_seconds
        while True:
            try:
                self._open()
                return
            except OSError as error:
                if time.monotonic() >= give_up:
                    raise LinkLost(f"no timeslicer answered within {self.reconnect_seconds:.0f} s: {error}") from error
                if delay >= 1.0:
                    log.warning("timeslicer: %s waits for the daemon (%s)", self.worker, error)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _on_message(self, message: dict) -> None:
        push = message.get("push")
        if push == "park":
            self._parks.put(str(message.get("job")))
            return
        if push == "revoked":
            with self._lock:
                lease = self._leases.get(int(message.get("lease_id", -1)))
            if lease is not None:
                lease.revoked = str(message.get("reason", "revoked"))
            return
        with self._lock:
            call = self._calls.pop(message.get("id"), None) if isinstance(message.get("id"), int) else None
        if call is None:
            return
        if call.abandoned and message.get("ok") and "lease_id" in message:
            # A grant that raced its cancel: give the device back at once.
            self._send({"op": "release", "lease_id": message["lease_id"], "id": next(self._ids)})
            return
        call.reply = message
        call.done.set()

    def _on_close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._connected.clear()
            self._link = None
            for lease in self._leases.values():
                lease.revoked = lease.revoked or "timeslicer connection lost"
            calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            call.lost = True
            call.done.set()
        threading.Thread(target=self._reconnect, name=f"timeslicer-reconnect-{self.worker}", daemon=True).start()

    def _reconnect(self) -> None:
        delay, give_up = 0.05, time.monotonic() + self.reconnect_seconds
        while not self._closed and time.monotonic() < give_up:
            try:
                self._open()
                log.info("timeslicer: %s reconnected and re-registered %d jobs", self.worker, len(self._jobs))
                return
            except (OSError, OpenRLError) as error:
                log.debug("timeslicer: reconnect failed: %s", error)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        log.error("timeslicer: %s could not reconnect within %.0f s", self.worker, self.reconnect_seconds)

    def _send(self, message: dict) -> None:
        link = self._link
        if link is None:
            raise LinkLost("no timeslicer link")
        link.send(message)

    def _call(
        self,
        message: dict,
        deadline: Optional[float] = None,
        retry: bool = True,
        cancellable: bool = False,
        opening: bool = False,
    ) -> dict:
        """Send and wait for the answer. With `retry`, a dropped link is waited out and the
        call sent again on the new one; without, the answer is {"lost": True}. A caller
        that stops waiting on a `cancellable` call (timeout, exception) withdraws it.
        `opening`: a call of `_open` itself, sent before the link is announced."""
        while True:
            if not opening and not self._connected.wait(timeout=self.reconnect_seconds):
                raise LinkLost(f"no timeslicer link for {self.reconnect_seconds:.0f} s")
            call = _Call()
            request_id = message["id"] = next(self._ids)
            with self._lock:
                self._calls[request_id] = call
            try:
                self._send(message)
            except LinkLost:
                with self._lock:
                    self._calls.pop(request_id, None)
                if retry:
                    continue
                return {"lost": True}
            try:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not call.done.wait(timeout=remaining):
                    raise TimeoutError(f"timeslicer {message['op']} got no answer in time")
            except BaseException:
                if cancellable:
                    self._abandon(request_id, call)
                else:
                    with self._lock:
                        self._calls.pop(request_id, None)
                raise
            if call.lost:
                if retry:
                    continue
                return {"lost": True}
            return call.reply or {}

    def _abandon(self, request_id: int, call: _Call) -> None:
        """The caller gave up on an acquire: withdraw it, or give back the grant it got."""
        with self._lock:
            waiting = request_id in self._calls
            call.abandoned = True  # a grant arriving from now on is released on arrival
        try:
            if waiting:
                self._send({"op": "cancel", "request": request_id, "id": next(self._ids)})
            elif call.reply is not None and call.reply.get("ok") and "lease_id" in call.reply:
                self._send({"op": "release", "lease_id": call.reply["lease_id"], "id": next(self._ids)})
        except LinkLost:
            pass  # the daemon dropped this link's waiters and leases with it

    @staticmethod
    def _check(reply: dict) -> dict:
        if reply.get("lost"):
            raise LinkLost("the timeslicer link dropped")
        if not reply.get("ok"):
            raise Conflict(reply.get("error", "timeslicer refused")) if reply.get("code") == 409 else _error(reply)
        return reply


def _error(reply: dict) -> OpenRLError:
    from openrl_core.errors import InvalidRequest, NotFound

    code = reply.get("code")
    kind = {404: NotFound, 409: Conflict}.get(code, InvalidRequest if code == 400 else ServerError)
    return kind(reply.get("error", "timeslicer refused"))


# -- transports ------------------------------------------------------------------------------


class UnixLink:
    """One connection to the daemon's Unix socket; a reader thread feeds `on_message`."""

    def __init__(self, path: str, on_message: Callable[[dict], None], on_close: Callable[[], None]) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(str(path))
        self._send_lock = threading.Lock()
        self._on_message, self._on_close = on_message, on_close
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="timeslicer-link", daemon=True)
        self._reader.start()

    def send(self, message: dict) -> None:
        data = (json.dumps(message) + "\n").encode()
        try:
            with self._send_lock:
                self._sock.sendall(data)
        except OSError as error:
            raise LinkLost(f"timeslicer link: {error}") from error

    def close(self) -> None:
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _read(self) -> None:
        stream = self._sock.makefile("rb")
        try:
            for line in stream:
                try:
                    message = json.loads(line)
                except ValueError:
                    log.error("timeslicer: undecodable line from the daemon: %r", line[:200])
                    continue
                self._on_message(message)
        except (OSError, ValueError):
            pass
        finally:
            if not self._closing:
                self._on_close()


def unix_transport(path: str) -> Connector:
    return lambda on_message, on_close: UnixLink(path, on_message, on_close)
