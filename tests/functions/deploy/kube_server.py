"""An API-shaped Kubernetes server on 127.0.0.1 for tests: PyPI `kmock`'s emulator in a thread.

The emulator stores objects in memory and answers the API's create, get, list, merge-patch
and delete the way the official client expects; it runs no controllers and validates
nothing (the schema tests do that). Every kind OpenRL manages is declared, so listing an
empty kind answers an empty list instead of a 404.
"""

from __future__ import annotations

import asyncio
import threading

import kmock

from functions.deploy.kube import KINDS, KubernetesApi


class KubeServer:
    def __enter__(self) -> "KubeServer":
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._failure: BaseException | None = None

        async def serve() -> None:
            self.emulator = kmock.KubernetesEmulator()
            for kind in KINDS.values():
                group, _, version = kind.api_version.rpartition("/")
                self.emulator.resources[f"{group}/{version}/{kind.plural}"] = {}
            async with self.emulator, kmock.Server(self.emulator) as server:
                self.url = str(server.url).rstrip("/")
                self._stop = asyncio.Event()
                ready.set()
                await self._stop.wait()

        def run() -> None:
            try:
                self._loop.run_until_complete(serve())
            except BaseException as exc:  # surfaced by __enter__ instead of a silent hang
                self._failure = exc
                ready.set()

        self._thread = threading.Thread(target=run, name="kmock", daemon=True)
        self._thread.start()
        if not ready.wait(20) or self._failure is not None:
            raise RuntimeError(f"kmock did not start: {self._failure!r}")
        self.api = KubernetesApi.at(self.url)
        return self

    def requests(self, method: str) -> list:
        """The requests of this HTTP method the server has answered, oldest first."""
        return list(self.emulator[method.lower()])

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self.api.client.close()
