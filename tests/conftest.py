"""Fixtures shared by every test package: the real offline models (materialised once) and
fresh PostgreSQL databases on the local server."""

from __future__ import annotations

import contextlib
import os
import uuid

import pytest
from hypothesis import settings as hypothesis_settings
from sqlalchemy import create_engine, text

from openrl_core.catalog import BUILTIN, SMOLLM2_135M, TINY_QWEN3

# No model hub at test time: huggingface_hub reads this once, at import, and every server and
# recipe subprocess inherits it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on two cores. With torch's default of a thread per core in
    # each worker and in every server they start, OpenMP threads spin-wait on each other
    # (steps measured 10-100x slower); one thread each keeps the cores busy without that.
    # Set before torch is imported anywhere; servers and recipes inherit it.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"

# Property tests: no example database (nothing written into the work tree; a failure prints
# its seed and minimal example instead) and no per-example deadline (a shared CI machine's
# pauses must not fail a property). Each test sets its own modest max_examples.
hypothesis_settings.register_profile("openrl", database=None, deadline=None, print_blob=True)
hypothesis_settings.load_profile("openrl")


@pytest.fixture(scope="session")
def tiny_files():
    """The tiny Qwen3 (random weights, real Qwen tokenizer), built once per machine."""
    from functions.compute.models import materialize

    return materialize(BUILTIN[TINY_QWEN3])


@pytest.fixture(scope="session")
def smol_files():
    """The pretrained SmolLM2-135M-Instruct, dequantised from its GGUF once per machine."""
    from functions.compute.models import materialize

    return materialize(BUILTIN[SMOLLM2_135M])


PG_ADMIN = os.environ.get("OPENRL_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


@contextlib.contextmanager
def scratch_pg_database():
    """A fresh, empty PostgreSQL database, dropped on leaving; yields its URL."""
    name = "openrl_test_" + uuid.uuid4().hex[:12]
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN.rsplit("/", 1)[0] + "/" + name
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def pg_url():
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    with scratch_pg_database() as url:
        yield url
