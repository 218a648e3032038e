"""The model catalogue: served names, aliases, and the refusals that list what is served."""

from __future__ import annotations

import pytest

from openrl_core.catalog import SMOLLM2_135M, TINY_QWEN3, Catalog
from openrl_core.errors import InvalidRequest
from openrl_core.settings import Settings

ALIASES = {"Qwen/Qwen3-8B": TINY_QWEN3, "Qwen/Qwen3-8B-Base": TINY_QWEN3}


def test_an_alias_is_served_with_its_targets_weights_under_its_own_name():
    catalog = Catalog.from_names([TINY_QWEN3], aliases=ALIASES)
    assert catalog.names() == ["Qwen/Qwen3-8B", "Qwen/Qwen3-8B-Base", TINY_QWEN3]
    spec = catalog.resolve("Qwen/Qwen3-8B")
    target = catalog.resolve(TINY_QWEN3)
    assert (spec.name, spec.source, spec.params) == ("Qwen/Qwen3-8B", target.source, target.params)
    assert catalog.canonical("Qwen/Qwen3-8B") == TINY_QWEN3 == catalog.canonical(TINY_QWEN3)


def test_naming_only_the_alias_serves_it_with_its_target():
    catalog = Catalog.from_names(["Qwen/Qwen3-8B"], aliases=ALIASES)
    assert TINY_QWEN3 in catalog.names() and SMOLLM2_135M not in catalog.names()


def test_aliases_of_models_not_served_are_dropped():
    catalog = Catalog.from_names([SMOLLM2_135M], aliases=ALIASES)
    assert catalog.names() == [SMOLLM2_135M]
    with pytest.raises(InvalidRequest, match="this server supports"):
        catalog.resolve("Qwen/Qwen3-8B")


@pytest.mark.parametrize(
    "aliases, message",
    [
        ({TINY_QWEN3: SMOLLM2_135M}, "would shadow"),
        ({"Qwen/Qwen3-8B": "no/such-model"}, "not a catalogue model"),
        ({"a/b": "Qwen/Qwen3-8B", "Qwen/Qwen3-8B": TINY_QWEN3}, "not a catalogue model"),  # no chains
    ],
)
def test_bad_aliases_are_refused_with_a_reason(aliases, message):
    with pytest.raises(InvalidRequest, match=message):
        Catalog.from_names(None, aliases=aliases)


def test_aliases_come_from_the_environment_as_json(monkeypatch):
    monkeypatch.setenv("OPENRL_MODEL_ALIASES", '{"Qwen/Qwen3-8B": "openrl/tiny-qwen3"}')
    assert Settings().model_aliases == {"Qwen/Qwen3-8B": TINY_QWEN3}
