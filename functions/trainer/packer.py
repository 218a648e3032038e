"""The trainer worker's packing: ready forward_backward requests of several LoRA models on one
base model, across tenants, run as shared passes in one turn.

From what one poll (plus a short linger, only while two or more LoRA models are active) made
ready, each LoRA model's leading run of forward_backward / forward requests is taken out of
its queue; the requests of all such models on one base model then run in one timeslicer
turn that covers every one of their jobs (`also`), through `TrainerEngine.
forward_backward_many` (bitwise what each would compute alone). What follows a model's
leading run (an optim_step, a save) stays queued and runs after, in the model's own turn,
so seq order and the optim_step barrier hold. A full fine-tuning run is never packed. A
request that fails (bad shape, unknown loss config) fails alone; if the turn itself cannot
be had, every request of the pack falls back to its model's own turn.

The packer sees the worker only through `PackHost`, the few public members it needs; it
imports nothing of the worker (the worker owns a packer, not the other way round).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager
from datetime import datetime, timezone
from typing import Any, Optional, Protocol

from eventing.bus import EventPublisher
from eventing.offsets import OffsetTracker
from functions.compute.models import ModelDirectory
from functions.timeslicer.client import Fenced, Turn
from functions.trainer.recovery import ModelSlot, position
from functions.trainer.turns import with_started
from openrl_core.cohort import Cohort
from openrl_core.datum import validate_batch
from openrl_core.events import Event
from openrl_core.events import training as te
from openrl_core.events.lifecycle import RequestCompleted

log = logging.getLogger(__name__)
PACKABLE = {te.FORWARD_BACKWARD["requested"]}
ACTIVE_SECONDS = 10.0  # a model counts as active this long after its last request


class PackHost(Protocol):
    """What a packer needs of the worker it serves (`TrainerWorker` is one)."""

    slots: dict[str, ModelSlot]
    models: ModelDirectory
    offsets: OffsetTracker
    publisher: EventPublisher

    @property
    def state(self) -> threading.Lock:
        """Held around compute, parking and restoring of any model."""
        ...

    def engine(self, base_model: str) -> Any:  # the base model's `TrainerEngine`
        ...

    def shared_turn(self, model_ids: list[str]) -> AbstractContextManager[Turn]:
        """One timeslicer turn that covers every one of these models' jobs."""
        ...

    def ensure_resident(self, model_id: str, turn: Turn) -> None: ...

    def absorb(self, in_turn: bool = False) -> None: ...

    def take_arrived(self, model_id: str) -> list:
        """Remove and return what `absorb` made ready for this model."""
        ...

    def run_ready(self, ready: list, turn: Optional[Turn] = None, replies: Optional[list] = None) -> None: ...

    def fail(self, event: Event, exc: Exception) -> None: ...

    def lose(self, model_id: str) -> None:
        """The model changed hands: drop it here and never serve it again."""
        ...

    def reply(self, request: Event, phase: str, payload, lease: Optional[int] = None) -> tuple:
        """(topic, event, dedup) of a request's answer, for `publish_many`."""
        ...

    def forward_backward_result(self, output, request) -> dict: ...


class Packer:
    def __init__(self, worker: PackHost, linger: float, cohort_wait: float = 0.0, enabled: bool = True) -> None:
        self.worker = worker
        self.linger = linger
        self.cohort_wait = cohort_wait
        self.enabled = enabled
        self.cohort = Cohort(ACTIVE_SECONDS)  # the LoRA models that sent requests lately

    def saw(self, model_id: str) -> None:
        slot = self.worker.slots.get(model_id)
        if slot is not None and not slot.full:
            self.cohort.saw(model_id, time.monotonic())

    def forget(self, model_id: str) -> None:
        self.cohort.forget(model_id)

    def should_linger(self) -> bool:
        """Wait a moment for more requests only while several LoRA models are training."""
        return (self.linger > 0 or self.cohort_wait > 0) and len(self.cohort.expected(time.monotonic())) >= 2

    def take(self, ready: dict[str, list]) -> dict[str, list]:
        """Remove the packable leading requests from `ready`: base model -> [(model, items)],
        only for base models with two or more models to pack."""
        groups: dict[str, list] = {}
        if not self.enabled:
            return {}
        for model_id, items in ready.items():
            slot = self.worker.slots.get(model_id)
            if slot is None or slot.full:
                continue
            count = 0
            while count < len(items) and items[count][1][1].type in PACKABLE:
                count += 1
            if count:
                groups.setdefault(self.worker.models.canonical(slot.base_model), []).append((model_id, count))
        packs = {}
        for base, members in groups.items():
            if len(members) < 2:
                continue
            packs[base] = [(model_id, ready[model_id][:count]) for model_id, count in members]
            for model_id, count in members:
                ready[model_id] = ready[model_id][count:]
        return packs

    def run(self, base: str, members: list, follow: dict[str, list]) -> None:
        """The members' leading requests as shared passes; then, in the same turn, what each
        member has ready after them (`follow`, taken out of it, and what arrived during the
        pass): its optim_step and save, whose answers are published together. The models of a pass then finish their step together,
        so their next requests (the samples of RL loops) reach the sampler together too,
        instead of one model's step ending while the others wait a turn each behind the
        sampler."""
        worker = self.worker
        items = [(model_id, record, event) for model_id, ready in members for _seq, (record, event) in ready]
        for model_id, record, event in items:
            worker.offsets.release(record.topic, record.partition, record.offset)
            slot = worker.slots[model_id]
            slot.applied(position(record))
            if not event.data.forward_only:
                slot.clean = False  # gradients accumulate (even if the pass fails: then they are unknown)
        models = list(dict.fromkeys(model_id for model_id, _record, _event in items))
        engine = worker.engine(base)
        files = worker.models.files(base)
        from functions.trainer.engine import PackRequest

        requests, checked = [], []
        for model_id, _record, event in items:
            data = event.data
            try:
                batch = [datum.to_datum() for datum in data.data]
                validate_batch(batch, data.loss_fn, files.vocab_size, files.max_context)
            except Exception as exc:  # this request's own failure
                worker.fail(event, exc)
                continue
            requests.append(PackRequest(model_id, batch, data.loss_fn, data.loss_fn_config, data.forward_only))
            checked.append(event)
        if not requests:
            return
        computed = False
        asked = time.monotonic()
        try:
            with worker.shared_turn(models) as turn:
                with worker.state:
                    began = time.monotonic()
                    started = datetime.now(timezone.utc)
                    for model_id in models:
                        worker.ensure_resident(model_id, turn)
                    results = engine.forward_backward_many(requests)
                    computed = True
                passed = time.monotonic()
                lease = turn.confirm()
                self._publish(checked, results, started, lease)
                # Their answers go out together at the end of the turn: the models finish their
                # step at one moment, so their next requests arrive together as well.
                answers: list = []
                worker.absorb(
                    in_turn=True
                )  # what the SDKs sent after the pass's requests (optim_step, save) came meanwhile
                try:
                    for model_id in models:
                        worker.run_ready(follow.pop(model_id, []) + worker.take_arrived(model_id), turn, answers)
                finally:
                    worker.publisher.publish_many(answers)
        except Fenced as fenced:
            # The models changed hands (a replacement worker with this identity): drop them,
            # publish nothing; the replacement replays these requests.
            log.error("trainer: models %s were taken over (%s); dropping them here", models, fenced.detail)
            for model_id in models:
                worker.lose(model_id)
            return
        except Exception as exc:
            if computed:  # the gradients are in: running again would apply them twice
                for event in checked:
                    worker.fail(event, exc)
                return
            log.exception("trainer: no packed turn on %s; its requests run one model at a time", base)
            for _model_id, ready in members:
                worker.run_ready(ready)
            return
        log.debug("trainer: packed %d requests of %d models on %s (%s) waited %.3f s for its turn, pass %.3f s, follow-ups %.3f s",
                  len(requests), len(models), base, ", ".join(models), began - asked, passed - began, time.monotonic() - passed)  # fmt: skip

    def _publish(self, checked: list, results: list, started: datetime, lease) -> None:
        """The pass's answers, in one append."""
        worker, replies = self.worker, []
        for event, result in zip(checked, results):
            if isinstance(result, Exception):
                worker.fail(event, result)
            else:
                outcome = with_started(worker.forward_backward_result(result, event.data), started)
                payload = RequestCompleted(request_id=event.data.request_id, **outcome)
                replies.append(worker.reply(event, "completed", payload, lease))
        worker.publisher.publish_many(replies)
