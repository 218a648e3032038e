"""The trainer worker: consumes every tenant's training topic and applies it to the engine.

Three verbs per loop: poll the log, order each model's requests through its `SeqGate`,
execute what is ready on the accelerator and emit one completion (or failure) per request.
A model's state (adapter, gradients, optimizer) lives in the engine; the worker keeps only
its gate. A request that fails answers its own future with `{error, category}` and never
fails its neighbours. Offsets are committed up to the oldest record still held by a gate.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timezone
from typing import Callable, Optional

from eventing import topics
from eventing.blobs import BlobStore
from eventing.bus import EventBus, EventPublisher, Record
from eventing.offsets import OffsetTracker
from eventing.store.projections import expiry
from functions.compute.accelerator import AcceleratorTurns
from functions.compute.models import ModelDirectory
from functions.trainer.recovery import ModelSlot, Recovery, position
from functions.trainer.snapshots import SnapshotStore
from openrl_core.datum import validate_batch
from openrl_core.errors import NotFound, OpenRLError
from openrl_core.events import Event, new_event
from openrl_core.events import training as te
from openrl_core.events.base import event_type
from openrl_core.events.lifecycle import CheckpointSaved, RequestCompleted, RequestFailed, SamplingSessionBound
from openrl_core.events.recovery import SNAPSHOT_TAKEN
from openrl_core.seqgate import SeqGate
from openrl_core.tensors import Array

log = logging.getLogger(__name__)
SOURCE = "/openrl/trainer"


class TrainerWorker:
    def __init__(
        self,
        bus: EventBus,
        publisher: EventPublisher,
        blobs: BlobStore,
        models: ModelDirectory,
        turns: Optional[AcceleratorTurns] = None,
        device: str = "cpu",
        group: str = "openrl-trainer",
        base_models: Optional[list[str]] = None,
        snapshots: Optional[SnapshotStore] = None,
        snapshot_every_steps: int = 0,
        instance_id: Optional[str] = None,
    ) -> None:
        self.publisher = publisher
        self.blobs = blobs
        self.models = models
        self.turns = turns or AcceleratorTurns()
        self.device = device
        # One trainer may serve every base model (embedded) or only some (one per GPU pool).
        self.consumer = bus.consumer(group, pattern=topics.pattern("training", base_models), instance_id=instance_id)
        self.offsets = OffsetTracker()
        self.slots: dict[str, ModelSlot] = {}
        self.recovery = Recovery(snapshots, snapshot_every_steps)
        self._engines: dict = {}
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
        for record in records:
            self.offsets.polled(record)
            self._receive(record)
        settled = self.recovery.settle(self.slots)
        for tenant, snapshot in settled:
            event = new_event(SNAPSHOT_TAKEN, snapshot, tenant=tenant, source=SOURCE, key=snapshot.model_id)
            self.publisher.publish(topics.topic(tenant, "completions"), event)
        if records or settled:
            # Never past a record a gate still holds, nor past what a model's latest durable
            # snapshot lacks: a replacement trainer must see those again.
            self.consumer.commit(self.offsets.committable(self.recovery.anchors(self.slots)))
        return len(records)

    def _receive(self, record: Record) -> None:
        try:
            event = self.publisher.codec.decode(record.message)
        except Exception:
            log.exception("trainer: undecodable record %s/%s@%s skipped", record.topic, record.partition, record.offset)
            return
        if event.type in (te.CREATE_MODEL["requested"],) or (
            event.type == te.LOAD_WEIGHTS["requested"] and event.data.seq_id is None
        ):
            self._execute(event, self._create)
            slot = self.slots.get(event.data.model_id)
            if slot is not None and slot.anchor is None and slot.gate.next_seq == 1:
                slot.anchor = position(record)  # no snapshot yet: recovery starts at creation
            return
        if event.type == te.SEQ_SKIPPED:
            slot = self.slots.get(event.data.model_id)
            if slot is not None:
                self._run_ready(slot.gate.skip(event.data.seq_id))
            return
        handler = self._handlers.get(event.type)
        if handler is None:
            return
        slot = self.slots.get(event.data.model_id) or self._restore(event.tenant, event.data.model_id)
        if slot is None:
            self._fail(event, NotFound(f"model {event.data.model_id!r} is not loaded on this trainer"))
            return
        offer = slot.gate.offer(event.data.seq_id, (record, event))
        if offer.duplicate:
            return  # already applied (a redelivery); its completion was emitted then
        if not offer.ready:
            self.offsets.hold(record)
        self._run_ready(offer.ready)

    def _run_ready(self, ready: list) -> None:
        for seq_id, (record, event) in ready:
            self.offsets.release(record.topic, record.partition, record.offset)
            slot = self.slots[event.data.model_id]
            slot.applied(position(record))
            done = self._execute(event, self._handlers[event.type])
            if done and event.type == te.OPTIM_STEP["requested"]:
                # A clean point (no gradients pending): the one place a snapshot may be taken.
                engine = self.engine(slot.base_model)
                with self.turns.turn():
                    self.recovery.after_optim_step(event.data.model_id, slot, seq_id, engine.copy_state)

    def _execute(self, event: Event, handler: Callable[[Event], dict]) -> bool:
        try:
            with self.turns.turn():
                outcome = handler(event)
        except Exception as exc:  # one request's failure is reported on its own future
            self._fail(event, exc)
            return False
        payload = RequestCompleted(request_id=event.data.request_id, **outcome)
        self._emit(event, "completed", payload)
        return True

    def _fail(self, event: Event, exc: Exception) -> None:
        if isinstance(exc, OpenRLError):
            error, category = exc.detail, exc.category
        else:
            log.exception("trainer: %s failed", event.type)
            error, category = f"{type(exc).__name__}: {exc}", "server"
        self._emit(event, "failed", RequestFailed(request_id=event.data.request_id, error=error, category=category))

    def _emit(self, request: Event, phase: str, payload) -> None:
        type_ = event_type(request.family, request.verb, phase)
        reply = new_event(type_, payload, tenant=request.tenant, source=SOURCE, key=request.key, subject=payload.request_id)
        self.publisher.publish(topics.topic(request.tenant, "completions"), reply)

    # -- verbs ---------------------------------------------------------------------------

    def engine(self, base_model: str):
        key = self.models.canonical(base_model)  # an alias shares its target's base weights
        if key not in self._engines:
            from functions.trainer.engine import TrainerEngine

            self._engines[key] = TrainerEngine(self.models.files(base_model), device=self.device)
        return self._engines[key]

    def _restore(self, tenant: str, model_id: str, locked: bool = False) -> Optional[ModelSlot]:
        """Rebuild a model this trainer does not hold from its latest snapshot, if it has one."""
        snapshot = self.recovery.latest(tenant, model_id)
        if snapshot is None:
            return None
        engine = self.engine(snapshot.base_model)
        files = self.recovery.files(tenant, snapshot)
        if locked:
            engine.import_state(model_id, files, with_optimizer=True)
        else:
            with self.turns.turn():
                engine.import_state(model_id, files, with_optimizer=True)
        slot = ModelSlot(tenant, snapshot.base_model, snapshot.session_id, snapshot.lora_config, gate=SeqGate(snapshot.next_seq))
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
        engine = self.engine(data.base_model)
        if data.model_id not in self.slots and self._restore(event.tenant, data.model_id, locked=True) is None:
            engine.create_adapter(data.model_id, data.lora_config)
            if isinstance(data, te.LoadWeightsRequested):
                engine.import_state(data.model_id, self._read(event.tenant, data.files), data.with_optimizer)
            self.slots[data.model_id] = ModelSlot(event.tenant, data.base_model, data.session_id, data.lora_config)
        if isinstance(data, te.LoadWeightsRequested):
            return {"result": {"path": data.path, "model_id": data.model_id, "type": "load_weights"}}
        return {"result": {"model_id": data.model_id, "type": "create_model"}}

    def _forward_backward(self, event: Event) -> dict:
        data = event.data
        slot = self._slot(event)
        files = self.models.files(slot.base_model)
        batch = [record.to_datum() for record in data.data]
        validate_batch(batch, data.loss_fn, files.vocab_size, files.max_context)
        output = self.engine(slot.base_model).forward_backward(
            data.model_id, batch, data.loss_fn, data.loss_fn_config, data.forward_only
        )
        outputs = [{"logprobs": Array.from_numpy(lp).model_dump()} for lp in output.logprobs]
        return {"result": {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs, "metrics": output.metrics}}

    def _optim_step(self, event: Event) -> dict:
        slot = self._slot(event)
        metrics = self.engine(slot.base_model).optim_step(event.data.model_id, event.data.adam_params)
        return {"result": {"metrics": metrics}}

    def _save_weights(self, event: Event) -> dict:
        data = event.data
        slot = self._slot(event)
        files = self._write(event.tenant, self.engine(slot.base_model).export_state(data.model_id))
        checkpoint = _checkpoint(data, "weights", files, user_metadata=data.user_metadata)
        return {"result": {"path": checkpoint.tinker_path, "type": "save_weights"}, "checkpoint": checkpoint}

    def _save_for_sampler(self, event: Event) -> dict:
        data = event.data
        slot = self._slot(event)
        files = self._write(event.tenant, self.engine(slot.base_model).export_adapter(data.model_id))
        if data.name is not None:
            checkpoint = _checkpoint(data, "sampler_weights", files, user_metadata=data.user_metadata)
            return {"result": {"path": checkpoint.tinker_path, "type": "save_weights_for_sampler"}, "checkpoint": checkpoint}
        bound = SamplingSessionBound(
            sampling_session_id=data.sampling_session_id,
            session_id=slot.session_id,
            base_model=slot.base_model,
            adapter=files,
        )
        result = {"sampling_session_id": data.sampling_session_id, "type": "save_weights_for_sampler"}
        return {"result": result, "sampling_session": bound}

    def _save_external(self, event: Event) -> dict:
        """The adapter as plain PEFT files (adapter_model.safetensors + adapter_config.json), for download."""
        data = event.data
        slot = self._slot(event)
        files = self._write(event.tenant, self.engine(slot.base_model).export_adapter(data.model_id))
        checkpoint = _checkpoint(data, "external_weights", files)
        result = {"path": checkpoint.tinker_path, "size_bytes": checkpoint.size_bytes, "type": "save_weights_external"}
        return {"result": result, "checkpoint": checkpoint}

    def _load_in_place(self, event: Event) -> dict:
        data = event.data
        slot = self._slot(event)
        self.engine(slot.base_model).import_state(data.model_id, self._read(event.tenant, data.files), data.with_optimizer)
        return {"result": {"path": data.path, "model_id": data.model_id, "type": "load_weights"}}

    def _write(self, tenant: str, files: dict[str, bytes]):
        return {name: self.blobs.put(tenant, content) for name, content in files.items()}

    def _read(self, tenant: str, refs) -> dict[str, bytes]:
        return {name: self.blobs.get(tenant, ref) for name, ref in refs.items()}


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
