"""What storage may be collected: the pure rules behind the blob collector.

Blobs are content-addressed and shared (a checkpoint, its copy, a sampling session and a
snapshot can all name the same bytes), so nothing is deleted because one owner let go of
it: the collector marks every blob some record still needs and sweeps the rest. These
functions decide, from plain values, which records still count; the collector
(`functions/collector`) reads the records and the blob store and applies them.

Rules:
- A named checkpoint keeps its files until it is deleted or expires (the reaper removes the
  record, then the sweep finds its files unreferenced).
- A sampling session keeps its weights while it is *live*: its client session is not
  finished, it was not closed (its run cancelled), and either it was made from a named
  checkpoint path or it is one of the `keep_per_run` newest ephemeral versions of its
  training run (`save_weights_and_get_sampling_client` makes a new version every step;
  an RL loop samples from the newest few, and the rest are superseded). Once not live it
  never becomes live again: finishing and closing are final, and only newer versions come.
- A trainer's snapshot counts while its model's pointer names it: recovery restores the
  latest durable snapshot and replays the log after it, never an older one.
- Payloads of stored events (claim checks) count for as long as their event is stored.
- A blob younger than `grace_seconds` is never collected: it may have been written a moment
  before the record that names it was projected (a save's files, a snapshot in flight).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Iterable, Optional


@dataclass(frozen=True)
class SamplerVersion:
    """The facts about one sampling session that decide whether its weights are kept."""

    sampling_session_id: str
    run_id: Optional[str]  # the training run whose weights it samples; None for a base model
    created_at: datetime
    from_checkpoint: bool  # made from a named checkpoint path (create_sampling_client(model_path))
    session_finished: bool  # its client session ended
    closed: bool  # closed because its training run was cancelled


@dataclass(frozen=True)
class StoredBlob:
    digest: str
    age_seconds: float  # since it was last written


def live_sampler_versions(versions: Iterable[SamplerVersion], keep_per_run: int) -> set[str]:
    """Ids of the sampling sessions whose weights must stay (see the module's rules)."""
    if keep_per_run < 0:
        raise ValueError("keep_per_run must be >= 0")
    live: set[str] = set()
    ephemeral: dict[Optional[str], list[SamplerVersion]] = {}
    for version in versions:
        if version.session_finished or version.closed:
            continue
        if version.from_checkpoint or version.run_id is None:
            live.add(version.sampling_session_id)
        else:
            ephemeral.setdefault(version.run_id, []).append(version)
    for run_versions in ephemeral.values():
        # Newest first; the id breaks ties between sessions made in the same instant.
        run_versions.sort(key=lambda v: (v.created_at, v.sampling_session_id), reverse=True)
        live.update(v.sampling_session_id for v in run_versions[:keep_per_run])
    return live


def collectable(stored: Iterable[StoredBlob], referenced: set[str], grace_seconds: float) -> list[str]:
    """Digests of stored blobs that nothing references and that are past the grace period, sorted."""
    if grace_seconds < 0:
        raise ValueError("grace_seconds must be >= 0")
    return sorted(b.digest for b in stored if b.digest not in referenced and b.age_seconds >= grace_seconds)
