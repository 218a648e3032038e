"""Per-model ordering of training requests by `seq_id`.

The SDK numbers every training operation of a model 1, 2, 3, … and sends them without
waiting, on several connections, the first chunk of a large forward_backward last. The
gate releases requests strictly in that order and holds later ones until the gap fills.
Because nothing passes a gap, `optim_step` and `load_weights` are barriers for free: no
earlier `forward_backward` can overtake them and no later one can run before them.
A seq_id below the next expected one was already applied: it is a redelivery, reported as
a duplicate so the caller can answer from the stored result instead of applying it twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
_SKIPPED = object()


@dataclass
class Offer(Generic[T]):
    ready: list[tuple[int, T]] = field(default_factory=list)
    duplicate: bool = False


class SeqGate(Generic[T]):
    def __init__(self, next_seq: int = 1) -> None:
        self.next_seq = next_seq
        self._held: dict[int, T] = {}

    def offer(self, seq_id: int, item: T) -> Offer[T]:
        """Hand in one request; get back every request that may now run, in order."""
        if seq_id < self.next_seq or seq_id in self._held:
            return Offer(duplicate=True)
        self._held[seq_id] = item
        return Offer(ready=self._drain())

    def skip(self, seq_id: int) -> list[tuple[int, T]]:
        """Mark a seq_id consumed without an item (the gateway refused that request)."""
        if seq_id < self.next_seq or seq_id in self._held:
            return []
        self._held[seq_id] = _SKIPPED  # type: ignore[assignment]
        return self._drain()

    def discard(self) -> list[T]:
        """Drop every held request (its run was cancelled); returns them, to release them."""
        held = [item for item in self._held.values() if item is not _SKIPPED]
        self._held.clear()
        return held

    @property
    def waiting_for(self) -> int | None:
        """The missing seq_id that holds everything back, or None when nothing is held."""
        return self.next_seq if self._held else None

    @property
    def held(self) -> list[int]:
        return sorted(self._held)

    def _drain(self) -> list[tuple[int, T]]:
        ready: list[tuple[int, T]] = []
        while self.next_seq in self._held:
            item = self._held.pop(self.next_seq)
            if item is not _SKIPPED:
                ready.append((self.next_seq, item))
            self.next_seq += 1
        return ready
