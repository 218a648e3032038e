"""An in-process timeslicer: the same service and protocol, without a socket.

A worker started on its own (`openrl trainer` with no `OPENRL_TIMESLICER_SOCKET`, or a
test) takes its turns through one of these; `connect` has the transport signature the
client expects, so the client code is the same as against the daemon. Messages are
handled on the caller's thread and answers come back through the client's callback; a
ticker thread expires leases.
"""

from __future__ import annotations

import threading
from typing import Callable

from functions.timeslicer.service import SlicerService

TICK_SECONDS = 0.05


class _LocalLink:
    def __init__(self, slicer: "LocalSlicer", on_message: Callable[[dict], None], on_close: Callable[[], None]) -> None:
        self.slicer = slicer
        self.on_close = on_close
        self.owner = slicer.service.connect(on_message)
        self.open = True

    def send(self, message: dict) -> None:
        from functions.timeslicer.client import LinkLost

        if not self.open:
            raise LinkLost("the in-process timeslicer link is closed")
        self.slicer.service.handle(self.owner, message)

    def close(self) -> None:
        if self.open:
            self.open = False
            self.slicer.service.disconnect(self.owner)

    def drop(self) -> None:
        """Simulate a lost connection (tests): the daemon forgets this owner, the client reconnects."""
        self.close()
        self.on_close()


class LocalSlicer:
    def __init__(self, service: SlicerService) -> None:
        self.service = service
        self.links: list[_LocalLink] = []
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="timeslicer-tick", daemon=True)
        self._ticker.start()

    def connect(self, on_message: Callable[[dict], None], on_close: Callable[[], None]) -> _LocalLink:
        link = _LocalLink(self, on_message, on_close)
        self.links.append(link)
        return link

    def close(self) -> None:
        self._stop.set()

    def _tick(self) -> None:
        while not self._stop.wait(TICK_SECONDS):
            self.service.tick()
