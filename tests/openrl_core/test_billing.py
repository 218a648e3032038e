"""openrl_core.billing: window rules, hourly token sums, checkpoint counts and storage
gigabyte-hours, against numbers worked out by hand from hand-built rows."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from openrl_core.billing import StoredRow, TokenRow, buckets, check_window, prefill_tokens, sampled_tokens
from openrl_core.errors import InvalidRequest

T0 = datetime(2026, 7, 13, tzinfo=timezone.utc)
H = timedelta(hours=1)
GB = 10**9


def at(hours: float) -> datetime:
    return T0 + timedelta(hours=hours)


def stored(saved: float, size: int = GB, removed=None, expires=None, session="s1") -> StoredRow:
    return StoredRow(
        saved_at=at(saved),
        removed_at=at(removed) if removed is not None else None,
        expires_at=at(expires) if expires is not None else None,
        size_bytes=size,
        base_model="m",
        session_id=session,
        project_id="p",
    )


def storage(events) -> dict[datetime, float]:
    return {
        datetime.fromisoformat(e["bucket_start"]): e["event_info"]["gigabyte_hours"]
        for e in events
        if e["event_info"]["type"] == "storage"
    }


@pytest.mark.parametrize(
    "start, end, field",
    [
        (None, "2026-07-13T01:00:00Z", "starting_on is required"),
        ("yesterday", "2026-07-13T01:00:00Z", "starting_on must be an RFC 3339"),
        ("2026-07-13T00:30:00Z", "2026-07-13T01:00:00Z", "starting_on must be aligned"),
        ("2026-07-13T00:00:00Z", "2026-07-13T01:00:01Z", "ending_before must be aligned"),
        ("2026-07-20T00:00:00Z", "2026-07-21T00:00:00Z", "starting_on must not be in the future"),
        ("2026-07-13T01:00:00Z", "2026-07-13T01:00:00Z", "ending_before must be after starting_on"),
        ("2026-07-01T00:00:00Z", "2026-07-15T01:00:00Z", "ending_before must be at most 14 days"),
    ],
)
def test_a_bad_window_is_a_400_naming_the_field(start, end, field):
    with pytest.raises(InvalidRequest, match=field):
        check_window(start, end, now=at(5))


def test_a_window_is_utc_and_may_end_in_the_future():
    assert check_window("2026-07-13T02:00:00+02:00", "2026-07-27T00:00:00", now=at(5)) == (at(0), at(14 * 24))


def test_tokens_sum_per_hour_kind_and_attribution_largest_first():
    rows = [
        TokenRow(at(0), "training", 10, "m", "s1", "p"),
        TokenRow(at(0), "training", 5, "m", "s1", "p"),  # the same bucket: summed
        TokenRow(at(0), "sampling_prefill", 40, "m", "s2", "p"),
        TokenRow(at(0), "sampling_sample", 0, "m", "s2", "p"),  # nothing used: no event
        TokenRow(at(1), "sampling_sample", 7, "m", "s2", "p"),
        TokenRow(at(9), "training", 99, "m", "s1", "p"),  # outside the window
    ]
    events = buckets(at(0), at(2), at(5), rows, [])
    got = [(e["bucket_start"], e["event_info"], e["session_id"]) for e in events]
    assert got == [
        (at(0).isoformat(), {"type": "sampling_prefill", "token_count": 40, "cached": False}, "s2"),
        (at(0).isoformat(), {"type": "training", "token_count": 15}, "s1"),
        (at(1).isoformat(), {"type": "sampling_sample", "token_count": 7}, "s2"),
    ]
    assert all(e["estimated_cost_usd"] is None and e["effective_rate_usd_per_million_tokens"] is None for e in events)
    assert events[0]["bucket_end"] == at(1).isoformat()


def test_storage_integrates_bytes_over_each_hour_it_was_stored():
    rows = [
        stored(0.5, GB),  # live since 00:30: half of hour 0, all of hours 1 and 2
        stored(1.25, 2 * GB, removed=1.75),  # 2 GB for half an hour of hour 1
        stored(-3, GB, expires=0.25),  # saved before the window, expired a quarter into it
        stored(2.5, 4 * GB, removed=10),  # stored until now (02:45): a quarter of hour 2
    ]
    events = buckets(at(0), at(3), at(2.75), [], rows)
    assert storage(events) == pytest.approx({at(0): 0.5 + 0.25, at(1): 1.0 + 1.0, at(2): 0.75 + 4 * 0.25})
    saves = {datetime.fromisoformat(e["bucket_start"]): e["event_info"]["count"] for e in events if e["event_info"]["type"] == "checkpoint"}  # fmt: skip
    assert saves == {at(0): 1, at(1): 1, at(2): 1}  # the one saved before the window is not counted
    assert all(e["event_info"].get("free") is False for e in events if e["event_info"]["type"] == "storage")


def test_storage_ends_at_the_earlier_of_removal_and_expiry_and_never_after_now():
    assert storage(buckets(at(0), at(1), at(5), [], [stored(0, GB, removed=0.5, expires=0.25)])) == {
        at(0): pytest.approx(0.25)
    }
    assert storage(buckets(at(0), at(4), at(0.5), [], [stored(0, GB)])) == {at(0): pytest.approx(0.5)}
    assert storage(buckets(at(0), at(1), at(5), [], [stored(0, 0)])) == {}  # no bytes, no event


def test_attribution_keeps_sessions_apart():
    events = buckets(at(0), at(1), at(1), [], [stored(0, GB, session="a"), stored(0, GB, session="b")])
    assert sorted((e["session_id"], e["event_info"]["type"]) for e in events) == [
        ("a", "checkpoint"), ("a", "storage"), ("b", "checkpoint"), ("b", "storage"),
    ]  # fmt: skip


def test_token_counts_from_events():
    class Sample:
        prompt_tokens = [1, 2, 3]
        num_samples = 4

    assert prefill_tokens(Sample()) == 3  # once per request, whatever num_samples
    assert prefill_tokens(object()) is None
    assert sampled_tokens({"sequences": [{"tokens": [1, 2]}, {"tokens": [3]}]}) == 3
    assert sampled_tokens({"sequences": None}) == 0 and sampled_tokens(None) == 0
