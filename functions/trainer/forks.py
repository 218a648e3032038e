"""Rebuilding a forked run: a parent's state at a step, from a snapshot or its creation plus replay.

`rebuild(engine, model_id, fork, read)` makes `model_id` on a LoRA or full fine-tuning engine
exactly as the `ForkRequested` event says: restore the parent's snapshot (adapter or weights
and the optimizer state) or start as the parent started, then re-apply the parent's logged
requests in seq order through the same engine calls the worker made for them. Nothing here
depends on the worker, so on CPU the result is bitwise the parent's state after that step,
as recovery by replay is (`recovery.py`): the same calls on the same state give the same
numbers. The parent's own state, if this trainer holds it, is never touched.

Starting as the parent started needs the parent's initial weights: a fresh LoRA adapter is
drawn from a seed derived from the run's id (`adapters.init_seed`), so the fork's adapter
is drawn from the *parent's* seed; a full run starts from the base weights, which need no
seed. A parent that was itself a fork starts as its own fork event says (recursively).
On any error the half-built model is dropped, so a failed fork leaves nothing behind.
"""

from __future__ import annotations

from typing import Callable, Mapping

from functions.trainer import adapters
from openrl_core.errors import ServerError
from openrl_core.events import payload_model
from openrl_core.events import training as te
from openrl_core.events.lifecycle import BlobRef

Read = Callable[[Mapping[str, BlobRef]], dict[str, bytes]]


def rebuild(engine, model_id: str, fork: te.ForkRequested, read: Read, full: bool) -> None:
    """Build `model_id` on `engine` (a TrainerEngine, or a FullFinetuneEngine when `full`)."""
    try:
        _build(engine, model_id, fork, read, full)
    except BaseException:
        drop(engine, model_id, full)
        raise


def drop(engine, model_id: str, full: bool) -> None:
    if full:
        engine.drop(model_id)
    elif engine.has_adapter(model_id):
        engine.drop_adapter(model_id)


def _build(engine, model_id: str, fork: te.ForkRequested, read: Read, full: bool) -> None:
    if fork.snapshot is not None:
        # Taken right after an optim_step: weights and optimizer exactly, no gradients pending.
        engine.import_state(model_id, read(fork.snapshot.files), with_optimizer=True)
    elif fork.origin is not None:
        _start(engine, model_id, _payload(fork.origin), read, full)
    else:
        raise ServerError(f"fork {fork.model_id!r} names neither a snapshot nor an origin to start from")
    for item in fork.replay:
        _apply(engine, model_id, _payload(item), read)


def _payload(item: te.Replayed):
    return payload_model(item.type).model_validate(item.data)


def _start(engine, model_id: str, origin, read: Read, full: bool) -> None:
    """The state the parent had right after it was created."""
    if isinstance(origin, te.ForkRequested):
        _build(engine, model_id, origin, read, full)
        return
    if not isinstance(origin, (te.CreateModelRequested, te.LoadWeightsRequested)):
        raise ServerError(f"a run cannot start as a {type(origin).__name__}")
    if full:
        engine.create(model_id)
    elif origin.lora_config is not None:  # else import_state makes it from the checkpoint's config
        lora = origin.lora_config
        # The parent's adapter was drawn from a seed of the parent's id (unless the SDK gave one).
        seeded = lora.model_copy(update={"seed": adapters.init_seed(origin.model_id, lora)})
        engine.create_adapter(model_id, seeded, (origin.optimizer_config or {}).get("type", "adamw"))
    if isinstance(origin, te.LoadWeightsRequested):
        engine.import_state(model_id, read(origin.files), origin.with_optimizer)


def _apply(engine, model_id: str, request, read: Read) -> None:
    """One logged request, through the engine call the worker made for it."""
    if isinstance(request, te.ForwardBackwardRequested):
        batch = [record.to_datum() for record in request.data]
        engine.forward_backward(model_id, batch, request.loss_fn, request.loss_fn_config, request.forward_only)
    elif isinstance(request, te.OptimStepRequested):
        engine.optim_step(model_id, request.params)
    elif isinstance(request, te.LoadWeightsRequested):
        engine.import_state(model_id, read(request.files), request.with_optimizer)
    else:
        raise ServerError(f"a fork cannot replay a {type(request).__name__}")
