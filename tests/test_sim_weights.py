"""The sim engine's load time: ``--cached-load-time`` when the agent says the
weights were already in the node's model cache (``--weights-cached``),
``--load-time`` otherwise; and what it refuses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmgw.services.cli import build_parser
from llmgw.services.engines.sim import SimConfig
from llmgw.shared.errors import ConfigError

BASE = ["engine", "sim", "--model", "m", "--nnodes", "1", "--rank", "0", "--leader-addr", "127.0.0.1", "--rendezvous-port", "29500"]
BASE += ["--host", "127.0.0.1", "--port", "8100"]


def config(*extra: str) -> SimConfig:
    return SimConfig.from_args(build_parser().parse_args([*BASE, *extra]))


def test_load_times(tmp_path):
    w = str(tmp_path)
    cases = [
        ((), 15.0),
        (("--load-time", "30s"), 30.0),
        (("--load-time", "30s", "--cached-load-time", "2s"), 30.0),  # no weights named: not cached
        (("--load-time", "30s", "--cached-load-time", "2s", "--weights", w), 30.0),  # staged for this launch
        (("--load-time", "30s", "--cached-load-time", "2s", "--weights", w, "--weights-cached"), 2.0),
        (("--load-time", "30s", "--weights", w, "--weights-cached"), 30.0),  # no cached time given: the same
    ]
    for args, seconds in cases:
        assert config(*args).effective_load_time == seconds, args


REFUSED = [
    ("cached without a directory", ("--weights-cached",), "--weights-cached needs --weights"),
    ("a directory that is not there", ("--weights", "/nonexistent/llmgw-weights"), "--weights /nonexistent/llmgw-weights: not a directory"),
    ("a cached time that is no duration", ("--cached-load-time", "soon"), "--cached-load-time: 'soon' is not a duration"),
]


@pytest.mark.parametrize(("args", "words"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refusals(args, words):
    with pytest.raises(ConfigError, match=words.replace("-", r"\-")):
        config(*args)


def test_a_bad_weights_directory_ends_the_process_with_one_line():
    r = subprocess.run([sys.executable, "-m", "llmgw.services", *BASE, "--weights", "/nonexistent/w"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and "--weights /nonexistent/w: not a directory" in lines[0], lines
