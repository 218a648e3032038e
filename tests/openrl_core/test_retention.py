"""The blob collector's retention rules, as given/when/then tables (no I/O)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from openrl_core.retention import SamplerVersion, StoredBlob, collectable, live_sampler_versions

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)


def version(sid: str, run: str | None = "run-a", minute: int = 0, **facts) -> SamplerVersion:
    values = dict(from_checkpoint=False, session_finished=False, closed=False)
    values.update(facts)
    return SamplerVersion(sid, run, T0 + timedelta(minutes=minute), **values)


@pytest.mark.parametrize(
    "given, keep, live",
    [
        # the newest `keep` ephemeral versions of each run, by creation time
        ([version("s1", minute=1), version("s2", minute=2), version("s3", minute=3)], 2, {"s2", "s3"}),
        ([version("s1", minute=1), version("s2", minute=2)], 4, {"s1", "s2"}),
        # runs are counted apart
        ([version("a1", "run-a", 1), version("a2", "run-a", 2), version("b1", "run-b", 0)], 1, {"a2", "b1"}),
        # same instant: the id breaks the tie, so the answer never depends on row order
        ([version("s2", minute=5), version("s1", minute=5)], 1, {"s2"}),
        # made from a named checkpoint path, or on a base model: kept while its session is open
        (
            [version("c1", minute=0, from_checkpoint=True), version("s1", minute=1), version("s2", minute=2)],
            1,
            {"c1", "s2"},
        ),
        ([version("base", run=None)], 1, {"base"}),
        # a finished session or a cancelled run keeps nothing, however new
        ([version("s1", minute=1), version("s2", minute=2, session_finished=True)], 1, {"s1"}),
        ([version("c1", from_checkpoint=True, session_finished=True)], 4, set()),
        ([version("s1", minute=1), version("s2", minute=2, closed=True)], 1, {"s1"}),
        ([], 3, set()),
        ([version("s1")], 0, set()),
    ],
)
def test_live_sampler_versions(given, keep, live):
    assert live_sampler_versions(given, keep) == live
    assert live_sampler_versions(list(reversed(given)), keep) == live


def test_a_version_that_is_not_live_never_becomes_live_when_newer_ones_come():
    versions = [version(f"s{i}", minute=i) for i in range(10)]
    gone: set[str] = set()
    for n in range(1, len(versions) + 1):
        live = live_sampler_versions(versions[:n], 3)
        assert not (live & gone)
        gone |= {v.sampling_session_id for v in versions[:n]} - live


@pytest.mark.parametrize(
    "stored, referenced, grace, doomed",
    [
        ([StoredBlob("a", 100), StoredBlob("b", 100)], {"a"}, 10, ["b"]),
        # young blobs stay, referenced or not: their record may not be stored yet
        ([StoredBlob("a", 5), StoredBlob("b", 9.9), StoredBlob("c", 10)], set(), 10, ["c"]),
        # written after the records were read (negative age) is never collected, even without grace
        ([StoredBlob("a", -1.0), StoredBlob("b", 0.0)], set(), 0, ["b"]),
        ([StoredBlob("z", 50), StoredBlob("y", 50)], set(), 0, ["y", "z"]),
        ([], {"a"}, 0, []),
    ],
)
def test_collectable(stored, referenced, grace, doomed):
    assert collectable(stored, referenced, grace) == doomed


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        live_sampler_versions([], -1)
    with pytest.raises(ValueError):
        collectable([], set(), -1)
