"""Blocking work of the async hot routes (the store, the log), in the gateway's own threads.

Why not Starlette's `run_in_threadpool`: its anyio hop cost about 70 us of CPU per call here,
a plain executor's 30-60 us, and the Tinker routes make one or two per request. Concurrency
is what the threads are for: requests that wait side by side on the store and the log are
group-committed together (`eventing.appender`), one after another on the event loop they
would each pay their own commit.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

# As many as anyio's default limiter allows: a request holds a thread while its commit runs.
_THREADS = ThreadPoolExecutor(max_workers=40, thread_name_prefix="gateway")


async def blocking(fn: Callable[..., T], *args) -> T:
    """Run `fn(*args)` in a gateway thread; its exception is raised here."""
    return await asyncio.get_running_loop().run_in_executor(_THREADS, fn, *args)
