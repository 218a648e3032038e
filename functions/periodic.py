"""A background pass a serving process runs every so often: the checkpoint reaper, the blob
collector, the outbox relay."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

log = logging.getLogger(__name__)


class Periodic:
    """Runs `once()` every `interval_seconds` until `stop` is set (first at once, or after one
    interval with `first_at_start=False`). `once` returns what the pass did, to log, or None
    when it did nothing. A failed pass is logged and the next one retries: one bad pass must
    not end the loop."""

    def __init__(
        self, name: str, once: Callable[[], Optional[str]], interval_seconds: float, first_at_start: bool = True
    ) -> None:
        self.name = name
        self.once = once
        self.interval_seconds = interval_seconds
        self.first_at_start = first_at_start

    def run(self, stop: threading.Event) -> None:
        if not self.first_at_start and stop.wait(self.interval_seconds):
            return
        while not stop.is_set():
            try:
                done = self.once()
                if done:
                    log.info("%s: %s", self.name, done)
            except Exception:
                log.exception("%s: pass failed; the next one retries", self.name)
            stop.wait(self.interval_seconds)
