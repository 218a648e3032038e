"""Cohorts: which jobs have sent work lately, so a batch can wait a moment for the rest of them.

On one accelerator, several RL loops gain from sharing only if their requests meet: a
sampler batch of four jobs' samples costs little more than one job's (decoding reads every
weight once per step, whatever the rows), and their trainer passes pack. Loops drift apart,
though: requests that went out together come back a few tens of milliseconds apart (the
environment, the client, the network), and a batch that starts with the first runs the
others alone right after it. So a worker that has work from some members of a cohort may
wait, up to a bound, for the others, and stops waiting the moment every member that was
active lately is present. Alone (a cohort of one) nothing ever waits.

A member that a batch waited for in vain (the deadline passed without it) is not waited for
again until it sends something: a run that has ended (or paused) costs the others one wait,
not one per batch for as long as it still counts as active, and a job left alone after the
others ended stops waiting for them at once.

Pure state, no clock of its own and no I/O: the worker passes the times in.
"""

from __future__ import annotations

from typing import Hashable, Iterable


class Cohort:
    def __init__(self, active_seconds: float = 10.0) -> None:
        """A member counts as active for `active_seconds` after its last request."""
        if active_seconds <= 0:
            raise ValueError("active_seconds must be positive")
        self.active_seconds = active_seconds
        self._last_seen: dict[Hashable, float] = {}
        self._late: set[Hashable] = set()  # waited for in vain; not waited for until seen again

    def saw(self, member: Hashable, now: float) -> None:
        self._last_seen[member] = now
        self._late.discard(member)

    def forget(self, member: Hashable) -> None:
        self._last_seen.pop(member, None)
        self._late.discard(member)

    def active(self, now: float) -> set[Hashable]:
        """Members seen within the last `active_seconds` (older ones are forgotten)."""
        horizon = now - self.active_seconds
        self._last_seen = {m: t for m, t in self._last_seen.items() if t >= horizon}
        self._late &= set(self._last_seen)
        return set(self._last_seen)

    def expected(self, now: float) -> set[Hashable]:
        """Active members that are not late: those a batch would wait for."""
        return self.active(now) - self._late

    def missing(self, present: Iterable[Hashable], now: float) -> set[Hashable]:
        """Active members, not late, with nothing in the batch yet; empty for a cohort of one."""
        active = self.active(now)
        if len(active) < 2:
            return set()
        return active - set(present) - self._late

    def waits(self, present: Iterable[Hashable], now: float, deadline: float) -> bool:
        """Whether a batch holding `present` should wait for more, given its deadline. Once
        the deadline has passed, the members still missing count as late (see above)."""
        missing = self.missing(present, now)
        if missing and now >= deadline:
            self._late |= missing
            return False
        return bool(missing)
