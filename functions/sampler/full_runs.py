"""A sampler's copies of full fine-tuning runs' weights, kept current by weight sync.

Each full run a sampler serves is a `SamplerEngine` of its own (the base model's files,
then the run's published weights) plus a `weight_sync.Receiver` that knows the version it
holds. `prepare(key, manifest)` brings the copy to the manifest's version, by delta in
place when it can, else from the chain's full checkpoint. At most `max_copies` copies are
kept per sampler; the least recently used goes first. A copy is a timeslicer job of its
own, so it can be parked (its weights to host memory) while other jobs use the device.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

from functions.compute import parking
from functions.compute.models import ModelFiles
from functions.compute.weight_sync import Fetch, Receiver

log = logging.getLogger(__name__)


@dataclass
class Copy:
    key: str  # "<tenant>:<run_id>"
    engine: object  # SamplerEngine
    receiver: Receiver
    parked: Optional[parking.Parked] = None

    def slots(self) -> list[parking.Slot]:
        return parking.param_slots("w/", self.receiver.params, with_grads=False)


class FullRunCopies:
    def __init__(self, make_engine: Callable[[ModelFiles], object], max_copies: int = 2) -> None:
        self.make_engine = make_engine
        self.max_copies = max_copies
        self.copies: OrderedDict[str, Copy] = OrderedDict()

    def get(self, key: str) -> Optional[Copy]:
        return self.copies.get(key)

    def evictable(self, keep: set[str]) -> list[str]:
        """Keys to drop so one more copy fits, least recently used first (never one in `keep`)."""
        out = []
        for key in self.copies:
            if len(self.copies) - len(out) < self.max_copies:
                break
            if key not in keep:
                out.append(key)
        return out

    def drop(self, key: str) -> None:
        self.copies.pop(key, None)

    def create(self, key: str, files: ModelFiles, dtype: str) -> Copy:
        engine = self.make_engine(files)
        params = dict(engine.model.named_parameters())
        copy = Copy(key, engine, Receiver(params, dtype))
        self.copies[key] = copy
        return copy

    def prepare(self, key: str, manifest: dict, fetch: Fetch) -> dict:
        copy = self.copies[key]
        self.copies.move_to_end(key)
        update = copy.receiver.update(manifest, fetch)
        if update["kind"] != "none":
            copy.engine.weights_changed(update["touched"])  # an engine that cannot use `.model` in place copies
            log.info("sampler: %s now at version %s (%s, %d links, %.3f s, %d bytes)", key,
                     copy.receiver.version, update["kind"], update.get("links", 0), update["seconds"], update["bytes"])  # fmt: skip
        return update

    def park(self, key: str) -> tuple[float, int]:
        """An engine that sleeps (vLLM on CUDA) frees its own device memory; its host copy of
        the weights stays, which is what a deep sleep reloads from. Else the copy's tensors
        move to host memory."""
        copy = self.copies.get(key)
        if copy is None:
            return 0.0, 0
        if getattr(copy.engine, "can_sleep", False):
            return copy.engine.park()
        return parking.park_once(copy, copy.slots())

    def restore(self, key: str) -> tuple[float, int]:
        copy = self.copies.get(key)
        if copy is None:
            return 0.0, 0
        if getattr(copy.engine, "can_sleep", False):
            return copy.engine.restore()
        return parking.restore_once(copy, copy.slots())

    def is_parked(self, key: str) -> bool:
        copy = self.copies.get(key)
        return copy is not None and (copy.parked is not None or bool(getattr(copy.engine, "asleep", False)))
