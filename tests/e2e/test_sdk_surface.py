"""Every public method of the installed SDK's `ServiceClient`, `TrainingClient`, `SamplingClient`,
`RestClient` and `AdminClient`, run against a live `openrl serve`.

The methods come from reflection over the installed `tinker`, not from a list kept here, so
an SDK upgrade that adds one fails `test_method[...]` until a case is written for it
(`surface_cases_*.py`). `_async` variants are their own methods: each is awaited in its own
case run, because in 0.38 they are separate (mostly deprecated) code paths. Public
properties count too (`ServiceClient.holder`).

`docs/compatibility.md` is generated from the cases: `make compat` rewrites it
(`OPENRL_WRITE_COMPAT=1`) after every case has passed; otherwise the last test fails when the
file no longer says what the cases check.
"""

from __future__ import annotations

import inspect
import os
from collections import Counter
from pathlib import Path

import httpx
import pytest
import tinker

from tests.e2e import surface_cases_admin, surface_cases_sampling_rest, surface_cases_training, surface_fields  # noqa: F401  (they register the cases)
from tests.e2e.conftest import API_KEY
from tests.e2e.sdk_close import close_service
from tests.e2e.surface_rig import CASES, NOTE, OTHER, REFUSED, WORKS, World, make_call

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore::FutureWarning")]  # deprecated methods are cases too

CLIENTS = (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient, tinker.AdminClient)
DOC = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
PASSED: set[str] = set()


def public_methods() -> list[str]:
    """`Class.name` for every public function, static or class method and property, by client."""
    names = []
    for cls in CLIENTS:
        for name in sorted(dir(cls)):
            if name.startswith("_"):
                continue
            member = inspect.getattr_static(cls, name)
            if isinstance(member, (staticmethod, classmethod, property)) or inspect.isfunction(member):
                names.append(f"{cls.__name__}.{name}")
    return names


METHODS = public_methods()


@pytest.fixture(scope="module")
def world(server, hf_home):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TINKER_BASE_URL", server.url)
        env.setenv("TINKER_API_KEY", API_KEY)
        env.setenv("TINKER_TELEMETRY", "0")
        w = World(server, hf_home, API_KEY)
        yield w
        close_service(w.service)


@pytest.mark.parametrize("method", METHODS)
def test_method(world, method):
    case = CASES.get(method)
    assert case is not None, (
        f"{method} is a public SDK method with no case: add one in tests/e2e/surface_cases_*.py, then `make compat`"
    )
    case.run(world, make_call(method.endswith("_async")))
    PASSED.add(method)


def test_every_case_is_for_a_method_the_sdk_has():
    assert sorted(set(CASES) - set(METHODS)) == []


def render() -> str:
    counts = Counter(CASES[m].status for m in METHODS if m in CASES)
    lines = [
        "# Tinker SDK compatibility",
        "",
        "Every public method of `ServiceClient`, `TrainingClient`, `SamplingClient`, `RestClient` and `AdminClient` in the",
        f"installed `tinker` {tinker.__version__}, run against a live `openrl serve` on the tiny model by",
        "`tests/e2e/test_sdk_surface.py`, which finds the methods by reflection and fails on a method",
        "without a case. `_async` variants are rows of their own, each awaited in its own run. This",
        "file is generated from the cases: `make compat` rewrites it after they all pass.",
        "Loss functions, and what `stable_reinforce` assumes where Tinker publishes no formula:",
        "[losses.md](losses.md) (written by hand).",
        "",
        f"**{len(METHODS)} methods: {counts[WORKS]} work, {counts[NOTE]} work with a note, "
        f"{counts[REFUSED]} are refused (make no sense self-hosted), {counts[OTHER]} other.**",
        "",
        "- works: does what the SDK documents, checked as the last column says.",
        "- works, with a note: the same, with a caveat for a self-hosted user.",
        "- refused: the server answers 404 with a `detail` that names the feature and why it is absent.",
        "- other: refused by the SDK itself before any request, or not offered yet (with a clear 4xx).",
        "",
        "| method | status | note | checked |",
        "|---|---|---|---|",
    ]
    for method in METHODS:
        case = CASES.get(method)
        if case is None:
            lines.append(f"| `{method}` | **no case** | | |")
            continue
        lines.append(f"| `{method}` | {case.status} | {case.note} | {case.checked} |")
    lines += surface_fields.render_fields()
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("refused", sorted(surface_fields.REFUSED), ids=lambda key: ".".join(key))
def test_refused_field_is_a_clear_400(world, refused):
    """Each `refused values` entry of the field table: such a value gets a 400 naming the field."""
    route, body = surface_fields.REFUSED[refused][1](world)
    answer = httpx.post(world.server.url + route, json=body, headers={"X-API-Key": world.api_key}, timeout=30)
    assert answer.status_code == 400 and refused[1] in answer.json()["detail"], (refused, answer.text)


@pytest.mark.parametrize("loss", surface_fields.refused_losses())
def test_refused_loss_is_a_clear_400(world, loss):
    with pytest.raises(tinker.BadRequestError, match=loss):
        world.probe_training.forward_backward(world.batch, loss).result()


def test_compatibility_doc_says_what_the_cases_check():
    text = render()
    if os.environ.get("OPENRL_WRITE_COMPAT") == "1":
        missing = sorted(set(METHODS) - PASSED)
        assert not missing, f"not writing {DOC}: these cases did not run or pass: {missing}"
        DOC.parent.mkdir(exist_ok=True)
        DOC.write_text(text)
    assert DOC.exists() and DOC.read_text() == text, f"{DOC} is stale: run `make compat`"
