"""``llmgw up --scenario fabric``'s story end to end (docs/hardware.md), real processes, compressed timings.

``llmgw up --detach`` brings up the seed cluster with agents re-reading their
hardware every 0.5 s; the test then runs the story the scenario prints: node02's
``mlx5_0`` port written DOWN in its sysfs tree, the ib-a replica failed (the
reason naming the port), reaped and rebuilt whole on ib-b, node02 never lost
and still offered single-node work but not multi-node work.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from llmgw.services.devcluster import simcluster
from llmgw.services.devcluster.scenario import observe_fabric_story, report_fabric
from llmgw.shared import bus
from llmgw.shared.config import load_service_config

from .test_seed_scenario import HB, LOAD, LOST_AFTER, llmgw

DISCOVERY = 0.5

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@pytest.fixture
def cluster(tmp_path):
    d = tmp_path / "llmgw"
    r = llmgw(
        "up", "--dir", str(d), "--detach", "--heartbeat-interval", f"{HB}s", "--node-lost-after", f"{LOST_AFTER}s",
        "--engine-load-time", f"{LOAD}s", "--discovery-interval", f"{DISCOVERY}s", "--gateway-port", "0",
    )  # fmt: skip
    info = json.loads((d / "cluster.json").read_text()) if (d / "cluster.json").exists() else None
    try:
        assert r.returncode == 0, f"llmgw up failed:\n{r.stdout}\n{r.stderr}"
        yield d, info
    finally:
        down = llmgw("down", "--dir", str(d))
        assert down.returncode == 0, down.stderr
        if info:
            leftovers = {n["node_id"]: simcluster.processes_of(n["node_id"], str(d.resolve())) for n in info["nodes"]}
            assert not any(leftovers.values()), f"processes left behind: {leftovers}"


async def _observe(d: Path, info):
    cfg = load_service_config(d / "operator.yaml")
    nc = await bus.connect(cfg.server, cfg.tls_files(), name="test", initial_attempts=5)
    try:
        return await observe_fabric_story(
            nc.jetstream(), gateway_url=info["gateway_url"], model="sim-70b",
            agent_config=d / "nodes" / "node02" / "agent.yaml", timeout=60, say=lambda *_: None,
        )  # fmt: skip
    finally:
        await nc.close()


def test_fabric_story(cluster, capsys):
    d, info = cluster
    story = asyncio.run(_observe(d, info))
    report_fabric(story)  # the timeline, in the test log
    printed = capsys.readouterr().out

    before = sorted(story.before.values(), key=lambda r: r.fabric)
    assert [r.fabric for r in before] == ["ib-a", "ib-b"]
    assert not story.first_reply.startswith(("HTTP", "failed")), story.first_reply
    assert story.port == "mlx5_0 port 1: 4: ACTIVE -> 1: DOWN"
    # The agent noticed, the registry recorded it, the replica on ib-a failed for that reason.
    assert story.problem == "mlx5_0: no ACTIVE port: port 1 is 1: DOWN (3: Disabled)"
    assert story.failed is not None and story.failed.fabric == "ib-a"
    assert story.failed.reason == f"fabric ib-a unusable on node02: {story.problem}"
    assert story.down_at <= story.seen_unusable_at <= story.failed_at
    # Rebuilt whole on ib-b, beside the replica already there, on its free GPUs.
    rep = story.replacement
    assert rep is not None and rep.fabric == "ib-b" and rep.state == "ready"
    ib_b_first = before[1]
    for m in rep.members:
        first = next(x for x in ib_b_first.members if x.node_id == m.node_id)
        assert set(m.gpus).isdisjoint(first.gpus) and len(m.gpus) == 4
    assert story.gone_at is not None and story.failed.id not in story.after
    # node02 stayed alive the whole time and still takes single-node work, not multi-node.
    assert story.victim_leases == ["ready"]
    assert story.single_node_ok, story.single_node_detail
    assert story.multi_node_reason == f"fabric_unusable: ib-a: {story.problem}"
    assert not story.second_reply.startswith(("HTTP", "failed")), story.second_reply
    assert "node02 lease meanwhile: ready (never lost: True)" in printed
    assert "node02 for a single-node replica: fits" in printed
