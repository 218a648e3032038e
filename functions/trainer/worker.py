"""The trainer worker: consumes every tenant's training topics and applies them to the engines.

Three verbs per loop: poll the log, order each model's requests through its `SeqGate`,
execute what is ready on the accelerator and emit one completion (or failure) per request.
Ready work runs one model per turn, round-robin across tenants (`openrl_core.fairness`), and
requests that arrive between turns join the queue, so one tenant's many models do not make
another tenant's one model wait for all of them.
A model's state (LoRA adapter on the shared base, or a full run's own weights; gradients;
optimizer) lives in an engine; the worker keeps its gate. A request that fails answers its
own future with `{error, category}` and never fails its neighbours. Offsets are committed
up to the oldest record still held by a gate.

The accelerator is shared through the node's timeslicer: every model is a job, registered
with the bytes it keeps resident; each request runs inside a turn of its model's job, on a
model restored first if it was parked. The work's completion carries the lease it ran under
(`Turn.confirm`), so the event store refuses it if that lease was fenced meanwhile. The
timeslicer's park requests arrive on another thread and take the same state lock as the
compute, so a model is never moved while it is being used.

A cancelled run (`training.run.cancelled`, on the run's own topic and key, so after all its
earlier requests) loses everything it held here: requests still waiting, adapter or weights
and optimizer state, its timeslicer job; any later event of it is ignored.

A run that sent nothing for `release_idle_seconds` is released (`openrl_core.eviction`): at a
clean point, once a durable snapshot covers everything it applied (one is taken first if
needed), its state and timeslicer job go, and its next request restores it from that
snapshot as a replacement trainer would. So memory holds the runs in use, not every run
this trainer ever served.

A fork (`training.fork.requested`) arrives like a create_model, on the new run's key: the
run is rebuilt as the event says (`forks`: the parent's snapshot or creation, then its
logged requests) and saved with its optimizer as the fork's first checkpoint.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Optional

import numpy as np

from eventing import topics
from eventing.blobs import BlobStore
from eventing.bus import EventBus, EventPublisher, Record
from eventing.offsets import OffsetTracker
from eventing.store.projections import expiry
from functions.compute import host_memory
from functions.compute.models import ModelDirectory
from functions.compute.weight_sync import MANIFEST
from functions.timeslicer.client import Fenced, TimeslicerClient
from functions.timeslicer.setup import device_name, private
from functions.trainer import forks
from functions.trainer.packer import Packer
from functions.trainer.recovery import ModelSlot, Recovery, position
from functions.trainer.snapshots import SnapshotStore
from openrl_core.datum import validate_batch
from openrl_core.errors import InvalidRequest, NotFound, OpenRLError
from openrl_core.events import Event, new_event
from openrl_core.events import training as te
from openrl_core.events.base import event_type
from openrl_core.events.lifecycle import CheckpointSaved, RequestCompleted, RequestFailed, SamplingSessionBound
from openrl_core.events.recovery import SNAPSHOT_TAKEN
from openrl_core.eviction import Action, RunFacts, decide
from openrl_core.fairness import FairQueue
from openrl_core.seqgate import SeqGate
from openrl_core.tensors import Array

log = logging.getLogger(__name__)
SOURCE = "/openrl/trainer"
KINDS = ("lora", "full")
# While a loop keeps taking in requests that arrive during its turns, it commits this often.
ABSORB_SECONDS = 1.0


@dataclass(frozen=True)
class TrainerOptions:
    """How one trainer serves: which runs, and how full runs publish to samplers."""

    kinds: tuple[str, ...] = KINDS  # lora: the shared-base adapters; full: full fine-tuning runs
    only_model: Optional[str] = None  # serve one run only (a per-run StatefulSet)
    serving_dtype: str = "bfloat16"
    delta_full_every: int = 20
    delta_max_share: float = 0.5
    pack: bool = True  # several LoRA models' forward_backward requests share passes
    pack_linger: float = 0.005  # seconds a poll waits for more requests while several LoRA models train
    cohort_wait: float = 0.1  # and at most this long for the models active lately that sent nothing yet
    pack_max_tokens: int = 8192  # padded tokens in one pass (see openrl_core.packing)
    pack_max_rows: int = 256
    pack_max_shared_bytes: int = 1 << 30  # estimated activations of a pass several models share
    release_memory: bool = True  # give the pass's freed activations back to the system (`host_memory`)
    release_idle_seconds: float = 1.0  # once the process has been idle this long
    release_runs_after: float = 0.0  # seconds without a request before a run's state is released (0: never)


class TrainerWorker:
    def __init__(
        self,
        bus: EventBus,
        publisher: EventPublisher,
        blobs: BlobStore,
        models: ModelDirectory,
        slicer: Optional[TimeslicerClient] = None,
        device: str = "cpu",
        group: str = "openrl-trainer",
        base_models: Optional[list[str]] = None,
        snapshots: Optional[SnapshotStore] = None,
        snapshot_every_steps: int = 0,
        instance_id: Optional[str] = None,
        options: TrainerOptions = TrainerOptions(),
    ) -> None:
        self.publisher = publisher
        self.blobs = blobs
        self.models = models
        self.device = device
        self.options = options
        self.instance = instance_id or group
        self.slicer = slicer or private(self.instance)
        self.slicer.on_park = self._park
        self.slicer_device = device_name(device)
        streams = [{"lora": "training", "full": "training-full"}[kind] for kind in options.kinds]
        pattern = "|".join(f"(?:{topics.pattern(stream, base_models)})" for stream in streams)
        # One trainer may serve every base model (embedded) or only some (one per GPU pool).
        self.consumer = bus.consumer(group, pattern=pattern, instance_id=instance_id)
        self.offsets = OffsetTracker()
        self.slots: dict[str, ModelSlot] = {}
        self.recovery = Recovery(snapshots, snapshot_every_steps)
        self._lora: dict = {}
        self._full: dict = {}
        # Models another worker took over (a replacement with this worker's identity): never
        # served here again, so a paused-then-resumed worker cannot take them back.
        self._lost: set[str] = set()
        self._cancelled: set[str] = set()  # runs cancelled: their state is dropped, their events ignored
        self._state = threading.Lock()  # compute, parking and restoring of any model
        self.packer = Packer(
            self,
            options.pack_linger if options.pack else 0.0,
            options.cohort_wait if options.pack else 0.0,
            enabled=options.pack,
        )
        self._ready: dict[str, list] = {}
        self._fair: FairQueue = FairQueue()  # this loop's turns not yet run
        self._postponed: list[Record] = []  # what a held turn's `absorb` left for after it
        self._handlers: dict[str, Callable[[Event], dict]] = {
            te.FORWARD_BACKWARD["requested"]: self._forward_backward,
            te.OPTIM_STEP["requested"]: self._optim_step,
            te.SAVE_WEIGHTS["requested"]: self._save_weights,
            te.SAVE_WEIGHTS_FOR_SAMPLER["requested"]: self._save_for_sampler,
            te.SAVE_WEIGHTS_EXTERNAL["requested"]: self._save_external,
            te.LOAD_WEIGHTS["requested"]: self._load_in_place,
        }

    # -- loop ----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once(timeout=0.5)
            except Exception:
                log.exception("trainer: batch failed")
                stop.wait(0.5)
        self.recovery.close()
        self.consumer.close()

    def run_once(self, timeout: float = 1.0) -> int:
        records = self.consumer.poll(max_records=64, timeout=timeout)
        if records:
            with host_memory.working():
                records = self._work(records)
        elif self.options.release_memory:
            # Idle: give back what the passes freed, once the whole process has been idle a
            # moment (`host_memory`). Not after every pass: on SmolLM2 (8 x 128 tokens) a trim
            # took ~0.6 s of a ~4 s step, on the path of the request waiting behind it
            # (bench/fwdbwd_roundtrip.py: 1.08x vs 0.95x); nor at every idle poll: an RL
            # loop's trainer is idle while its samples run, and re-faulting a pass's pages
            # every step cost ~0.5 s a pass.
            host_memory.release_if_idle(self.options.release_idle_seconds)
        self._settle(bool(records))
        if not records:
            self._release_idle_runs()
        return len(records)

    def _work(self, records: list) -> list:
        """Run what `records` (and what arrives meanwhile) make ready; the records polled."""
        if self.packer.should_linger():
            # Several LoRA models are training: a moment more gathers their requests into
            # shared passes. The SDKs send them a few milliseconds apart (`linger`), and the
            # models active lately that have nothing here yet may be a few tens of
            # milliseconds behind (`cohort_wait`, which ends once each has sent).
            deadline = time.monotonic() + self.packer.cohort_wait
            while True:
                now = time.monotonic()
                waiting = self.packer.cohort.waits(
                    {r.message.key.decode() for r in records if r.message.key}, now, deadline
                )
                more = self.consumer.poll(max_records=64, timeout=(deadline - now) if waiting else self.packer.linger)
                if not more and not waiting:
                    break
                records += more
        # Everything of a model that this poll makes ready runs in one turn of its job (a
        # forward_backward and the optim_step the SDK sent right after it, say): fewer
        # switches, fewer parks, and one model's step is not interleaved with others'.
        self._ready: dict[str, list] = {}
        for record in records:
            self.offsets.polled(record)
            self._receive(record)
        ready, self._ready = self._ready, {}
        for base, members in self.packer.take(ready).items():
            self.packer.run(base, members, ready)
        self._receive_postponed()
        for model_id, items in self._ready.items():  # what a packed turn took in and left
            ready.setdefault(model_id, []).extend(items)
        self._ready = {}
        self._run_fairly(ready)
        return records

    def _settle(self, polled: bool) -> None:
        settled = self.recovery.settle(self.slots)
        for tenant, snapshot in settled:
            event = new_event(SNAPSHOT_TAKEN, snapshot, tenant=tenant, source=SOURCE, key=snapshot.model_id)
            self.publisher.publish(topics.topic(tenant, "completions"), event)
        if polled or settled:
            # Never past a record a gate still holds or a turn has not run yet, nor past what a
            # model's latest durable snapshot lacks: a replacement trainer must see those again.
            # Without waiting for them to be durable, unless a snapshot just settled: what they
            # cover is answered on the log already, and a replacement that finds them older only
            # sees some records again, which the seq gates absorb; past a new snapshot they are
            # made durable at once, so a replacement starts from that snapshot's anchor.
            self.consumer.commit(self.offsets.committable(self.recovery.anchors(self.slots)), wait=bool(settled))

    def _receive(self, record: Record) -> None:
        try:
            event = self.publisher.codec.decode(record.message)
        except Exception:
            log.exception("trainer: undecodable record %s/%s@%s skipped", record.topic, record.partition, record.offset)
            return
        model_id = getattr(event.data, "model_id", None)
        if self.options.only_model is not None and model_id != self.options.only_model:
            return  # another run's trainer serves it
        if model_id in self._lost or model_id in self._cancelled:
            return  # its replacement answers it; or it was cancelled, and its futures with it
        if event.type == te.RUN_CANCELLED:
            self._cancel(model_id)
            return
        full = record.topic.split(".")[2] == "training-full"
        creates = event.type == te.CREATE_MODEL["requested"] or (
            event.type == te.LOAD_WEIGHTS["requested"] and event.data.seq_id is None
        )
        if creates or event.type == te.FORK["requested"]:
            handler = self._create if creates else self._fork
            self._execute(event, handler, model_id, create=(full, event.data.base_model, event.data.lora_config))
            slot = self.slots.get(model_id)
            if slot is not None and slot.anchor is None and slot.gate.next_seq == 1:
                slot.anchor = position(record)  # no snapshot yet: recovery starts at creation
            return
        if event.type == te.SEQ_SKIPPED:
            slot = self.slots.get(model_id)
            if slot is not None:
                self._queue(model_id, slot.gate.skip(event.data.seq_id))
            return
        handler = self._handlers.get(event.type)
        if handler is None:
            return
        slot = self.slots.get(model_id) or self._restore(event.tenant, model_id)
        if slot is None:
            self._fail(event, NotFound(f"model {model_id!r} is not loaded on this trainer"))
            return
        self.packer.saw(model_id)
        offer = slot.gate.offer(event.data.seq_id, (record, event))
        if offer.duplicate:
            return  # already applied (a redelivery); its completion was emitted then
        if not offer.ready:
            self.offsets.hold(record)
        self._queue(model_id, offer.ready)

    def _run_fairly(self, ready: dict[str, list]) -> None:
        """Each model's ready requests in a turn of its own, round-robin across tenants, then
        models (`openrl_core.fairness`). Between turns, while others still wait, what arrived
        meanwhile joins the queue: a light tenant's request waits for about one turn of each
        other tenant, not for every model a heavy tenant has queued. Under a steady flood the
        queue may never empty, so offsets are committed (and snapshots settled) every
        ABSORB_SECONDS on the way; a queued request's record is held until its turn runs, so
        no commit passes it."""
        fair = self._fair = FairQueue()

        def enqueue(batch: dict[str, list]) -> None:
            for model_id, items in batch.items():
                if items:
                    for _seq, (record, _event) in items:
                        self.offsets.hold(record)  # released as its turn runs (or is dropped)
                    fair.add(items[0][1][1].tenant, model_id, items)

        enqueue(ready)
        deadline = time.monotonic() + ABSORB_SECONDS
        while (turn := fair.pop()) is not None:
            _tenant, model_id, items = turn
            if model_id in self.slots:
                self._run_ready(items)
            else:  # taken over or cancelled since it was queued: its requests are answered elsewhere
                for _seq, (record, _event) in items:
                    self.offsets.release(record.topic, record.partition, record.offset)
            if len(fair):
                self.absorb()
                arrived, self._ready = self._ready, {}
                enqueue(arrived)
                if time.monotonic() >= deadline:
                    self._settle(True)
                    deadline = time.monotonic() + ABSORB_SECONDS

    def absorb(self, in_turn: bool = False) -> None:
        """Take what reached the log since the last poll into the ready queues, without waiting.

        `in_turn`: called inside a turn this thread holds (a packed pass's). A record that
        needs a turn of its own (a run's creation or fork, a model to restore) would wait there
        for the device this thread holds, forever, and a cancellation would drop a model of the
        pass in the middle of it: such a record and every one after it (their order kept) are
        held back for `_receive_postponed` once the turn is over."""
        for record in self.consumer.poll(max_records=64, timeout=0):
            self.offsets.polled(record)
            if in_turn and (self._postponed or self._after_the_turn(record)):
                self.offsets.hold(record)  # no commit passes it before it is received
                self._postponed.append(record)
            else:
                self._receive(record)

    def _after_the_turn(self, record: Record) -> bool:
        try:
            event = self.publisher.codec.decode(record.message)
        except Exception:
            return False  # `_receive` logs and skips it
        creates = event.type == te.CREATE_MODEL["requested"] or (
            event.type == te.LOAD_WEIGHTS["requested"] and event.data.seq_id is None
        )
        restores = event.type in self._handlers and getattr(event.data, "model_id", None) not in self.slots
        return creates or restores or event.type in (te.FORK["requested"], te.RUN_CANCELLED)

    def _receive_postponed(self) -> None:
        postponed, self._postponed = self._postponed, []
        for record in postponed:
            self.offsets.release(record.topic, record.partition, record.offset)
            self._receive(record)

    def _queue(self, model_id: str, ready: list) -> None:
        if ready:
            self._ready.setdefault(model_id, []).extend(ready)

    def _run_ready(self, ready: list, turn=None, replies: Optional[list] = None) -> None:
        """A model's ready requests, in seq order, in one turn (`turn`: one already held that
        covers its job, as a packed pass's turn does; `replies`: where to leave the answers
        for the caller to publish, instead of publishing each at once)."""
        items = []
        for seq_id, (record, event) in ready:
            self.offsets.release(record.topic, record.partition, record.offset)
            model_id = event.data.model_id
            slot = self.slots[model_id]

            # Recovery's bookkeeping happens as each request runs, in order: a snapshot taken
            # after an optim_step must see the requests after it as not yet covered.
            def before(slot=slot, where=position(record), gradients=_accumulates(event)):
                slot.applied(where)
                if gradients:
                    slot.clean = False  # even if it fails midway: its gradients are unknown

            after = None
            if event.type == te.OPTIM_STEP["requested"]:
                # A clean point (no gradients pending): the one place a snapshot may be taken,
                # in the same turn, before anything later runs.
                def after(slot=slot, seq_id=seq_id, model_id=model_id):
                    self.recovery.after_optim_step(model_id, slot, seq_id, self._engine(slot).copy_state)

            items.append((event, self._handlers[event.type], before, after))
        if items:
            self._execute_all(items[0][0].data.model_id, items, turn, replies)

    def _execute(self, event: Event, handler: Callable[[Event], dict], model_id: str, create=None) -> None:
        if create is not None and not self.slicer.registered(self._job(model_id)):
            try:
                self._register(model_id, *create)
            except Exception as exc:
                self._fail(event, exc)
                return
        self._execute_all(model_id, [(event, handler, None, None)])

    def _execute_all(self, model_id: str, items: list, turn=None, replies: Optional[list] = None) -> None:
        """Run requests of one model in one turn of its job (or in `turn`, held already);
        emit each one's completion (under the lease confirmed after it) or failure. A failure
        is its request's alone."""
        answered = [0]
        try:
            if turn is None:
                with self.slicer.turn(self._job(model_id)) as own:
                    self._run_items(model_id, items, own, answered, replies)
            else:
                self._run_items(model_id, items, turn, answered, replies)
        except Fenced as fenced:
            log.error("trainer: %s was taken over by another worker (%s); dropping it here", model_id, fenced.detail)
            self._lost.add(model_id)
            self._forget(model_id)
        except Exception as exc:  # no turn (the timeslicer refused): the unanswered requests say so
            for event, *_ in items[answered[0] :]:
                self._fail(event, exc)

    def _run_items(self, model_id: str, items: list, turn, answered: list[int], replies: Optional[list] = None) -> None:
        for event, handler, before, after in items:
            if before is not None:
                before()
            try:
                with self._state:
                    started = datetime.now(timezone.utc)
                    self._ensure_resident(model_id, turn)
                    outcome = with_started(handler(event), started)
                    if event.type in _CLEANS and (slot := self.slots.get(model_id)) is not None:
                        slot.clean = True  # the step (or the load) consumed the gradients
                    if after is not None:
                        after()
            except Exception as exc:  # reported on its own future
                self._fail(event, exc)
                answered[0] += 1
                continue
            lease = turn.confirm()  # outside the state lock: it may wait for a new turn
            reply = self.reply(event, "completed", RequestCompleted(request_id=event.data.request_id, **outcome), lease)
            if replies is None:
                self.publisher.publish(*reply)
            else:
                replies.append(reply)
            answered[0] += 1

    def _fail(self, event: Event, exc: Exception) -> None:
        if isinstance(exc, OpenRLError):
            error, category = exc.detail, exc.category
        else:
            log.exception("trainer: %s failed", event.type)
            error, category = f"{type(exc).__name__}: {exc}", "server"
        self._emit(event, "failed", RequestFailed(request_id=event.data.request_id, error=error, category=category))

    def _emit(self, request: Event, phase: str, payload, lease: Optional[int] = None) -> None:
        self.publisher.publish(*self.reply(request, phase, payload, lease))

    def reply(self, request: Event, phase: str, payload, lease: Optional[int] = None):
        """(topic, event, dedup) of a request's answer, for `publish` or `publish_many`."""
        type_ = event_type(request.family, request.verb, phase)
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

    # -- engines and the timeslicer -------------------------------------------------------

    def engine(self, base_model: str):
        """The LoRA engine of a base model (an alias shares its target's base weights)."""
        key = self.models.canonical(base_model)
        if key not in self._lora:
            from functions.trainer.engine import TrainerEngine

            engine = TrainerEngine(
                self.models.files(base_model), device=self.device,
                max_padded_tokens=self.options.pack_max_tokens, max_rows=self.options.pack_max_rows,
                max_shared_pass_bytes=self.options.pack_max_shared_bytes,
            )  # fmt: skip
            # The frozen base is resident for as long as this worker lives: it never parks.
            self.slicer.register(
                f"{self.instance}/base/{key}", engine.base_bytes(), self.slicer_device, parkable=False, resident=True
            )
            self._lora[key] = engine
        return self._lora[key]

    def full_engine(self, base_model: str):
        key = self.models.canonical(base_model)
        if key not in self._full:
            from functions.trainer.full import FullFinetuneEngine

            self._full[key] = FullFinetuneEngine(
                self.models.files(base_model), device=self.device, serving_dtype=self.options.serving_dtype,
                full_every=self.options.delta_full_every, max_share=self.options.delta_max_share,
            )  # fmt: skip
        return self._full[key]

    def _engine(self, slot: ModelSlot):
        return self.full_engine(slot.base_model) if slot.full else self.engine(slot.base_model)

    def _job(self, model_id: str) -> str:
        """A model's timeslicer job: named after this worker (its pod name first, which is how
        the scheduler knows its own) so a replacement with the same identity takes it over."""
        return f"{self.instance}/model/{model_id}"

    def _register(self, model_id: str, full: bool, base_model: str, lora=None) -> None:
        if full:
            nbytes = self.full_engine(base_model).state_bytes_estimate()
        else:
            from openrl_core.params import LoraConfig

            nbytes = self.engine(base_model).adapter_bytes_estimate(lora or LoraConfig(rank=32))
        self.slicer.register(
            self._job(model_id), nbytes, self.slicer_device, parkable=True, resident=False, group=model_id
        )

    def _ensure_resident(self, model_id: str, turn) -> None:
        slot = self.slots.get(model_id)
        if slot is None:
            return  # being created: nothing to restore
        engine = self._engine(slot)
        if engine.is_parked(model_id):
            seconds, nbytes = engine.restore(model_id)
            self.slicer.report_restored(self._job(model_id), seconds, nbytes)

    def _park(self, job: str) -> tuple[float, int]:
        """The timeslicer asks: move this model's state to host memory (park thread)."""
        model_id = job.split("/model/", 1)[1]
        with self._state:
            slot = self.slots.get(model_id)
            if slot is None:
                return 0.0, 0
            seconds, nbytes = self._engine(slot).park(model_id)
        log.info("trainer: parked %s (%.1f MB in %.3f s)", model_id, nbytes / 1e6, seconds)
        return seconds, nbytes

    def _cancel(self, model_id: str) -> None:
        """The run was cancelled: drop what it held here (its requests waiting for a seq gap,
        those ready in this poll, its adapter or weights with their optimizer state, its
        timeslicer job). Its futures were already failed by the cancellation's projection."""
        self._cancelled.add(model_id)
        slot = self.slots.get(model_id)
        queued = self._ready.pop(model_id, []) + self._fair.discard(model_id)
        waiting = (slot.gate.discard() if slot is not None else []) + [item for _seq, item in queued]
        for record, _event in waiting:
            self.offsets.release(record.topic, record.partition, record.offset)
        self._drop(model_id)
        log.info("trainer: %s was cancelled; dropped its state and %d request(s) not yet run", model_id, len(waiting))

    def _release_idle_runs(self) -> None:
        """Release the runs idle for `release_runs_after` (see the module docstring)."""
        after = self.options.release_runs_after
        if after <= 0 or self.recovery.snapshotter is None:
            return  # without snapshots a released run could not come back
        now = time.monotonic()
        for model_id, slot in list(self.slots.items()):
            facts = RunFacts(
                idle_seconds=now - slot.last_active, clean=slot.clean, busy=bool(slot.gate.held),
                snapshot_in_flight=slot.pending_seq is not None, covered=slot.covered,
            )  # fmt: skip
            action = decide(facts, after)
            if action is Action.SNAPSHOT:
                with self.slicer.turn(self._job(model_id)) as turn:
                    with self._state:
                        self._ensure_resident(model_id, turn)
                        self.recovery.snapshot_now(model_id, slot, self._engine(slot).copy_state)
            elif action is Action.RELEASE:
                self._drop(model_id)
                log.info(
                    "trainer: released %s after %.0f s idle; its next request restores its snapshot",
                    model_id,
                    facts.idle_seconds,
                )

    def _drop(self, model_id: str) -> None:
        """Everything this worker holds of a run: its state, its timeslicer job, its cohort place."""
        with self._state:
            self._forget(model_id)
        if self.slicer.registered(self._job(model_id)):
            self.slicer.unregister(self._job(model_id))
        self.packer.forget(model_id)

    def _forget(self, model_id: str) -> None:
        slot = self.slots.pop(model_id, None)
        if slot is None:
            return
        engine = self._engine(slot)
        if slot.full:
            engine.drop(model_id)
        elif engine.has_adapter(model_id):
            engine.drop_adapter(model_id)

    # -- verbs ---------------------------------------------------------------------------

    def _restore(self, tenant: str, model_id: str, locked: bool = False) -> Optional[ModelSlot]:
        """Rebuild a model this trainer does not hold from its latest snapshot, if it has one."""
        snapshot = self.recovery.latest(tenant, model_id)
        if snapshot is None:
            return None
        full = bool(snapshot.full_finetune)
        files = self.recovery.files(tenant, snapshot)

        def load():
            if full:
                self.full_engine(snapshot.base_model).import_state(model_id, files, with_optimizer=True)
            else:
                self.engine(snapshot.base_model).import_state(model_id, files, with_optimizer=True)

        if locked:
            load()
        else:
            if not self.slicer.registered(self._job(model_id)):
                self._register(model_id, full, snapshot.base_model, snapshot.lora_config)
            with self.slicer.turn(self._job(model_id)):
                with self._state:
                    load()
        slot = ModelSlot(
            tenant,
            snapshot.base_model,
            snapshot.session_id,
            snapshot.lora_config,
            gate=SeqGate(snapshot.next_seq),
            full=full,
        )
        self.slots[model_id] = slot
        log.info("trainer: restored %s from its snapshot at seq %d", model_id, snapshot.next_seq - 1)
        return slot

    def _slot(self, event: Event) -> ModelSlot:
        slot = self.slots.get(event.data.model_id)
        if slot is None or slot.tenant != event.tenant:
            raise NotFound(f"model {event.data.model_id!r} is not loaded on this trainer")
        return slot

    def _create(self, event: Event) -> dict:
        data = event.data
        full = bool(data.full_finetune)
        if data.model_id not in self.slots and self._restore(event.tenant, data.model_id, locked=True) is None:
            if full:
                engine = self.full_engine(data.base_model)
                engine.create(data.model_id)
            else:
                engine = self.engine(data.base_model)
                engine.create_adapter(data.model_id, data.lora_config, optimizer_family(data))
            if isinstance(data, te.LoadWeightsRequested):
                try:
                    engine.import_state(data.model_id, self._read(event.tenant, data.files), data.with_optimizer)
                except OpenRLError:
                    if full:
                        engine.drop(data.model_id)
                    else:
                        engine.drop_adapter(data.model_id)
                    raise
            self.slots[data.model_id] = ModelSlot(
                event.tenant, data.base_model, data.session_id, data.lora_config, full=full
            )
        if isinstance(data, te.LoadWeightsRequested):
            return {"result": {"path": data.path, "model_id": data.model_id, "type": "load_weights"}}
        return {"result": {"model_id": data.model_id, "type": "create_model"}}

    def _fork(self, event: Event) -> dict:
        """A new run rebuilt as another run's state at a step (see `forks`), then saved with its
        optimizer as the fork's first checkpoint, the path the SDK loads it from."""
        data = event.data
        full = bool(data.full_finetune)
        engine = self.full_engine(data.base_model) if full else self.engine(data.base_model)
        if data.model_id not in self.slots and self._restore(event.tenant, data.model_id, locked=True) is None:
            forks.rebuild(engine, data.model_id, data, lambda refs: self._read(event.tenant, refs), full)
            self.slots[data.model_id] = ModelSlot(
                event.tenant, data.base_model, data.session_id, data.lora_config, full=full
            )
        files = self._write(event.tenant, engine.export_state(data.model_id))
        checkpoint = CheckpointSaved(
            run_id=data.model_id,
            kind="weights",
            name=data.checkpoint_name,
            files=files,
            user_metadata=data.user_metadata,
        )
        result = {"model_id": data.model_id, "path": checkpoint.tinker_path, "type": "fork",
                  "snapshot_step": data.snapshot_step if data.snapshot is not None else None,
                  "replayed_requests": len(data.replay)}  # fmt: skip
        return {"result": result, "checkpoint": checkpoint}

    def _forward_backward(self, event: Event) -> dict:
        data = event.data
        slot = self._slot(event)
        files = self.models.files(slot.base_model)
        batch = [record.to_datum() for record in data.data]
        validate_batch(batch, data.loss_fn, files.vocab_size, files.max_context)
        output = self._engine(slot).forward_backward(
            data.model_id, batch, data.loss_fn, data.loss_fn_config, data.forward_only
        )
        return self.forward_backward_result(output, data)

    @staticmethod
    def forward_backward_result(output, request) -> dict:
        outputs = [{"logprobs": Array.from_numpy(lp).model_dump()} for lp in output.logprobs]
        # For the per-step metrics projection: what the step trained on (kept in the event only).
        tokens = sum(int(np.prod(record.tokens.shape)) for record in request.data)
        details = {"tokens": tokens, "forward_only": bool(request.forward_only)}
        result = {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs, "metrics": output.metrics}
        return {"result": result, "details": details}

    def _optim_step(self, event: Event) -> dict:
        slot = self._slot(event)
        if slot.full and event.data.dimuon_params is not None:
            raise InvalidRequest("full fine-tuning trains with AdamW; optim_step needs AdamParams")
        metrics = self._engine(slot).optim_step(event.data.model_id, event.data.params)
        return {"result": {"metrics": metrics}}

    def _save_weights(self, event: Event) -> dict:
        data = event.data
        slot = self._slot(event)
        files = self._write(event.tenant, self._engine(slot).export_state(data.model_id))
        checkpoint = _checkpoint(data, "weights", files, user_metadata=data.user_metadata)
        return {"result": {"path": checkpoint.tinker_path, "type": "save_weights"}, "checkpoint": checkpoint}

    def _save_for_sampler(self, event: Event) -> dict:
        data = event.data
        slot = self._slot(event)
        adapter = weights = None
        details = None
        if slot.full:
            publication = self.full_engine(slot.base_model).publish(
                data.model_id, data.seq_id, lambda content: self.blobs.put(event.tenant, content)
            )
            weights = publication.manifest
            files = {MANIFEST: weights, **{f"chain/{i:03d}": ref for i, ref in enumerate(publication.chain)}}
            details = {"publication": {k: v for k, v in publication.__dict__.items() if k not in ("manifest", "chain")}}
            log.info("trainer: %s published version %d as %s (%s): %d of %d elements changed, %d bytes",
                     data.model_id, data.seq_id, publication.kind, publication.reason, publication.changed,
                     publication.elements, publication.file_bytes)  # fmt: skip
        else:
            files = adapter = self._write(event.tenant, self.engine(slot.base_model).export_adapter(data.model_id))
        if data.name is not None:
            checkpoint = _checkpoint(data, "sampler_weights", files, user_metadata=data.user_metadata)
            result = {"path": checkpoint.tinker_path, "type": "save_weights_for_sampler"}
            return {"result": result, "checkpoint": checkpoint, "details": details}
        bound = SamplingSessionBound(
            sampling_session_id=data.sampling_session_id,
            session_id=slot.session_id,
            base_model=slot.base_model,
            adapter=adapter,
            weights=weights,
        )
        result = {"sampling_session_id": data.sampling_session_id, "type": "save_weights_for_sampler"}
        return {"result": result, "sampling_session": bound, "details": details}

    def _save_external(self, event: Event) -> dict:
        """LoRA: plain PEFT files; full: a Hugging Face model directory. For download."""
        data = event.data
        slot = self._slot(event)
        engine = self._engine(slot)
        exported = engine.export_external(data.model_id) if slot.full else engine.export_adapter(data.model_id)
        files = self._write(event.tenant, exported)
        checkpoint = _checkpoint(data, "external_weights", files)
        result = {"path": checkpoint.tinker_path, "size_bytes": checkpoint.size_bytes, "type": "save_weights_external"}
        return {"result": result, "checkpoint": checkpoint}

    def _load_in_place(self, event: Event) -> dict:
        data = event.data
        slot = self._slot(event)
        self._engine(slot).import_state(data.model_id, self._read(event.tenant, data.files), data.with_optimizer)
        return {"result": {"path": data.path, "model_id": data.model_id, "type": "load_weights"}}

    def _write(self, tenant: str, files: dict[str, bytes]):
        return {name: self.blobs.put(tenant, content) for name, content in files.items()}

    def _read(self, tenant: str, refs) -> dict[str, bytes]:
        return {name: self.blobs.get(tenant, ref) for name, ref in refs.items()}


# Requests after which a run holds no accumulated gradients.
_CLEANS = (te.OPTIM_STEP["requested"], te.LOAD_WEIGHTS["requested"])


def _accumulates(event: Event) -> bool:
    return event.type == te.FORWARD_BACKWARD["requested"] and not event.data.forward_only


def optimizer_family(data) -> str:
    """The optimizer a create (or create-via-load) event starts the model with."""
    return (getattr(data, "optimizer_config", None) or {}).get("type", "adamw")


def with_started(outcome: dict, started: datetime) -> dict:
    """Add when the work began to the completion's details (the step metrics' queue wait)."""
    return {**outcome, "details": {**(outcome.get("details") or {}), "started": started.isoformat()}}


def _checkpoint(data, kind: str, files: dict, **extra) -> CheckpointSaved:
    """The record of a named save request's files; its TTL counts from now."""
    return CheckpointSaved(
        run_id=data.model_id,
        kind=kind,
        name=data.name,
        files=files,
        expires_at=expiry(data.ttl_seconds, datetime.now(timezone.utc)),
        **extra,
    )
