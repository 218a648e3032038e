"""The trainer worker's request verbs: create, fork, forward_backward, optim_step, the saves
and the loads, each from a decoded event to its outcome.

`Handlers` is a part of `TrainerWorker` (a mixin over the worker's own state). Each handler
runs inside its model's turn with the state lock held (`Turns._run_items`) and returns the
outcome dict its completion carries (`result`, and where it applies `checkpoint`,
`sampling_session`, `details`); it raises a typed `OpenRLError` for a request's own fault.
Invariants: a request only touches the model it names, of its own tenant (`_slot`); a load
that fails leaves no half-created model behind; a named save's checkpoint TTL counts from
the moment it is recorded.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone

import numpy as np

from eventing.store.projections import expiry
from functions.compute.age_export import encrypt_files
from functions.compute.weight_sync import MANIFEST
from functions.trainer import forks
from functions.trainer.recovery import ModelSlot
from openrl_core.datum import validate_batch
from openrl_core.errors import InvalidRequest, NotFound, OpenRLError
from openrl_core.events import Event
from openrl_core.events import training as te
from openrl_core.events.lifecycle import CheckpointSaved, SamplingSessionBound
from openrl_core.tensors import Array

log = logging.getLogger(__name__)


class Handlers:
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
        files = self._write(event.tenant, encrypt_files(exported, data.age_encryption_recipients))
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


def optimizer_family(data) -> str:
    """The optimizer a create (or create-via-load) event starts the model with."""
    return (getattr(data, "optimizer_config", None) or {}).get("type", "adamw")


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
