"""A real size-limited filesystem for disk-full tests: a tmpfs mounted with `size=`.

The kernel enforces the limit, so writes fail with ENOSPC exactly where they would on a full
data disk (no wrapper fakes the error). Mounting needs CAP_SYS_ADMIN (root in the CI
container); where it is refused the test is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import errno
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> Path:
    """Fill the filesystem under `path` with one file until a write fails with ENOSPC."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return filler
