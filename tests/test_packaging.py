"""A wheel built from the repo installs only `llmgw.*` import names."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_wheel_installs_only_under_llmgw(tmp_path):
    r = subprocess.run(
        # No build isolation: the test extra installs the backend [build-system] names
        # (setuptools, which builds wheels itself from 70.1), so pip need not fetch it into a fresh environment each run.
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("llmgw-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"llmgw"}
    assert "llmgw/shared/schemas.py" in names
    assert "llmgw/services/cli.py" in names
    assert not any(n.startswith(("llmgw/tests", "tests/")) for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "llmgw = llmgw.services.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
