"""The AdminClient (and RestClient's forwards to it) through the real tinker SDK against a real
`openrl serve`: alice trains, samples, saves two checkpoints, deletes one and moves her session
to another project; then her audit log, her billing usage and her current storage say exactly
that, counted here from what the test sent and got back, not from the server's own numbers.
Bob, another tenant, sees none of it, and bad parameters are 400s that store nothing."""

from __future__ import annotations

import sqlite3
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import tinker
from tinker import types

from functions.local_server import LocalServer

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.filterwarnings("ignore:DEPRECATED. RestClient:FutureWarning"),
]  # its forwards are checked too
MODEL = "openrl/tiny-qwen3"
ALICE, BOB = "tml-usage-alice", "tml-usage-bob"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_files):
    with LocalServer(tmp_path_factory.mktemp("openrl-usage"), [MODEL], f"alice={ALICE},bob={BOB}") as srv:
        yield srv


def hour(offset: int) -> datetime:
    return datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0) + timedelta(hours=offset)


def stored_events(server) -> int:
    database = sqlite3.connect(f"file:{server.data_dir / 'events.db'}?mode=ro", uri=True)
    try:
        return database.execute("SELECT count(*) FROM events").fetchone()[0]
    finally:
        database.close()


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def test_audit_billing_and_storage_say_what_the_tenant_did(server, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    service = tinker.ServiceClient(user_metadata={"team": "rl"}, project_id="p1", base_url=server.url, api_key=ALICE)
    rest = tinker.RestClient(base_url=server.url, api_key=ALICE)
    admin = tinker.AdminClient(base_url=server.url, api_key=ALICE)
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    session_id = training.model_id.split(":train:")[0]

    batch = [datum(list(range(100, 109))), datum(list(range(200, 214)))]
    trained = 0
    for _ in range(2):
        training.forward_backward(batch, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        trained += sum(d.model_input.length for d in batch)
    training.forward(batch[:1], "cross_entropy").result()  # forward-only counts as training too
    trained += batch[0].model_input.length

    state = training.save_state("usage-state").result().path
    sampler_path = training.save_weights_for_sampler("usage-sampler").result().path
    sampler = service.create_sampling_client(model_path=sampler_path).result()
    prompt = types.ModelInput.from_ints([5, 6, 7, 8, 9])
    answer = sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=4, seed=1)).result()
    sampled = sum(len(s.tokens) for s in answer.sequences)
    rest.delete_checkpoint_from_tinker_path(state).result()
    rest.assign_session_project(session_id, "p2").result()

    # -- audit: the checkpoint story in order, with the deprecated fields the SDK documents
    log = admin.get_audit_log("checkpoints").result()
    story = [(e.event, e.tinker_path, e.purpose) for e in log.entries]
    assert story == [
        ("checkpoint_saved", state, None),
        ("checkpoint_saved", sampler_path, None),
        ("checkpoint_read", sampler_path, "sampling"),
        ("checkpoint_deleted", state, None),
    ]
    assert {e.model_id for e in log.entries if e.event != "checkpoint_read"} == {training.model_id}
    projects = [e.event for e in rest.get_audit_log("projects").result().entries]
    assert projects == ["project_session_created", "project_assigned"]
    everything = admin.get_audit_log().result().entries
    assert {"training_run_created", "checkpoint_deleted", "project_assigned"} <= {e.event for e in everything}
    assert [e.timestamp for e in everything] == sorted(e.timestamp for e in everything)

    # -- billing: the tokens sent and sampled, two saves, storage, all in project p2 now
    usage = admin.get_billing_usage(hour(-1), hour(1)).result()

    def total(kind: str) -> float:
        events = [e for e in usage.data if e.event_info.type == kind]
        assert all(e.session_id == session_id and e.project_id == "p2" and e.base_model == MODEL for e in events)
        field = {"checkpoint": "count", "storage": "gigabyte_hours"}.get(kind, "token_count")
        return sum(getattr(e.event_info, field) for e in events)

    assert total("training") == trained
    assert total("sampling_prefill") == prompt.length  # once per request, not per sample
    assert total("sampling_sample") == sampled
    assert total("checkpoint") == 2 and total("storage") > 0
    assert all(e.estimated_cost_usd is None and e.effective_rate_usd_per_gigabyte_month is None for e in usage.data)
    assert usage.sessions[session_id].user_metadata == {"team": "rl"} and usage.cost_data_through is None
    same = rest.get_billing_usage(hour(-1), hour(1)).result()
    assert [e.event_info for e in same.data if e.event_info.type != "storage"] == [
        e.event_info for e in usage.data if e.event_info.type != "storage"
    ]  # storage grows with the clock; the rest is the same answer

    # -- current storage: what list_user_checkpoints lists, in the session's current project
    listed = rest.list_user_checkpoints(limit=1000).result().checkpoints
    storage = admin.get_current_checkpoint_storage_usage().result()
    [row] = storage.data
    assert (row.project_id, row.checkpoint_count) == ("p2", len(listed)) == ("p2", 1)
    assert row.size_bytes == sum(c.size_bytes or 0 for c in listed) and row.size_gigabytes == row.size_bytes / 1e9
    assert storage.effective_rate_usd_per_gigabyte_month is None and row.estimated_monthly_cost_usd is None
    assert rest.get_current_checkpoint_storage_usage("p1").result().data == []

    # -- bob sees none of it
    bob = tinker.AdminClient(base_url=server.url, api_key=BOB)
    assert bob.get_audit_log().result().entries == []
    assert bob.get_billing_usage(hour(-1), hour(1)).result().data == []
    assert bob.get_current_checkpoint_storage_usage().result().data == []

    # -- bad parameters: a 400 naming the parameter, nothing stored
    before = stored_events(server)
    with pytest.raises(tinker.BadRequestError, match="starting_on must be aligned"):
        admin.get_billing_usage("2026-01-01T00:30:00Z", "2026-01-02T00:00:00Z").result()
    with pytest.raises(tinker.BadRequestError, match="at most 14 days"):
        admin.get_billing_usage(hour(-24 * 15), hour(0)).result()
    with pytest.raises(tinker.BadRequestError, match="starting_on must not be in the future"):
        admin.get_billing_usage(hour(2), hour(3)).result()
    for params in ({"event_type": "users"}, {"day": "2026-02-30"}):
        answer = httpx.get(f"{server.url}/api/v1/audit", params=params, headers={"X-API-Key": ALICE})
        assert answer.status_code == 400 and next(iter(params)) in answer.json()["detail"], answer.text
    assert stored_events(server) == before
