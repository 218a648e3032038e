"""Both SDK generations against a server that makes them take the rarer paths: a short
long-poll (unfinished futures answer 408 try_again) and a tiny complete_metadata threshold
(every result is announced by size first).

tinker 0.22.7 runs `sdk_0_22_walkthrough.py` in its own venv (`make sdk-0.22` builds it):
JSON forward/forward_backward bodies, JSON `/forward`, protobuf or JSON results. 0.38 runs
in this process. Both handle 408 and 200 try_again the same way (`api_future_impl.py`:
408 → immediate re-poll, no log line), so the server answers 408 to every version.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import tinker
from tinker import types
from tinker.lib import api_future_impl

from functions.local_server import LocalServer
from tests.e2e.conftest import API_KEY
from tests.e2e.sdk_close import close_service

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
OLD_SDK_PYTHON = REPO / ".venv-sdk-0.22" / "bin" / "python"
MODEL = "openrl/tiny-qwen3"


@pytest.fixture(scope="module")
def quirky_server(tmp_path_factory):
    env = {"OPENRL_LONG_POLL_SECONDS": "0.05", "OPENRL_METADATA_ONLY_THRESHOLD_BYTES": "64"}
    srv = LocalServer(tmp_path_factory.mktemp("openrl-quirky"), [MODEL], f"alice={API_KEY}", extra_env=env)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_tinker_0_22_walkthrough(quirky_server, tmp_path):
    if not OLD_SDK_PYTHON.exists():
        pytest.skip("no .venv-sdk-0.22: run `make sdk-0.22`")
    env = dict(
        os.environ, TINKER_BASE_URL=quirky_server.url, TINKER_API_KEY=API_KEY, TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1"
    )
    env.pop("PYTHONPATH", None)
    script = REPO / "tests" / "e2e" / "sdk_0_22_walkthrough.py"
    run = subprocess.run(
        [str(OLD_SDK_PYTHON), str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, (
        f"{run.stdout[-3000:]}\n{run.stderr[-6000:]}\n--- server ---\n{quirky_server.log_tail()}"
    )
    facts = json.loads(run.stdout.strip().splitlines()[-1])
    assert facts["json_fwdbwd_calls"] >= 4 and facts["json_forward_calls"] >= 3  # no protobuf bodies from 0.22
    assert facts["408"] > 0  # re-polled at once, and every future still resolved
    assert facts["complete_metadata"] > 0  # size first, then the payload
    assert facts["json_checked"] == 2


def test_tinker_0_38_takes_408_and_complete_metadata_in_its_stride(quirky_server, monkeypatch):
    seen = {"408": 0, "metadata": 0}
    to_transport_error, handle_outcome = (
        api_future_impl._rest_status_error_to_transport_error,
        api_future_impl._APIFuture._handle_outcome,
    )

    def counting_transport_error(error):
        seen["408"] += error.response.status_code == 408
        return to_transport_error(error)

    async def counting_outcome(self, outcome, *args, **kwargs):
        seen["metadata"] += isinstance(outcome, api_future_impl._MetadataOnly)
        return await handle_outcome(self, outcome, *args, **kwargs)

    monkeypatch.setattr(api_future_impl, "_rest_status_error_to_transport_error", counting_transport_error)
    monkeypatch.setattr(api_future_impl._APIFuture, "_handle_outcome", counting_outcome)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    service = tinker.ServiceClient(base_url=quirky_server.url, api_key=API_KEY)
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    tokens = list(range(100, 120))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 19},
    )
    before = training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = training.forward([datum], "cross_entropy").result()
    assert after.metrics["loss:sum"] < before.metrics["loss:sum"]
    sampler = training.save_weights_and_get_sampling_client().result()
    response = sampler.sample(
        types.ModelInput.from_ints(tokens[:5]), 2, types.SamplingParams(max_tokens=6, seed=3, stop=[])
    ).result()
    assert [len(s.tokens) for s in response.sequences] == [6, 6]
    assert seen["408"] > 0 and seen["metadata"] > 0, seen
    close_service(service)
