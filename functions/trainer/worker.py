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

This module holds the loop (poll, order, schedule the turns). The worker's other parts are
mixins over the same state, one module each: `turns` (running a model's requests in a turn
and answering them), `residency` (engines, timeslicer jobs, park, restore, release, cancel)
and `handlers` (the request verbs); `packer` runs several models' requests as shared passes.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from eventing import topics
from eventing.blobs import BlobStore
from eventing.bus import EventBus, EventPublisher, Record
from eventing.offsets import OffsetTracker
from functions.compute import host_memory
from functions.compute.models import ModelDirectory
from functions.timeslicer.client import TimeslicerClient
from functions.timeslicer.setup import device_name, private
from functions.trainer.handlers import Handlers
from functions.trainer.packer import Packer
from functions.trainer.recovery import ModelSlot, Recovery, position
from functions.trainer.residency import Residency
from functions.trainer.snapshots import SnapshotStore
from functions.trainer.turns import SOURCE, Turns
from openrl_core.errors import NotFound
from openrl_core.events import Event, new_event
from openrl_core.events import training as te
from openrl_core.events.recovery import SNAPSHOT_TAKEN
from openrl_core.fairness import FairQueue

log = logging.getLogger(__name__)
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
    precision: str = "auto"  # trainer dtypes (precision.py): auto, float32 or bfloat16
    activation_checkpointing: bool = False
    full_shards: int = 1  # FSDP2 ranks of a full run (sharded.py); 1: FullFinetuneEngine on one device


class TrainerWorker(Turns, Residency, Handlers):
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
        for engine in self._full.values():
            getattr(engine, "close", lambda: None)()  # a sharded engine's rank processes

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

    # -- what the packer uses (`packer.PackHost`) ---------------------------------------

    @property
    def state(self) -> threading.Lock:
        return self._state

    def shared_turn(self, model_ids: list[str]):
        jobs = [self._job(model_id) for model_id in model_ids]
        return self.slicer.turn(jobs[0], also=tuple(jobs[1:]))

    def ensure_resident(self, model_id: str, turn) -> None:
        self._ensure_resident(model_id, turn)

    def take_arrived(self, model_id: str) -> list:
        return self._ready.pop(model_id, [])

    def run_ready(self, ready: list, turn=None, replies: Optional[list] = None) -> None:
        self._run_ready(ready, turn, replies)

    def fail(self, event: Event, exc: Exception) -> None:
        self._fail(event, exc)

    def lose(self, model_id: str) -> None:
        self._lost.add(model_id)
        self._forget(model_id)
