"""The background-pass loop the reaper, the blob collector and the outbox relay share: real
threads, short intervals."""

from __future__ import annotations

import logging
import threading
import time

from functions.periodic import Periodic


def run_for(loop: Periodic, seconds: float) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(stop,))
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_failed_pass_is_logged_and_the_next_one_runs(caplog):
    calls = []

    def once():
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("first pass breaks")
        return "did 3 things" if len(calls) == 2 else None

    with caplog.at_level(logging.INFO, logger="functions.periodic"):
        run_for(Periodic("sweeper", once, 0.05), 0.4)
    assert len(calls) >= 3, "kept running after the failure"
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("sweeper: pass failed") for m in messages)
    assert messages.count("sweeper: did 3 things") == 1, "a pass that did nothing logs nothing"


def test_first_at_start_false_waits_one_interval_and_stop_ends_the_wait():
    calls = []
    started = time.monotonic()
    run_for(Periodic("relay", lambda: calls.append(time.monotonic() - started), 0.3, first_at_start=False), 0.15)
    assert calls == [], "stopped before the first interval ended: no pass"
    calls.clear()
    started = time.monotonic()
    run_for(Periodic("relay", lambda: calls.append(time.monotonic() - started), 0.1, first_at_start=False), 0.35)
    assert calls and calls[0] >= 0.1
