"""Core imports no I/O library: importing every core module with them blocked must work."""

import pkgutil
import subprocess
import sys

import openrl_core

BLOCKED = ["fastapi", "starlette", "sqlalchemy", "alembic", "kafka", "torch", "transformers", "peft",
           "cloudevents", "httpx", "uvicorn", "psycopg", "sqlite3", "google.protobuf", "safetensors",
           "kubernetes", "kmock", "yaml"]  # fmt: skip

SCRIPT = """
import importlib, importlib.abc, sys
blocked = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in blocked):
            raise ImportError("core must not import " + name)
sys.meta_path.insert(0, Block())
for name in {modules!r}:
    importlib.import_module(name)
print("ok", len({modules!r}))
"""


def test_core_imports_without_io_libraries():
    modules = ["openrl_core"] + [m.name for m in pkgutil.walk_packages(openrl_core.__path__, prefix="openrl_core.")]
    assert len(modules) > 10
    script = SCRIPT.format(blocked=BLOCKED, modules=modules)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok")


def test_the_blocker_really_blocks():
    script = SCRIPT.format(blocked=["pydantic"], modules=["openrl_core.events"])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "core must not import pydantic" in done.stderr
