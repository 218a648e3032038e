"""Cases for `AdminClient` and the `RestClient` methods that forward to it (see `surface_rig.py`
for the contract): the audit log, billing usage and current storage, served from the tenant's
event store. Exact token and byte counts are checked in `test_sdk_usage.py`."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from tinker import types

from tests.e2e.surface_rig import MODEL, WORKS, case, train_one_step

R, A = "RestClient.", "AdminClient."


def _hour(offset: int) -> datetime:
    return datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0) + timedelta(hours=offset)


def _audit(w, client, call):
    path = w.state_path
    log = call(client, "get_audit_log", "checkpoints", datetime.now(timezone.utc).date())
    assert isinstance(log, types.AuditLogResponse)
    saved = [e for e in log.entries if e.event == "checkpoint_saved" and e.tinker_path == path]
    assert saved and saved[0].model_id == w.training.model_id and saved[0].event_details["ids"]["run_id"]
    assert [e.timestamp for e in log.entries] == sorted(e.timestamp for e in log.entries)
    assert call(client, "get_audit_log", "teams").entries == []


def _billing(w, client, call):
    train_one_step(w.training, w.batch)
    usage = call(client, "get_billing_usage", _hour(-1), _hour(1))
    training = [e for e in usage.data if e.event_info.type == "training" and e.session_id == w.session_id]
    assert training and all(e.base_model == MODEL and e.estimated_cost_usd is None for e in training)
    assert sum(e.event_info.token_count for e in training) > 0  # type: ignore[union-attr]
    assert usage.sessions[w.session_id].user_metadata is None  # the SDK made its session without any


def _storage(w, client, call):
    assert w.state_path  # at least one checkpoint
    usage = call(client, "get_current_checkpoint_storage_usage")
    listed = w.rest.list_user_checkpoints(limit=1000).result().checkpoints
    assert sum(row.checkpoint_count for row in usage.data) == len(listed)
    assert sum(row.size_bytes for row in usage.data) == sum(c.size_bytes or 0 for c in listed)
    assert all(row.estimated_monthly_cost_usd is None and row.org_user_urn for row in usage.data)


ADMIN_METHODS = {
    "get_audit_log": (
        _audit,
        "today's checkpoint entries name a saved checkpoint's path; the teams filter is empty",
        "from the tenant's stored events; no teams or organisations self-hosted (their filters give none)",
    ),
    "get_billing_usage": (
        _billing,
        "hourly training tokens of the tenant's base model and session, with the session's metadata",
        "quantities from the event store; costs and rates are null (nothing is priced self-hosted)",
    ),
    "get_current_checkpoint_storage_usage": (
        _storage,
        "per project, the count and bytes of list_user_checkpoints' live checkpoints",
        "size_gigabytes is bytes / 1e9; the estimated cost and rate are null",
    ),
}
for _prefix, _attr in ((R, "rest"), (A, "admin")):
    for _name, (_body, _checked, _note) in ADMIN_METHODS.items():
        case(_prefix + _name, _prefix + _name + "_async", status=WORKS, checked=_checked, note=_note)(
            lambda w, call, body=_body, attr=_attr: body(w, getattr(w, attr), call)
        )


@case(A + "get_telemetry", checked="the holder's telemetry (None when TINKER_TELEMETRY=0; no request)")
def _admin_telemetry(w, call):
    assert call(w.admin, "get_telemetry") is None
