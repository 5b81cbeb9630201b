"""The module map in shared/__init__.py names every module of shared/, once, and
nothing that is not one: a new module gets its line, a removed one loses it."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import llmgw.shared

SHARED = Path(__file__).resolve().parent.parent / "shared"
# A map line: four spaces, the module's name, at least two spaces, what it is for.
_LINE = re.compile(r" {4}(?P<name>[a-z_][a-z0-9_]*) {2,}\S")


def test_the_module_map_names_each_module_of_shared_once():
    doc = llmgw.shared.__doc__ or ""
    named = Counter(m["name"] for line in doc.splitlines() if (m := _LINE.match(line)))
    modules = {p.stem for p in SHARED.glob("*.py") if p.stem != "__init__"}
    assert len(modules) > 20  # the glob found the package
    assert sorted(n for n, k in named.items() if k > 1) == [], "named twice"
    assert sorted(modules - set(named)) == [], "modules of shared/ the map lacks"
    assert sorted(set(named) - modules) == [], "names in the map that are no module"
