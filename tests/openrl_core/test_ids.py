"""Ids and tinker:// paths, including the tricks a path must not allow."""

import pytest

from openrl_core.errors import InvalidRequest
from openrl_core.ids import TinkerPath, model_id_for, sampling_session_id_for, tenant_for_key

RUN = "b89f6676-49c4-53ed-9788-2e0c81a9eabf:train:0"


def test_model_ids_follow_the_sdk_scheme():
    assert model_id_for("s1", 3) == "s1:train:3"
    assert sampling_session_id_for("s1", 0) == "s1:sample:0"


@pytest.mark.parametrize("kind", ["weights", "sampler_weights", "external_weights"])
def test_round_trip(kind):
    path = TinkerPath.parse(f"tinker://{RUN}/{kind}/step-0010")
    assert (path.run_id, path.kind, path.name) == (RUN, kind, "step-0010")
    assert str(path) == f"tinker://{RUN}/{kind}/step-0010"
    assert path.checkpoint_id == f"{kind}/step-0010"
    assert TinkerPath.from_checkpoint_id(RUN, path.checkpoint_id) == path


@pytest.mark.parametrize(
    "bad",
    [
        f"file://{RUN}/weights/x",
        f"tinker://{RUN}/weights/../../etc",
        f"tinker://{RUN}/weights/..",
        f"tinker://{RUN}/weights/.",
        f"tinker://{RUN}/weights/a/b",
        f"tinker://{RUN}/weights/",
        f"tinker://{RUN}/optimizer/x",
        "tinker:///etc/passwd",
        "tinker://../weights/x",
        f"tinker://{RUN}/weights/.hidden",
        f"tinker://{RUN}/weights/x y",
        "tinker://not-a-run/weights/x",
        "tinker://",
        42,
    ],
)
def test_path_tricks_are_refused(bad):
    with pytest.raises(InvalidRequest):
        TinkerPath.parse(bad)


def test_tenant_ids_are_stable_and_key_dependent():
    assert tenant_for_key("tml-a") == tenant_for_key("tml-a") != tenant_for_key("tml-b")


def test_new_ids_are_uuid7_and_sort_by_their_time(monkeypatch):
    """Event, session and request ids are RFC 9562 version-7 UUIDs: unique, and one made in a
    later millisecond sorts after (the store's indexes on them grow at their right edge)."""
    import time
    import uuid

    from openrl_core import ids

    made = [ids.new_uuid() for _ in range(2000)]
    assert len(set(made)) == len(made)
    assert all(
        uuid.UUID(one).version == 7 and uuid.UUID(one).variant == uuid.RFC_4122 and str(uuid.UUID(one)) == one
        for one in made
    )
    now = time.time_ns()
    clock = iter([now, now + 1_000_000, now + 2_000_000, now + 3_000_000])
    monkeypatch.setattr(ids.time, "time_ns", lambda: next(clock))
    earlier, later = ids.new_uuid(), ids.new_uuid()
    first, second = ids.new_request_id(), ids.new_request_id()
    assert earlier < later and first < second and first.startswith("req-") and len(first) == 36
    assert int(uuid.UUID(earlier).hex[:12], 16) == now // 1_000_000  # the time is the first 48 bits
