"""When a process is idle enough for housekeeping that costs the next piece of work.

Giving freed memory back to the system (`functions.compute.host_memory`) makes the next pass
take fresh pages from the kernel: on SmolLM2, a trainer pass of 16 x 32 tokens ran about
0.5 s slower after a trim than without one. A worker of an RL loop is idle for a moment
every step (the trainer while the sampler runs, both while the environment grades), so
trimming at every idle poll paid that price each step, and a trim from one worker's thread
also competed with the other worker's compute in the same process. So the housekeeping is
due only when no worker of the process is working, none has for `quiet` seconds, and some
work ran since it was last done: a steady loop keeps its pages, a process left alone gives
them back a moment later.

Pure state, no clock and no lock of its own: the caller passes the times in and serialises calls.
"""

from __future__ import annotations

from typing import Optional


class Idleness:
    def __init__(self) -> None:
        self._working = 0  # workers inside a piece of work now
        self._last_end: Optional[float] = None
        self._dirty = False  # work ran since the housekeeping was last done

    def begin(self) -> None:
        self._working += 1
        self._dirty = True

    def end(self, now: float) -> None:
        if self._working <= 0:
            raise ValueError("end() without begin()")
        self._working -= 1
        self._last_end = now

    def due(self, now: float, quiet: float) -> bool:
        """Whether the housekeeping should run now (then call `done`)."""
        return self._dirty and self._working == 0 and self._last_end is not None and now - self._last_end >= quiet

    def done(self) -> None:
        self._dirty = False
