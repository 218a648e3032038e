"""The data disk full under a real `openrl serve`, driven by the real SDK.

The blob directory (checkpoints, snapshots, large payloads) is its own size-limited tmpfs
(tests/small_disk.py: the kernel enforces the limit; skipped where mounting is not allowed),
filled to the last byte mid-run:

- `save_state` fails with a clear error that says the data disk is full (no server path in it);
- training goes on (a step needs no blob), no blob is half-written or corrupt (every file is
  named by its own SHA-256, no temporary file is left), the checkpoint saved before still
  loads;
- once space is freed, the same save succeeds and loads, with no restart.
"""

from __future__ import annotations

import hashlib

import pytest
import tinker
from tinker import types

from functions.local_server import LocalServer
from tests.e2e.test_sdk_walkthrough import make_batch
from tests.small_disk import fill, small_disk

pytestmark = pytest.mark.e2e
KEY = "tml-disk-full"
MODEL = "openrl/tiny-qwen3"
ADAM = types.AdamParams(learning_rate=5e-3)


def blobs_are_whole(root) -> None:
    files = [p for p in root.rglob("*") if p.is_file() and p.name != "filler"]
    assert files and not [p for p in files if p.name.startswith(".tmp-")]
    for path in files:
        assert hashlib.sha256(path.read_bytes()).hexdigest() == path.name, path


def test_a_full_data_disk_is_a_clear_error_corrupts_nothing_and_the_service_resumes(tmp_path):
    data = tmp_path / "data"
    with small_disk(data / "blobs", "16m") as blobs:
        server = LocalServer(data, [MODEL], f"alice={KEY}")
        try:
            server.wait_ready()
            client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
            training = client.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
            batch = make_batch(training.get_tokenizer())
            training.forward_backward(batch, "cross_entropy").result()
            training.optim_step(ADAM).result()
            before = training.save_state("before").result(timeout=120).path

            fill(blobs)
            step = training.forward_backward(batch, "cross_entropy").result(timeout=120)  # training needs no blob
            training.optim_step(ADAM).result(timeout=120)
            with pytest.raises(Exception) as refused:  # new weights: new blobs, and no room for them
                training.save_state("while-full").result(timeout=120)
            message = str(refused.value)
            assert "data disk is full" in message and str(blobs) not in message, message
            blobs_are_whole(blobs)
            restored = client.create_training_client_from_state(before).result()
            # the checkpoint saved before the disk filled holds the weights that step ran on
            assert restored.forward(batch, "cross_entropy").result(timeout=120).metrics["loss:sum"] == pytest.approx(
                step.metrics["loss:sum"], rel=1e-5
            )

            (blobs / "filler").unlink()
            after = training.save_state("while-full").result(timeout=120).path  # the same save, now with room
            again = client.create_training_client_from_state(after).result()
            assert (
                again.forward(batch, "cross_entropy").result(timeout=120).metrics["loss:sum"] < step.metrics["loss:sum"]
            )
            blobs_are_whole(blobs)
        except Exception:
            print(server.log_tail())
            raise
        finally:
            server.stop()
