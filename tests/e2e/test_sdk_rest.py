"""The RestClient surface against a real server: training runs, checkpoints (list, publish,
TTL, delete), weights_info, copy_weights, sessions, and save_weights_external downloaded
with a plain urllib GET and loaded in PEFT, whose logits must be the server's."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import OTHER_KEY
from tests.e2e.sdk_close import close_service

pytestmark = pytest.mark.e2e
MODEL = "openrl/tiny-qwen3"


def trained(service, steps=2):
    training = service.create_lora_training_client(
        base_model=MODEL, rank=4, seed=11, user_metadata={"renderer_name": "qwen3"}
    ).result()
    tokens = training.get_tokenizer().encode("the quick brown fox jumps over the lazy dog again and again")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    for _ in range(steps):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    return training, datum, tokens


def target_logprobs(model, tokens) -> np.ndarray:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()


def peft_logprobs(tiny_files, adapter_dir: Path, tokens, merge: bool) -> np.ndarray:
    import torch
    from peft import PeftModel

    from functions.compute.models import load_causal_lm

    base = load_causal_lm(tiny_files)
    if merge:
        # The tiny Qwen3 ties lm_head to the input embeddings; merging the lm_head LoRA into a
        # tied weight would change the embeddings too, so untie first (as PEFT's warning says).
        base.lm_head.weight = torch.nn.Parameter(base.model.embed_tokens.weight.detach().clone())
        base.config.tie_word_embeddings = False
    model = PeftModel.from_pretrained(base, adapter_dir)
    if merge:
        model = model.merge_and_unload()
    model.eval()
    return target_logprobs(model, tokens)


def download(urls: dict[str, str], into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    for name, url in urls.items():
        with urllib.request.urlopen(url, timeout=60) as response:  # no API key, as the CLI does it
            (into / name).write_bytes(response.read())


def test_rest_client_over_runs_checkpoints_and_sessions(sdk_env, tiny_files, tmp_path):
    service = tinker.ServiceClient()
    rest = tinker.RestClient()
    training, datum, tokens = trained(service)
    run_id = training.model_id
    state = training.save_state("state-1", ttl_seconds=86400).result().path
    sampler = training.save_weights_for_sampler("sampler-1").result().path
    export = training.save_weights_external("export-1").result().path
    assert export == f"tinker://{run_id}/external_weights/export-1"
    reference = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    # training runs
    runs = rest.list_training_runs(limit=100).result()
    assert run_id in [run.training_run_id for run in runs.training_runs] and runs.cursor.total_count >= 1
    run = rest.get_training_run(run_id).result()
    assert (run.base_model, run.is_lora, run.lora_rank, run.corrupted) == (MODEL, True, 4, False)
    assert run.user_metadata == {"renderer_name": "qwen3"} and run.model_owner == "alice"
    assert run.last_checkpoint.tinker_path == state and run.last_checkpoint.checkpoint_type == "training"
    assert run.last_sampler_checkpoint.tinker_path == sampler
    assert rest.get_training_run_by_tinker_path(sampler).result().training_run_id == run_id

    # checkpoints
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert set(listed) == {"weights/state-1", "sampler_weights/sampler-1", "external_weights/export-1"}
    assert (
        listed["external_weights/export-1"].checkpoint_type == "external"
        and listed["external_weights/export-1"].size_bytes > 0
    )
    assert listed["weights/state-1"].expires_at is not None
    mine = rest.list_user_checkpoints(limit=100).result()
    assert {"weights/state-1", "external_weights/export-1"} <= {c.checkpoint_id for c in mine.checkpoints}
    assert mine.cursor.total_count >= 3
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_unembed, info.train_mlp, info.train_attn) == (
        MODEL,
        True,
        4,
        True,
        True,
        True,
    )

    rest.publish_checkpoint_from_tinker_path(state).result()
    assert next(c for c in rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == state).public
    rest.unpublish_checkpoint_from_tinker_path(state).result()
    assert not next(c for c in rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == state).public
    rest.set_checkpoint_ttl_from_tinker_path(state, None).result()
    assert (
        next(c for c in rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == state).expires_at is None
    )
    rest.set_checkpoint_ttl_from_tinker_path(export, 7200).result()
    assert (
        next(c for c in rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == export).expires_at
        is not None
    )

    # the export: signed links, a plain urllib download, PEFT on the base model gives the server's logprobs
    links = rest.get_external_weights_urls(export).result()
    assert set(links.urls) == {"adapter_model.safetensors", "adapter_config.json"}
    download(links.urls, tmp_path / "export")
    np.testing.assert_allclose(
        peft_logprobs(tiny_files, tmp_path / "export", tokens, merge=False), reference, atol=1e-4
    )
    np.testing.assert_allclose(peft_logprobs(tiny_files, tmp_path / "export", tokens, merge=True), reference, atol=1e-4)

    # copy_weights: a new run holds the copy; it loads into a training client with the same weights
    copied = rest.copy_weights(state, "archive").result()
    assert copied.endswith("/weights/state-1") and copied != state
    restored = service.create_training_client_from_state(copied).result()
    again = restored.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(again, reference, atol=1e-6)

    # sessions
    session_id = run_id.split(":train:")[0]
    assert session_id in rest.list_sessions(limit=100).result().sessions
    session = rest.get_session(session_id).result()
    assert run_id in session.training_run_ids and restored.model_id in session.training_run_ids

    # another tenant sees none of it
    bob = tinker.RestClient(api_key=OTHER_KEY)
    with pytest.raises(tinker.NotFoundError):
        bob.get_training_run(run_id).result()
    with pytest.raises(tinker.NotFoundError):
        bob.get_weights_info_by_tinker_path(state).result()
    assert session_id not in bob.list_sessions(limit=100).result().sessions

    # delete, by id and by path. No training happened between the saves, so the export's
    # adapter file is byte-identical to the one in state-1 (and its copy): the blob, and so
    # the link, lives until the last checkpoint holding it is gone.
    rest.delete_checkpoint(run_id, "sampler_weights/sampler-1").result()
    rest.delete_checkpoint_from_tinker_path(export).result()
    assert {c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints} == {"weights/state-1"}
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(export).result()
    with urllib.request.urlopen(links.urls["adapter_model.safetensors"], timeout=60) as still:
        assert still.status == 200
    rest.delete_checkpoint_from_tinker_path(state).result()
    rest.delete_checkpoint_from_tinker_path(copied).result()
    with pytest.raises(urllib.error.HTTPError) as gone:
        urllib.request.urlopen(links.urls["adapter_model.safetensors"], timeout=60)
    assert gone.value.code == 410

    close_service(service)


def test_openrl_serve_reaps_expired_checkpoints(tmp_path, monkeypatch):
    """The reaper thread that `openrl serve` runs removes an expired checkpoint within a few
    seconds: an expiry event, the record gone from reads, its blobs deleted, others kept."""
    import sqlite3
    import time

    from functions.local_server import LocalServer

    key = "tml-e2e-reaper"
    env = {"OPENRL_CHECKPOINT_REAPER_SECONDS": "0.3"}
    blob_dir = tmp_path / "data" / "blobs" / "carol"

    def blobs() -> set[str]:
        return {p.name for p in blob_dir.rglob("*") if p.is_file()}

    with LocalServer(tmp_path / "data", [MODEL], f"carol={key}", extra_env=env) as server:
        monkeypatch.setenv("TINKER_TELEMETRY", "0")
        # explicit: the SDK caches session-less holders by these arguments, not by the environment
        service = tinker.ServiceClient(base_url=server.url, api_key=key)
        rest = tinker.RestClient(base_url=server.url, api_key=key)
        training, datum, _ = trained(service, steps=1)
        before = blobs()
        short = training.save_state("short-lived", ttl_seconds=1).result().path
        short_only = blobs() - before  # its adapter and optimizer state
        assert short_only
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        kept = training.save_state("kept").result().path  # other weights, so other blobs
        everything = blobs()

        database = sqlite3.connect(f"file:{tmp_path / 'data' / 'events.db'}?mode=ro", uri=True)
        deadline, expired = time.monotonic() + 20, []
        while time.monotonic() < deadline and not expired:
            time.sleep(0.2)
            expired = database.execute("SELECT subject FROM events WHERE type LIKE '%checkpoint.expire%'").fetchall()
        database.close()
        assert expired == [(short,)]
        assert [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints] == [kept]
        while time.monotonic() < deadline and not short_only - blobs():  # blobs go just after the event
            time.sleep(0.1)
        # its weights and optimizer state are gone; its adapter_config.json, byte-identical to
        # the one "kept" holds, stays, as does everything "kept" and earlier saves hold
        assert short_only - blobs()
        assert before <= blobs() and everything - short_only <= blobs()
        rest.get_weights_info_by_tinker_path(kept).result()
        close_service(service)
