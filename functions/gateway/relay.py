"""The outbox relay: publishes events the store holds but the log never got.

The gateway stores an event, then publishes it. If publishing fails (the broker is
restarting) or the process dies in between, the event waits in the outbox. A retried
request flushes it at once; this loop catches the rest, so a future never hangs on an
event that exists only in the store.
"""

from __future__ import annotations

from functions.periodic import Periodic


class OutboxRelay(Periodic):
    def __init__(self, ctx, interval_seconds: float = 5.0) -> None:
        self.ctx = ctx
        super().__init__("outbox relay", self._republish, interval_seconds, first_at_start=False)

    def _republish(self):
        sent = self.ctx.republish_outbox()
        return f"published {sent} stored event(s)" if sent else None
