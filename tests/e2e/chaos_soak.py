"""A chaos soak of the distributed deployment: four tenants' RL loops while roles die.

The rig is `tests/e2e/cluster.py` (a Kafka-protocol broker, PostgreSQL, one process per
role). Each tenant runs the same RL loop with the real tinker SDK: sample a group from the
current sampler weights (seeded), grade it with a tiny verifiable reward, train on it with
`importance_sampling`, `optim_step`, and every few steps `save_weights_for_sampler` and a new
sampling client. The four loops run once on the quiet deployment (the reference), then again
while `Chaos` SIGKILLs a random role (trainer, sampler, projector, gateway) and restarts it,
or restarts the broker, at seeded random intervals. The short form (in the test suite) does
each kind of fault once and paces the loops so that all five land mid-run on any machine;
the long form keeps injecting faults until the loops are done.

What the soak promises, checked by `verify`:

- no wait is unbounded: every future is awaited with a timeout; one that runs out is a hang;
- every future completed (a failure is reported with its message; the soak wants none);
- no step lost or applied twice: each run's `run_steps` rows are 1..N, all completed, with N
  the steps the client did; its sequenced requests' seq ids are contiguous; N optim_step
  requests completed (a completion event may repeat after a kill: the replacement answers
  again what its predecessor answered but had not committed; the projection keeps the first,
  and the bitwise weights show that no step was applied twice);
- every chaos run's final state (weights and optimizer, by the checkpoint's content hashes)
  and learning curve are bitwise those of its reference run;
- `openrl replay` (from the store and from the log) says the projections match.

Why the reference runs are bitwise reproducible although four tenants share one sampler and
one trainer: the trainer packs models into one pass bitwise as if each ran alone, and the
sampler is started with `sampler_max_batch_rows` equal to the group size, so each sampling
request (one prompt, GROUP samples, its own seed) runs in a wave of its own: the same shapes,
the same numbers, whatever else is queued. Sampled tokens, rewards, logprobs and advantages
then depend only on the run's own weights and seeds.

The noida-db broker is restarted with `noida-db down` (a SIGKILL there may drop the last second
of acknowledged writes), and only while the loops are held between steps and no future is
open: even its clean shutdown acknowledges a few records it does not keep (`Chaos.quiesce`),
a property of that test broker, not of a Kafka cluster with `acks=all` replication. The long
form with seed 2024 found this: a request the broker had acknowledged was missing from the
log after the restart, so its future stayed pending (a bounded wait caught it as a hang).
The other roles die at any moment.

    python -m tests.e2e.chaos_soak --steps 60 --interval 15 30   # the long form (`make chaos`)
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from tests.e2e.cluster import MODEL, Cluster

TENANTS = {f"tenant{i}": f"tml-chaos-tenant{i}" for i in range(4)}
KEYS = ",".join(f"{name}={key}" for name, key in TENANTS.items())
SEEDS = {name: 101 + 17 * i for i, name in enumerate(TENANTS)}
GROUP, MAX_TOKENS, PROMPT_TOKENS = 4, 4, 16
SYNC_EVERY = 2  # steps between save_weights_for_sampler
FUTURE_TIMEOUT = 240.0  # seconds any one future may take, chaos included, before it counts as hung
ROLES = ("trainer", "sampler", "projector", "gateway", "broker")
ENV = {
    # one sampling request per wave: its numbers do not depend on what else is queued
    "OPENRL_SAMPLER_MAX_BATCH_ROWS": str(GROUP),
}


def _say(line: str) -> None:
    """Progress, so a soak that ends badly shows how far each loop got (pytest shows it then)."""
    print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)


class Hang(Exception):
    """A future that did not finish within FUTURE_TIMEOUT."""


def grade(tokens: list[int]) -> float:
    """The verifiable reward: the share of even token ids in the completion."""
    return sum(1 for t in tokens if t % 2 == 0) / max(1, len(tokens))


@dataclass
class RunRecord:
    tenant: str
    model_id: Optional[str] = None
    steps: int = 0
    futures: int = 0
    curve: list = field(default_factory=list)  # per step: (reward mean, loss:sum, sampled tokens)
    final_path: Optional[str] = None
    failures: list = field(default_factory=list)  # (what, error message)
    hangs: list = field(default_factory=list)


def _wait(record: RunRecord, future, what: str):
    """Every wait is bounded: a future that outlives FUTURE_TIMEOUT is recorded as a hang."""
    record.futures += 1
    try:
        return future.result(timeout=FUTURE_TIMEOUT)
    except TimeoutError as exc:  # concurrent.futures.TimeoutError is TimeoutError on 3.11
        record.hangs.append(what)
        raise Hang(what) from exc


def rl_loop(url: str, tenant: str, steps: int, record: RunRecord, pace=None) -> None:
    """One tenant's RL loop; it stops at the first failed or hung future and records it.
    `pace(step)`, when given, is called before each step and before the final save (step =
    None), and may hold the loop (the short form keeps its faults among the steps)."""
    import tinker
    from tinker import types

    seed = SEEDS[tenant]
    rng = np.random.default_rng(seed)
    prompt = rng.integers(100, 5000, size=PROMPT_TOKENS).tolist()
    adam = types.AdamParams(learning_rate=2e-3)
    what = "create"
    service = None
    try:
        service = tinker.ServiceClient(base_url=url, api_key=TENANTS[tenant])
        training = _wait(record, service.create_lora_training_client(base_model=MODEL, rank=4, seed=seed), what)
        record.model_id = training.model_id
        what = "save_weights_for_sampler 0"
        path = _wait(record, training.save_weights_for_sampler(name="w0"), what).path
        sampler = _wait(record, training.create_sampling_client(path), "create_sampling_client 0")
        for step in range(steps):
            if pace is not None:
                pace(step)
            what = f"sample {step}"
            params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed * 1000 + step)
            result = _wait(
                record,
                sampler.sample(types.ModelInput.from_ints(prompt), num_samples=GROUP, sampling_params=params),
                what,
            )
            rewards = [grade(seq.tokens) for seq in result.sequences]
            baseline = sum(rewards) / len(rewards)
            data = []
            for seq, reward in zip(result.sequences, rewards):
                tokens = prompt + list(seq.tokens)
                observed = len(prompt) - 1
                n = len(tokens) - 1
                logprobs = ([0.0] * observed + list(seq.logprobs))[:n]
                advantages = ([0.0] * observed + [reward - baseline] * len(seq.tokens))[:n]
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": logprobs, "advantages": advantages},
                ))  # fmt: skip
            fb = training.forward_backward(data, "importance_sampling")
            opt = training.optim_step(adam)
            what = f"forward_backward {step}"
            loss = _wait(record, fb, what).metrics["loss:sum"]
            what = f"optim_step {step}"
            _wait(record, opt, what)
            record.steps = step + 1
            _say(f"{tenant}: step {step + 1} done")
            record.curve.append((baseline, loss, [list(seq.tokens) for seq in result.sequences]))
            if (step + 1) % SYNC_EVERY == 0 and step + 1 < steps:
                what = f"save_weights_for_sampler {step + 1}"
                path = _wait(record, training.save_weights_for_sampler(name=f"w{step + 1}"), what).path
                sampler = _wait(record, training.create_sampling_client(path), f"create_sampling_client {step + 1}")
        if pace is not None:
            pace(None)
        what = "save_state"
        record.final_path = _wait(record, training.save_state("final"), what).path
        # End the session as a finished script does: an open one keeps heartbeating, and
        # `replay --from-log` compares against the live store, so a heartbeat landing while
        # it runs reads as a difference (the first passing long soak's only "problem").
        what = "close"
        _wait(record, service.close("success"), what)
        service = None
    except Hang:
        pass
    except Exception as exc:  # the soak reports every failure with its message and goes on
        record.failures.append((what, f"{type(exc).__name__}: {exc}"))
    finally:
        if service is not None:  # a loop that stopped early: stop its heartbeats all the same
            try:
                service.close("errored").result(timeout=30)
            except Exception:
                pass


def start_tenants(url: str, steps: int, pace=None) -> tuple[dict[str, RunRecord], list[threading.Thread]]:
    records = {tenant: RunRecord(tenant) for tenant in TENANTS}
    threads = [threading.Thread(target=rl_loop, args=(url, t, steps, records[t], pace), daemon=True) for t in TENANTS]
    for thread in threads:
        thread.start()
    return records, threads


def join(threads: list[threading.Thread], steps: int) -> None:
    for thread in threads:
        # each loop's waits are bounded; this bound only keeps a wedged SDK from wedging us
        thread.join(timeout=FUTURE_TIMEOUT * (3 * steps + 4))


class Chaos:
    """Waits a random interval, then kills a role with SIGKILL and restarts it (or restarts
    the broker); the first faults are each kind once, in a random order, the rest random
    kinds. Seeded: the same seed gives the same sequence of faults.

    It runs in the test's main thread: the brokers die with the thread that started them
    (PR_SET_PDEATHSIG, tests/eventing/brokers.py), so a broker restarted from a helper thread
    would go down again when that thread ends."""

    def __init__(
        self, cluster: Cluster, seed: int, interval: tuple[float, float], roles=ROLES, max_faults: Optional[int] = None
    ) -> None:
        self.cluster, self.rng, self.interval, self.roles = cluster, random.Random(seed), interval, roles
        self.max_faults = max_faults  # then the loops finish on a quiet deployment
        self._order = self.rng.sample(list(roles), len(roles))
        self.faults: list[tuple[float, str, float]] = []  # (seconds since start, role, seconds to ready)
        self.errors: list[str] = []
        self._hold = threading.Event()
        self._lock = threading.Lock()
        self._parked = 0

    def pace(self, step: Optional[int]) -> None:
        """Called by every loop between steps. It holds the loop while the broker is being
        restarted (see `quiesce`) and, with `max_faults` (the short form), holds step k until
        k faults are done and the final save until all are, so every fault lands while the
        loops are mid-run however fast the machine is. Bounded: a stalled chaos loop does
        not hold the loops."""
        deadline = time.monotonic() + FUTURE_TIMEOUT
        with self._lock:
            self._parked += 1
        try:
            while self._hold.is_set() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.max_faults is None:
                return
            wanted = self.max_faults if step is None else min(step, self.max_faults)
            while len(self.faults) < wanted and not self.errors and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            with self._lock:
                self._parked -= 1

    def quiesce(self, running) -> None:
        """Hold every loop at its next step boundary and wait until no future is open, so
        nothing is being produced to the log. noida-db acknowledges records during its own
        shutdown that it then does not keep (measured: 11 of 8,336 acknowledged records gone
        after 5 `noida-db down` restarts under a steady producer), a flaw of that test broker
        that would otherwise read as a lost request; a replicated Kafka with acks=all keeps
        what it acknowledged."""
        self._hold.set()
        deadline = time.monotonic() + FUTURE_TIMEOUT
        while time.monotonic() < deadline and (self._parked < running() or open_futures(self.cluster)):
            time.sleep(0.1)

    def run(self, running) -> None:
        """Inject faults while `running()` (how many loops still run) is not zero."""
        started = time.monotonic()
        busy = lambda: running() > 0  # noqa: E731
        while busy():
            deadline = time.monotonic() + self.rng.uniform(*self.interval)
            while busy() and time.monotonic() < deadline:
                time.sleep(0.1)
            if not busy() or (self.max_faults is not None and len(self.faults) >= self.max_faults):
                continue
            # every kind of fault once (in a seeded order), then any at random
            first = len(self.faults) < len(self.roles)
            role = self._order[len(self.faults)] if first else self.rng.choice(self.roles)
            began = time.monotonic()
            try:
                if role == "broker":
                    self.quiesce(running)
                self.inject(role)
            except Exception as exc:  # a role that will not come back fails the soak
                self.errors.append(f"{role}: {exc}")
                return
            finally:
                self._hold.clear()
            self.faults.append((round(began - started, 1), role, round(time.monotonic() - began, 1)))
            _say(f"chaos: {role} killed and back after {self.faults[-1][2]} s")

    def inject(self, role: str) -> None:
        cluster = self.cluster
        if role == "broker":
            cluster.broker.restart()
        elif role == "gateway":
            port = cluster.gateway.port
            cluster.gateway.kill()
            cluster.start_gateway(port=port)  # the same address: the SDK clients carry on
        else:
            cluster.workers[role].kill()
            cluster.start_role(role).wait_ready()


def store_checks(cluster: Cluster, record: RunRecord) -> list[str]:
    """What the store says about one run: its steps, its seq ids, its completions."""
    from sqlalchemy import func, select

    from eventing.store import tables as t

    problems = []
    model = record.model_id
    steps = cluster.query(
        select(t.run_steps.c.step, t.run_steps.c.completed_at)
        .where(t.run_steps.c.model_id == model)
        .order_by(t.run_steps.c.step)
    )
    numbers = [step for step, _ in steps]
    if numbers != list(range(1, record.steps + 1)) and numbers != list(range(record.steps)):
        problems.append(f"{record.tenant}: run_steps {numbers} for {record.steps} client steps")
    if any(done is None for _, done in steps):
        problems.append(f"{record.tenant}: a step never completed")
    keys = cluster.query(select(t.submissions.c.dedup_key).where(t.submissions.c.dedup_key.like(f"seq:{model}:%")))
    seq_ids = sorted(int(key.rsplit(":", 1)[1]) for (key,) in keys)
    if not seq_ids or seq_ids != list(range(seq_ids[0], seq_ids[0] + len(seq_ids))):
        problems.append(f"{record.tenant}: seq ids not contiguous: {seq_ids}")
    # Completion events may repeat (a killed worker's replacement answers again what it had
    # answered but not yet committed; the projection keeps the first), so count requests.
    events = t.events
    optim = cluster.query(
        select(func.count(func.distinct(events.c.subject)))
        .where(events.c.key == model, events.c.type.like("%optim_step.completed.v1"), events.c.fenced.isnot(True))
    )  # fmt: skip
    if optim != [(record.steps,)]:
        problems.append(f"{record.tenant}: {optim[0][0]} optim_steps completed for {record.steps} client steps")
    return problems


def open_futures(cluster: Cluster) -> int:
    from sqlalchemy import func, select

    from eventing.store import tables as t

    return cluster.query(
        select(func.count())
        .select_from(t.futures)
        .where(t.futures.c.state.in_(("pending", "running")), t.futures.c.tenant.in_(list(TENANTS)))
    )[0][0]


def verify(cluster: Cluster, reference: dict[str, RunRecord], chaotic: dict[str, RunRecord], steps: int) -> list[str]:
    """Every promise of the module docstring; an empty list means the soak passed."""
    problems = []
    for tenant in TENANTS:
        ref, run = reference[tenant], chaotic[tenant]
        for label, record in (("reference", ref), ("chaos", run)):
            problems += [f"{tenant} {label}: hung at {what}" for what in record.hangs]
            problems += [f"{tenant} {label}: {what} failed: {message}" for what, message in record.failures]
            if record.steps != steps or record.final_path is None:
                problems.append(f"{tenant} {label}: did {record.steps} of {steps} steps")
        if run.final_path and ref.final_path:
            if cluster.checkpoint_files(run.final_path) != cluster.checkpoint_files(ref.final_path):
                problems.append(f"{tenant}: final weights/optimizer differ from the fault-free run")
            if run.curve != ref.curve:
                problems.append(f"{tenant}: learning curve differs from the fault-free run")
        if run.model_id:
            problems += store_checks(cluster, run)
    deadline = time.monotonic() + 60  # the projector may still be folding the last completions
    while open_futures(cluster) and time.monotonic() < deadline:
        time.sleep(0.5)
    if open_futures(cluster):
        problems.append(f"{open_futures(cluster)} futures still pending or running")
    for source in ([], ["--from-log"]):
        replayed = cluster.cli("replay", *source)
        if replayed.returncode != 0 or "projections match" not in replayed.stdout:
            problems.append(f"replay {source}: {replayed.stdout[-2000:]} {replayed.stderr[-2000:]}")
    return problems


def soak(
    cluster: Cluster,
    steps: int,
    seed: int,
    interval: tuple[float, float],
    roles=ROLES,
    max_faults: Optional[int] = None,
) -> dict:
    """The reference loops on the quiet deployment, then the same loops under chaos."""
    began = time.monotonic()
    reference, threads = start_tenants(cluster.url, steps)
    join(threads, steps)
    reference_seconds = time.monotonic() - began
    began = time.monotonic()
    chaos = Chaos(cluster, seed, interval, roles, max_faults)
    chaotic, threads = start_tenants(cluster.url, steps, pace=chaos.pace)
    chaos.run(running=lambda: sum(thread.is_alive() for thread in threads))
    join(threads, steps)
    chaos_seconds = time.monotonic() - began
    problems = chaos.errors + verify(cluster, reference, chaotic, steps)
    finals = [
        json.dumps(cluster.checkpoint_files(r.final_path), sort_keys=True) for r in reference.values() if r.final_path
    ]
    return {
        "seed": seed, "steps_per_tenant": steps, "tenants": len(TENANTS), "interval_seconds": list(interval),
        "faults": chaos.faults, "fault_count": len(chaos.faults),
        "futures": sum(r.futures for r in chaotic.values()),
        # the runs differ from each other, so "bitwise equal to its reference" is no accident
        "distinct_final_states": len(set(finals)),
        "reference_seconds": round(reference_seconds, 1), "chaos_seconds": round(chaos_seconds, 1),
        "problems": problems,
    }  # fmt: skip


def main(argv: Optional[list[str]] = None) -> int:
    """The long form: a cluster of its own on a fresh PostgreSQL database; prints a JSON report."""
    import tempfile

    from sqlalchemy import create_engine, text

    from tests.conftest import PG_ADMIN

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="RL steps per tenant")
    parser.add_argument("--seed", type=int, default=2024, help="seed of the chaos loop")
    parser.add_argument(
        "--interval", type=float, nargs=2, default=(15.0, 30.0), help="seconds between faults: low high"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = parser.parse_args(argv)
    name = "openrl_chaos_" + uuid.uuid4().hex[:12]
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    cluster = None
    try:
        with tempfile.TemporaryDirectory(prefix="openrl-chaos-") as root:
            began = time.monotonic()
            cluster = Cluster(Path(root), PG_ADMIN.rsplit("/", 1)[0] + "/" + name, extra_env=ENV, keys=KEYS).start()
            try:
                report = soak(cluster, args.steps, args.seed, tuple(args.interval))
            except BaseException:
                print(cluster.logs())
                raise
            finally:
                cluster.stop()
            report["wall_seconds"] = round(time.monotonic() - began, 1)
            report["outcome"] = "pass" if not report["problems"] else "FAIL"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    text_report = json.dumps(report, indent=1)
    print(text_report)
    if args.out:
        args.out.write_text(text_report)
    return 0 if report["outcome"] == "pass" else 1


if __name__ == "__main__":
    raise SystemExit(main())
