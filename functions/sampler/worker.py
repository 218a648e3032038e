"""The sampler worker: batches every pending sample request of a base model into one run.

Each poll takes whatever requests are waiting (up to the batch's row budget), loads any
adapter they name (cached by content hash, so publishing new weights is just a new key),
checks each request on its own (a bad one fails alone), and runs the rest as one batched
generation on the accelerator, in a turn of the timeslicer. Requests for a full
fine-tuning run's weights run on that run's own copy (`full_runs`), brought to the
published version by weight sync in its own turn; the copy is a parkable job. Sampling requests have no order, so offsets are committed
as soon as their completions are on the log. A sample whose cancel arrives in the same
poll as the request (the two share the sampling session's partition, cancel after request)
is answered CANCELLED and never runs; one already taken into a batch runs to the end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, defaultdict
from typing import Optional

from eventing import topics
from eventing.blobs import BlobStore
from eventing.bus import EventBus, EventPublisher
from functions.compute import host_memory
from functions.compute.models import ModelDirectory, parameter_count
from functions.compute.weight_sync import read_manifest
from functions.sampler.full_runs import FullRunCopies
from functions.sampler.scoring_payload import add_scoring_results, scoring_fields
from functions.sampler.stability import stability_entry
from functions.sampler.types import SampleJob, SampleResult
from functions.timeslicer.client import TimeslicerClient
from functions.timeslicer.setup import device_name, private
from openrl_core.cohort import Cohort
from openrl_core.errors import OpenRLError
from openrl_core.events import Event, new_event
from openrl_core.events.lifecycle import RequestCompleted, RequestFailed
from openrl_core.events.sampling import SAMPLE, SAMPLE_CANCEL_REQUESTED, SAMPLE_CANCELLED, SampleCancelled

log = logging.getLogger(__name__)
SOURCE = "/openrl/sampler"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class SamplerWorker:
    def __init__(
        self,
        bus: EventBus,
        publisher: EventPublisher,
        blobs: BlobStore,
        models: ModelDirectory,
        slicer: Optional[TimeslicerClient] = None,
        device: str = "cpu",
        max_batch_rows: int = 64,
        max_adapters: int = 16,
        max_run_versions: int = 4,
        linger: float = 0.02,
        cohort_wait: float = 0.1,
        group: str = "openrl-sampler",
        base_models: Optional[list[str]] = None,
        instance_id: Optional[str] = None,
        max_full_models: int = 2,
        engine: str = "torch",
        vllm=None,
        share_base: bool = True,
        release_memory: bool = True,
        release_idle_seconds: float = 1.0,
    ) -> None:
        self.publisher = publisher
        self.blobs = blobs
        self.models = models
        self.instance = instance_id or group
        self.slicer = slicer or private(self.instance)
        self.slicer.on_park = self._park
        self.slicer_device = device_name(device)
        self._state = threading.Lock()  # sampling, parking and restoring of any copy
        self.device = device
        self.max_batch_rows = max_batch_rows
        self.max_adapters = max_adapters
        self.max_run_versions = max_run_versions
        self.linger = linger
        self.cohort_wait = cohort_wait  # see run_once
        self.cohort = Cohort()
        # Base engines read the base weights only, so in one process they serve the trainer's
        # frozen copy (`shared_weights`); full runs' copies are written by weight sync and never share.
        self.share_base = share_base
        self.release_memory = release_memory  # give a batch's freed memory back (`host_memory`)
        self.release_idle_seconds = release_idle_seconds  # once the process has been idle this long
        self._polled = self._gathered = 0.0  # when the batch's first request and the rest were polled
        # "torch" (in this process) or "vllm" (a child process per weight set, `vllm_engine`);
        # `vllm` holds the VllmOptions. Without the vLLM environment this fails now, not at
        # the first request.
        self.engine_kind = engine
        self.vllm = vllm
        if engine == "vllm":
            from functions.sampler.vllm_engine import VllmOptions, vllm_python

            self.vllm = vllm or VllmOptions(device=device, max_num_seqs=max_batch_rows)
            vllm_python(self.vllm.env)
        elif engine != "torch":
            raise ValueError(f"unknown sampler engine {engine!r}")
        self.consumer = bus.consumer(group, pattern=topics.pattern("sampling", base_models), instance_id=instance_id)
        self._engines: dict = {}
        # Adapters loaded per base model, least recently used first, each with its training run
        # (None: unknown). Every published version of every tenant's weights is a new key, so
        # without eviction memory only grows; a run's superseded versions go first.
        self._adapters: dict[str, OrderedDict[str, Optional[str]]] = defaultdict(OrderedDict)
        self.full_runs = FullRunCopies(self._make_engine, max_full_models)
        self._manifests: OrderedDict[str, dict] = OrderedDict()  # manifest sha256 -> parsed

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once(timeout=0.5)
            except Exception:
                log.exception("sampler: batch failed")
                stop.wait(0.5)
        self.consumer.close()

    def run_once(self, timeout: float = 1.0) -> int:
        records = self.consumer.poll(max_records=self.max_batch_rows, timeout=timeout)
        if records:
            with host_memory.working():
                self._work(records)
            # Without waiting for the offsets to be durable: the completions are on the log,
            # so a crash before they are only reruns a sample the store already answered
            # (its first completion wins); the next batch need not sit through an fsync.
            self.consumer.commit(wait=False)
        elif self.release_memory:
            host_memory.release_if_idle(self.release_idle_seconds)  # see the trainer's run_once
        return len(records)

    def _work(self, records: list) -> None:
        self._polled = time.monotonic()  # for the debug line of the batch (`_run`)
        events = self._decode(records)
        # Requests a client sends together reach the log a few milliseconds apart; waiting a
        # moment for the rest turns them into one batch instead of one batch each. While
        # several runs sample (RL loops side by side), the batch also waits, up to
        # `cohort_wait`, for the runs active lately that have no request in it yet
        # (`openrl_core.cohort`): their samples share the decoding steps almost for free.
        deadline = time.monotonic() + self.cohort_wait
        while len(records) < self.max_batch_rows:
            now = time.monotonic()
            waiting = self.cohort.waits(self._members(events), now, deadline)
            more = self.consumer.poll(
                max_records=self.max_batch_rows - len(records), timeout=(deadline - now) if waiting else self.linger
            )
            if not more and not waiting:
                break
            records = records + more
            events += self._decode(more)
        self._gathered = time.monotonic()
        self._late: list[Event] = []
        self._dispatch(events)
        while self._late:  # what arrived while a batch waited for its turn and did not join it
            late, self._late = self._late, []
            self._dispatch(late)

    def _dispatch(self, events: list[Event]) -> bool:
        """Cancel, fail or sample each request (one batch per base model); True if any ran."""
        requested: list[Event] = []
        cancelled: set[str] = set()
        for event in events:
            if event.type == SAMPLE["requested"]:
                requested.append(event)
            elif event.type == SAMPLE_CANCEL_REQUESTED:
                cancelled.add(event.data.request_id)
        by_model: dict[str, list[Event]] = defaultdict(list)
        for event in requested:
            if event.data.request_id in cancelled:
                self._cancel(event)
            else:
                by_model[event.data.base_model].append(event)
        for base_model, batch in by_model.items():
            self._sample(base_model, batch)
        return bool(by_model)

    def _late_joiners(self, engine, base_model: str, in_use: set[str]):
        """A function that, called once the batch holds its turn, takes the sample requests
        for this base model's own weights that reached the log while it waited for the device
        (the trainer's turn, say) and returns them as jobs of the batch; whatever else it
        polled waits in `_late` for the next dispatch. Requests that pile up behind a busy
        accelerator thus run in the batch that was waiting anyway, not in one right after it."""
        canonical = self.models.canonical(base_model)

        def join() -> list[tuple[Event, SampleJob]]:
            joined = []
            for event in self._decode(self.consumer.poll(max_records=self.max_batch_rows, timeout=0)):
                own = event.type == SAMPLE["requested"] and event.data.weights is None
                if not own or self.models.canonical(event.data.base_model) != canonical:
                    self._late.append(event)
                    continue
                try:
                    job = self._job(engine, base_model, event, in_use)
                    engine.validate(job)
                    joined.append((event, job))
                except Exception as exc:
                    self._fail(event, exc)
            return joined

        return join

    def _decode(self, records) -> list[Event]:
        events, now = [], time.monotonic()
        for record in records:
            try:
                event = self.publisher.codec.decode(record.message)
            except Exception:
                log.exception(
                    "sampler: undecodable record %s/%s@%s skipped", record.topic, record.partition, record.offset
                )
                continue
            if event.type == SAMPLE["requested"]:
                self.cohort.saw(_member(event), now)
            events.append(event)
        return events

    @staticmethod
    def _members(events: list[Event]) -> set[str]:
        return {_member(event) for event in events if event.type == SAMPLE["requested"]}

    def engine(self, base_model: str):
        key = self.models.canonical(base_model)  # an alias shares its target's base weights
        if key not in self._engines:
            engine = self._make_engine(self.models.files(base_model), share=self.share_base)
            # The base weights (and the adapters on them) stay resident, unless the engine can
            # sleep (vLLM on CUDA): then the timeslicer may park it like any run (`_park`).
            parkable = bool(getattr(engine, "can_sleep", False))
            self.slicer.register(
                self._base_job(key), engine.weight_bytes, self.slicer_device, parkable=parkable, resident=True
            )
            self._engines[key] = engine
        return self._engines[key]

    def _make_engine(self, files, share: bool = False):
        if self.engine_kind == "vllm":
            from functions.sampler.vllm_engine import VllmEngine

            return VllmEngine(files, self.vllm)
        from functions.sampler.engine import SamplerEngine

        return SamplerEngine(files, device=self.device, max_batch_rows=self.max_batch_rows, share_base=share)

    def _base_job(self, canonical: str) -> str:
        return f"{self.instance}/base/{canonical}"

    def _sample(self, base_model: str, events: list[Event]) -> None:
        try:
            engine = self.engine(base_model)
        except Exception as exc:
            for event in events:
                self._fail(event, exc)
            return
        groups: dict[Optional[str], list[tuple[Event, SampleJob]]] = defaultdict(list)
        manifests: dict[str, dict] = {}
        in_use: set[str] = set()
        for event in events:
            try:
                run_key = None
                if event.data.weights is not None:
                    manifest = self._manifest(event)
                    run_key = f"{event.tenant}:{manifest['run_id']}"
                    manifests[run_key] = manifest  # the newest version asked in this batch wins
                job = self._job(engine, base_model, event, in_use)
                engine.validate(job)
                groups[run_key].append((event, job))
            except Exception as exc:
                self._fail(event, exc)
        for run_key, jobs in groups.items():
            if run_key is None:
                join = self._late_joiners(engine, base_model, in_use)
                job_name = self._base_job(self.models.canonical(base_model))
                self._run(job_name, lambda: self._awake(job_name, engine), jobs, join)
            else:
                self._run_full(base_model, run_key, manifests[run_key], jobs, keep=set(groups) - {None})

    def _run(self, job_name: str, prepare, jobs: list[tuple[Event, SampleJob]], join=None) -> None:
        """One batched generation in a turn of `job_name`; `prepare()` gives the engine, and
        `join()`, if given, the late requests that join the batch once the turn is held."""
        asked = time.monotonic()
        # The training runs whose samples these are: the device's affinity for a run that just
        # trained waits for that run's next request, which this batch may be carrying.
        runs = tuple(sorted({event.data.run_id for event, _job in jobs if event.data.run_id}))
        try:
            with self.slicer.turn(job_name, serves=runs) as turn:
                with self._state:
                    began = time.monotonic()
                    engine = prepare()
                    if join is not None:
                        jobs = jobs + join()
                    results = engine.sample([job for _event, job in jobs])
                lease = turn.lease_id
            if log.isEnabledFor(logging.DEBUG):
                members = sorted({_member(event) for event, _job in jobs})
                log.debug("sampler: batch of %d requests (%d rows) of %d runs (%s) gathered %.3f s, prepared %.3f s, "
                          "waited %.3f s for its turn, ran %.3f s",
                          len(jobs), sum(job.num_samples for _e, job in jobs), len(members), ", ".join(members),
                          self._gathered - self._polled, asked - self._gathered, began - asked, time.monotonic() - began)  # fmt: skip
        except Exception as exc:
            for event, _job in jobs:
                self._fail(event, exc)
            return
        # A batch's completions go to the log in one append (one fsync for the whole batch).
        self.publisher.publish_many(
            [self._completion(event, result, lease) for (event, _job), result in zip(jobs, results)]
        )

    def _run_full(self, base_model: str, run_key: str, manifest: dict, jobs, keep: set[str]) -> None:
        files = self.models.files(base_model)
        job_name = self._run_job(run_key)
        if self.full_runs.get(run_key) is None:
            for old in self.full_runs.evictable(keep):
                self.full_runs.drop(old)
                self.slicer.unregister(self._run_job(old))
            # grouped with the run's trainer job: a run's step (train, publish, sample) stays together
            group = run_key.split(":", 1)[1]
            self.slicer.register(
                job_name, parameter_count(files) * 4, self.slicer_device, parkable=True, resident=False, group=group
            )

        def prepare():
            copy = self.full_runs.get(run_key) or self.full_runs.create(run_key, files, manifest["dtype"])
            if self.full_runs.is_parked(run_key):
                seconds, nbytes = self.full_runs.restore(run_key)
                self.slicer.report_restored(job_name, seconds, nbytes)
            tenant = run_key.split(":", 1)[0]
            self.full_runs.prepare(run_key, manifest, lambda ref: self.blobs.get(tenant, ref))
            return copy.engine

        self._run(job_name, prepare, jobs)

    def _run_job(self, run_key: str) -> str:
        return f"{self.instance}/run/{run_key}"

    def _manifest(self, event: Event) -> dict:
        ref = event.data.weights
        manifest = self._manifests.get(ref.sha256)
        if manifest is None:
            manifest = read_manifest(self.blobs.get(event.tenant, ref))
            self._manifests[ref.sha256] = manifest
            while len(self._manifests) > 64:
                self._manifests.popitem(last=False)
        return manifest

    def _awake(self, job_name: str, engine):
        """A base engine the timeslicer put to sleep wakes in its turn (and says so)."""
        if getattr(engine, "asleep", False):
            seconds, nbytes = engine.restore()
            self.slicer.report_restored(job_name, seconds, nbytes)
        return engine

    def _park(self, job: str) -> tuple[float, int]:
        """The timeslicer asks (park thread): move a full run's copy to host memory, or put a
        base engine that can sleep to sleep."""
        with self._state:
            if "/base/" in job:
                engine = self._engines.get(job.split("/base/", 1)[1])
                return engine.park() if getattr(engine, "can_sleep", False) else (0.0, 0)
            return self.full_runs.park(job.split("/run/", 1)[1])

    def _job(self, engine, base_model: str, event: Event, in_use: set[str]) -> SampleJob:
        data = event.data
        adapter_key = None
        if data.adapter:
            weights = data.adapter[ADAPTER_WEIGHTS]
            adapter_key = f"{event.tenant}:{weights.sha256}"
            loaded = self._adapters[self.models.canonical(base_model)]  # per engine, which aliases share
            run = f"{event.tenant}:{data.run_id}" if data.run_id else None
            if not engine.has_adapter(adapter_key):
                self._evict(engine, loaded, in_use, run)
                files = {name: self.blobs.get(event.tenant, ref) for name, ref in data.adapter.items()}
                engine.load_adapter(adapter_key, files)
            loaded[adapter_key] = run
            loaded.move_to_end(adapter_key)
            in_use.add(adapter_key)
        return SampleJob(
            prompt_tokens=list(data.prompt_tokens),
            num_samples=data.num_samples,
            params=data.sampling_params,
            prompt_logprobs=data.prompt_logprobs,
            topk_prompt_logprobs=data.topk_prompt_logprobs,
            prompt_logprobs_last_n=data.prompt_logprobs_last_n,
            adapter=adapter_key,
            record_stability_info=data.record_stability_info,
            **scoring_fields(data, self.models.files(base_model).vocab_size),
        )

    def _evict(self, engine, loaded: OrderedDict, in_use: set[str], run: Optional[str]) -> None:
        """Make room for one more adapter of `run`: first its run's older idle versions past
        `max_run_versions`, then the least recently used idle ones past `max_adapters`."""
        if run is not None:
            same_run = [key for key, owner in loaded.items() if owner == run]
            for key in same_run[: max(0, len(same_run) - self.max_run_versions + 1)]:
                if key not in in_use:
                    engine.drop_adapter(key)
                    del loaded[key]
        for key in list(loaded):
            if len(loaded) < self.max_adapters:
                return
            if key not in in_use:
                engine.drop_adapter(key)
                del loaded[key]

    def _completion(self, event: Event, result: SampleResult, lease: Optional[int] = None):
        """The completion event of a sample and its topic, for `publish_many`."""
        payload = {
            "sequences": [
                {"tokens": list(s.tokens), "logprobs": [float(x) for x in s.logprobs], "stop_reason": s.stop_reason}
                for s in result.sequences
            ],
            "prompt_logprobs": result.prompt_logprobs,
            "topk_prompt_logprobs": [
                [list(pair) for pair in row] if row is not None else None for row in result.topk_prompt_logprobs
            ]
            if result.topk_prompt_logprobs is not None
            else None,
        }
        if event.data.record_stability_info:
            payload["stability"] = stability_entry(event.data.prompt_tokens, result)
        add_scoring_results(payload, event.data, result)
        return self._reply(
            event, SAMPLE["completed"], RequestCompleted(request_id=event.data.request_id, result=payload), lease
        )

    def _cancel(self, event: Event) -> None:
        """A cancel reached the log before this batch took its request: never run it.

        A cancel that arrives after its request was taken into a batch finds nothing to do
        here (the request ran, or is running) and that sample completes as usual.
        """
        self._emit(event, SAMPLE_CANCELLED, SampleCancelled(request_id=event.data.request_id))

    def _fail(self, event: Event, exc: Exception) -> None:
        if isinstance(exc, OpenRLError):
            error, category = exc.detail, exc.category
        else:
            log.exception("sampler: request failed")
            error, category = f"{type(exc).__name__}: {exc}", "server"
        self._emit(
            event, SAMPLE["failed"], RequestFailed(request_id=event.data.request_id, error=error, category=category)
        )

    def _emit(self, request: Event, type_: str, payload, lease: Optional[int] = None) -> None:
        self.publisher.publish(*self._reply(request, type_, payload, lease))

    def _reply(self, request: Event, type_: str, payload, lease: Optional[int] = None):
        reply = new_event(
            type_,
            payload,
            tenant=request.tenant,
            source=SOURCE,
            key=request.key,
            subject=payload.request_id,
            lease=lease,
        )
        return topics.topic(request.tenant, "completions"), reply, None


def _member(event: Event) -> str:
    """Who a sample belongs to for the cohort: its training run (an RL loop samples each
    step from a new sampling session of the same run), else its sampling session."""
    return event.data.run_id or event.data.sampling_session_id


def engine_options(settings) -> dict:
    """The sampling engine a worker uses, from the process settings (SamplerWorker kwargs)."""
    if settings.sampler_engine != "vllm":
        return {"engine": settings.sampler_engine}
    from functions.sampler.vllm_engine import VllmOptions

    return {"engine": "vllm", "vllm": VllmOptions.from_settings(settings, settings.device)}
