"""A real `openrl serve` with the tiny model for the example recipes, and a way to run them.

The recipes are scripts (`python examples/NAME.py ...`), so tests run them as a researcher
does, in a subprocess with TINKER_BASE_URL / TINKER_API_KEY pointing at the server; their
pure helpers are also imported directly (`examples/` on `sys.path`, as when run as scripts).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from functions.local_server import LocalServer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
API_KEY = "tml-examples"
TINY = "openrl/tiny-qwen3"

if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))


@pytest.fixture(scope="session")
def recipe_server(tmp_path_factory):
    with LocalServer(tmp_path_factory.mktemp("openrl-examples"), [TINY], f"examples={API_KEY}") as srv:
        yield srv


@pytest.fixture
def run_example(recipe_server, tmp_path):
    """Run examples/<script> with args against the server; returns the finished process."""

    def run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        # PYTHONFAULTHANDLER: a crash (a fatal signal at exit, say) leaves every thread's stack in the output.
        env = dict(
            os.environ,
            TINKER_BASE_URL=recipe_server.url,
            TINKER_API_KEY=API_KEY,
            TINKER_TELEMETRY="0",
            PYTHONFAULTHANDLER="1",
        )
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / script), *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        # Exit 0, not only the numbers written: a recipe that crashes at interpreter exit (a
        # signal: a negative code) fails here, as it fails `make recipe-*` and autoresearch's runs.
        assert done.returncode == 0, f"exit {done.returncode}\n" + done.stdout[-4000:] + done.stderr[-4000:]
        return done

    return run
