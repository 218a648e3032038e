"""Give host memory that a pass freed back to the operating system.

A training pass allocates its activations (SmolLM2-135M, 32 x 24 tokens: about 1.5 GB of
tensors of a few MB each) and frees them at its end. glibc keeps freed chunks below its
mmap threshold (which it raises up to 32 MB as big blocks are freed) in its arenas, one
per thread that allocated, so without help the process keeps the peak of every thread that
ever ran a pass: measured, `openrl serve` stayed 2.3 GB above its weights after one step.
`malloc_trim(0)` returns every free page of every arena; it costs milliseconds and the
next pass takes fresh pages from the kernel instead of reused ones.

The workers of a process trim only once the whole process has been idle a moment
(`working()` around each piece of work, `release_if_idle(quiet)` when a poll finds nothing;
the rule is `openrl_core.idleness`): trimming at every idle poll cost an RL loop the re-faulted
pages of every pass.

`release()` is a no-op where there is no glibc (musl, macOS): correctness never depends on it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

from openrl_core.idleness import Idleness

log = logging.getLogger(__name__)
_libc: Optional[ctypes.CDLL] = None
_looked = False
_idleness = Idleness()  # of every worker in this process
_lock = threading.Lock()


def _glibc() -> Optional[ctypes.CDLL]:
    global _libc, _looked
    if not _looked:
        _looked = True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = libc if hasattr(libc, "malloc_trim") else None
        except OSError:
            _libc = None
    return _libc


def release() -> bool:
    """Return the free pages of every malloc arena to the system; whether anything was given back."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.malloc_trim(0))


@contextmanager
def working() -> Iterator[None]:
    """Around a piece of a worker's work: the process is not idle meanwhile."""
    with _lock:
        _idleness.begin()
    try:
        yield
    finally:
        with _lock:
            _idleness.end(time.monotonic())


def release_if_idle(quiet: float) -> bool:
    """`release()` if no worker of this process has worked for `quiet` seconds and some work
    ran since the last release; whether it ran."""
    with _lock:
        if not _idleness.due(time.monotonic(), quiet):
            return False
        _idleness.done()
    release()
    return True
