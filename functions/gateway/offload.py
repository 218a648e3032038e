"""Blocking work of the async hot routes (the store, the log), in the gateway's own threads.

Why not Starlette's `run_in_threadpool`: its anyio hop cost about 70 us of CPU per call here,
a plain executor's 30-60 us, and the Tinker routes make one or two per request. Concurrency
is what the threads are for: store reads side by side, and the appends of routes that wait
for them here, group-committed together (`eventing.appender`); the training routes hand
their appends to the appender's writer instead (`functions.gateway.submit.submitting`).
How many: setting `gateway_threads`.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


class Offload:
    def __init__(self, threads: int) -> None:
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gateway")

    async def __call__(self, fn: Callable[..., T], *args) -> T:
        """Run `fn(*args)` in a gateway thread; its exception is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    def close(self) -> None:
        self._threads.shutdown(wait=False)
