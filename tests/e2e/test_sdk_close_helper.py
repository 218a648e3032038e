"""`sdk_close`'s reading of a stuck close: the await chains of a live loop's tasks, and
which step of the SDK's close they are in. Coroutines named as the SDK's stand in for it:
a stuck SDK cannot be made to order."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.e2e import sdk_close


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


async def _never(gate: asyncio.Event) -> None:
    await gate.wait()


async def _close_holders(gate):  # the SDK's clean-up step, by name
    await _never(gate)


async def _finish_session_async(gate):  # the SDK's finish step, by name
    await _never(gate)


async def _close_async(step, gate):
    await step(gate)


@pytest.mark.parametrize(
    "step, phase", [(_close_holders, "cleanup"), (_finish_session_async, "finish"), (_never, "unknown")]
)
def test_a_stuck_close_is_placed_in_its_step(loop, step, phase):
    gate = asyncio.Event()
    future = asyncio.run_coroutine_threadsafe(_close_async(step, gate), loop)
    try:
        chains = sdk_close.task_chains(loop)
        assert len(chains) == 1
        names = [entry.split(" ", 1)[0] for entry in chains[0]]
        assert names[:2] == ["_close_async", step.__name__]  # followed inward, not just the outer frame
        assert names[-1] == "wait"  # down to asyncio.Event.wait
        assert sdk_close.close_phase(chains) == phase
    finally:
        loop.call_soon_threadsafe(gate.set)
        future.result(5)


class _Holder:
    def __init__(self, loop):
        self._loop = loop

    def get_loop(self):
        return self._loop


class _Service:
    """What `close_service` uses of a ServiceClient: close() and its holders."""

    def __init__(self, loop, step, gate):
        self._session_holder, self._rest_holder = _Holder(loop), None
        self._loop, self._step, self._gate = loop, step, gate

    def close(self, status):
        return asyncio.run_coroutine_threadsafe(_close_async(self._step, self._gate), self._loop)


def test_stuck_in_cleanup_warns_and_stuck_in_finish_fails(loop):
    gates = [asyncio.Event(), asyncio.Event()]
    try:
        with pytest.warns(sdk_close.SdkCloseStuck, match="_close_holders"):
            sdk_close.close_service(_Service(loop, _close_holders, gates[0]), timeout=0.2)
        with pytest.raises(AssertionError, match=r"(?s)\(finish\).*_finish_session_async"):
            sdk_close.close_service(_Service(loop, _finish_session_async, gates[1]), timeout=0.2)
    finally:
        for gate in gates:
            loop.call_soon_threadsafe(gate.set)


def test_a_close_that_ends_is_quiet(loop):
    gate = asyncio.Event()
    loop.call_soon_threadsafe(gate.set)
    sdk_close.close_service(_Service(loop, _close_holders, gate), timeout=5)
