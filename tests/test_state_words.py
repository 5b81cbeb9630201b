"""No production code compares against a bare state or event word.

Every state and event word that crosses a process boundary is a member of a
vocabulary in ``shared/states.py``; code elsewhere compares against the member
(``lease.state == LeaseState.LOST``), never the word (``lease.state == "lost"``),
so a misspelt word is a NameError at import and a type error under mypy's
``strict_equality``, not a comparison that is silently always False.

The check reads the code's syntax tree (not its text, so a word in a docstring,
a log line or a comment is no comparison) and finds, in ``services/``,
``shared/`` and ``tui/`` outside ``shared/states.py``:

* ``==``, ``!=``, ``is``, ``is not`` with a vocabulary word on either side;
* ``in`` / ``not in`` against a tuple, list, set or dict literal holding one,
  or with a word on the left (``"lost" in seen``);
* a ``case "lost":`` (alone or in an ``|`` pattern).
"""

from __future__ import annotations

import ast
import enum
from pathlib import Path

import pytest

from llmgw.shared import states

ROOT = Path(__file__).resolve().parent.parent
PRODUCTION = ("services", "shared", "tui")
DEFINED_IN = Path("shared/states.py")


WORDS = frozenset(m.value for vocabulary in states.VOCABULARIES for m in vocabulary) - {""}

# Other vocabularies that share a word with these (a certificate's role "node" or
# "operator", the first token after llmgw. in a subject, the supervisor's answer to
# who listens on a port, "unknown"): a comparison whose other side is exactly one of
# these expressions is about that vocabulary, not a state.
OTHER_VOCABULARIES = {
    "role": "a certificate's role (shared/names.py check_role)",
    "parts[1]": "a subject's second token (shared/subjects.py)",
    "who": "who listens on an engine's port (services/agent/supervisor.py)",
}

EQUALITY = (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)
MEMBERSHIP = (ast.In, ast.NotIn)


def _word(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in WORDS:
        return node.value
    return None


def _words_in_literal(node: ast.AST) -> list[str]:
    """The vocabulary words a collection literal spells (``("suspect", "lost")``, ``{"lost": …}``)."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items: list[ast.AST] = list(node.elts)
    elif isinstance(node, ast.Dict):
        items = [k for k in node.keys if k is not None]
    else:
        return []
    return [w for w in map(_word, items) if w is not None]


def _case_words(pattern: ast.pattern) -> list[str]:
    if isinstance(pattern, ast.MatchValue):
        w = _word(pattern.value)
        return [w] if w else []
    if isinstance(pattern, ast.MatchOr):
        return [w for p in pattern.patterns for w in _case_words(p)]
    if isinstance(pattern, ast.MatchAs) and pattern.pattern is not None:
        return _case_words(pattern.pattern)
    return []


def bare_comparisons(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, what) for each comparison against a bare vocabulary word in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, operands[:-1], operands[1:], strict=True):
                if isinstance(op, EQUALITY):
                    words = [w for w, other in ((_word(left), right), (_word(right), left)) if w and ast.unparse(other) not in OTHER_VOCABULARIES]
                elif isinstance(op, MEMBERSHIP):
                    words = [w for w in (_word(left),) if w] + _words_in_literal(right)
                else:
                    words = []
                if words:
                    found.append((node.lineno, f"compares with {', '.join(repr(w) for w in words)}: {ast.unparse(node)}"))
        elif isinstance(node, ast.match_case):
            if words := _case_words(node.pattern):
                found.append((node.pattern.lineno, f"matches {', '.join(repr(w) for w in words)}"))
    return found


def _production_files() -> list[Path]:
    files = [p for top in PRODUCTION for p in sorted((ROOT / top).rglob("*.py"))]
    return [p for p in files if p.relative_to(ROOT) != DEFINED_IN]


def test_no_production_code_compares_against_a_bare_state_or_event_word():
    offences = []
    for path in _production_files():
        rel = path.relative_to(ROOT)
        for line, what in bare_comparisons(path.read_text(), str(rel)):
            offences.append(f"{rel}:{line}: {what}")
    assert not offences, "compare with the member of the shared/states.py vocabulary instead:\n" + "\n".join(offences)


def test_the_check_reads_the_production_code():
    """A check over no files would pass for nothing: it reads every top folder."""
    files = _production_files()
    for top in PRODUCTION:
        assert any(p.relative_to(ROOT).parts[0] == top for p in files), top
    assert ROOT / "tui" / "story.py" in files


@pytest.mark.parametrize(
    "source",
    [
        'if lease.state == "lost": pass',
        'if "lost" == lease.state: pass',
        'if rec.admin != "cordoned": pass',
        'if lease.state in ("suspect", "lost"): pass',
        'if state not in ["gone"]: pass',
        'if r.state in {"failed", "reaping"}: pass',
        'if ev.what in {"ready": 1}: pass',
        'if "lost" not in seen: pass',
        'if a < b == "draining": pass',
        'x = lease.state is "ready"',
        'match ev.what:\n    case "joined": pass',
        'match ev.what:\n    case "joined" | "ready": pass',
        'match ev.kind:\n    case ("node" as k): pass',
        'if ev.kind == "node" and role == "node": pass',  # the role is exempt, the kind is not
        'if roles == "node": pass',  # only the exact expression is exempt
        'def f(ev):\n    return [e for e in ev if e.what == "auto-cordon-withheld"]',
    ],
)
def test_the_check_finds_a_bare_word(source):
    assert bare_comparisons(source), source


@pytest.mark.parametrize(
    "source",
    [
        "if lease.state == LeaseState.LOST: pass",
        "if state in ENDING_REPLICA: pass",
        'log.info("node %s lost", node)',
        '"""A lost node is lost."""',
        'if name == "lostly": pass',  # not a word of any vocabulary
        'if state == "": pass',  # the empty word is too common to mean a state
        'x = {"ready": 1}',  # not a comparison
        'if role == "node": pass',  # a certificate's role
        'if who == "unknown": pass',  # the supervisor's own word
    ],
)
def test_the_check_leaves_the_rest_alone(source):
    assert bare_comparisons(source) == [], source


def test_every_vocabulary_in_the_states_module_is_checked():
    defined = {v for v in vars(states).values() if isinstance(v, type) and issubclass(v, enum.StrEnum) and list(v)}
    assert defined == set(states.VOCABULARIES)
