"""The modules of llmgw.services, llmgw.shared and llmgw.tui import one another
without a circle.

A circle between modules means neither can be read, tested or replaced without
the other; Python lets it pass when one side imports inside a function or under
``if TYPE_CHECKING:``, which hides it from the interpreter but not from a reader.
So every import counts here, wherever it is written (module level, in a
function, under ``TYPE_CHECKING``), at module granularity: ``from pkg import
name`` is an edge to the module ``pkg.name`` when there is one, else to ``pkg``
(its ``__init__``). Importing a module does not count as importing its parent
packages: a package's ``__init__`` that imports its own submodules is no circle.

The walk reads the source (as tests/test_devcluster_apart.py does), so an
import on a path no test runs is still seen.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_devcluster_apart import imported_names

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("services", "shared", "tui")

# Circles allowed while a change that removes them is under way, each the set of its
# modules, so that nothing else can join or start one meanwhile. None today: the
# last (the scheduler's view -> placement -> filters/scorers -> view) went when
# placement's memo moved beside the view into the cycle.
KNOWN_CIRCLES: tuple[frozenset[str], ...] = ()


def modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted installed name -> file, for every module of the packages."""
    out = {}
    for top in packages:
        for f in sorted((root / top).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(("llmgw", *parts))] = f
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``mods`` it imports, anywhere in its source."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for _, target in imported_names(name, path):
            # ``from pkg import name``: the module pkg.name, or a name defined in pkg.
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Every strongly connected set of more than one module (Tarjan): the modules of
    each circle, and of circles that share a module, together."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found, key=sorted)


def described(graph: dict[str, set[str]], component: frozenset[str]) -> str:
    """A circle in words: the shortest path from the component's first module back to
    it (``a -> b -> a``), then any other modules of the component."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    circle = [*paths[v], start]
                    rest = sorted(component - set(circle))
                    return " -> ".join(circle) + (f" (and {', '.join(rest)})" if rest else "")
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {sorted(component)}")  # a strongly connected set has one


def test_the_walk_finds_the_modules_and_their_imports():
    mods = modules()
    graph = import_graph(mods)
    # The walk could go wrong quietly and check nothing: a few edges known to exist,
    # one of each kind (module level, relative, in a function).
    assert len(mods) > 100
    assert "llmgw.shared.errors" in graph["llmgw.shared.config"]  # from .errors import ConfigError
    assert "llmgw.services.gateway.workers" in graph["llmgw.services.gateway.service"]
    assert "llmgw.shared.pki" in graph["llmgw.shared.tls"]  # inside TlsFiles.identity


def test_no_module_imports_itself_back_through_others():
    graph = import_graph(modules())
    unknown = [described(graph, c) for c in circles(graph) if c not in KNOWN_CIRCLES]
    assert unknown == [], "import circles:\n" + "\n".join(unknown)


def test_each_known_circle_is_still_there():
    """An allowance outliving its circle would let a new one in unseen: once the
    circle is gone, empty KNOWN_CIRCLES."""
    found = circles(import_graph(modules()))
    gone = [sorted(c) for c in KNOWN_CIRCLES if c not in found]
    assert gone == [], f"no longer a circle, remove it from KNOWN_CIRCLES: {gone}"


@pytest.mark.parametrize(
    "files, circle",
    [
        ({"a.py": "from . import b\n", "b.py": "from .a import X\n"}, ["llmgw.shared.a", "llmgw.shared.b", "llmgw.shared.a"]),
        ({"a.py": "import llmgw.shared.b\n", "b.py": "def f():\n    from . import a\n"}, ["llmgw.shared.a", "llmgw.shared.b", "llmgw.shared.a"]),
        (
            {"a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n", "b.py": "from llmgw.shared import a\n"},
            ["llmgw.shared.a", "llmgw.shared.b", "llmgw.shared.a"],
        ),
        (
            {"a.py": "from .b import x\n", "b.py": "from .c import y\n", "c.py": "from .a import z\n"},
            ["llmgw.shared.a", "llmgw.shared.b", "llmgw.shared.c", "llmgw.shared.a"],
        ),
        (
            {"pkg/__init__.py": "from .sub import x\n", "pkg/sub.py": "from .. import a\n", "a.py": "from .pkg import sub\n"},
            ["llmgw.shared.a", "llmgw.shared.pkg.sub", "llmgw.shared.a"],
        ),
        ({"pkg/__init__.py": "from .sub import x\n", "pkg/sub.py": "from . import other\n", "pkg/other.py": "X = 1\n"}, []),
    ],
    ids=["relative", "in-a-function", "type-checking", "three", "through-a-package", "package-and-its-submodule"],
)
def test_the_walk_names_each_kind_of_circle(tmp_path, files, circle):
    """The check can fail: each way of writing a circle is found and named."""
    for rel, text in files.items():
        path = tmp_path / "shared" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    graph = import_graph(modules(tmp_path, ("shared",)))
    # A package importing its own submodules is no circle ([]): importing a module
    # does not count as importing its parents.
    assert [described(graph, c) for c in circles(graph)] == ([" -> ".join(circle)] if circle else [])
