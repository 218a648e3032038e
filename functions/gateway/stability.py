"""The gateway's half of StableReinforce: find the records a datum names, attach them.

A `stable_reinforce` forward_backward is checked here before it is queued: every sequence
id its provenance names must be a sample of this tenant (another tenant's id is unknown,
exactly as a missing one), taken in the training run's own session
(Tinker: "a training request can only name sequences sampled in its own session") with
`record_stability_info=true`, completed, and at most `RECORD_TTL` old. The records are the
completed samples' futures, folded from their completion events by the projector, so they
survive any restart; nothing here keeps state. `openrl_core.stability.resolve` then checks
the spans against them and gives the two arrays the trainer's loss reads, which go into the
event (so a replayed event trains exactly as the first time, with no lookup).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

from functions.gateway.context import GatewayContext
from openrl_core.datum import Datum
from openrl_core.errors import InvalidRequest
from openrl_core.ids import session_of
from openrl_core.stability import RECORD_TTL, StabilityRecord, record_from_result, resolve, split_sequence_id

LOSS = "stable_reinforce"


def attach_records(ctx: GatewayContext, tenant: str, model_id: str, loss_fn: str, data: list[Datum]) -> list[Datum]:
    """`data` with each datum's stability arrays added (unchanged for any other loss)."""
    if loss_fn != LOSS:
        return data
    session_id = session_of(model_id)
    now = datetime.now(timezone.utc)
    records: dict[str, StabilityRecord] = {}
    futures: dict[str, object] = {}
    out = []
    for index, datum in enumerate(data):
        where = f"data[{index}]"
        if datum.provenance is not None:
            for sequence_id in sorted(datum.provenance.sequence_ids() - set(records)):
                records[sequence_id] = _record(ctx, tenant, session_id, sequence_id, now, futures, where)
        arrays = resolve(where, datum.tokens_N, datum.loss_fn_inputs, datum.provenance, records)
        out.append(replace(datum, loss_fn_inputs={**datum.loss_fn_inputs, **arrays}))
    return out


def _record(ctx, tenant: str, session_id: str, sequence_id: str, now: datetime, futures: dict, where: str):
    parts = split_sequence_id(sequence_id)
    row = None
    if parts is not None:
        request_id, _index = parts
        if request_id not in futures:
            futures[request_id] = ctx.projections.future(tenant, request_id)
        row = futures[request_id]
    if row is None or row.kind != "sample":
        raise InvalidRequest(f"{where} names sequence {sequence_id!r}, which is no sampled sequence of this tenant")
    if row.session_id != session_id:
        raise InvalidRequest(
            f"{where} names sequence {sequence_id!r}, sampled in session {row.session_id!r}; a training request "
            f"can only name sequences sampled in its own session ({session_id!r})"
        )
    if row.state != "completed":
        raise InvalidRequest(f"{where} names sequence {sequence_id!r}, whose sample is {row.state}, not completed")
    record = record_from_result(row.result or {}, parts[1])
    if record is None:
        raise InvalidRequest(
            f"{where} names sequence {sequence_id!r}, sampled without record_stability_info=true; loss_fn "
            "'stable_reinforce' needs samples from a sampling client created with record_stability_info=True"
        )
    completed = row.completed_at
    if completed.tzinfo is None:
        completed = completed.replace(tzinfo=timezone.utc)
    if now - completed > RECORD_TTL:
        raise InvalidRequest(
            f"{where} names sequence {sequence_id!r}, sampled at {completed.isoformat()}: its stability record "
            "expired (records can be trained on for one day after sampling); sample again"
        )
    return record
