"""A long-running process's Python heap: what start-up made is kept out of the garbage
collector's full passes.

A full (generation 2) collection walks every object the collector tracks, holding the GIL,
so every thread of the process stops meanwhile. Once an `openrl` process has imported its
libraries and built its roles (FastAPI, SQLAlchemy, pydantic models, torch, the gateway's
routes) it holds about 320,000 such objects, nearly all of which live as long as the
process, and a full pass over them took 30-200 ms on this machine: each one a stall of every
request in flight, the no-op futures bench's slowest futures (README.md at 40db992, "Numbers").
`settle_startup_heap` collects once, then freezes what is left (`gc.freeze`): later passes
walk only what was made since, and start-up's objects are never collected (they were not
going to be anyway; its garbage went in the collection before).
"""

from __future__ import annotations

import gc


def settle_startup_heap() -> int:
    """Collect start-up's garbage, then move every surviving object to the permanent
    generation; returns how many objects it now holds."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
