"""Production services never import the dev cluster (services/devcluster/).

``llmgw up`` and its simulated nodes depend on the services, never the other
way round: a service that imported them would ship the simulator's fault verbs
and fake devices into every real node and control-plane machine, and would
bring the dev cluster back into an import cycle with what it starts.

Two checks, because each misses what the other sees: importing every
production module in a fresh interpreter catches any path that pulls the
package in at import time, however indirect; reading the source catches the
imports written inside functions, which run only when that code path does.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SERVICES = Path(__file__).resolve().parent.parent / "services"
DEVCLUSTER = "llmgw.services.devcluster"
# The production services and what they are built on: the modules a node or
# control-plane machine runs.
PRODUCTION = ("registry.py", "health", "runtime.py", "natsrun.py", "scheduler", "gateway", "agent")


def production_modules() -> list[tuple[str, Path]]:
    """(dotted name, file) of every production module."""
    out = []
    for entry in PRODUCTION:
        path = SERVICES / entry
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            parts = f.relative_to(SERVICES).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append((".".join(("llmgw", "services", *parts)), f))
    return out


def imported_names(name: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, nested ones included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # ``from llmgw.services import devcluster`` names the package in the alias.
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def devcluster_imports(modules: list[tuple[str, Path]]) -> list[str]:
    return [
        f"{path}:{line} imports {target}"
        for name, path in modules
        for line, target in imported_names(name, path)
        if target == DEVCLUSTER or target.startswith(DEVCLUSTER + ".")
    ]


def test_the_production_modules_are_found():
    names = {n for n, _ in production_modules()}
    # The walk itself could go wrong quietly and check nothing.
    assert {
        "llmgw.services.registry",
        "llmgw.services.health.service",
        "llmgw.services.scheduler.service",
        "llmgw.services.gateway.service",
        "llmgw.services.agent.agent",
        "llmgw.services.agent.wrapper",
    } <= names
    assert not any(n.startswith(DEVCLUSTER) for n in names)


def first_loader(names: list[str]) -> str:
    """Import ``names`` in turn in a fresh interpreter; the first after which the dev
    cluster is loaded, with what it pulled in ("" when none)."""
    probe = textwrap.dedent(
        f"""
        import importlib, sys
        for name in {names!r}:
            importlib.import_module(name)
            loaded = sorted(m for m in sys.modules if m == {DEVCLUSTER!r} or m.startswith({DEVCLUSTER + "."!r}))
            if loaded:
                print(f"{{name}} loads {{', '.join(loaded)}}")
                break
        """
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_no_production_module_imports_the_dev_cluster_when_loaded():
    assert first_loader([n for n, _ in production_modules()]) == ""


def test_the_load_check_names_the_module_that_pulls_it_in():
    # bench/control_plane.py's way in: the dev cluster's Cluster, after a production module.
    assert first_loader(["llmgw.services.registry", "llmgw.services.devcluster.up"]).startswith("llmgw.services.devcluster.up loads llmgw.services.devcluster,")


def test_no_production_module_names_the_dev_cluster_in_any_import():
    assert devcluster_imports(production_modules()) == []


@pytest.mark.parametrize(
    "source",
    [
        "from llmgw.services.devcluster import simcluster\n",
        "from llmgw.services import devcluster\n",
        "import llmgw.services.devcluster.up\n",
        "def f():\n    from ..devcluster.scenario import DEMO_MODEL\n",
        "def f():\n    from .. import devcluster\n",
    ],
)
def test_the_source_check_sees_each_way_of_importing_it(tmp_path, source):
    """The check above can fail: each spelling, written in a scheduler module, is found."""
    path = tmp_path / "service.py"
    path.write_text(source)
    found = devcluster_imports([("llmgw.services.scheduler.service", path)])
    assert len(found) == 1, found
