"""Futures per second and submit -> result latency through the real gateway and projector,
with a no-op worker, over the embedded log + SQLite and over Kafka + PostgreSQL, in one run.

Every configuration runs the same process: the real gateway app under uvicorn, the real
projector, and in place of the trainer a no-op worker (below) that consumes the training
topics and at once publishes a `…completed` event per request, through the same codec, bus
and topics the trainer uses. So only the model compute is gone; everything an `optim_step`
future costs besides it (HTTP, validation, dedup, store transactions, outbox, log append,
consume, decode, projector append, wake-up, long-poll answer) is measured.

The server is a child process reached over loopback HTTP, not the ASGI app called in this
process: in process, the clients and the gateway would share one GIL and one event loop, so
the clients' own work would count as server time, and the gateway's blocking calls inside
its async handlers (store append, log append) would stall the clients too. Over HTTP the
client costs what the tinker SDK's transport costs, and it is reported apart.

Each client owns one model (so the worker sees each model's seq_ids in order) and loops:
submit `optim_step`, long-poll `retrieve_future` until it answers. Per configuration, one
client alone first (latency without queueing), then `--clients` at once until
`--requests` futures or the time cap (throughput, and latency under load). CPU time per
future is read from /proc for the client, the server and the broker (on 2 cores it bounds
throughput), and PostgreSQL connections opened under load from pg_stat_database. With
`--per-thread` the server's share is split by thread (event loop, gateway pool, writer,
projector, worker), with each one's context switches, from /proc/PID/task.

Only the configuration being measured is up: an idle kafka-python consumer spins on
noida-db (it answers an empty fetch at once instead of waiting), so an idle neighbour
would steal a core from the others. To cancel drift in a noisy machine's load, the
configurations run in two passes, the second in reverse order (ABC CBA), half the
budget each. Rows beyond the two deployments isolate one change each: the embedded log
without fsync, and the embedded log over PostgreSQL. The "one process per role" rows run the
Kafka deployment as it is deployed (gateway, projector and worker each a process of its own,
sharing the broker and the database), so its roles no longer share one interpreter's lock;
their CPU is reported per process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import scratch_pg
from scratch_pg import PG_ADMIN

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.eventing.brokers: the brokers the test suite starts

KEY = "tml-bench"
TENANT = "bench"
MODEL = "openrl/tiny-qwen3"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- the server child: gateway + projector + no-op worker in one process -------------------


class NoopWorker:
    """The trainer's messaging without its compute: decode each request, emit its completion."""

    def __init__(self, bus, publisher) -> None:
        from eventing import topics

        self.publisher = publisher
        # The trainer's group and subscription, so the log sees the same consumer shape.
        self.consumer = bus.consumer("openrl-trainer", pattern=topics.pattern("training", [MODEL]))

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once()
            except Exception:
                if not stop.is_set():
                    logging.exception("noop worker: batch failed")
                    stop.wait(0.5)

    def run_once(self) -> None:
        from eventing import topics
        from openrl_core.events import new_event
        from openrl_core.events.base import event_type
        from openrl_core.events.lifecycle import RequestCompleted

        records = self.consumer.poll(max_records=64, timeout=0.5)
        replies = []
        for record in records:
            event = self.publisher.codec.decode(record.message)
            if event.phase != "requested":
                continue
            result = (
                {"model_id": event.data.model_id, "type": "create_model"}
                if event.verb == "create_model"
                else {"metrics": {}}
            )
            payload = RequestCompleted(request_id=event.data.request_id, result=result)
            reply = new_event(
                event_type(event.family, event.verb, "completed"), payload,
                tenant=event.tenant, source="/bench/noop-worker", key=event.key, subject=payload.request_id,
            )  # fmt: skip
            replies.append((topics.topic(event.tenant, "completions"), reply, None))
        # What a worker finishes together it publishes together (the sampler's batch does).
        self.publisher.publish_many(replies)
        if records:
            self.consumer.commit(wait=False)  # as the sampler: its completions are on the log


def serve(args: argparse.Namespace) -> None:
    from functions.serve import Node
    from openrl_core.settings import Settings

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = dict(
        host="127.0.0.1",
        port=args.port,
        data_dir=args.data_dir,
        api_keys=[f"{TENANT}={KEY}"],
        models=[MODEL],
        bus=args.bus,
        log_fsync=not args.no_fsync,
    )
    if args.kafka_bootstrap:
        options["kafka_bootstrap"] = args.kafka_bootstrap
    if args.database_url:
        options["database_url"] = args.database_url
    roles = args.roles.split(",")
    node = Node(Settings(**options), roles=[role for role in roles if role != "worker"], base_models=[MODEL])
    stop = threading.Event()
    worker = None
    if "worker" in roles:
        worker = threading.Thread(
            target=NoopWorker(node.runtime.bus, node.runtime.publisher).run,
            args=(stop,),
            name="noop-worker",
            daemon=True,
        )
        worker.start()
    names = args.data_dir / f"threads-{args.roles}.json"
    threading.Thread(target=name_threads, args=(names, stop), name="thread-names", daemon=True).start()
    try:
        node.serve_forever()  # until SIGTERM; then stops the projector and closes the log
    finally:
        stop.set()
        if worker is not None:
            worker.join(timeout=5)


def name_threads(path: Path, stop: threading.Event) -> None:
    """Keep `path` holding {native thread id: Python thread name}: the kernel's per-thread
    counters (/proc/PID/task) know threads only by id (Python does not name them there)."""
    while not stop.wait(0.5):
        names = {str(thread.native_id): thread.name for thread in threading.enumerate()}
        path.with_suffix(".tmp").write_text(json.dumps(names))
        path.with_suffix(".tmp").replace(path)


# -- the parent: brokers, databases, servers, clients ---------------------------------------


def stat_cpu(stat: str) -> float:
    """User + system CPU seconds from a /proc stat line (a process's or one thread's)."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (every thread), from /proc; 0.0 once it has exited."""
    try:
        return stat_cpu(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return 0.0


def thread_counters(pid: int) -> dict[str, tuple[float, int]]:
    """Per thread id: (CPU seconds, context switches, voluntary and not) from /proc."""
    counters = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat, status = (task / "stat").read_text(), (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        switches = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)
        counters[task.name] = (stat_cpu(stat), switches)
    return counters


def thread_role(name: str) -> str:
    """One row per role: the gateway's pool threads (gateway_0, gateway_1, ...) together."""
    if name.startswith("gateway_"):
        return "gateway pool"
    return {"MainThread": "event loop"}.get(name, name)


def pg_query(statement: str, database: str) -> list:
    from sqlalchemy import create_engine, text

    admin = create_engine(PG_ADMIN)
    try:
        with admin.connect() as conn:
            return list(conn.execute(text(statement), {"d": database}).scalars())
    finally:
        admin.dispose()


def sessions_opened(database: str) -> int:
    """Connections ever made to one database (PostgreSQL 14+ counts them)."""
    return int(pg_query("SELECT sessions FROM pg_stat_database WHERE datname = :d", database)[0])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


@dataclass
class Config:
    key: str
    name: str
    bus: str = "embedded"
    broker: Optional[str] = None  # "noida" | "tansu"
    postgres: bool = False
    fsync: bool = True
    env: dict[str, str] = field(default_factory=dict)  # OPENRL_* settings of the server
    # One process per role (gateway; projector; no-op worker), as the distributed deployment
    # runs them, instead of all three in one.
    split: bool = False
    # per pass
    process: Optional[subprocess.Popen] = None  # the gateway's (every role's unless split)
    others: dict[str, subprocess.Popen] = field(default_factory=dict)  # split: projector, worker
    broker_handle: object = None
    database: Optional[str] = None
    url: str = ""
    models: list[str] = field(default_factory=list)
    next_seq: dict[str, int] = field(default_factory=dict)
    # accumulated over passes
    solo_ms: list[float] = field(default_factory=list)
    load_ms: list[float] = field(default_factory=list)
    futures: int = 0
    seconds: float = 0.0
    rates: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    connections: int = 0  # PostgreSQL connections opened under load
    threads: dict[str, list[float]] = field(default_factory=dict)  # role -> [CPU s, switches] under load (--per-thread)
    data_dir: Optional[Path] = None
    skipped: Optional[str] = None


CONFIGS = {
    "embedded": lambda: Config("embedded", "embedded log + SQLite"),
    "embedded-nofsync": lambda: Config("embedded-nofsync", "  same, log_fsync=false", fsync=False),
    "embedded-pg": lambda: Config("embedded-pg", "  embedded log + PostgreSQL", postgres=True),
    "noida": lambda: Config("noida", "Kafka (noida-db) + PostgreSQL", "kafka", broker="noida", postgres=True),
    # noida-db answers an empty fetch at once (it ignores fetch.max.wait.ms), so an idle
    # consumer pauses between empty fetches: 1 ms by default (kafka_idle_poll_pause_ms), 5 here.
    "noida-pause": lambda: Config(
        "noida-pause",
        "  same, idle poll pause 5 ms",
        "kafka",
        broker="noida",
        postgres=True,
        env={"OPENRL_KAFKA_IDLE_POLL_PAUSE_MS": "5"},
    ),  # fmt: skip
    "noida-split": lambda: Config(
        "noida-split", "  same, one process per role", "kafka", broker="noida", postgres=True, split=True
    ),
    # Split, without the pause, each idle consumer spins and takes CPU from the other processes.
    "noida-split-nopause": lambda: Config(
        "noida-split-nopause",
        "  same, per role, no idle poll pause",
        "kafka",
        broker="noida",
        postgres=True,
        split=True,
        env={"OPENRL_KAFKA_IDLE_POLL_PAUSE_MS": "0"},
    ),  # fmt: skip
    # Tansu holds every fetch for the consumer's full fetch_max_wait_ms even when records
    # arrive (Kafka answers at once), so a Tansu deployment lowers the wait (500 ms by default).
    "tansu": lambda: Config(
        "tansu",
        "Kafka (Tansu, fetch wait 20 ms) + PG",
        "kafka",
        broker="tansu",
        postgres=True,
        env={"OPENRL_KAFKA_FETCH_MAX_WAIT_MS": "20"},
    ),  # fmt: skip
    "tansu-split": lambda: Config(
        "tansu-split",
        "  same, one process per role",
        "kafka",
        broker="tansu",
        postgres=True,
        split=True,
        env={"OPENRL_KAFKA_FETCH_MAX_WAIT_MS": "20"},
    ),  # fmt: skip
}

ALL_ROLES = "gateway,projector,worker"


def start(config: Config, root: Path) -> None:
    """Broker (if any), scratch database (if any), then the server; ready once /healthz answers."""
    from functions.local_server import free_port
    from tests.eventing.brokers import NoidaBroker, TansuBroker

    workdir = Path(tempfile.mkdtemp(prefix=config.key + "-", dir=root))
    port = free_port()
    config.url = f"http://127.0.0.1:{port}"
    config.models, config.next_seq = [], {}
    config.data_dir = workdir / "data"
    command = [
        sys.executable,
        __file__,
        "--serve",
        "--port",
        str(port),
        "--data-dir",
        str(config.data_dir),
        "--bus",
        config.bus,
    ]
    if not config.fsync:
        command.append("--no-fsync")
    if config.broker:
        broker_class = NoidaBroker if config.broker == "noida" else TansuBroker
        config.broker_handle = broker_class(workdir / "broker").start()
        command += ["--kafka-bootstrap", config.broker_handle.bootstrap]
    if config.postgres:
        config.database, url = scratch_pg.create("openrl_bench")
        command += ["--database-url", url]
    log_path = workdir / "server.log"
    with open(log_path, "ab") as log:
        env = {**os.environ, **config.env}
        if config.split:
            for role in ("projector", "worker"):
                config.others[role] = subprocess.Popen(
                    command + ["--roles", role], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env
                )
        gateway = "gateway" if config.split else ALL_ROLES
        config.process = subprocess.Popen(
            command + ["--roles", gateway], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env
        )
    deadline = time.monotonic() + 120
    while True:
        exited = [p for p in (config.process, *config.others.values()) if p.poll() is not None]
        if exited or time.monotonic() > deadline:
            raise RuntimeError(f"server did not come up: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(config.url + "/api/v1/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def stop(config: Config) -> None:
    for process in (config.process, *config.others.values()):
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    config.process, config.others = None, {}
    if config.broker_handle is not None:
        config.broker_handle.stop()
        config.broker_handle = None
    if config.database is not None:
        scratch_pg.drop(config.database)
        config.database = None


class RawClient:
    """A lean HTTP/1.1 keep-alive client over asyncio streams, one connection per concurrent
    caller. The load generator shares the server's 2 cores, so it must cost far less per
    request than what it measures: httpx took 2.7 ms of CPU per future here (what the SDK's
    transport costs), this ~0.2 ms. `--client httpx` measures with httpx instead."""

    def __init__(self, url: str, limit: int) -> None:
        host, port = url.removeprefix("http://").split(":")
        self._address = (host, int(port))
        self._idle: list = []
        self._limit = asyncio.Semaphore(limit)

    async def post(self, path: str, body: dict) -> tuple[int, dict]:
        payload = json.dumps(body).encode()
        head = (
            f"POST /api/v1{path} HTTP/1.1\r\nHost: bench\r\nX-API-Key: {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode()
        async with self._limit:
            reader, writer = self._idle.pop() if self._idle else await asyncio.open_connection(*self._address)
            writer.write(head + payload)
            status_line, *header_lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            headers = dict(line.split(": ", 1) for line in header_lines if ": " in line)
            length = int(next(v for k, v in headers.items() if k.lower() == "content-length"))
            answer = await reader.readexactly(length)
            self._idle.append((reader, writer))
        return int(status_line.split()[1]), json.loads(answer)

    async def __aenter__(self) -> "RawClient":
        return self

    async def __aexit__(self, *exc) -> None:
        for _reader, writer in self._idle:
            writer.close()


class HttpxClient:
    def __init__(self, url: str, limit: int) -> None:
        limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
        self._http = httpx.AsyncClient(base_url=url + "/api/v1", headers={"X-API-Key": KEY}, timeout=60, limits=limits)

    async def post(self, path: str, body: dict) -> tuple[int, dict]:
        response = await self._http.post(path, json=body)
        return response.status_code, response.json()

    async def __aenter__(self) -> "HttpxClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self._http.aclose()


CLIENTS = {"raw": RawClient, "httpx": HttpxClient}
CLIENT = RawClient  # set from --client


def client(config: Config, limit: int):
    return CLIENT(config.url, limit)


async def result_of(http, request_id: str) -> dict:
    while True:
        status, answer = await http.post("/retrieve_future", {"request_id": request_id})
        if status == 408:  # the long-poll window ended: ask again, as the SDK does
            continue
        if status != 200:
            raise RuntimeError(f"retrieve_future: {status} {answer}")
        return answer


async def setup(config: Config, models: int, timeout: float) -> None:
    """One session and `models` models, each one's creation completed through the worker."""
    async with client(config, models + 2) as http:
        session = (await http.post("/create_session", {}))[1]["session_id"]
        futures = []
        for i in range(models):
            body = {"session_id": session, "model_seq_id": i, "base_model": MODEL, "lora_config": {"rank": 4}}
            created = (await http.post("/create_model", body))[1]
            config.models.append(created["model_id"])
            config.next_seq[created["model_id"]] = 1
            futures.append(created["request_id"])
        # The first completions also wait for the Kafka groups to form and to see new topics.
        results = await asyncio.wait_for(asyncio.gather(*(result_of(http, f) for f in futures)), timeout)
        if any(result.get("type") != "create_model" for result in results):
            raise RuntimeError(f"create_model failed: {results}")


async def optim_steps(config: Config, models: list[str], total: int, seconds: float) -> tuple[list[float], float]:
    """Each model's client loops submit -> result until `total` futures or `seconds` pass.
    Returns the latencies (ms) and the wall time."""
    latencies: list[float] = []
    started = time.perf_counter()
    deadline = started + seconds
    issued = 0

    async def one_client(http, model_id: str) -> None:
        nonlocal issued
        while issued < total and time.perf_counter() < deadline:
            issued += 1
            seq = config.next_seq[model_id]
            config.next_seq[model_id] = seq + 1
            begun = time.perf_counter()
            body = {"model_id": model_id, "seq_id": seq, "adam_params": {"learning_rate": 1e-4}}
            status, submitted = await http.post("/optim_step", body)
            if status != 200:
                raise RuntimeError(f"optim_step: {status} {submitted}")
            result = await result_of(http, submitted["request_id"])
            if "metrics" not in result:
                raise RuntimeError(f"optim_step failed: {result}")
            latencies.append((time.perf_counter() - begun) * 1000)

    async with client(config, len(models) + 2) as http:
        await asyncio.gather(*(one_client(http, model_id) for model_id in models))
    return latencies, time.perf_counter() - started


def server_pids(config: Config) -> dict[str, int]:
    """The server's process ("server"), or when split each role's ("gateway", "projector", "worker")."""
    if not config.split:
        return {"server": config.process.pid}
    return {"gateway": config.process.pid, **{role: process.pid for role, process in config.others.items()}}


def run_pass(config: Config, root: Path, args: argparse.Namespace, share: float) -> None:
    start(config, root)
    try:
        asyncio.run(setup(config, args.clients + 1, timeout=120))
        solo, loaders = config.models[:1], config.models[1:]
        # Warm-up, not counted: connections, statement caches, the first fetches.
        asyncio.run(optim_steps(config, config.models, 2 * len(config.models), 30))
        latencies, _ = asyncio.run(optim_steps(config, solo, max(1, int(args.solo * share)), args.time_cap * share / 4))
        config.solo_ms += latencies

        servers = server_pids(config)
        pids = dict(servers)
        if config.broker_handle is not None:
            pids["broker"] = config.broker_handle.process.pid
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        if config.database is not None:
            opened = sessions_opened(config.database)
        threads_before = {name: thread_counters(pid) for name, pid in servers.items()}
        client_before = time.process_time()
        latencies, seconds = asyncio.run(
            optim_steps(config, loaders, int(args.requests * share), args.time_cap * share)
        )
        used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
        if args.per_thread:
            for name, pid in servers.items():
                roles = ALL_ROLES if name == "server" else name
                names = json.loads((config.data_dir / f"threads-{roles}.json").read_text())
                for tid, (cpu, switches) in thread_counters(pid).items():
                    was = threads_before[name].get(tid, (0.0, 0))
                    label = thread_role(names.get(tid, f"thread {tid}"))
                    role = config.threads.setdefault(label if name == "server" else f"{name}: {label}", [0.0, 0])
                    role[0] += cpu - was[0]
                    role[1] += switches - was[1]
        used["client"] = time.process_time() - client_before
        if config.database is not None:
            time.sleep(1.0)  # PostgreSQL publishes session counts within a second
            config.connections += sessions_opened(config.database) - opened
        config.load_ms += latencies
        config.futures += len(latencies)
        config.seconds += seconds
        config.rates.append(len(latencies) / seconds)
        for name, value in used.items():
            config.cpu[name] = config.cpu.get(name, 0.0) + value
    finally:
        stop(config)


def report(configs: list[Config], args: argparse.Namespace, load_before: float) -> None:
    print(
        f"\noptim_step -> long-polled retrieve_future, no-op worker; 1 client alone, then {args.clients} concurrent "
        f"(one model each); load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(
        f"{'':34} {'alone':^15}   {'under load':^44}\n"
        f"{'configuration':34} {'p50':>7} {'p99':>7}   {'futures':>7} {'futures/s':>9} {'vs first':>8} {'p50':>7} {'p99':>7}"
    )
    measured = [c for c in configs if c.futures]
    base = measured[0].futures / measured[0].seconds if measured else 0.0
    for c in measured:
        rate = c.futures / c.seconds
        print(
            f"{c.name:34} {statistics.median(c.solo_ms):7.1f} {percentile(c.solo_ms, 0.99):7.1f}   {c.futures:7d} {rate:9.1f} "
            f"{rate / base:7.2f}x {statistics.median(c.load_ms):7.1f} {percentile(c.load_ms, 0.99):7.1f}"
        )
        cpu = ", ".join(f"{name} {1000 * value / c.futures:.1f}" for name, value in c.cpu.items())
        detail = f"passes {', '.join(f'{r:.1f}/s' for r in c.rates)}; CPU ms per future: {cpu}"
        if c.postgres:
            detail += f"; {c.connections / c.futures:.2f} new PostgreSQL connections per future"
        print(f"{'':36}{detail}")
        if c.threads:
            # The bench's own thread-naming thread is left out; so are threads idle under load.
            rows = [
                (role, cpu, switches)
                for role, (cpu, switches) in c.threads.items()
                if not role.endswith("thread-names")
            ]
            busy = sorted((row for row in rows if row[1] > 0), key=lambda row: -row[1])
            split = ", ".join(
                f"{role} {1000 * cpu / c.futures:.2f}/{switches / c.futures:.0f}" for role, cpu, switches in busy
            )
            total = sum(switches for _role, _cpu, switches in busy) / c.futures
            print(f"{'':36}per thread, ms CPU/context switches per future: {split}; {total:.0f} switches in all")
    for c in configs:
        if c.skipped:
            print(f"{c.name:34} skipped: {c.skipped}")
    print("latencies in ms, submit to result; futures/s = all futures / all load time over both passes;")
    print(
        'server = gateway + projector + no-op worker (one process; "one process per role": each its own). PostgreSQL\'s own CPU is left out: the pool'
    )
    print("closes connections beyond pool_size at check-in, so its backends come and go faster than /proc can be read")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from: {', '.join(CONFIGS)}")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients under load, one model each")
    parser.add_argument("--requests", type=int, default=2000, help="futures under load per configuration (both passes)")
    parser.add_argument("--solo", type=int, default=100, help="futures of the lone client per configuration")
    parser.add_argument("--time-cap", type=float, default=80, help="seconds of load per configuration (both passes)")
    parser.add_argument(
        "--client", choices=sorted(CLIENTS), default="raw", help="load generator's HTTP client (see RawClient)"
    )
    parser.add_argument(
        "--per-thread", action="store_true",
        help="also split the server's CPU and context switches under load by thread (/proc/PID/task), the pool together",
    )  # fmt: skip
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--bus", default="embedded", help=argparse.SUPPRESS)
    parser.add_argument("--no-fsync", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kafka-bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--database-url", help=argparse.SUPPRESS)
    parser.add_argument("--roles", default=ALL_ROLES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    global CLIENT
    CLIENT = CLIENTS[args.client]
    configs = [CONFIGS[name.strip()]() for name in args.configs.split(",") if name.strip()]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="openrl-bench-") as root:
        for order in (configs, configs[::-1]):
            for config in order:
                if config.skipped:
                    continue
                began = time.monotonic()
                try:
                    run_pass(config, Path(root), args, share=0.5)
                except Exception as exc:  # a broker that will not run is reported, not fatal
                    config.skipped = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(f"{config.key}: skipped: {config.skipped}", flush=True)
                    continue
                print(
                    f"{config.key}: {config.rates[-1]:.1f} futures/s ({time.monotonic() - began:.0f} s with start-up)",
                    flush=True,
                )
    report(configs, args, load_before)


if __name__ == "__main__":
    main()
