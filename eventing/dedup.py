"""A submission's identity, carried by its event into the store and onto the log."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Dedup:
    """A submission's identity, e.g. `seq:<model_id>:<seq_id>`, and its payload's hash.

    `rejected` marks a submission the gateway refused: its identity stays used (its
    seq_id was skipped), so a later, different body under it is a conflict.
    """

    key: str
    payload_sha256: str
    rejected: bool = False

    @classmethod
    def of(cls, key: str, payload: bytes) -> "Dedup":
        return cls(key, hashlib.sha256(payload).hexdigest())

    def refused(self) -> "Dedup":
        return Dedup(self.key, self.payload_sha256, rejected=True)
