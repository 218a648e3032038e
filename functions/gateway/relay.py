"""The outbox relay: publishes events the store holds but the log never got.

The gateway stores an event, then publishes it. If publishing fails (the broker is
restarting) or the process dies in between, the event waits in the outbox. A retried
request flushes it at once; this loop catches the rest, so a future never hangs on an
event that exists only in the store.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class OutboxRelay:
    def __init__(self, ctx, interval_seconds: float = 5.0) -> None:
        self.ctx = ctx
        self.interval = interval_seconds

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            try:
                sent = self.ctx.republish_outbox()
                if sent:
                    log.info("outbox relay: published %d stored event(s)", sent)
            except Exception:
                log.exception("outbox relay: publish failed; retrying later")
