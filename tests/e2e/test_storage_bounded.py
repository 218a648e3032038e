"""Nothing on disk or in memory grows with every step, and deleting a checkpoint never cuts a
download short. A live `openrl serve` on the tiny model, driven by the real tinker SDK:

- 40 steps, each forward_backward + optim_step + save_weights_and_get_sampling_client + a
  sample, with a snapshot every 5 steps: the blob store after step 40 is the size it was
  after step 10 (the run's newest sampler versions and its latest snapshot), the whole data
  directory grows only by the log's small events, and the server's RSS grows by less than a
  bound (the sampler keeps a run's newest versions loaded, not every one);
- sampling from a superseded, collected version answers a clear error, the newest samples,
  and so does a named checkpoint saved at step 3; the latest snapshot's files are all there;
- a checkpoint deleted (its blobs unlinked) while its archive, or a signed download link,
  is being read still gives the complete bytes.
"""

from __future__ import annotations

import hashlib
import io
import json
import sqlite3
import tarfile
import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from functions.local_server import LocalServer

pytestmark = pytest.mark.e2e
MODEL = "openrl/tiny-qwen3"
KEY = "tml-bounded"
STEPS = 40
PERIOD, GRACE = 0.3, 1.0  # the collector's, short so a test sees several passes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LocalServer(
        tmp_path_factory.mktemp("openrl-bounded"), [MODEL], f"alice={KEY}",
        extra_env={
            "TINKER_TELEMETRY": "0", "OPENRL_BLOB_COLLECTOR_SECONDS": str(PERIOD), "OPENRL_BLOB_GRACE_SECONDS": str(GRACE),
            "OPENRL_SNAPSHOT_EVERY_STEPS": "5", "OPENRL_SAMPLER_VERSIONS_KEPT": "2",
        },
    ) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def service(server):
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    yield client


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def settled(server) -> dict:
    """Sizes once the collector has had passes past the grace period."""
    time.sleep(GRACE + 3 * PERIOD)
    return {
        "blobs": tree_bytes(server.data_dir / "blobs"),
        "data": tree_bytes(server.data_dir),
        "rss": rss(server.process.pid),
    }


def test_many_steps_leave_storage_and_memory_bounded(server, service):
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    tokens = list(range(100, 117))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    params = types.SamplingParams(max_tokens=2, temperature=1.0, seed=0)
    prompt = types.ModelInput.from_ints(tokens[:5])
    samplers, sizes = [], {}
    for step in range(1, STEPS + 1):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        samplers.append(training.save_weights_and_get_sampling_client().result())
        assert samplers[-1].sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences
        if step == 3:
            named = training.save_weights_for_sampler("kept").result().path
        if step in (10, STEPS):
            sizes[step] = settled(server)
    adapter_bytes = 4 * 4 * (151936 + 64)  # the biggest file of one version: rank 4 on the unembedding
    first, last = sizes[10], sizes[STEPS]
    # Live at both points: two sampler versions and one snapshot. Without collection the blob
    # store would hold 30 more versions and 6 more snapshots (over 100 MB).
    assert last["blobs"] <= first["blobs"] + 2 * adapter_bytes, sizes
    # The log and the event store hold each step's small events; nothing big.
    assert last["data"] - first["data"] < 2 * adapter_bytes + (last["blobs"] - first["blobs"]), sizes
    # The sampler holds the run's 2 newest versions loaded, not its LRU's 16 (2.4 MB each at rank 4).
    assert last["rss"] - first["rss"] < 24 << 20, sizes

    # What recovery reads stays: every file of the run's latest snapshot.
    pointers = list((server.data_dir / "snapshots" / "alice").glob("*.json"))
    assert len(pointers) == 1
    files = json.loads(pointers[0].read_text())["files"]
    assert files and all(
        (server.data_dir / "blobs" / "alice" / r["sha256"][:2] / r["sha256"]).is_file() for r in files.values()
    )
    # A named checkpoint keeps its weights, however many versions came after it.
    kept = service.create_sampling_client(model_path=named)
    kept = kept.result() if hasattr(kept, "result") else kept
    assert kept.sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences
    with pytest.raises(Exception, match="superseded"):
        samplers[0].sample(prompt=prompt, num_samples=1, sampling_params=params).result()
    assert samplers[-1].sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences


def big_run(service, seed: int):
    """A trained run with a rank-32 adapter (about 20 MB on the unembedding, 60 MB with Adam's
    moments), so a download cannot sit whole in the loopback socket buffers before the delete."""
    training = service.create_lora_training_client(base_model=MODEL, rank=32, seed=seed).result()
    tokens = list(range(200, 211))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return training


def test_a_checkpoint_deleted_mid_archive_download_still_streams_whole(server, service):
    path = big_run(service, 1).save_state("big").result().path
    headers = {"X-API-Key": KEY}
    api = server.url + "/api/openrl/v1/checkpoints"
    expected = httpx.get(api + "/archive", params={"path": path}, headers=headers, timeout=60)
    assert expected.status_code == 200 and int(expected.headers["content-length"]) == len(expected.content)
    with httpx.stream("GET", api + "/archive", params={"path": path}, headers=headers, timeout=60) as response:
        chunks = response.iter_raw(64 << 10)
        received = [next(chunks)]
        deleted = httpx.delete(api, params={"path": path}, headers=headers)
        assert deleted.status_code == 200 and deleted.json()["freed_blobs"] >= 2  # its files are unlinked now
        received += list(chunks)
    body = b"".join(received)
    assert body == expected.content
    with tarfile.open(fileobj=io.BytesIO(body)) as archive:
        assert sum(member.size for member in archive.getmembers()) > 40 << 20
    assert httpx.get(api + "/archive", params={"path": path}, headers=headers).status_code == 404


def test_a_checkpoint_deleted_mid_signed_download_still_streams_whole(server, service):
    path = big_run(service, 2).save_weights_external("big-export").result().path
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    url = rest.get_external_weights_urls(path).result().urls["adapter_model.safetensors"]
    digest = url.split("/downloads/", 1)[1].split("/")[1]
    run_id, checkpoint_id = path.removeprefix("tinker://").split("/", 1)
    with httpx.stream("GET", url, timeout=60) as response:
        assert response.status_code == 200
        chunks = response.iter_raw(64 << 10)
        received = [next(chunks)]
        deleted = httpx.delete(
            f"{server.url}/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}", headers={"X-API-Key": KEY}
        )
        assert deleted.status_code == 204
        assert not (server.data_dir / "blobs" / "alice" / digest[:2] / digest).exists()
        received += list(chunks)
    body = b"".join(received)
    assert len(body) > 15 << 20 and hashlib.sha256(body).hexdigest() == digest
    assert httpx.get(url).status_code == 410


def test_deleting_a_full_runs_checkpoint_keeps_the_chain_a_live_session_needs(server, service):
    """A full run's sampler checkpoint (version 1, a full file) and the ephemeral version after
    it (a delta on it) share the chain's first file; deleting the checkpoint must not free it."""
    training = service.create_lora_training_client(
        base_model=MODEL, user_metadata={"openrl.full_finetune": "true"}
    ).result()
    tokens = list(range(300, 311))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = training.save_weights_for_sampler("v1").result().path
    training.forward_backward([datum], "cross_entropy").result()
    # A tiny step changes few bfloat16 values, so the next version is published as a delta.
    training.optim_step(types.AdamParams(learning_rate=1e-7)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    with sqlite3.connect(server.data_dir / "events.db") as db:
        (weights,) = db.execute(
            "SELECT weights FROM sampling_sessions WHERE sampling_session_id = ?", (sampler._sampling_session_id,)
        ).fetchone()
    digest = json.loads(weights)["sha256"]
    chain = json.loads((server.data_dir / "blobs" / "alice" / digest[:2] / digest).read_bytes())["chain"]
    assert [link["kind"] for link in chain] == ["full", "delta"]  # the full file is the checkpoint's too
    run_id, checkpoint_id = path.removeprefix("tinker://").split("/", 1)
    deleted = httpx.delete(
        f"{server.url}/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}", headers={"X-API-Key": KEY}
    )
    assert deleted.status_code == 204
    params = types.SamplingParams(max_tokens=2, temperature=0.0)
    assert (
        sampler.sample(prompt=types.ModelInput.from_ints(tokens[:4]), num_samples=1, sampling_params=params)
        .result()
        .sequences
    )
