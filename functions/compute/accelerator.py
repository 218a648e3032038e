"""One accelerator, taken in turns: a first-come-first-served lock for the workers.

In one process the trainer and the sampler would otherwise run their kernels at once and
fight over the same cores (or GPU memory), which is slower for both than taking turns.
A plain `threading.Lock` is not fair; this one grants turns in arrival order, so a busy
trainer cannot starve the sampler. (The node-local timeslicer daemon generalises this to
several processes.)
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class AcceleratorTurns:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._serving = 0

    @contextmanager
    def turn(self) -> Iterator[None]:
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            while ticket != self._serving:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._serving += 1
                self._cond.notify_all()
