"""No code comment or doc cites this project's issue tracker by number.

A reader of the repository cannot open an issue number of ours: the text
must say what and why instead. A reference to another project's issue names its repository
("nats-io/nats-server#5467", "NVIDIA/open-gpu-kernel-modules issue #1151") and
can be opened, so it is allowed.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WHERE = ("README.md", "docs", "services", "shared", "tui", "bench", "scripts", "deploy", "tests")
SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".tcss", ".service", ".txt"}

# The word issue(s) and a number, with or without "#" — or a bare "#" and a number.
CITATION = re.compile(r"(?i)\bissues?\s+#?\d+|(?<![\w/.#-])#\d+\b")
# What may stand right before a citation: another project's repository, owner/name,
# optionally followed by the kind of thread.
REPO = re.compile(r"[\w.-]+/[\w.-]+(?:\s+(?:issue|issues|pr|pull request|discussion))?\s*$", re.I)


def citations(text: str) -> list[str]:
    """Each citation of this project's issues in ``text``, with a little context."""
    found = []
    for m in CITATION.finditer(text):
        before = text[max(0, m.start() - 80) : m.start()]
        if REPO.search(before):
            continue
        found.append(text[max(0, m.start() - 30) : m.end() + 10].replace("\n", " "))
    return found


NUM = "#" + "12"  # spelt apart, so that this file does not cite anything itself


@pytest.mark.parametrize(
    ("text", "cited"),
    [
        (f"bounds on what a node may claim (issue {NUM})", True),
        (f"Issue {NUM}, finding 4: one node", True),
        ("at scale (issues " + "4 and 17)", True),
        ("the code before #" + "17 (aa40157)", True),
        (f"as quoted in NVIDIA/open-gpu-kernel-modules issue {NUM}", False),
        ("removes them (nats-io/nats-server#5467)", False),
        ("see ai-dynamo/dynamo #6985", False),
        ("vllm-project/vllm PR #855 added it", False),
        ("a comment # 12 GPUs", False),
        ("colour #1e1e1e", False),
        ("no reference here", False),
    ],
)
def test_the_rule(text, cited):
    assert bool(citations(text)) is cited, citations(text)


def _files():
    for name in WHERE:
        p = ROOT / name
        if p.is_file():
            yield p
        elif p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file() and f.suffix in SUFFIXES and "__pycache__" not in f.parts:
                    yield f


def test_no_file_cites_this_projects_issues():
    files = list(_files())
    assert len(files) > 100, "the walk found too few files to mean anything"
    bad = [f"{f.relative_to(ROOT)}: {c}" for f in files for c in citations(f.read_text(errors="replace"))]
    assert not bad, "say what and why instead of citing an issue number:\n" + "\n".join(bad)
