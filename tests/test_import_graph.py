"""No import circle among the project's modules: the graph of openrl_core/, eventing/ and
functions/, read from the source with `ast`, has no cycle.

Every import counts, wherever it is written: at module level, inside a function (a deferred
import still ties the two modules together), under `if TYPE_CHECKING:`. An import names the
most specific project module it reaches (`from a.b import c` is `a.b.c` when that is a module,
else `a.b`); relative imports are resolved against the importing module's package. A cycle is
reported with the imports that close it, so the failure says what to untie.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("openrl_core", "eventing", "functions")


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> its file, for every .py under the project's packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]):
    """The longest prefix of `name` that is a project module (None: not the project's)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `module` imports, anywhere in its source."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, known)
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


def graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {module: imports(module, path, known) for module, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively:
    the graph has hundreds of modules), each sorted; none means no circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            step = next(successors, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(edges.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_checker_finds_direct_indirect_and_deferred_circles(tmp_path):
    """The checker itself, on a made-up tree: a direct pair, a three-module ring closed by an
    import inside a function, one closed under TYPE_CHECKING by a relative import, and
    modules that only point one way."""
    files = {
        "openrl_core/__init__.py": "",
        "openrl_core/a.py": "from openrl_core import b\n",
        "openrl_core/b.py": "import openrl_core.a\n",
        "eventing/__init__.py": "",
        "eventing/x.py": "from eventing.y import thing\n",
        "eventing/y.py": "def f():\n    from eventing import z\n",
        "eventing/z.py": "from eventing.x import other\n",
        "functions/__init__.py": "",
        "functions/p.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .q import Q\n",
        "functions/q.py": "from functions import p\nimport openrl_core.a\n",
        "functions/leaf.py": "from eventing import x\nfrom openrl_core.a import name\nimport json\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = graph(tmp_path)
    assert edges["functions.leaf"] == {"eventing.x", "openrl_core.a"}
    assert sorted(cycles(edges)) == [
        ["eventing.x", "eventing.y", "eventing.z"],
        ["functions.p", "functions.q"],
        ["openrl_core.a", "openrl_core.b"],
    ]
    assert cycles({"m": {"n"}, "n": {"o"}, "o": set()}) == []


def test_no_import_circle_among_the_modules():
    edges = graph(ROOT)
    assert len(edges) > 100, "the project's modules were not found"
    found = cycles(edges)
    if found:
        lines = []
        for component in found:
            members = set(component)
            ties = [f"{a} -> {b}" for a in component for b in sorted(edges[a] & members)]
            lines.append(f"{len(component)} modules: " + "; ".join(ties))
        pytest.fail("import circles:\n" + "\n".join(lines))
