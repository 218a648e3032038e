"""settle_startup_heap: start-up's garbage is collected, what survives is frozen."""

from __future__ import annotations

import gc
import weakref

from functions.heap import settle_startup_heap


class _Node:
    pass


def test_garbage_is_collected_before_the_survivors_are_frozen():
    was_frozen = gc.get_freeze_count()
    kept = _Node()
    cycle = _Node()
    cycle.self = cycle  # garbage only the cyclic collector frees
    garbage = weakref.ref(cycle)
    del cycle
    try:
        frozen = settle_startup_heap()
        assert garbage() is None  # collected, not frozen with the rest
        # (a frozen object may still be freed by its reference count, so no equality here)
        assert frozen > was_frozen and gc.get_freeze_count() > was_frozen
        assert not any(o is kept for o in gc.get_objects(generation=2))  # out of the full passes
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())
