"""What the trainer worker holds on the accelerator: engines, timeslicer jobs, parked,
restored, released and cancelled runs.

`Residency` is a part of `TrainerWorker` (a mixin over the worker's own state). One LoRA
engine per canonical base model (its frozen base registered as a resident, never-parked
job) and one full fine-tuning engine per base model; every run is a parkable timeslicer
job named after this worker (`_job`), so a replacement with the same identity takes it
over. Invariants: parking, restoring and dropping a model take the state lock, so a model
is never moved while it is being used; a run is released only at a clean point once a
durable snapshot covers it (`openrl_core.eviction`), and its next request restores it from
that snapshot (`_restore`) as a replacement trainer would.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from functions.trainer.recovery import ModelSlot
from openrl_core.eviction import Action, RunFacts, decide
from openrl_core.seqgate import SeqGate

log = logging.getLogger(__name__)


class Residency:
    def engine(self, base_model: str):
        """The LoRA engine of a base model (an alias shares its target's base weights)."""
        key = self.models.canonical(base_model)
        if key not in self._lora:
            from functions.trainer.engine import TrainerEngine

            engine = TrainerEngine(
                self.models.files(base_model), device=self.device,
                max_padded_tokens=self.options.pack_max_tokens, max_rows=self.options.pack_max_rows,
                max_shared_pass_bytes=self.options.pack_max_shared_bytes, precision=self._precision(),
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
            serving = {"serving_dtype": self.options.serving_dtype, "full_every": self.options.delta_full_every,
                       "max_share": self.options.delta_max_share, "precision": self._precision()}  # fmt: skip
            if self.options.full_shards > 1:
                from functions.trainer.sharded import ShardedFullEngine

                engine = ShardedFullEngine(
                    self.models.files(base_model), self.options.full_shards, self.device, **serving
                )
            else:
                from functions.trainer.full import FullFinetuneEngine

                engine = FullFinetuneEngine(self.models.files(base_model), device=self.device, **serving)
            self._full[key] = engine
        return self._full[key]

    def _precision(self):
        from functions.trainer.precision import Precision

        return Precision.resolve(self.options.precision, self.device, self.options.activation_checkpointing)

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
