"""Closing an SDK `ServiceClient` in a test, with a bound on the wait.

The future that the SDK's `close()` returns covers two steps in turn, both on the SDK's
event-loop thread: the session's finish request to the server, then the release of the
client's own resources (heartbeat, futures pollers, telemetry, HTTP pools). In two full
`make test` runs a close never returned although the server had stored the finish. It sat
until the 900 s test timeout, and that timeout's thread dump cannot show asyncio tasks.

The likely cause (a stuck close of examples/lora_without_regret.py, caught live: the client
idle in `close().result()`, the server idle, no socket open, and one more telemetry batch
posted `FLUSH_INTERVAL`, 10 s, after the finish): the SDK's telemetry `close()` wakes its
periodic flush task and cancels it right after, and Python 3.11's `asyncio.wait_for` can
swallow a cancellation that races the inner wait it was given (fixed in 3.12), so the task
goes on looping and `close()` awaits it for ever. Only with telemetry on.

Here the wait is bounded. Past `timeout` the SDK loop's tasks are dumped with their await
chains. A close stuck after the finish was answered (in the SDK's clean-up, which is
client-side) is a warning that carries the dump. A close stuck before that (the server not
answering the finish), or one whose phase the dump cannot tell, fails the test.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import warnings

# The SDK's coroutine names for the two steps of `close` (tinker/lib/public_interfaces/service_client.py).
FINISH_STEP = "_finish_session_async"
CLEANUP_STEP = "_close_holders"


class SdkCloseStuck(UserWarning):
    """The SDK's client-side clean-up did not end; the finish had been answered."""


def close_service(service, status: str = "success", timeout: float = 120.0) -> None:
    future = service.close(status)
    try:
        future.result(timeout=timeout)
        return
    except (TimeoutError, concurrent.futures.TimeoutError):
        pass
    holder = service._session_holder or service._rest_holder
    chains = task_chains(holder.get_loop())
    report = "\n\n".join(" -> ".join(chain) for chain in chains)
    phase = close_phase(chains)
    if phase == "cleanup":
        warnings.warn(SdkCloseStuck(f"the SDK's close() clean-up did not end within {timeout} s; its tasks:\n{report}"))
        return
    raise AssertionError(f"the SDK's close() did not end within {timeout} s ({phase}); its tasks:\n{report}")


def task_chains(loop: asyncio.AbstractEventLoop, wait: float = 10.0) -> list[list[str]]:
    """Per task on `loop`, its await chain from the task's coroutine inward, as
    "function (file:line)" strings, read on the loop's own thread."""

    async def collect() -> list[list[str]]:
        here = asyncio.current_task()
        return [await_chain(task.get_coro()) for task in asyncio.all_tasks() if task is not here]

    return asyncio.run_coroutine_threadsafe(collect(), loop).result(timeout=wait)


def await_chain(coro) -> list[str]:
    """A suspended coroutine's frames, outermost first, following what each awaits
    (`Task.get_stack` shows only the outermost frame of a suspended coroutine)."""
    chain: list[str] = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            chain.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return chain


def close_phase(chains: list[list[str]]) -> str:
    """Which step of close the dumped tasks are in: "finish", "cleanup", or "unknown"."""
    names = {entry.split(" ", 1)[0] for chain in chains for entry in chain}
    if FINISH_STEP in names:
        return "finish"
    if CLEANUP_STEP in names:
        return "cleanup"
    return "unknown"
