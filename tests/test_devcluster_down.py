"""``llmgw down`` ends a cluster's engines even when the ``up`` that started it never
wrote ``cluster.json`` (killed while it waited, as a test's timeout kills it): the
engines outlive their agents by design, and left behind they keep the ports the
next cluster is given."""

from __future__ import annotations

import json

import pytest

from llmgw.services.devcluster import simcluster

from .test_seed_scenario import HB, LOAD, LOST_AFTER, llmgw

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_down_without_cluster_json_ends_the_engines_of_every_recorded_agent(tmp_path):
    d = (tmp_path / "llmgw").resolve()
    r = llmgw(
        "up", "--dir", str(d), "--detach", "--heartbeat-interval", f"{HB}s", "--node-lost-after", f"{LOST_AFTER}s",
        "--engine-load-time", f"{LOAD}s", "--gateway-port", "0",
    )  # fmt: skip
    nodes = [n["node_id"] for n in json.loads((d / "cluster.json").read_text())["nodes"]] if (d / "cluster.json").exists() else []
    try:
        assert r.returncode == 0, f"llmgw up failed:\n{r.stdout}\n{r.stderr}"
        recorded = json.loads((d / "pids.json").read_text())
        # More processes of a node than its agent alone: its engines run.
        assert any(len(simcluster.processes_of(n, str(d))) > 1 for n in nodes), "no engine running to be left behind"
        (d / "cluster.json").unlink()
        down = llmgw("down", "--dir", str(d))
        assert down.returncode == 0, down.stderr
        assert {f"agent-{n}" for n in nodes} <= set(recorded)
        left = {n: p for n in nodes if (p := simcluster.processes_of(n, str(d)))}
        assert left == {}, f"processes left behind: {left}"
    finally:
        if (d / "pids.json").exists():
            llmgw("down", "--dir", str(d))
        for n in nodes:
            simcluster.kill_node(n, str(d))
