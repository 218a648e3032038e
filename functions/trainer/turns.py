"""Running a model's requests in turns of its timeslicer job, and answering each one.

`Turns` is a part of `TrainerWorker` (a mixin over the worker's own state: `slots`,
`offsets`, `slicer`, `_state`, `_handlers`, `recovery`, `publisher`). A model's ready
requests run in seq order in one turn of its job, or in a turn already held that covers it
(a packed pass's). Invariants: each request's recovery bookkeeping (`ModelSlot.applied`,
`clean`) happens as it runs, in order, so a snapshot taken after an optim_step sees the
requests after it as not yet covered; every request gets exactly one answer, a completion
under the lease confirmed after it (outside the state lock, since confirming may wait for a
new turn) or a failure that is its own alone; a fenced turn (the model changed hands) drops
the model here and publishes nothing more for it.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Callable, Optional

from eventing import topics
from functions.timeslicer.client import Fenced
from functions.trainer.recovery import position
from openrl_core.errors import OpenRLError
from openrl_core.events import Event, new_event
from openrl_core.events import training as te
from openrl_core.events.base import event_type
from openrl_core.events.lifecycle import RequestCompleted, RequestFailed

log = logging.getLogger(__name__)
SOURCE = "/openrl/trainer"


class Turns:
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


# Requests after which a run holds no accumulated gradients.
_CLEANS = (te.OPTIM_STEP["requested"], te.LOAD_WEIGHTS["requested"])


def _accumulates(event: Event) -> bool:
    return event.type == te.FORWARD_BACKWARD["requested"] and not event.data.forward_only


def with_started(outcome: dict, started: datetime) -> dict:
    """Add when the work began to the completion's details (the step metrics' queue wait)."""
    return {**outcome, "details": {**(outcome.get("details") or {}), "started": started.isoformat()}}
