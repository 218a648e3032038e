"""The sampler worker: batches every pending sample request of a base model into one run.

Each poll takes whatever requests are waiting (up to the batch's row budget), loads any
adapter they name (cached by content hash, so publishing new weights is just a new key),
checks each request on its own (a bad one fails alone), and runs the rest as one batched
generation on the accelerator. Sampling requests have no order, so offsets are committed
as soon as their completions are on the log. A sample whose cancel arrives in the same
poll as the request (the two share the sampling session's partition, cancel after request)
is answered CANCELLED and never runs; one already taken into a batch runs to the end.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, defaultdict
from typing import Optional

from eventing import topics
from eventing.blobs import BlobStore
from eventing.bus import EventBus, EventPublisher
from functions.compute.accelerator import AcceleratorTurns
from functions.compute.models import ModelDirectory
from functions.sampler.types import SampleJob, SampleResult
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
        turns: Optional[AcceleratorTurns] = None,
        device: str = "cpu",
        max_batch_rows: int = 64,
        max_adapters: int = 16,
        linger: float = 0.02,
        group: str = "openrl-sampler",
        base_models: Optional[list[str]] = None,
        instance_id: Optional[str] = None,
    ) -> None:
        self.publisher = publisher
        self.blobs = blobs
        self.models = models
        self.turns = turns or AcceleratorTurns()
        self.device = device
        self.max_batch_rows = max_batch_rows
        self.max_adapters = max_adapters
        self.linger = linger
        self.consumer = bus.consumer(group, pattern=topics.pattern("sampling", base_models), instance_id=instance_id)
        self._engines: dict = {}
        # Adapters loaded per base model, least recently used first. Every published version
        # of every tenant's weights is a new key, so without eviction memory only grows.
        self._adapters: dict[str, OrderedDict[str, None]] = defaultdict(OrderedDict)

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
        # Requests a client sends together reach the log a few milliseconds apart; waiting a
        # moment for the rest turns them into one batch instead of one batch each.
        while records and len(records) < self.max_batch_rows:
            more = self.consumer.poll(max_records=self.max_batch_rows - len(records), timeout=self.linger)
            if not more:
                break
            records += more
        requested: list[Event] = []
        cancelled: set[str] = set()
        for record in records:
            try:
                event = self.publisher.codec.decode(record.message)
            except Exception:
                log.exception("sampler: undecodable record %s/%s@%s skipped", record.topic, record.partition, record.offset)
                continue
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
        for base_model, events in by_model.items():
            self._sample(base_model, events)
        if records:
            self.consumer.commit()
        return len(records)

    def engine(self, base_model: str):
        key = self.models.canonical(base_model)  # an alias shares its target's base weights
        if key not in self._engines:
            from functions.sampler.engine import SamplerEngine

            self._engines[key] = SamplerEngine(
                self.models.files(base_model), device=self.device, max_batch_rows=self.max_batch_rows
            )
        return self._engines[key]

    def _sample(self, base_model: str, events: list[Event]) -> None:
        try:
            engine = self.engine(base_model)
        except Exception as exc:
            for event in events:
                self._fail(event, exc)
            return
        jobs: list[tuple[Event, SampleJob]] = []
        in_use: set[str] = set()
        for event in events:
            try:
                job = self._job(engine, base_model, event, in_use)
                engine.validate(job)
                jobs.append((event, job))
            except Exception as exc:
                self._fail(event, exc)
        if not jobs:
            return
        try:
            with self.turns.turn():
                results = engine.sample([job for _event, job in jobs])
        except Exception as exc:
            for event, _job in jobs:
                self._fail(event, exc)
            return
        for (event, _job), result in zip(jobs, results):
            self._complete(event, result)

    def _job(self, engine, base_model: str, event: Event, in_use: set[str]) -> SampleJob:
        data = event.data
        adapter_key = None
        if data.adapter:
            weights = data.adapter[ADAPTER_WEIGHTS]
            adapter_key = f"{event.tenant}:{weights.sha256}"
            loaded = self._adapters[self.models.canonical(base_model)]  # per engine, which aliases share
            if not engine.has_adapter(adapter_key):
                self._evict(engine, loaded, in_use)
                files = {name: self.blobs.get(event.tenant, ref) for name, ref in data.adapter.items()}
                engine.load_adapter(adapter_key, files)
            loaded[adapter_key] = None
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
        )

    def _evict(self, engine, loaded: OrderedDict, in_use: set[str]) -> None:
        """Make room for one more adapter, dropping the least recently used idle ones."""
        for key in list(loaded):
            if len(loaded) < self.max_adapters:
                return
            if key not in in_use:
                engine.drop_adapter(key)
                del loaded[key]

    def _complete(self, event: Event, result: SampleResult) -> None:
        payload = {
            "sequences": [
                {"tokens": list(s.tokens), "logprobs": [float(x) for x in s.logprobs], "stop_reason": s.stop_reason}
                for s in result.sequences
            ],
            "prompt_logprobs": result.prompt_logprobs,
            "topk_prompt_logprobs": [[list(pair) for pair in row] if row is not None else None for row in result.topk_prompt_logprobs]
            if result.topk_prompt_logprobs is not None
            else None,
        }
        self._emit(event, SAMPLE["completed"], RequestCompleted(request_id=event.data.request_id, result=payload))

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
        self._emit(event, SAMPLE["failed"], RequestFailed(request_id=event.data.request_id, error=error, category=category))

    def _emit(self, request: Event, type_: str, payload) -> None:
        reply = new_event(type_, payload, tenant=request.tenant, source=SOURCE, key=request.key, subject=payload.request_id)
        self.publisher.publish(topics.topic(request.tenant, "completions"), reply)
