"""Cases for `SamplingClient` and `RestClient` (see `surface_rig.py` for the contract)."""

from __future__ import annotations

import json
import sqlite3
import urllib.request
import uuid
from datetime import datetime, timezone

import huggingface_hub.constants
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.lib.api_future_impl import QueueState

from tests.e2e.surface_rig import MODEL, NOTE, OTHER, case, train_one_step

SC, R = "SamplingClient.", "RestClient."


# -- SamplingClient --------------------------------------------------------------------------------


@case(
    SC + "compute_logprobs",
    SC + "compute_logprobs_async",
    checked="prompt logprobs, None at position 0 and before prompt_logprobs_last_n",
)
def _compute_logprobs(w, call):
    prompt = w.prompt()
    full = call(w.sampler, "compute_logprobs", prompt)
    assert full[0] is None and len(full) == prompt.length and all(np.isfinite(full[1:]))
    last = call(w.sampler, "compute_logprobs", prompt, prompt_logprobs_last_n=2)
    assert last[:-2] == [None] * (prompt.length - 2) and last[-2:] == pytest.approx(full[-2:], abs=1e-5)


@case(
    SC + "create",
    checked="(static) a client for an existing sampling session id, learning its base model from GET /samplers",
)
def _create(w, call):
    sampler = tinker.SamplingClient.create(
        w.service.holder, sampling_session_id=w.sampler._sampling_session_id
    ).result()
    assert sampler.get_base_model() == MODEL


@case(
    SC + "from_sampler_handle",
    SC + "get_sampler_handle",
    checked="a handle made here gives a client (own credentials) that samples the same tokens",
)
def _handle(w, call):
    handle = w.sampler.get_sampler_handle()
    assert isinstance(handle, str) and w.api_key not in handle  # no credentials inside
    clone = tinker.SamplingClient.from_sampler_handle(handle, api_key=w.api_key)
    params = types.SamplingParams(max_tokens=4, seed=3)
    ours, theirs = (c.sample(w.prompt(), num_samples=1, sampling_params=params).result() for c in (w.sampler, clone))
    assert ours.sequences[0].tokens == theirs.sequences[0].tokens


@case(SC + "get_base_model", SC + "get_base_model_async", checked="the base model name")
def _get_base_model(w, call):
    assert call(w.sampler, "get_base_model") == MODEL


@case(SC + "get_telemetry", checked="the holder's telemetry (None when TINKER_TELEMETRY=0; no request)")
def _sampling_telemetry(w, call):
    assert call(w.sampler, "get_telemetry") is None


@case(
    SC + "get_tokenizer",
    status=NOTE,
    checked="loads the tokenizer by base model name from a Hugging Face cache holding it (HF_HUB_OFFLINE)",
    note="a SamplingClient knows only the base model name, so its tokenizer must resolve offline by that name "
    "(a cache entry or local directory); TrainingClient.get_tokenizer needs nothing, get_info gives it a local directory",
)
def _sampling_tokenizer(w, call):
    with pytest.MonkeyPatch.context() as patch:  # the cache the cookbook tests populate
        patch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(w.hf_home / "hub"))
        assert call(w.sampler, "get_tokenizer").encode("Hello world") == [9707, 1879]


@case(
    SC + "on_queue_state_change",
    status=NOTE,
    checked="logs a pause warning (client-side callback)",
    note="a callback the SDK calls when the server reports a paused queue; OpenRL's queues never pause",
)
def _on_queue_state_change(w, call):
    assert call(w.sampler, "on_queue_state_change", QueueState.PAUSED_CAPACITY, "test") is None


@case(
    SC + "sample",
    SC + "sample_async",
    checked="num_samples sequences with tokens, logprobs, stop reasons and sequence ids; a seed repeats; "
    "topk_sample_logprobs, target_prompt_logprobs (dense and sparse CSR) and prompt_alt_tokens_k answered "
    "(their values are checked against a plain forward in test_sdk_prompt_scoring.py)",
)
def _sample(w, call):
    import torch

    params = types.SamplingParams(max_tokens=5, temperature=0.7, seed=9, stop=["\n\nUser:"])
    first = call(w.sampler, "sample", w.prompt(), 3, params, include_prompt_logprobs=True)
    assert len(first.sequences) == 3 and first.prompt_logprobs[0] is None
    for sequence in first.sequences:
        assert len(sequence.tokens) == len(sequence.logprobs) <= 5 and sequence.stop_reason in ("stop", "length")
    assert len({s.sequence_id for s in first.sequences}) == 3
    again = call(w.sampler, "sample", w.prompt(), 3, params)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]
    prompt = w.prompt()
    rows = prompt.length - 1
    ids = torch.full((rows, 4), -1, dtype=torch.int64)  # mostly -1: from_torch_sparse sends CSR
    ids[rows - 1, 0] = 11
    sparse = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert sparse.sparse_crow_indices is not None
    for target in (types.TensorData.from_torch(ids), sparse):
        scored = call(
            w.sampler, "sample", prompt, 1, params, topk_sample_logprobs=2, target_prompt_logprobs=target,
            prompt_alt_tokens_k=2,
        )  # fmt: skip
        assert scored.target_prompt_logprobs.shape == [rows, 4]
        assert (scored.target_prompt_logprobs.sparse_crow_indices is None) == (target.sparse_crow_indices is None)
        assert scored.target_prompt_logprobs.to_numpy()[rows - 1, 0] < 0
        assert scored.prompt_alt_tokens.tokens.shape == [rows, 2]
        assert all(len(row) == 2 for s in scored.sequences for row in s.topk_logprobs)


# -- RestClient ------------------------------------------------------------------------------------


@case(
    R + "assign_session_project",
    R + "assign_session_project_async",
    checked="the session moves: search_sessions and list_training_runs find it and its run under the new project",
)
def _assign_project(w, call):
    project = f"surface-{uuid.uuid4().hex[:8]}"
    call(w.rest, "assign_session_project", w.session_id, project)
    found = w.rest.search_sessions(types.SessionSearchRequest(project_ids=[project])).result()
    assert [s.session_id for s in found.sessions] == [w.session_id] and found.sessions[0].project_id == project
    runs = w.rest.list_training_runs(project_id=project).result().training_runs
    assert w.training.model_id in {run.training_run_id for run in runs}


@case(
    R + "copy_weights",
    R + "copy_weights_async",
    checked="a copy under a new run, loadable into a training client with the same weights",
)
def _rest_copy(w, call):
    copied = call(w.rest, "copy_weights", w.state_path, "archive")
    assert copied != w.state_path
    restored = w.service.create_training_client_from_state(copied).result()
    for got, want in zip(w.logprobs(restored), w.logprobs(w.training)):
        np.testing.assert_allclose(got, want, atol=1e-5)


@case(R + "delete_checkpoint", R + "delete_checkpoint_async", checked="the checkpoint leaves the run's list")
def _delete(w, call):
    path = w.fresh_checkpoint("sampler_weights")
    checkpoint_id = path.split(f"{w.training.model_id}/")[1]
    call(w.rest, "delete_checkpoint", w.training.model_id, checkpoint_id)
    assert path not in {c.tinker_path for c in w.rest.list_checkpoints(w.training.model_id).result().checkpoints}


@case(
    R + "delete_checkpoint_from_tinker_path",
    R + "delete_checkpoint_from_tinker_path_async",
    checked="gone; deleting again is a 404",
)
def _delete_by_path(w, call):
    path = w.fresh_checkpoint()
    call(w.rest, "delete_checkpoint_from_tinker_path", path)
    with pytest.raises(tinker.NotFoundError):
        w.rest.delete_checkpoint_from_tinker_path(path).result()


@case(
    R + "export_session_trace",
    R + "export_session_trace_async",
    checked="a signed link to a Chrome trace (traceEvents: ph/ts/dur/pid/tid) whose optim_step slices start and "
    "end at the stored events' times",
)
def _export_trace(w, call):
    train_one_step(w.training, w.batch)
    url = call(w.rest, "export_session_trace", w.session_id)
    with urllib.request.urlopen(url) as answer:  # a plain GET, no key: as the SDK documents
        trace = json.loads(answer.read())
    events = trace["traceEvents"]
    named = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M"}
    slices = [e for e in events if e["ph"] == "X"]
    assert slices and all(isinstance(e[k], int) for e in slices for k in ("ts", "dur", "pid", "tid"))
    assert all(e["dur"] >= 0 and (e["pid"], 0) in named and (e["pid"], e["tid"]) in named for e in slices)
    stored = stored_times(w, "optim_step")
    # the session's other runs (the world makes several) have their own slices; this run's:
    ran = {
        e["args"]["request_id"]: e
        for e in slices
        if e["name"] == "optim_step" and e["args"]["key"] == w.training.model_id
    }
    finished = {rid: phases for rid, phases in stored.items() if {"started", "completed"} <= set(phases)}
    assert finished and set(finished) <= set(ran) <= set(stored)
    for request_id, phases in finished.items():
        slice_ = ran[request_id]
        assert slice_["ts"] == micros(phases["started"]) and slice_["ts"] + slice_["dur"] == micros(phases["completed"])
        assert named[(slice_["pid"], slice_["tid"])] == f"run {w.training.model_id}"
    assert any(e["name"].startswith("turn ") for e in slices)  # timeslicer turns, from the events' lease ids


def stored_times(w, verb: str) -> dict[str, dict[str, datetime]]:
    """request id -> phase -> time, read from the server's event store (SQLite, read-only)."""
    database = sqlite3.connect(f"file:{w.server.data_dir / 'events.db'}?mode=ro", uri=True)
    try:
        rows = database.execute(
            "SELECT subject, type, time, data FROM events WHERE type LIKE ? AND key = ?",
            (f"%.{verb}.%", w.training.model_id),
        ).fetchall()
    finally:
        database.close()
    out: dict[str, dict[str, datetime]] = {}
    for subject, type_, time, data in rows:
        phases = out.setdefault(subject, {})
        moment = datetime.fromisoformat(str(time))
        phases[type_.split(".")[4]] = moment.replace(tzinfo=moment.tzinfo or timezone.utc)
        details = json.loads(bytes(data)).get("details") or {} if data else {}
        if "started" in details:  # the trainer records when work began in its completion
            phases["started"] = datetime.fromisoformat(details["started"])
    return out


def micros(moment: datetime) -> int:
    return int(round(moment.timestamp() * 1_000_000))


@case(
    R + "get_external_weights_urls",
    R + "get_external_weights_urls_async",
    checked="signed links to adapter_model.safetensors and adapter_config.json that download without a key",
)
def _external_urls(w, call):
    import urllib.request

    links = call(w.rest, "get_external_weights_urls", w.external_path)
    assert set(links.urls) == {"adapter_model.safetensors", "adapter_config.json"} and links.expires is not None
    with urllib.request.urlopen(links.urls["adapter_config.json"], timeout=30) as response:
        assert b"lora" in response.read().lower()


@case(R + "get_sampler", R + "get_sampler_async", checked="the sampler's base model and model path")
def _get_sampler(w, call):
    sampler = call(w.rest, "get_sampler", w.sampler._sampling_session_id)
    assert (sampler.base_model, sampler.model_path) == (MODEL, w.sampler_path)


@case(R + "get_server_capabilities", checked="lists the served models, the cookbook aliases among them")
def _rest_capabilities(w, call):
    names = {m.model_name for m in call(w.rest, "get_server_capabilities").supported_models}
    assert {"openrl/tiny-qwen3", "Qwen/Qwen3-8B", "Qwen/Qwen3-8B-Base"} <= names


@case(R + "get_session", R + "get_session_async", checked="the session's training runs and samplers")
def _get_session(w, call):
    w.sampler  # noqa: B018  (made in this session)
    session = call(w.rest, "get_session", w.session_id)
    assert w.training.model_id in session.training_run_ids and w.sampler._sampling_session_id in session.sampler_ids


@case(R + "get_telemetry", checked="the session-less holder's telemetry (None when TINKER_TELEMETRY=0; no request)")
def _rest_telemetry(w, call):
    assert call(w.rest, "get_telemetry") is None


@case(
    R + "get_training_run",
    R + "get_training_run_async",
    checked="base model, owner, LoRA rank, last checkpoints, user_metadata (renderer_name)",
)
def _get_run(w, call):
    w.state_path  # noqa: B018  (so there is a last checkpoint)
    run = call(w.rest, "get_training_run", w.training.model_id)
    assert (run.base_model, run.is_lora, run.lora_rank, run.model_owner) == (MODEL, True, 4, "alice")
    assert run.user_metadata["renderer_name"] == "qwen3" and run.last_checkpoint is not None


@case(
    R + "get_training_run_by_tinker_path",
    R + "get_training_run_by_tinker_path_async",
    checked="the run a checkpoint path belongs to",
)
def _get_run_by_path(w, call):
    assert call(w.rest, "get_training_run_by_tinker_path", w.sampler_path).training_run_id == w.training.model_id


@case(R + "get_weights_info_by_tinker_path", checked="base model, LoRA rank and targets of a checkpoint")
def _weights_info(w, call):
    info = call(w.rest, "get_weights_info_by_tinker_path", w.state_path)
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_mlp) == (MODEL, True, 4, True)


@case(R + "list_checkpoints", R + "list_checkpoints_async", checked="the run's checkpoints with their types")
def _list_checkpoints(w, call):
    listed = {
        c.tinker_path: c.checkpoint_type for c in call(w.rest, "list_checkpoints", w.training.model_id).checkpoints
    }
    assert listed[w.state_path] == "training" and listed[w.sampler_path] == "sampler"


@case(R + "list_sessions", R + "list_sessions_async", checked="this tenant's sessions, paged")
def _list_sessions(w, call):
    assert w.session_id in call(w.rest, "list_sessions", limit=1000).sessions
    assert len(call(w.rest, "list_sessions", limit=1).sessions) == 1


@case(R + "list_training_runs", R + "list_training_runs_async", checked="this tenant's runs with a total count")
def _list_runs(w, call):
    page = call(w.rest, "list_training_runs", limit=1000)
    assert w.training.model_id in {r.training_run_id for r in page.training_runs} and page.cursor.total_count >= 1


@case(
    R + "list_user_checkpoints", R + "list_user_checkpoints_async", checked="every checkpoint of the tenant, with sizes"
)
def _list_user_checkpoints(w, call):
    listed = {c.tinker_path: c for c in call(w.rest, "list_user_checkpoints", limit=1000).checkpoints}
    assert listed[w.state_path].size_bytes > 0


@case(
    R + "publish_checkpoint_from_tinker_path",
    R + "publish_checkpoint_from_tinker_path_async",
    R + "unpublish_checkpoint_from_tinker_path",
    R + "unpublish_checkpoint_from_tinker_path_async",
    checked="the public flag is set and cleared",
)
def _publish(w, call):
    path = w.fresh_checkpoint()
    w.rest.publish_checkpoint_from_tinker_path(path).result()
    call(w.rest, "unpublish_checkpoint_from_tinker_path", path)
    call(w.rest, "publish_checkpoint_from_tinker_path", path)
    assert next(
        c for c in w.rest.list_checkpoints(w.training.model_id).result().checkpoints if c.tinker_path == path
    ).public


@case(
    R + "search_sessions",
    checked="finds the session by id (status active); pages every session newest first by next_cursor, no repeats",
)
def _search(w, call):
    by_id = call(w.rest, "search_sessions", types.SessionSearchRequest(session_id=w.session_id))
    assert [s.session_id for s in by_id.sessions] == [w.session_id]
    assert by_id.sessions[0].status is not None and by_id.sessions[0].status.type == "active"
    seen, request = [], types.SessionSearchRequest(limit=1, owner=types.AccessibleSearchOwner())
    while True:
        page = call(w.rest, "search_sessions", request)
        seen += [s.session_id for s in page.sessions]
        if page.next_cursor is None:
            break
        request = request.model_copy(update={"cursor": page.next_cursor})
    assert w.session_id in seen and len(seen) == len(set(seen)) == len(
        w.rest.list_sessions(limit=100).result().sessions
    )


@case(
    R + "set_checkpoint_ttl_from_tinker_path",
    R + "set_checkpoint_ttl_from_tinker_path_async",
    checked="sets and clears expires_at",
)
def _ttl(w, call):
    path = w.fresh_checkpoint()

    def expires():
        return next(
            c for c in w.rest.list_checkpoints(w.training.model_id).result().checkpoints if c.tinker_path == path
        ).expires_at

    call(w.rest, "set_checkpoint_ttl_from_tinker_path", path, 7200)
    assert expires() is not None
    call(w.rest, "set_checkpoint_ttl_from_tinker_path", path, None)
    assert expires() is None


@case(
    R + "whoami",
    status=OTHER,
    checked="the SDK raises RuntimeError before any request",
    note="reads identity from a JWT; OpenRL authenticates plain API keys (pjwt_auth_enabled is false)",
)
def _whoami(w, call):
    with pytest.raises(RuntimeError, match="requires JWT auth"):
        call(w.rest, "whoami")
