"""The Tinker endpoints this server does not offer: each a 404 whose detail names the feature
and the reason, after authentication, never FastAPI's bare "Not Found" or a 405."""

from __future__ import annotations

import pytest

from tests.functions.gateway.rest_rig import rest  # noqa: F401  (fixture)

CASES = [
    ("GET", "/api/v1/billing/usage/events?starting_on=2026-01-01&ending_before=2026-02-01", None, "billing usage"),
    ("GET", "/api/v1/billing/usage/checkpoints/current", None, "checkpoint storage usage"),
    ("GET", "/api/v1/audit?event_type=all", None, "organisation audit log"),
]


@pytest.mark.parametrize("method, path, body, feature", CASES, ids=[c[3] for c in CASES])
def test_refused_with_the_feature_and_the_reason(rest, method, path, body, feature):
    response = rest.request(method, path, body)
    assert response.status_code == 404
    detail = response.json()["detail"]
    assert detail.startswith(feature) or f"the {feature}" in detail, detail
    assert "not offered by a self-hosted OpenRL server" in detail
    assert rest.request(method, path, body, key=None).status_code == 401
