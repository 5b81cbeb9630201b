"""The console benchmark (``bench/console.py``) in a tiny run: the real console in a real
terminal (tmux) against ``bench/control_plane.py``'s cluster, every phase measured, a
well-formed summary, every key's result seen on screen, and nothing left running.

Timing targets are not checked here: this is a shared machine, and the benchmark is
for figures, not verdicts (docs/performance.md records them).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .test_bench_smoke import _alive

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ["--nodes", "20", "--replicas", "5", "--steady", "1s", "--node-lost-after", "3s", "--heartbeat", "0.5s"]
CONSOLE = ["--rounds", "1", "--lease-nodes", "3", "--lease-cycles", "1", "--size", "160x45"]


def test_console_bench_measures_every_phase_and_cleans_up(tmp_path):
    figures, work = tmp_path / "figures.json", tmp_path / "work"
    argv = [sys.executable, str(ROOT / "bench" / "console.py"), *SMOKE, *CONSOLE, "--dir", str(work), "--json", str(figures)]
    p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        # SIGTERM: the bench stops its cluster, console and tmux server before it exits
        p.terminate()
        out, err = p.communicate(timeout=60)
        pytest.fail(f"the bench did not finish within 240 s:\n{out[-5000:]}{err[-3000:]}")
    assert p.returncode == 0, out[-5000:] + err[-3000:]
    summary = out.split("== CONSOLE SUMMARY ==", 1)[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in summary.splitlines() if line.startswith("| ")][1:]
    assert all(len(c) == 5 for c in rows), rows
    for _phase, what, value, target, check in rows:
        assert re.fullmatch(r"\d+(\.\d+)? (s|ms|%|MiB)|\d+ / \d+ ms \(n=\d+\)", value), (what, value)
        assert (target == "") == (check == ""), (what, target, check)
        assert check in ("", "ok", "MISSED")
    targeted = {c[0]: c[1] for c in rows if c[3]}
    assert set(targeted) >= {"steady", "placement", "restart", "all"}, targeted

    con = json.loads(figures.read_text())["console"]
    # every key's result reached the screen, in each phase
    for phase in ("steady", "placement", "restart"):
        keys = con[f"{phase}_keys"]
        assert keys["missed"] == [], (phase, keys["missed"])
        assert {"scroll (Down)", "filter", "detail (Enter)", "cordon (c)", "back (Esc)"} <= set(keys), (phase, set(keys))
        assert 0 < keys["keys"]["p50_s"] <= keys["keys"]["p99_s"] < 15, (phase, keys["keys"])
    assert {"cordon (y)", "cordon round trip (y -> row cordoned, via the registry)"} <= set(con["steady_keys"])
    # three nodes to suspect and back once: six lease changes, each seen on its row
    assert con["lease_lag"]["n"] == 6 and 0 < con["lease_lag"]["p99_s"] < 15, con["lease_lag"]
    for name in ("bringup", "steady", "placement", "placed", "restart"):
        assert con[f"{name}_cpu_pct"] >= 0, name
    assert 0 < con["rss_peak_mib"] < 1000
    # the console quit on q and a new one showed the whole cluster
    assert 0 < con["open_s"] < 120 and con["open_cpu_s"] > 0 and "quit on q" in out

    # Everything it started is gone: the console, its tmux server, the cluster.
    console_pid = int(re.search(r"tmux terminal \(pid (\d+)\)", out).group(1))
    assert not _alive(console_pid)  # (the second one went with its tmux server, checked next)
    tmux = re.search(r"tmux -L (\S+) kill-server", out).group(1)
    assert subprocess.run(["tmux", "-L", tmux, "ls"], capture_output=True).returncode != 0
    pids = [int(p) for p in re.findall(r"(?:registry|health|scheduler) (\d+)", out.split("started registry, health, scheduler", 1)[1].split("\n", 1)[0])]
    assert len(pids) == 3 and not any(_alive(p) for p in pids)
    assert not (work / "pids.json").exists()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--floor"], "--floor runs no control plane"),
        (["--size", "60x20"], "at least 80x24"),
        (["--rounds", "0"], "at least 1"),
        (["--nats-servers", "3"], "runs one server"),
    ],
)
def test_console_bench_refuses_what_it_cannot_measure(tmp_path, args, says):
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "console.py"), *args, "--dir", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert not (tmp_path / "work").exists()  # refused before anything started
