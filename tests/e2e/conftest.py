"""A real `openrl serve` subprocess on a free port, driven by the real tinker SDK."""

from __future__ import annotations

import pytest

from functions.local_server import LocalServer

API_KEY = "tml-e2e-alice"
OTHER_KEY = "tml-e2e-bob"


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = LocalServer(tmp_path_factory.mktemp("openrl-e2e"), ["openrl/tiny-qwen3"], f"alice={API_KEY},bob={OTHER_KEY}")
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
