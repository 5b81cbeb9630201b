"""The control-plane benchmark's smoke mode runs every phase and prints a well-formed summary;
its nats-server restart (phase 5) declares no live node lost and sees every lease renewed.

Timing targets are not checked here: this is a shared machine, and the
benchmark (``bench/control_plane.py``) is for figures, not verdicts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
# --steady 1s: the CPU windows (two of them) only have to be measured here, not to be long enough to mean anything
# --agent-procs 2: the agents split over two worker processes, as at 10,000 nodes (one would be the default at 20)
SMOKE = ["--nodes", "20", "--replicas", "5", "--steady", "1s", "--node-lost-after", "3s", "--heartbeat", "0.5s", "--agent-procs", "2"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_bench(tmp_path, *extra: str) -> tuple[str, Path, Path]:
    """The bench in smoke mode (plus ``extra``): its output, figures file and work dir; it must succeed."""
    figures, work = tmp_path / "figures.json", tmp_path / "work"
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "control_plane.py"), *extra, *SMOKE, "--dir", str(work), "--json", str(figures)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout, figures, work


def test_smoke_mode_runs_every_phase_and_cleans_up(tmp_path):
    out, figures, work = run_bench(tmp_path)
    for n, name in enumerate(("bring-up", "steady state", "placement", "failover", "nats-server restart"), 1):
        assert f"== phase {n}: {name} ==" in out

    summary = out.split("== SUMMARY ==", 1)[1]
    assert re.search(r"^command: .*control_plane\.py --nodes 20 --replicas 5 --steady 1s", summary, re.M)
    assert re.search(rf"^machine:  {os.cpu_count()} cores", summary, re.M)
    assert "phases completed: bring-up, steady, placement, failover, restart (5/5)" in summary
    rows = [line for line in summary.splitlines() if line.startswith("| ")]
    header, body = rows[0], rows[1:]
    assert [c.strip() for c in header.strip("|").split("|")] == ["phase", "figure", "value", "target", "check"]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in body]
    assert all(len(c) == 5 for c in cells), body
    assert {c[0] for c in cells} == {"bring-up", "steady", "placement", "failover", "restart"}
    for _phase, what, value, target, check in cells:
        assert re.fullmatch(r"\d+(\.\d+)? (s|ms|%|/s|nodes|errors|passes)", value), (what, value)
        assert (target == "") == (check == ""), (what, target, check)
        assert check in ("", "ok", "MISSED")
    targeted = {c[1] for c in cells if c[3]}
    assert any("registry + health + scheduler CPU" in w for w in targeted)
    assert any("last of 10 launches" in w for w in targeted)
    assert any("last replacement launch" in w for w in targeted)
    assert any("every lease renewed" in w for w in targeted)
    # The restart's verdict on lost nodes is a check, and it passed: none was declared lost.
    lost_row = next(c for c in cells if c[0] == "restart" and c[1] == "live nodes declared lost")
    assert lost_row[2:] == ["0 nodes", "0", "ok"], lost_row

    data = json.loads(figures.read_text())
    assert data["rc"] == 0
    for key in ("bringup_s", "steady_cpu_rh", "steady_cpu_control_plane", "place_last_launch_s", "place_ready_s", "failover_last_s"):
        assert isinstance(data[key], float), key
    assert data["failover_replicas"] >= 1
    # phase 5: 19 live agents (the failover's node stays silent) came back and were heard
    assert data["restart_wrongly_lost"] == 0 and data["restart_lost_transitions"] == 0 and data["restart_not_ready_after"] == 0, data
    assert 0 <= data["restart_renewed_s"] < 60, data["restart_renewed_s"]
    assert 0 <= data["reconnect_first_s"] <= data["reconnect_last_s"] < 60, data

    # Everything it started is gone.
    pids = [int(p) for p in re.findall(r"(?:registry|health|scheduler) (\d+)", out.split("started registry, health, scheduler", 1)[1].split("\n", 1)[0])]
    assert len(pids) == 3
    workers = [int(p) for p in re.search(r"2 agent worker process\(es\) \(pids (\d+), (\d+)\)", out).groups()]
    assert not any(_alive(p) for p in pids + workers)
    assert not (work / "pids.json").exists()
    assert not (work / "nats-server.pid").exists() or not _alive(int((work / "nats-server.pid").read_text().strip() or 0))


def test_floor_mode_sends_every_launch_and_restarts_with_no_control_plane(tmp_path):
    """--floor: nats-server and the agents alone; every launch arrives and is acknowledged,
    every agent is back after the restart, and nothing it started is left running."""
    out, figures, work = run_bench(tmp_path, "--floor")
    assert "started registry" not in out  # no control plane
    summary = out.split("== SUMMARY ==", 1)[1]
    assert "phases completed: 2/2" in summary
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in summary.splitlines()[1:] if row.startswith("| ")][1:]
    assert {c[0] for c in cells} == {"floor"}
    for _phase, what, value, target, check in cells:
        assert re.fullmatch(r"\d+(\.\d+)? (s|ms|%)", value), (what, value)
        assert target == check == "", what  # a floor has no target: it is what any control plane adds to
    data = json.loads(figures.read_text())
    assert data["rc"] == 0
    assert data["floor_launches"] == 10 and data["floor_errors"] == {}, data
    assert 0 < data["floor_first_launch_s"] <= data["floor_last_launch_s"] <= data["floor_last_ack_s"] < 60, data
    assert set(data["floor_cpu_s"]) == {"nats-server", "agent workers", "sender (the bench)"}
    assert 0 <= data["floor_reconnect_last_s"] < 60, data
    workers = [int(p) for p in re.search(r"2 agent worker process\(es\) \(pids (\d+), (\d+)\)", out).groups()]
    assert not any(_alive(p) for p in workers)
    assert not (work / "nats-server.pid").exists() or not _alive(int((work / "nats-server.pid").read_text().strip() or 0))


@pytest.mark.parametrize(
    "args, says",
    [
        (["--nats-servers", "3"], "--floor runs one nats-server"),
        (["--until", "steady"], "--until names the full bench's phases"),
    ],
)
def test_floor_mode_refuses_what_it_does_not_do(tmp_path, args, says):
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "control_plane.py"), "--floor", *args, "--dir", str(tmp_path / "work")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert not (tmp_path / "work").exists()  # refused before anything started


@pytest.mark.parametrize("client", ["lean", "aiohttp"])
def test_gateway_bench_measures_both_targets_without_errors(tmp_path, client):
    """bench/gateway.py in a tiny run: every cell measured, no failed request, CPU accounted."""
    figures = tmp_path / "gateway.json"
    # a warm-up as short as a cell: it has to go through every path once, not to steady the figures
    args = [
        "--seconds",
        "0.3",
        "--warmup",
        "0.3",
        "--rounds",
        "1",
        "--clients",
        "1,4",
        "--paced",
        "50",
        "--litellm",
        "",
        "--client",
        client,
        "--json",
        str(figures),
    ]
    r = subprocess.run([sys.executable, "-m", "bench.gateway", *args], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert f"load generator: {client} client" in r.stdout
    rows = json.loads(figures.read_text())["rows"]
    cells = {(row["stream"], row["clients"], row["target"], row.get("paced")) for row in rows}
    assert cells == {(s, c, t, None) for s in (False, True) for c in (1, 4) for t in ("direct", "llmgw")} | {(False, 16, t, 50.0) for t in ("direct", "llmgw")}
    for row in rows:
        assert row["rps"] > 0, row
        if "errors" in row:
            assert row["errors"] == 0 and row["requests"] > 0, row
            cpu = row["cpu_us_per_request"]
            assert cpu["engine"] > 0 and cpu["client"] > 0, row
            assert (cpu["proxy"] is None) == (row["target"] == "direct"), row
