"""The docs held to the code: the README stays a five-minute read, every relative link in the
README and docs/ resolves (files and #anchors), the configuration reference in
docs/operations.md is what openrl_core/settings.py says, and docs/api.md's version table is
exactly the OpenRL routes the gateway serves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from functions import settings_reference
from functions.gateway.openapi_routes import ROUTES

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = sorted(
    [
        README,
        ROOT / "CONTRIBUTING.md",
        ROOT / "SECURITY.md",
        ROOT / "knative" / "README.md",
        ROOT / "examples" / "README.md",
    ]
    + list((ROOT / "docs").glob("*.md"))
)
OWN_API = "/api/openrl/v1/"
# The prefixes the gateway serves (docs/api.md): Tinker, OpenAI-compatible, OpenRL's own.
PREFIXES = ("/api/v1/", "/v1/", OWN_API)
UNVERSIONED = {"/openapi.json", "/dashboard", "/dashboard/{name}"}

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)


def prose(text: str) -> str:
    """The text without code blocks and code spans, where brackets are not links."""
    return CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(heading) for heading in HEADING.findall(FENCE.sub("", path.read_text()))}


def test_the_readme_is_a_five_minute_read():
    text = README.read_text()
    assert len(text.splitlines()) <= 300, "README.md is over 300 lines: move detail to docs/"
    assert len(text.encode()) <= 25_000, "README.md is over 25 KB: move detail to docs/"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_resolves(document: Path):
    broken = []
    for target in LINK.findall(prose(document.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file, _, anchor = target.partition("#")
        path = (document.parent / file).resolve() if file else document
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{document.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_link_checker_sees_a_broken_link_and_a_broken_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) [bad](#nowhere) `[code](ignored.md)`\n")
    links = LINK.findall(prose(page.read_text()))
    assert links == ["#title", "missing.md", "#nowhere"]
    assert anchors(page) == {"title"}
    assert slug("`openrl replay`") == "openrl-replay" and slug("Runs from the shell: `openrl runs`") == (
        "runs-from-the-shell-openrl-runs"
    )


def test_the_settings_reference_is_current():
    document = settings_reference.DOCUMENT.read_text()
    assert settings_reference.replaced(document) == document, (
        "docs/operations.md's settings reference is stale: run `make settings-doc`"
    )


def test_the_settings_reference_has_a_row_per_setting_with_its_default():
    from openrl_core.settings import Settings

    block = settings_reference.render()
    for name in Settings.model_fields:
        assert f"| `OPENRL_{name.upper()}` |" in block, name
    assert "| `OPENRL_PORT` | int, ≥ 0, ≤ 65535 | `8000` | port the gateway listens on |" in block
    assert "| `OPENRL_API_KEYS` | comma-separated list | `tml-openrl-local` |" in block
    assert "| `OPENRL_DATABASE_URL` | str (optional) | unset |" in block


def test_every_route_is_under_a_served_prefix_and_the_own_api_under_its_version():
    stray = [path for _, path in ROUTES if path not in UNVERSIONED and not path.startswith(PREFIXES)]
    assert not stray, f"routes outside /api/v1, /v1 and {OWN_API}: {stray}"
    unversioned_own = [path for _, path in ROUTES if path.startswith("/api/openrl/") and not path.startswith(OWN_API)]
    assert not unversioned_own


def test_the_api_versioning_table_lists_exactly_the_own_routes():
    text = (ROOT / "docs" / "api.md").read_text()
    listed = set(re.findall(r"^\| `(GET|POST|PUT|DELETE) (/api/openrl/[^`]+)` \|", text, re.M))
    served = {(method, path) for method, path in ROUTES if path.startswith("/api/openrl/")}
    assert listed == served, f"docs/api.md lists {sorted(listed - served)} not served, misses {sorted(served - listed)}"
