"""Group commit: concurrent writers share batches, each gets its own outcome."""

from __future__ import annotations

import asyncio
import threading

import pytest

from eventing.group_commit import GroupCommit


def test_items_queued_during_a_write_go_together_in_the_next_batch():
    batches: list[list[int]] = []
    gate = threading.Event()

    def write(items):
        batches.append(list(items))
        if items == [0]:
            gate.wait(10)  # the first batch is "writing" while the others queue up
        return [item * 10 for item in items]

    group = GroupCommit(write)
    results: dict[int, int] = {}
    first = threading.Thread(target=lambda: results.__setitem__(0, group.submit(0)))
    first.start()
    while not batches:
        threading.Event().wait(0.005)
    others = [threading.Thread(target=lambda n=n: results.__setitem__(n, group.submit(n))) for n in range(1, 9)]
    for thread in others:
        thread.start()
    while len(group._queue) < 8:
        threading.Event().wait(0.005)
    gate.set()
    for thread in [first, *others]:
        thread.join(10)
    assert batches[0] == [0] and sorted(batches[1]) == list(range(1, 9)) and len(batches) == 2
    assert results == {n: n * 10 for n in range(9)}


def test_each_caller_gets_its_own_exception_and_a_failed_batch_fails_everyone_in_it():
    group = GroupCommit(lambda items: [ValueError(f"bad {i}") if i < 0 else i for i in items])
    assert group.submit_many([1, 2]) == [1, 2]
    with pytest.raises(ValueError, match="bad -1"):
        group.submit(-1)

    def broken(items):
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        GroupCommit(broken).submit(1)
    with pytest.raises(RuntimeError, match="outcomes"):
        GroupCommit(lambda items: []).submit(1)


def test_max_batch_caps_a_write_and_the_rest_follow():
    batches: list[int] = []
    group = GroupCommit(lambda items: (batches.append(len(items)), list(items))[1], max_batch=3)
    assert group.submit_many(list(range(7))) == list(range(7))
    assert batches == [3, 3, 1]


def test_an_enqueued_item_goes_with_the_next_batch_or_a_flush():
    batches: list[list[str]] = []
    group = GroupCommit(lambda items: (batches.append(list(items)), [None] * len(items))[1])
    group.enqueue("offsets-1")
    assert batches == []  # nobody waited, nothing written yet
    group.submit("record")
    assert batches == [["offsets-1", "record"]]
    group.enqueue("offsets-2")
    group.flush()
    assert batches[-1] == ["offsets-2"]
    group.flush()  # nothing queued: nothing written
    assert len(batches) == 2


# -- submit_later: the writer thread, settling asyncio futures --------------------------------


def holding_first(answer):
    """A group whose batch [0] is held until `gate` is set; `batches` records every batch;
    `answer(items)` gives the outcomes."""
    batches: list[list[int]] = []
    gate = threading.Event()

    def write(items):
        batches.append(list(items))
        if items == [0]:
            gate.wait(10)
        return answer(items)

    return GroupCommit(write), batches, gate


async def submit_held_first(group: GroupCommit, batches: list) -> asyncio.Future:
    """Submit item 0 and return once the writer thread holds it."""
    first = group.submit_later(0, asyncio.get_running_loop())
    while not batches:
        await asyncio.sleep(0.005)
    return first


def test_items_submitted_later_are_written_by_the_writer_thread_and_settle_on_their_loop():
    """Items queued while a batch is written go together in the next one, from any thread,
    with no thread of the caller's waiting; each future gets its own outcome on the loop."""
    writers: set[str] = set()

    def answer(items):
        writers.add(threading.current_thread().name)
        return [ValueError(f"bad {i}") if i < 0 else i * 10 for i in items]

    group, batches, gate = holding_first(answer)

    async def main():
        loop = asyncio.get_running_loop()
        first = await submit_held_first(group, batches)
        # Queued from other threads (the gateway's), returning at once while batch [0] is held.
        queued = [await asyncio.to_thread(group.submit_later, n, loop) for n in (1, 2, -3, 4)]
        assert not any(future.done() for future in [first, *queued])
        gate.set()
        return await asyncio.gather(first, *queued, return_exceptions=True)

    results = asyncio.run(main())
    assert batches == [[0], [1, 2, -3, 4]]
    assert writers == {"group-commit"}
    assert results[:3] == [0, 10, 20] and results[4] == 40
    assert isinstance(results[3], ValueError) and str(results[3]) == "bad -3"
    group.close()


def test_a_synchronous_submitter_and_later_items_share_a_batch_and_each_gets_its_outcome():
    batches: list[list[str]] = []
    gate = threading.Event()

    def write(items):
        batches.append(list(items))
        if items == ["held"]:
            gate.wait(10)
        return [item.upper() for item in items]

    group = GroupCommit(write)

    async def main():
        loop = asyncio.get_running_loop()
        held = group.submit_later("held", loop)
        while not batches:
            await asyncio.sleep(0.005)
        later = group.submit_later("later", loop)
        in_thread = asyncio.get_running_loop().run_in_executor(None, group.submit, "sync")
        while len(group._queue) < 2:
            await asyncio.sleep(0.005)
        gate.set()
        return await held, await later, await in_thread

    assert asyncio.run(main()) == ("HELD", "LATER", "SYNC")
    assert batches[0] == ["held"] and sorted(batches[1]) == ["later", "sync"] and len(batches) == 2
    group.close()


def test_a_caller_that_gave_up_does_not_stop_the_others_and_close_writes_what_is_queued():
    group, batches, gate = holding_first(list)

    async def main():
        loop = asyncio.get_running_loop()
        first = await submit_held_first(group, batches)
        abandoned = asyncio.ensure_future(group.submit_later(1, loop))
        kept = group.submit_later(2, loop)
        await asyncio.sleep(0.01)
        abandoned.cancel()  # the client went away: its write still happens, nobody is told
        gate.set()
        return await asyncio.wait_for(first, 5), await asyncio.wait_for(kept, 5)

    assert asyncio.run(main()) == (0, 2)
    assert batches == [[0], [1, 2]]  # the given-up item shared the batch of one still awaited
    # Queued for a loop that is now closed: written at close, its settling dropped quietly.
    loop = asyncio.new_event_loop()
    orphan = group.submit_later(3, loop)
    loop.close()
    group.close()
    assert batches[-1] == [3]
    assert not orphan.done()  # its loop is gone; nothing was set from the wrong thread
    other = asyncio.new_event_loop()
    with pytest.raises(RuntimeError, match="closed"):
        group.submit_later(4, other)
    other.close()
