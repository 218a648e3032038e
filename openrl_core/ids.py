"""Identifiers and `tinker://` checkpoint paths.

Model ids must be `<session_id>:train:<model_seq_id>`: the SDK computes the id of a model it
creates from a checkpoint itself (`create_training_client_from_state`) and never asks the
server, so any other scheme breaks resume. Sampling sessions follow the same pattern with
`:sample:`. A checkpoint path is exactly `tinker://<run_id>/<kind>/<name>`; the parser is
strict because the path names files on disk and must not be a way out of the tenant's tree.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import dataclass
from typing import Literal

from openrl_core.errors import InvalidRequest

CheckpointKind = Literal["weights", "sampler_weights", "external_weights"]
CHECKPOINT_KINDS: tuple[str, ...] = ("weights", "sampler_weights", "external_weights")
CHECKPOINT_TYPE = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}

# Matched with `fullmatch`, never `match`: a `$` also matches before a final newline, which
# let "step\n" through as a checkpoint name and "alice\n" as a tenant (an audit file name).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,127}")
_RUN = re.compile(r"[A-Za-z0-9-]{1,64}:train:[0-9]{1,9}")
_TENANT = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")


def _time_ordered() -> str:
    """32 hex digits of a UUIDv7 (RFC 9562): the Unix time in ms, then 74 random bits. Ids
    made later sort later, so the store's indexes on them (events.id, futures.request_id)
    take each insert at their right edge instead of at a random leaf: with uuid4 ids a
    batch's inserts each dirtied a page of its own, and the more the tables held, the more
    pages each transaction wrote (docs/benchmarks.md, "Futures per second")."""
    rand = int.from_bytes(os.urandom(10), "big")
    value = (
        (time.time_ns() // 1_000_000) << 80
        | 0x7 << 76
        | (rand >> 62 & 0xFFF) << 64
        | 0b10 << 62
        | (rand & (1 << 62) - 1)
    )
    return f"{value:032x}"


def new_uuid() -> str:
    hexed = _time_ordered()
    return f"{hexed[:8]}-{hexed[8:12]}-{hexed[12:16]}-{hexed[16:20]}-{hexed[20:]}"


def new_request_id() -> str:
    return "req-" + _time_ordered()


def model_id_for(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def sampling_session_id_for(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"


def session_of(model_or_sampler_id: str) -> str:
    return model_or_sampler_id.split(":", 1)[0]


def tenant_for_key(api_key: str) -> str:
    """A stable tenant id for a key configured without an explicit tenant name."""
    return "t-" + hashlib.sha256(api_key.encode()).hexdigest()[:12]


def check_tenant_name(name: str) -> str:
    if not _TENANT.fullmatch(name):
        raise InvalidRequest(f"tenant name {name!r} must be 1-40 lower-case letters, digits or '-'")
    return name


def check_checkpoint_name(name: str) -> str:
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise InvalidRequest(
            f"checkpoint name {name!r} must be 1-128 characters of letters, digits and ._=+- "
            "and start with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class TinkerPath:
    run_id: str
    kind: CheckpointKind
    name: str

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    def __str__(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"

    @classmethod
    def parse(cls, path: str) -> "TinkerPath":
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise InvalidRequest(f"checkpoint path {path!r} must start with tinker://")
        parts = path[len("tinker://") :].split("/")
        if len(parts) != 3:
            raise InvalidRequest(f"checkpoint path {path!r} must be tinker://<run_id>/<kind>/<name>")
        run_id, kind, name = parts
        if not _RUN.fullmatch(run_id):
            raise InvalidRequest(f"checkpoint path {path!r} has a malformed training run id {run_id!r}")
        if kind not in CHECKPOINT_KINDS:
            raise InvalidRequest(
                f"checkpoint path {path!r} has kind {kind!r}; expected one of {list(CHECKPOINT_KINDS)}"
            )
        return cls(run_id, kind, check_checkpoint_name(name))  # type: ignore[arg-type]

    @classmethod
    def from_checkpoint_id(cls, run_id: str, checkpoint_id: str) -> "TinkerPath":
        return cls.parse(f"tinker://{run_id}/{checkpoint_id}")
