"""Byte sizes in the notations the timeslicer flags, node labels and settings use."""

import pytest

from openrl_core.errors import InvalidRequest
from openrl_core.quantity import parse_bytes
from openrl_core.settings import Settings


@pytest.mark.parametrize(
    "text, expected",
    [("6GiB", 6 * 2**30), ("512Mi", 512 * 2**20), ("15360Mi", 15 * 2**30), ("2G", 2 * 10**9), ("1.5k", 1500),
     ("4096", 4096), (" 1 TiB ", 2**40), (7, 7)],
)  # fmt: skip
def test_sizes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "6 GiBs", "-1", "1e9", ""])
def test_unreadable_sizes_are_refused_naming_the_text(text):
    with pytest.raises(InvalidRequest, match="is not a byte size"):
        parse_bytes(text)


def test_settings_refuse_a_bad_worker_memory_before_anything_starts():
    with pytest.raises(ValueError, match="'a lot' is not a byte size"):
        Settings(scheduler_job_memory={"openrl/tiny-qwen3": "a lot"})
    assert Settings(scheduler_base_models="a, b").scheduler_base_models == ["a", "b"]
