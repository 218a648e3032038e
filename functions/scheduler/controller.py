"""The scheduler: one reconcile loop that makes the worker StatefulSets match what the runs need.

Each pass reads three things and writes one:

1. demand: the event store's runs and sampling sessions (`eventing.store.demand`), turned
   into wanted workers by the pure lifecycle rules (`openrl_core.workload`);
2. inventory: accelerator nodes and their timeslicers' occupancy (`inventory`), placed by
   the pure policy (`openrl_core.placement`), running workers pinned where they are;
3. what exists: StatefulSets labelled managed-by=openrl-scheduler in the namespace;

then creates the missing workers (stamped from the templates), scales released ones back
up, scales idle base-model workers to zero and deletes the trainers of full fine-tuning runs
that are done. Nothing else is touched.

A worker that is wanted but fits no accelerator stays unplaced (and is reported). When the
oldest request its runs wait on is older than `scheduler_unplaced_grace_seconds`, those
requests are failed with the reason (a `…failed` event per future, through the log and the
projector like any worker's), so no client polls forever for a worker that cannot exist.
A deleted worker is simply created again on the next pass under the same name: its pod
gets the same static group membership id, restores the latest snapshot and replays.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable, Optional

import yaml

from eventing import topics
from eventing.bus import EventPublisher
from eventing.store.demand import pending_request_ids, read_activity, requests_of
from eventing.store.event_store import EventStore
from functions.deploy.errors import ClusterError, DeployConfigError
from functions.deploy.kube import KubeApi
from functions.deploy.workers import MANAGED_BY, Pin, placement_of, stamp
from functions.scheduler.inventory import devices_from
from functions.scheduler.timeslicer_status import NodeStatus, TimeslicerStatusError, fetch_status
from openrl_core import memory
from openrl_core.events import new_event
from openrl_core.events.base import event_type
from openrl_core.events.lifecycle import RequestFailed
from openrl_core.placement import Job, place
from openrl_core.quantity import parse_bytes
from openrl_core.settings import Settings
from openrl_core.workload import Activity, WorkerSpec, serves, waiting_since, wanted_workers

log = logging.getLogger(__name__)
STS = ("apps/v1", "StatefulSet")
SOURCE = "/openrl/scheduler"
SELECTOR = f"app.kubernetes.io/managed-by={MANAGED_BY}"
TIMESLICER_PODS = "app.kubernetes.io/name=openrl,app.kubernetes.io/component=timeslicer"


@dataclass
class Report:
    created: list[str] = field(default_factory=list)
    scaled_up: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    unplaced: dict[str, str] = field(default_factory=dict)
    failed_requests: list[str] = field(default_factory=list)
    skipped_nodes: dict[str, str] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = [f"{verb:10} {name}" for verb, names in
               (("created", self.created), ("scaled-up", self.scaled_up), ("moved", self.moved), ("released", self.released),
                ("deleted", self.deleted)) for name in names]  # fmt: skip
        out += [f"unplaced   {name}: {why}" for name, why in self.unplaced.items()]
        out += [f"failed     request {request_id}" for request_id in self.failed_requests]
        out += [f"node       {node}: {why}" for node, why in self.skipped_nodes.items()]
        return out or ["nothing to change"]


def load_templates(directory: Path) -> dict[str, dict]:
    templates = {}
    for role in ("trainer", "sampler"):
        path = directory / f"{role}.yaml"
        if not path.is_file():
            raise DeployConfigError(f"no {role} template at {path} (the ConfigMap openrl-worker-templates, mounted)")
        templates[role] = yaml.safe_load(path.read_text())
    return templates


class Scheduler:
    def __init__(
        self,
        api: KubeApi,
        settings: Settings,
        templates: dict[str, dict],
        store: EventStore,
        publisher: EventPublisher,
        clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
        read_status: Callable[[str], NodeStatus] = fetch_status,
    ) -> None:
        self.api = api
        self.settings = settings
        self.templates = templates
        self.store = store
        self.publisher = publisher
        self.clock = clock
        self.read_status = read_status
        self.namespace = settings.namespace
        self._failed: set[str] = set()  # requests already failed by this scheduler (until the projector stores it)
        self._stop = threading.Event()
        self._runtime = None

    @classmethod
    def from_settings(cls, settings: Settings, api: KubeApi, templates_dir: Path) -> "Scheduler":
        from functions.runtime import Runtime

        templates = load_templates(templates_dir)
        runtime = Runtime(settings)
        scheduler = cls(api, settings, templates, runtime.store, runtime.publisher)
        scheduler._runtime = runtime
        return scheduler

    # -- one pass ----------------------------------------------------------------------------

    def reconcile(self) -> Report:
        report = Report()
        now = self.clock()
        activities = read_activity(self.store.engine)
        idle = timedelta(minutes=self.settings.scheduler_idle_minutes)
        wanted = sorted(
            wanted_workers(activities, now, idle, self.settings.scheduler_base_models), key=lambda s: s.name
        )
        existing = {s["metadata"]["name"]: s for s in self.api.list(STS, self.namespace, SELECTOR)}
        pins = self._place(wanted, existing, report)
        for spec in wanted:
            if spec.name not in pins:
                self._unplaced(spec, activities, now, report)
                continue
            self._ensure(spec, pins[spec.name], existing.get(spec.name), report)
        wanted_names = {spec.name for spec in wanted}
        for name, worker in sorted(existing.items()):
            if name in wanted_names:
                continue
            annotations = worker["metadata"].get("annotations") or {}
            if annotations.get("openrl.ai/model-id"):
                # A full run's own trainer: its run is done or idle; a new request recreates it.
                if self.api.delete(STS, name, self.namespace):
                    report.deleted.append(name)
            elif worker["spec"].get("replicas", 1) > 0:
                self.api.patch(STS, name, {"spec": {"replicas": 0}}, self.namespace)
                report.released.append(name)
        return report

    def _memory(self, spec: WorkerSpec) -> int:
        """A worker's bytes: configured per base model (a full run's trainer that times the
        full-FT factor); else, for a trainer of a model whose dimensions are known, the memory
        model's peak (openrl_core/memory.py); else the default."""
        configured = self.settings.scheduler_job_memory.get(spec.base_model)
        shape = memory.shape_of(spec.base_model) if configured is None and spec.role == "trainer" else None
        if shape is not None:
            precision = memory.resolve_precision(self.settings.trainer_precision, self.settings.device)
            kind = "full" if spec.model_id else "lora"
            tokens, checkpointing = (
                self.settings.trainer_pack_max_tokens,
                self.settings.trainer_activation_checkpointing,
            )
            return memory.trainer_bytes(shape, kind, precision, tokens, checkpointing)
        factor = self.settings.scheduler_full_finetune_factor if spec.model_id else 1.0
        return int(parse_bytes(configured or self.settings.scheduler_default_job_memory) * factor)

    def _place(self, wanted: list[WorkerSpec], existing: dict[str, dict], report: Report) -> dict[str, Optional[Pin]]:
        """Worker name -> its pin (None: no accelerator to pin, on a CPU deployment)."""
        if self.settings.device == "cpu":
            return {spec.name: None for spec in wanted}
        nodes = self.api.list(("v1", "Node"))
        statuses = self._statuses()
        ours = tuple(existing) + tuple(spec.name for spec in wanted)
        devices, report.skipped_nodes = devices_from(nodes, statuses, lambda job: job.startswith(ours))
        running = {
            name: f"{pin.node}/{pin.device}"
            for name, worker in existing.items()
            if worker["spec"].get("replicas", 1) > 0 and (pin := placement_of(worker)) is not None
        }
        jobs = [Job(spec.name, self._memory(spec)) for spec in wanted]
        placement = place(jobs, devices, self.settings.scheduler_policy, pinned=running)
        report.unplaced.update(placement.unplaced)
        pins: dict[str, Optional[Pin]] = {}
        for name, device_id in placement.assignments.items():
            node, _, index = device_id.rpartition("/")
            pins[name] = Pin(node, int(index))
        return pins

    def _statuses(self) -> dict[str, NodeStatus]:
        statuses = {}
        for pod in self.api.list(("v1", "Pod"), self.namespace, TIMESLICER_PODS):
            node, ip = pod.get("spec", {}).get("nodeName"), pod.get("status", {}).get("podIP")
            if not node or not ip:
                continue
            try:
                statuses[node] = self.read_status(f"http://{ip}:{self.settings.scheduler_timeslicer_port}")
            except TimeslicerStatusError as exc:
                log.warning("scheduler: %s (node %s falls back to its labels)", exc.detail, node)
        return statuses

    def _ensure(self, spec: WorkerSpec, pin: Optional[Pin], worker: Optional[dict], report: Report) -> None:
        desired = stamp(self.templates[spec.role], spec, pin, self._memory(spec) if pin else None)
        desired["metadata"]["namespace"] = self.namespace
        if worker is None:
            self.api.create(desired)
            report.created.append(spec.name)
        elif worker["spec"].get("replicas", 1) == 0:
            # Placement may have changed while it was released: the whole stamped spec goes back.
            self.api.patch(STS, spec.name, desired, self.namespace)
            report.scaled_up.append(spec.name)
        elif pin is not None and placement_of(worker) != pin:
            # Its device is gone (node drained, budget shrank): it restarts where it now fits.
            self.api.patch(STS, spec.name, desired, self.namespace)
            report.moved.append(spec.name)

    def _unplaced(self, spec: WorkerSpec, activities: list[Activity], now: datetime, report: Report) -> None:
        since = waiting_since(activities, spec)
        grace = timedelta(seconds=self.settings.scheduler_unplaced_grace_seconds)
        if since is None or now - since < grace:
            return
        why = report.unplaced.get(spec.name, "no accelerator")
        error = (
            f"no worker could be placed for {spec.role} of {spec.base_model} ({why}); "
            f"the request waited {int((now - since).total_seconds())} s. Retry once capacity is free."
        )
        for activity in activities:
            if activity.pending and serves(spec, activity):
                report.failed_requests.extend(self._fail(activity, error))

    def _fail(self, activity: Activity, error: str) -> list[str]:
        ids = [
            i for i in pending_request_ids(self.store.engine, activity.tenant, activity.key) if i not in self._failed
        ]
        failed = []
        for request in requests_of(self.store, activity.tenant, activity.key, ids):
            payload = RequestFailed(request_id=request.data.request_id, error=error, category="server")
            reply = new_event(
                event_type(request.family, request.verb, "failed"), payload,
                tenant=request.tenant, source=SOURCE, key=request.key, subject=payload.request_id,
            )  # fmt: skip
            self.publisher.publish(topics.topic(request.tenant, "completions"), reply)
            self._failed.add(payload.request_id)
            failed.append(payload.request_id)
        return failed

    # -- the loop ----------------------------------------------------------------------------

    def serve_forever(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self._stop.set())
        log.info(
            "scheduler: reconciling namespace %s every %.0f s", self.namespace, self.settings.scheduler_interval_seconds
        )
        while not self._stop.is_set():
            try:
                for line in self.reconcile().lines():
                    if line != "nothing to change":
                        log.info("scheduler: %s", line)
            except (ClusterError, OSError) as exc:  # the API or the store is briefly away: next pass
                log.warning("scheduler: pass failed: %s", exc)
            self._stop.wait(self.settings.scheduler_interval_seconds)
        self.close()

    def close(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
