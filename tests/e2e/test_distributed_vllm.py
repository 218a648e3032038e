"""The vLLM engine as a process of its own in the distributed deployment: the sampler role is
`openrl sampler --engine vllm` over noida-db and PostgreSQL, beside separate gateway,
projector and trainer processes. Through the real SDK, a LoRA run trained two steps, then
greedy samples of the base model and of the published adapter sent together (one batch) and
the adapter's prompt logprobs; then the sampler is replaced by `openrl sampler --engine
torch` on the same deployment and the identical run repeated. Tokens must be identical and
logprobs within 1e-4 (float32 on both engines), as `test_sdk_vllm_engine` asks of `openrl
serve`.

Skipped only when the vLLM venv (`OPENRL_VLLM_ENV`, else `.venv-vllm`) is absent.
"""

from __future__ import annotations

import pytest

from tests.e2e.cluster import KEY, MODEL, Cluster
from tests.e2e.test_sdk_vllm_engine import VLLM_ENV, check_sessions_match, run_session

pytestmark = [
    # One vLLM start (40-90 s here, more beside busy neighbours), the cluster's, and two sessions.
    pytest.mark.timeout(900),
    pytest.mark.e2e,
    pytest.mark.kafka,
    pytest.mark.postgres,
    pytest.mark.skipif(
        not (VLLM_ENV / "bin" / "python").exists(), reason=f"no vLLM venv at {VLLM_ENV}: run `make vllm`"
    ),
]


def test_a_vllm_sampler_process_samples_like_a_torch_one(tmp_path, pg_url):
    with Cluster(tmp_path, pg_url, role_args={"sampler": ["--engine", "vllm"]}).running() as cluster:
        got = run_session(cluster.url, KEY)
        cluster.workers["sampler"].stop()
        vllm_log = cluster.workers["sampler"].log_path.read_text()
        torch_sampler = cluster.start_role("sampler", extra_args=["--engine", "torch"]).wait_ready()
        want = run_session(cluster.url, KEY)
        torch_log = torch_sampler.log_path.read_text()[len(vllm_log) :]
    assert f"vLLM engine for {MODEL} ready" in vllm_log  # the samples came from vLLM ...
    assert "vLLM engine" not in torch_log and "openrl: sampler" in torch_log  # ... and these from torch
    check_sessions_match(got, want)
