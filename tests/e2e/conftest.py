"""A real `openrl serve` subprocess on a free port, driven by the real tinker SDK.

The server also serves the tiny model under the Qwen3 names tinker-cookbook recipes know
(`tests/e2e/cookbook_rig.py` says why).
"""

from __future__ import annotations

import json

import pytest

from functions.local_server import LocalServer
from tests.e2e.cookbook_rig import COOKBOOK_ALIASES, FULL_FINETUNE_NAMES

API_KEY = "tml-e2e-alice"
OTHER_KEY = "tml-e2e-bob"


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = LocalServer(
        tmp_path_factory.mktemp("openrl-e2e"),
        ["openrl/tiny-qwen3"],
        f"alice={API_KEY},bob={OTHER_KEY}",
        extra_env={
            "OPENRL_MODEL_ALIASES": json.dumps(COOKBOOK_ALIASES),
            "OPENRL_FULL_FINETUNE_MODELS": ",".join(FULL_FINETUNE_NAMES),
        },
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def sdk_env(server, monkeypatch):
    monkeypatch.setenv("TINKER_BASE_URL", server.url)
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    return server


@pytest.fixture(scope="session")
def hf_home(tmp_path_factory, tiny_files):
    """A Hugging Face cache holding the tiny model's tokenizer under the aliased hub names."""
    from tests.e2e.cookbook_rig import populate_hf_cache

    return populate_hf_cache(tmp_path_factory.mktemp("hf-home"), sorted(COOKBOOK_ALIASES), tiny_files.path)
