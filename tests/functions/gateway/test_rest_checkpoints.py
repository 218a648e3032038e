"""The REST surface over the projections: runs, checkpoints, sessions, TTLs and the reaper,
copies, signed download links. No workers: checkpoints are made as the trainer makes them
(see rest_rig.py), so these run in a second or two."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from urllib.parse import parse_qs, urlsplit

import pyrage
from sqlalchemy import select

from eventing.store import database, projections, tables
from eventing.store.queries import Projections
from eventing.store.unit_of_work import Rows
from functions.gateway import downloads
from functions.gateway.routes.checkpoints import reap_expired
from tests.functions.gateway.rest_rig import BOB, MODEL, assert_clear_4xx, rest  # noqa: F401  (fixture)

NOW = lambda: datetime.now(timezone.utc)  # noqa: E731
RUNS, CKPTS = "/api/v1/training_runs", "/api/v1/checkpoints"


def ids(listing) -> list[str]:
    return [c["checkpoint_id"] for c in listing["checkpoints"]]


def test_training_runs_are_listed_newest_first_with_their_newest_checkpoints(rest):
    session = rest.session(user_metadata={"purpose": "tests"}, display_name="run list")
    first = rest.model(session, 0, user_metadata={"renderer_name": "qwen3", "steps": 3})
    second = rest.model(session, 1, rank=8)
    rest.save(first, "old")
    rest.save(first, "new")
    rest.save(first, "for-sampling", kind="sampler_weights")
    rest.save(first, "export", kind="external_weights")  # neither last_checkpoint nor last_sampler_checkpoint

    listing = rest.ok("GET", RUNS)
    assert [run["training_run_id"] for run in listing["training_runs"]] == [second, first]
    assert listing["cursor"] == {"offset": 0, "limit": 20, "total_count": 2}
    page = rest.ok("GET", RUNS, params={"limit": 1, "offset": 1})
    assert [run["training_run_id"] for run in page["training_runs"]] == [first]
    assert page["cursor"] == {"offset": 1, "limit": 1, "total_count": 2}

    run = rest.ok("GET", f"{RUNS}/{first}", params={"access_scope": "owned"})
    assert run["base_model"] == MODEL and run["model_owner"] == "alice" and run["is_lora"] and run["lora_rank"] == 4
    assert run["corrupted"] is False
    assert run["last_checkpoint"]["checkpoint_id"] == "weights/new"
    assert run["last_checkpoint"]["checkpoint_type"] == "training"
    assert run["last_sampler_checkpoint"]["tinker_path"] == f"tinker://{first}/sampler_weights/for-sampling"
    # the SDK reads user_metadata as {str: str}: other values travel as JSON
    assert run["user_metadata"] == {"renderer_name": "qwen3", "steps": "3"}
    assert rest.ok("GET", f"{RUNS}/{second}")["last_checkpoint"] is None

    # bob has no runs, and alice's are unknown to him
    assert rest.ok("GET", RUNS, key=BOB)["training_runs"] == []
    assert_clear_4xx(rest.request("GET", f"{RUNS}/{first}", key=BOB), 404, "unknown training run")

    sessions = rest.ok("GET", "/api/v1/sessions")
    assert sessions == {"sessions": [session]}
    sampler = rest.ok(
        "POST",
        "/api/v1/create_sampling_session",
        {"session_id": session, "sampling_session_seq_id": 0, "base_model": MODEL},
    )
    got = rest.ok("GET", f"/api/v1/sessions/{session}")
    assert got == {"training_run_ids": [first, second], "sampler_ids": [sampler["sampling_session_id"]],
                   "user_metadata": {"purpose": "tests"}, "display_name": "run list"}  # fmt: skip
    assert rest.ok("GET", "/api/v1/sessions", key=BOB) == {"sessions": []}
    assert_clear_4xx(rest.request("GET", f"/api/v1/sessions/{session}", key=BOB), 404, "unknown session_id")


def test_checkpoint_lists_and_weights_info(rest):
    session = rest.session()
    run = rest.model(session)
    rest.save(run, "a", user_metadata={"step": "10"})
    rest.save(run, "b", kind="sampler_weights")
    other = rest.model(session, 1)
    rest.save(other, "c")

    assert ids(rest.ok("GET", f"{RUNS}/{run}/checkpoints")) == ["sampler_weights/b", "weights/a"]
    everything = rest.ok("GET", CKPTS)
    assert ids(everything) == ["weights/c", "sampler_weights/b", "weights/a"]
    assert everything["cursor"] == {"offset": 0, "limit": 100, "total_count": 3}
    assert ids(rest.ok("GET", CKPTS, params={"limit": 2, "offset": 2})) == ["weights/a"]
    a = rest.ok("GET", f"{RUNS}/{run}/checkpoints")["checkpoints"][1]
    assert (
        a["user_metadata"] == {"step": "10"}
        and a["public"] is False
        and a["expires_at"] is None
        and a["size_bytes"] > 0
    )

    info = rest.ok("POST", "/api/v1/weights_info", {"tinker_path": f"tinker://{run}/sampler_weights/b"})
    assert info == {"base_model": MODEL, "optimizer_config": {"type": "adamw"}, "is_lora": True, "lora_rank": 4,
                    "train_unembed": True, "train_mlp": True, "train_attn": True}  # fmt: skip
    assert rest.ok("GET", CKPTS, key=BOB)["checkpoints"] == []


def test_expired_checkpoints_are_hidden_at_once_and_the_reaper_removes_them_and_their_unshared_blobs(rest):
    session = rest.session()
    run = rest.model(session)
    shared = b"the same adapter bytes"
    keep = rest.save(run, "keep", files={"adapter_model.safetensors": shared})
    gone = rest.save(
        run,
        "gone",
        files={"adapter_model.safetensors": shared, "optimizer.pt": b"only mine"},
        expires_at=NOW() - timedelta(seconds=1),
    )
    later = rest.save(run, "later", kind="sampler_weights", expires_at=NOW() + timedelta(hours=2))

    # hidden from every read before any reaper has run
    assert ids(rest.ok("GET", f"{RUNS}/{run}/checkpoints")) == ["sampler_weights/later", "weights/keep"]
    assert rest.ok("GET", CKPTS)["cursor"]["total_count"] == 2
    assert rest.ok("GET", f"{RUNS}/{run}")["last_checkpoint"]["checkpoint_id"] == "weights/keep"
    assert_clear_4xx(rest.request("POST", "/api/v1/weights_info", {"tinker_path": gone.tinker_path}), 404, "not found")
    assert_clear_4xx(rest.request("DELETE", f"{RUNS}/{run}/checkpoints/weights/gone"), 404, "not found")

    assert reap_expired(rest.ctx) == [gone.tinker_path]
    assert rest.count_events("checkpoint.expire") == 1
    with rest.runtime.engine.connect() as conn:
        names = {row.checkpoint_id for row in conn.execute(select(tables.checkpoints))}
        last = conn.execute(select(tables.training_runs.c.last_checkpoint)).scalar()
    assert names == {"weights/keep", "sampler_weights/later"} and last == "weights/keep"
    assert not rest.blob_exists("alice", gone.files["optimizer.pt"])  # only the expired one used it
    assert rest.blob_exists("alice", keep.files["adapter_model.safetensors"])  # still referenced by "keep"
    assert reap_expired(rest.ctx) == []  # nothing left to do

    # a TTL, later: the reaper removes it when its time comes, not before
    assert reap_expired(rest.ctx, now=NOW() + timedelta(hours=1)) == []
    assert reap_expired(rest.ctx, now=NOW() + timedelta(hours=3)) == [later.tinker_path]
    assert not rest.blob_exists("alice", later.files["adapter_model.safetensors"])
    assert rest.ok("GET", f"{RUNS}/{run}")["last_sampler_checkpoint"] is None


def test_set_ttl_publish_unpublish_and_delete(rest):
    session = rest.session()
    run = rest.model(session)
    saved = rest.save(run, "final")
    base = f"{RUNS}/{run}/checkpoints/weights/final"

    before = NOW()
    assert rest.ok("PUT", f"{base}/ttl", {"ttl_seconds": 7200}) is None
    [checkpoint] = rest.ok("GET", f"{RUNS}/{run}/checkpoints")["checkpoints"]
    expires = datetime.fromisoformat(checkpoint["expires_at"].replace("Z", "+00:00"))
    assert before + timedelta(seconds=7200) <= expires <= NOW() + timedelta(seconds=7200)
    rest.ok("PUT", f"{base}/ttl", {"ttl_seconds": None})
    assert rest.ok("GET", f"{RUNS}/{run}/checkpoints")["checkpoints"][0]["expires_at"] is None
    # moved back to "never" after the reaper looked: the expiry event must not remove it
    assert reap_expired(rest.ctx, now=NOW() + timedelta(days=1)) == []

    rest.ok("POST", f"{base}/publish")
    assert rest.ok("GET", f"{RUNS}/{run}/checkpoints")["checkpoints"][0]["public"] is True
    rest.ok("POST", f"{base}/publish")  # already public: nothing to do, nothing recorded
    assert rest.count_events("checkpoint.publish") == 1
    rest.ok("DELETE", f"{base}/publish")
    assert rest.ok("GET", f"{RUNS}/{run}/checkpoints")["checkpoints"][0]["public"] is False
    rest.ok("DELETE", f"{base}/publish")
    assert rest.count_events("checkpoint.unpublish") == 1

    # a checkpoint may be named like an action: the id is always two segments
    rest.save(run, "publish")
    rest.ok("POST", f"{RUNS}/{run}/checkpoints/weights/publish/publish")
    rest.ok("DELETE", f"{RUNS}/{run}/checkpoints/weights/publish")

    rest.ok("DELETE", base)
    assert rest.ok("GET", f"{RUNS}/{run}/checkpoints")["checkpoints"] == []
    assert rest.ok("GET", f"{RUNS}/{run}")["last_checkpoint"] is None
    assert not any(rest.blob_exists("alice", ref) for ref in saved.files.values())
    assert_clear_4xx(rest.request("DELETE", base), 404, "not found")
    assert rest.count_events("checkpoint.delete") == 2


def test_a_deleted_checkpoint_keeps_the_blobs_a_sampling_session_still_uses(rest):
    session = rest.session()
    run = rest.model(session)
    saved = rest.save(run, "serving", kind="sampler_weights")
    rest.ok(
        "POST",
        "/api/v1/create_sampling_session",
        {"session_id": session, "sampling_session_seq_id": 0, "model_path": saved.tinker_path},
    )
    rest.ok("DELETE", f"{RUNS}/{run}/checkpoints/sampler_weights/serving")
    assert all(rest.blob_exists("alice", ref) for ref in saved.files.values())


def test_copy_weights_into_a_session_slot_and_into_a_project(rest):
    session = rest.session()
    run = rest.model(session, user_metadata={"renderer_name": "qwen3"})
    source = rest.save(run, "step-400", user_metadata={"note": "best"})

    body = {"source_path": source.tinker_path, "session_id": session, "model_seq_id": 5, "ttl_seconds": 7200}
    copied = rest.ok("POST", "/api/v1/copy_weights", body)
    copy_run = f"{session}:train:5"
    assert copied == {"tinker_path": f"tinker://{copy_run}/weights/step-400"}
    assert rest.ok("POST", "/api/v1/copy_weights", body) == copied  # a retry copies nothing again
    assert rest.count_events("checkpoint.copy") == 1
    [copy] = rest.ok("GET", f"{RUNS}/{copy_run}/checkpoints")["checkpoints"]
    assert copy["user_metadata"] == {"note": "best"} and copy["public"] is False and copy["expires_at"] is not None
    new_run = rest.ok("GET", f"{RUNS}/{copy_run}")
    assert (
        new_run["base_model"] == MODEL
        and new_run["lora_rank"] == 4
        and new_run["user_metadata"] == {"renderer_name": "qwen3"}
    )
    assert new_run["last_checkpoint"]["tinker_path"] == copied["tinker_path"]
    assert copy_run in rest.ok("GET", f"/api/v1/sessions/{session}")["training_run_ids"]
    # the slot is taken: create_model there, or another copy there, is a conflict
    taken = {"session_id": session, "model_seq_id": 5, "base_model": MODEL, "lora_config": {"rank": 4}}
    assert rest.request("POST", "/api/v1/create_model", taken).status_code == 409
    assert rest.request("POST", "/api/v1/copy_weights", {**body, "ttl_seconds": 3600}).status_code == 409

    # into a project: a new session holds the copy; the idempotency key makes retries safe
    headers = {"X-Idempotency-Key": "copy-attempt-1"}
    project_copy = rest.ok(
        "POST",
        "/api/v1/copy_weights",
        {"source_path": source.tinker_path, "destination_project_id": "archive"},
        headers=headers,
    )
    again = rest.ok(
        "POST",
        "/api/v1/copy_weights",
        {"source_path": source.tinker_path, "destination_project_id": "archive"},
        headers=headers,
    )
    assert again == project_copy and rest.count_events("checkpoint.copy") == 2
    archive_run = project_copy["tinker_path"][len("tinker://") :].split("/")[0]
    assert archive_run.endswith(":train:0") and archive_run != run
    archived = rest.ok("GET", RUNS, params={"project_id": "archive"})["training_runs"]
    assert [r["training_run_id"] for r in archived] == [archive_run]
    assert rest.ok("GET", f"/api/v1/sessions/{archive_run.split(':')[0]}")["training_run_ids"] == [archive_run]

    # the copies share the source's blobs; deleting the source leaves them whole
    rest.ok("DELETE", f"{RUNS}/{run}/checkpoints/weights/step-400")
    assert all(rest.blob_exists("alice", ref) for ref in source.files.values())
    info = rest.ok("POST", "/api/v1/weights_info", {"tinker_path": project_copy["tinker_path"]})
    assert info["base_model"] == MODEL and info["lora_rank"] == 4
    # the last copy gone, the blobs go too
    rest.ok("DELETE", f"{RUNS}/{copy_run}/checkpoints/weights/step-400")
    rest.ok("DELETE", f"{RUNS}/{archive_run}/checkpoints/weights/step-400")
    assert not any(rest.blob_exists("alice", ref) for ref in source.files.values())


def test_signed_download_links(rest):
    session = rest.session()
    run = rest.model(session)
    files = {"adapter_model.safetensors": b"\x00weights" * 100, "adapter_config.json": b'{"r": 4}'}
    export = rest.save(run, "final", kind="external_weights", files=files)
    answer = rest.ok("GET", f"{RUNS}/{run}/checkpoints/external_weights/final/external_weights_urls")
    assert set(answer["urls"]) == set(files)
    expires = datetime.fromisoformat(answer["expires"].replace("Z", "+00:00"))
    assert NOW() + timedelta(minutes=59) < expires <= NOW() + timedelta(hours=1)
    for name, url in answer["urls"].items():
        got = rest.client.get(url)  # no API key: the signature is the authorisation
        assert got.status_code == 200 and got.content == files[name], got.text

    url = answer["urls"]["adapter_config.json"]
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    tampered_sig = url.replace(query["signature"], "0" * 64)
    assert_clear_4xx(rest.client.get(tampered_sig), 403, "signature does not match")
    non_ascii = url.replace(query["signature"], "%C3%89%C3%A4")  # once a 500: compare_digest refuses non-ASCII str
    assert_clear_4xx(rest.client.get(non_ascii), 403, "signature does not match")
    tampered_expiry = url.replace(f"expires={query['expires']}", f"expires={int(query['expires']) + 3600}")
    assert_clear_4xx(rest.client.get(tampered_expiry), 403, "signature does not match")
    other_blob = url.replace(
        export.files["adapter_config.json"].sha256, export.files["adapter_model.safetensors"].sha256
    )
    assert_clear_4xx(rest.client.get(other_blob), 403, "signature does not match")
    assert_clear_4xx(rest.client.get(parts.path), 403, "lacks its expires and signature")
    secret = downloads.server_secret(rest.runtime.settings)
    past = int(NOW().timestamp()) - 10
    sha = export.files["adapter_config.json"].sha256
    expired = f"/api/v1/downloads/alice/{sha}/adapter_config.json?expires={past}&signature={downloads.signature(secret, 'alice', sha, past)}"
    assert_clear_4xx(rest.client.get(expired), 410, "expired")
    # the secret lives in the data dir and is the same for the next process on it
    assert (rest.runtime.settings.data_dir / downloads.SECRET_FILE).read_text().strip().encode() == secret

    # a checkpoint that expires sooner than the link lifetime caps the links
    short = rest.save(run, "short", kind="external_weights", expires_at=NOW() + timedelta(minutes=10))
    capped = rest.ok("GET", f"{RUNS}/{run}/checkpoints/{short.checkpoint_id}/external_weights_urls")
    assert datetime.fromisoformat(capped["expires"].replace("Z", "+00:00")) <= NOW() + timedelta(minutes=10)

    # once the checkpoint is deleted, its links answer 410, except for a file that another
    # checkpoint still holds ("short" has a byte-identical adapter_config.json)
    rest.ok("DELETE", f"{RUNS}/{run}/checkpoints/external_weights/final")
    assert_clear_4xx(rest.client.get(answer["urls"]["adapter_model.safetensors"]), 410, "no longer stored")
    assert rest.client.get(url).content == files["adapter_config.json"]


def test_save_weights_external_is_a_sequenced_request(rest):
    session = rest.session()
    run = rest.model(session)
    future = rest.ok(
        "POST", "/api/v1/save_weights_external", {"model_id": run, "seq_id": 1, "path": "final", "ttl_seconds": 3600}
    )
    assert future["model_id"] == run and future["request_id"]
    event = next(e for _, e in rest.runtime.store.iterate() if e.type.endswith("save_weights_external.requested.v1"))
    assert (event.data.model_id, event.data.seq_id, event.data.name, event.data.ttl_seconds) == (run, 1, "final", 3600)
    # the same body again is a retry: the first future comes back
    assert (
        rest.ok(
            "POST",
            "/api/v1/save_weights_external",
            {"model_id": run, "seq_id": 1, "path": "final", "ttl_seconds": 3600},
        )
        == future
    )
    # a refused export (a key age does not accept) still uses its seq_id, so the trainer never
    # waits for it; no export request is stored for it
    good = str(pyrage.x25519.Identity.generate().to_public())
    refused = rest.request(
        "POST",
        "/api/v1/save_weights_external",
        {"model_id": run, "seq_id": 2, "path": "x", "age_encryption_recipients": [good, "age1abc"]},
    )
    assert_clear_4xx(refused, 400, "age_encryption_recipients[1] ('age1abc') is not an age recipient")
    assert rest.count_events("seq.skipped") == 1
    exports = [e for _, e in rest.runtime.store.iterate() if e.type.endswith("save_weights_external.requested.v1")]
    assert len(exports) == 1
    # valid recipients (age and SSH keys) travel in the event, for the trainer to encrypt to
    ssh_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDq8llDO9+aezaG8DFVOvEajtLsdihhBmuAt3WQlebIg someone@host"
    rest.ok(
        "POST",
        "/api/v1/save_weights_external",
        {"model_id": run, "seq_id": 3, "path": "enc", "age_encryption_recipients": [good, ssh_key]},
    )
    event = [e for _, e in rest.runtime.store.iterate() if e.type.endswith("save_weights_external.requested.v1")][-1]
    assert (event.data.name, event.data.age_encryption_recipients) == ("enc", [good, ssh_key])


def test_replaying_the_events_rebuilds_the_same_runs_checkpoints_and_sessions(rest, tmp_path):
    """Every change above is an event and the projections are a pure fold of them."""
    session = rest.session()
    run = rest.model(session)
    source = rest.save(run, "a")
    rest.save(run, "b", kind="sampler_weights", expires_at=NOW() - timedelta(seconds=1))
    rest.save(run, "c", kind="external_weights")
    rest.ok("PUT", f"{RUNS}/{run}/checkpoints/weights/a/ttl", {"ttl_seconds": 3600})
    rest.ok("POST", f"{RUNS}/{run}/checkpoints/weights/a/publish")
    rest.ok(
        "POST",
        "/api/v1/copy_weights",
        {"source_path": source.tinker_path, "destination_project_id": "p"},
        headers={"X-Idempotency-Key": "k"},
    )
    rest.ok(
        "POST", "/api/v1/copy_weights", {"source_path": source.tinker_path, "session_id": session, "model_seq_id": 2}
    )
    rest.ok("DELETE", f"{RUNS}/{run}/checkpoints/external_weights/c")
    reap_expired(rest.ctx)

    engine = database.make_engine(f"sqlite:///{tmp_path / 'replay.db'}")
    database.upgrade(engine)
    with engine.begin() as conn:
        rows = Rows(conn)
        for _, event in rest.runtime.store.iterate():
            projections.apply(rows, event)
        rows.flush()
    replayed = Projections(engine)
    for table in ("checkpoints", "training_runs", "sessions"):
        assert replayed.table_rows(table) == rest.runtime.projections.table_rows(table), table
    engine.dispose()
