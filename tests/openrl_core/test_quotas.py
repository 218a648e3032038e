"""The quota rule without I/O: limits from defaults and overrides, the sliding window's wait,
and which limit a request trips, with the setting it names and its Retry-After."""

from __future__ import annotations

import pytest

from openrl_core.errors import InvalidRequest, UserError
from openrl_core.quotas import Cost, QuotaExceeded, Quotas, Usage, check, limits_for, sampling_tokens, window_wait

NOW = 1_000.0


def test_an_override_wins_over_the_default_even_when_it_lifts_the_limit():
    defaults = Quotas(requests_in_flight=4, checkpoint_bytes=100)
    overrides = {"alice": {"requests_in_flight": 1}, "bob": {"checkpoint_bytes": None}}
    assert limits_for(defaults, overrides, "alice") == (
        Quotas(requests_in_flight=1, checkpoint_bytes=100),
        {"requests_in_flight"},
    )
    assert limits_for(defaults, overrides, "bob") == (Quotas(requests_in_flight=4), {"checkpoint_bytes"})
    assert limits_for(defaults, overrides, "carol") == (defaults, frozenset())
    assert limits_for(Quotas(), {"a": {"checkpoint_bytes": "1KiB"}}, "a")[0].checkpoint_bytes == 1024
    with pytest.raises(InvalidRequest, match="unknown limits"):
        limits_for(defaults, {"alice": {"requests": 1}}, "alice")


# (entries (at, tokens), limit, cost) -> seconds to wait, worked out by hand: the window is 60 s.
WINDOW_CASES = [
    ([], 100, 100, 0.0),  # empty window, exactly the limit fits
    ([(NOW - 10, 50)], 100, 50, 0.0),  # 50 + 50 = 100 fits
    ([(NOW - 10, 50)], 100, 51, 50.0),  # must wait for the entry at now-10 to leave (at now+50)
    ([(NOW - 30, 40), (NOW - 50, 40)], 100, 30, 10.0),  # the older (now-50) leaving frees enough
    ([(NOW - 30, 40), (NOW - 50, 40)], 100, 70, 30.0),  # both must leave
    ([(NOW - 61, 1_000), (NOW - 5, 10)], 100, 90, 0.0),  # an entry older than the window counts for nothing
    ([(NOW - 60, 100)], 100, 1, 0.0),  # leaves exactly at now
]


@pytest.mark.parametrize("entries,limit,cost,wait", WINDOW_CASES)
def test_the_sliding_window_waits_until_enough_old_tokens_leave_it(entries, limit, cost, wait):
    assert window_wait(entries, limit, cost, NOW) == pytest.approx(wait)


def refusal(limits, usage, cost, **kw) -> QuotaExceeded:
    with pytest.raises(QuotaExceeded) as info:
        check(limits, usage, cost, NOW, tenant="alice", **kw)
    return info.value


def test_each_limit_refuses_with_a_429_naming_it_its_setting_and_a_retry_after():
    cases = [
        (Quotas(requests_in_flight=2), Usage(requests_in_flight=2), Cost(requests=1), "requests_in_flight", 1),
        (
            Quotas(queued_training_tokens=100),
            Usage(queued_training_tokens=60),
            Cost(requests=1, training_tokens=41),
            "queued_training_tokens",
            1,
        ),
        (
            Quotas(sampling_tokens_per_minute=100),
            Usage(sampling_window=[(NOW - 20.5, 80)]),
            Cost(requests=1, sampling_tokens=30),
            "sampling_tokens_per_minute",
            40,
        ),
        (
            Quotas(checkpoint_bytes=100),
            Usage(checkpoint_bytes=100),
            Cost(requests=1, saves_checkpoint=True),
            "checkpoint_bytes",
            60,
        ),
        (
            Quotas(checkpoint_bytes=100),
            Usage(checkpoint_bytes=100, next_checkpoint_expiry=NOW + 7.2),
            Cost(saves_checkpoint=True),
            "checkpoint_bytes",
            8,
        ),
        (Quotas(checkpoint_bytes=100), Usage(checkpoint_bytes=60), Cost(checkpoint_bytes=41), "checkpoint_bytes", 60),
    ]
    for limits, usage, cost, limit, retry_after in cases:
        refused = refusal(limits, usage, cost)
        assert refused.http_status == 429 and not isinstance(refused, UserError)  # a UserError would consume the seq_id
        assert refused.limit == limit and refused.retry_after == retry_after, (limit, refused.retry_after)
        assert f"the {limit} limit is {getattr(limits, limit)}" in refused.detail
        assert f"quota_{limit} (OPENRL_QUOTA_{limit.upper()})" in refused.detail


def test_an_overridden_limit_names_the_tenant_override_setting():
    refused = refusal(
        Quotas(requests_in_flight=1),
        Usage(requests_in_flight=1),
        Cost(requests=1),
        overridden=frozenset({"requests_in_flight"}),
    )
    assert "tenant_quotas['alice']['requests_in_flight'] (OPENRL_TENANT_QUOTAS)" in refused.detail


def test_what_fits_passes_and_unset_limits_never_refuse():
    limits = Quotas(
        requests_in_flight=3, queued_training_tokens=100, sampling_tokens_per_minute=100, checkpoint_bytes=100
    )
    usage = Usage(requests_in_flight=2, queued_training_tokens=50, sampling_window=[(NOW - 1, 50)], checkpoint_bytes=99)
    check(limits, usage, Cost(requests=1, training_tokens=50), NOW)
    check(limits, usage, Cost(requests=1, sampling_tokens=50), NOW)
    check(limits, usage, Cost(requests=1, saves_checkpoint=True), NOW)  # under the limit: the save may cross it
    check(
        Quotas(),
        Usage(requests_in_flight=10**9, checkpoint_bytes=10**18),
        Cost(requests=10**6, training_tokens=10**9, saves_checkpoint=True),
        NOW,
    )
    # a limit the request does not touch is not checked: sampling does not care about queued training tokens
    check(Quotas(queued_training_tokens=1), Usage(queued_training_tokens=5), Cost(requests=1, sampling_tokens=10), NOW)


def test_a_request_bigger_than_a_whole_limit_is_a_400_not_a_429():
    for limits, cost in [
        (Quotas(queued_training_tokens=100), Cost(requests=1, training_tokens=101)),
        (Quotas(sampling_tokens_per_minute=100), Cost(requests=1, sampling_tokens=101)),
        (Quotas(requests_in_flight=2), Cost(requests=3)),
        (Quotas(checkpoint_bytes=100), Cost(checkpoint_bytes=101)),
    ]:
        with pytest.raises(InvalidRequest, match="can never be admitted"):
            check(limits, Usage(), cost, NOW)


def test_sampling_cost_counts_every_sample_budget():
    assert sampling_tokens(prompt_tokens=10, max_tokens=20, num_samples=4) == 90
    assert Cost(requests=1, sampling_tokens=5) + Cost(requests=2, sampling_tokens=7) == Cost(
        requests=3, sampling_tokens=12
    )
