"""The seed's failover story, end to end, with real processes and compressed timings.

``llmgw up --detach`` starts the embedded nats-server, the four services and
four simulated nodes (agents + real `sim` engines); the test then drives and
checks the story itself: placement, a request with the official openai
client, who listens (the kernel's socket table), node02 killed, lost, the ib-a
replica failed and reaped, the replacement on ib-b's free GPUs, node01 idle,
and a request served again. ``llmgw down`` must leave no process behind.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import openai
import pytest

from llmgw.services.devcluster import simcluster
from llmgw.services.devcluster.scenario import observe_seed_story, report
from llmgw.shared import bus
from llmgw.shared.config import load_service_config
from llmgw.shared.procnet import listening_on

from .waiting import eventually_sync

HB = 0.5
LOST_AFTER = 3.0
LOAD = 1.0

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def llmgw(*args, timeout=180, cwd=None):
    return subprocess.run([sys.executable, "-m", "llmgw.services", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


@pytest.fixture
def cluster(tmp_path):
    yield from _running(tmp_path)


@pytest.fixture
def spared_cluster(tmp_path):
    yield from _running(tmp_path, "--spares", "1")


def _running(tmp_path, *extra):
    d = tmp_path / "llmgw"
    # A relative --dir, as a person types it: everything it starts runs elsewhere.
    r = llmgw(
        "up",
        "--dir",
        "llmgw",
        "--detach",
        "--heartbeat-interval",
        f"{HB}s",
        "--node-lost-after",
        f"{LOST_AFTER}s",
        "--engine-load-time",
        f"{LOAD}s",
        "--gateway-port",
        "0",
        *extra,
        cwd=tmp_path,
    )
    info = json.loads((d / "cluster.json").read_text()) if (d / "cluster.json").exists() else None
    try:
        assert r.returncode == 0, f"llmgw up failed:\n{r.stdout}\n{r.stderr}"
        yield d, info, r.stdout
    finally:
        down = llmgw("down", "--dir", str(d))
        assert down.returncode == 0, down.stderr
        if info:
            leftovers = {n["node_id"]: simcluster.processes_of(n["node_id"], str(d.resolve())) for n in info["nodes"]}
            assert not any(leftovers.values()), f"processes left behind: {leftovers}"


async def _observe(d, info, timeout=60):
    cfg = load_service_config(d / "operator.yaml")
    nc = await bus.connect(cfg.server, cfg.tls_files(), name="test", initial_attempts=5)
    try:
        addresses = {n["node_id"]: n["mgmt_addr"] for n in info["nodes"]}
        return await observe_seed_story(
            nc.jetstream(), gateway_url=info["gateway_url"], model="sim-70b", addresses=addresses, cluster_dir=d, timeout=timeout, say=lambda *_: None
        )
    finally:
        await nc.close()


def test_seed_failover_story(cluster):
    d, info, up_output = cluster
    assert "llmgw is up" in up_output and info["gateway_url"] in up_output
    nodes = {n["node_id"]: n for n in info["nodes"]}
    # 127.0.1.N, or the next free 127.0.M.0/24 when another cluster on this machine holds it.
    net = nodes["node01"]["mgmt_addr"].rsplit(".", 1)[0]
    assert net.startswith("127.0.")
    assert {n: (v["fabric"], v["mgmt_addr"]) for n, v in nodes.items()} == {
        "node01": ("ib-a", f"{net}.1"),
        "node02": ("ib-a", f"{net}.2"),
        "node03": ("ib-b", f"{net}.3"),
        "node04": ("ib-b", f"{net}.4"),
    }
    client = openai.OpenAI(base_url=info["gateway_url"] + "/v1", api_key="none", timeout=20, max_retries=0)
    first = client.chat.completions.create(model="sim-70b", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert first.choices[0].message.content

    story = asyncio.run(_observe(d, info))
    report(story, {n: v["mgmt_addr"] for n, v in nodes.items()})  # the measured timeline, in the test log

    # one replica per fabric, four GPUs from each node
    before = sorted(story.before.values(), key=lambda r: r.fabric)
    assert [r.fabric for r in before] == ["ib-a", "ib-b"]
    for r in before:
        assert sorted(m.node_id for m in r.members) == sorted(n for n, v in nodes.items() if v["fabric"] == r.fabric)
        assert all(len(m.gpus) == 4 for m in r.members)
    ib_b_first = next(r for r in before if r.fabric == "ib-b")

    # only the leaders listen: node01 and node03; node02 and node04 have no socket at all
    assert story.listening_before["node02"] == [] and story.listening_before["node04"] == []
    assert story.listening_before["node01"] and story.listening_before["node03"]
    assert not story.first_reply.startswith(("HTTP", "failed")), story.first_reply

    # node02 lost within one heartbeat of node_lost_after
    assert story.lost_at is not None, "node02 was never declared lost"
    assert LOST_AFTER - HB <= story.lost_at - story.killed_at <= LOST_AFTER + HB + 0.5
    # the ib-a replica failed and was reaped; node01's leader is gone
    assert story.failed is not None and story.failed.fabric == "ib-a"
    assert story.gone_at is not None
    # its socket closes as the engine exits, which need not come before the record is gone: waited for
    eventually_sync(lambda: listening_on(nodes["node01"]["mgmt_addr"]), [], what="node01's leader socket closed", timeout=10)
    # the replacement is whole on ib-b, on the GPUs the first ib-b replica does not use
    rep = story.replacement
    assert rep is not None and rep.fabric == "ib-b" and rep.state == "ready"
    for m in rep.members:
        first_member = next(x for x in ib_b_first.members if x.node_id == m.node_id)
        assert set(m.gpus).isdisjoint(first_member.gpus) and len(m.gpus) == 4
    assert story.replacement_ready_at - story.lost_at <= LOAD + 5
    # node01 hosts nothing; a request is served again
    assert not any(m.node_id == "node01" for r in story.after.values() for m in r.members)
    again = client.chat.completions.create(model="sim-70b", messages=[{"role": "user", "content": "again"}], max_tokens=8)
    assert again.choices[0].message.content
    assert not story.second_reply.startswith(("HTTP", "failed")), story.second_reply
    # clients streamed through the gateway all along: none saw an error, every answer whole,
    # and the stream under way on the ib-a replica when node02 died went on from ib-b
    streams = story.streams
    assert streams is not None and streams.runs
    assert [r.error for r in streams.errors] == []
    assert streams.differ == [] and all(streams.references.values())
    moved = [what for _, what in story.timeline if what.startswith("stream ") and "-> migrated to" in what]
    assert moved and all(story.failed.id in what for what in moved), story.timeline


def test_seed_story_with_a_spare_is_back_at_full_capacity_in_the_failures_cycle(spared_cluster):
    """``--spares 1``: a fabric of two nodes more, the spare standing by there; node02's
    kill has it promoted in the cycle the ib-a replica leaves ready (before that replica
    is even failed), and a new spare stands by later, built in the background."""
    d, info, up_output = spared_cluster
    assert "and 1 warm spare" in up_output
    nodes = {n["node_id"]: n for n in info["nodes"]}
    assert {n: v["fabric"] for n, v in nodes.items()} == {
        "node01": "ib-a", "node02": "ib-a", "node03": "ib-b", "node04": "ib-b", "node05": "ib-c", "node06": "ib-c",
    }  # fmt: skip
    story = asyncio.run(_observe(d, info, timeout=90))
    report(story, {n: v["mgmt_addr"] for n, v in nodes.items()})

    assert sorted(r.fabric for r in story.before.values()) != [] and len(story.before) == 2
    (spare,) = story.spares_before.values()
    assert not {m.node_id for m in spare.members} & {"node02"}, "the spare must not share the victim's node"
    # promoted: the spare itself, ready, in the cycle the doomed replica left ready
    assert story.promoted is not None and story.promoted.id == spare.id
    assert story.left_ready_at is not None and story.capacity_back_at is not None
    assert story.capacity_back_at == story.promoted.since
    assert story.failed_at is not None and story.capacity_back_at <= story.failed_at
    # the background rebuild: a new spare, of a new generation, standing by after
    assert story.new_spare is not None and story.new_spare.generation > max(r.generation for r in [*story.before.values(), spare])
    assert story.new_spare_at > story.capacity_back_at
    assert [r.state for r in story.after.values()].count("ready") == 2
    assert not story.second_reply.startswith(("HTTP", "failed")), story.second_reply
    # and the clients streaming all along saw no error
    assert story.streams is not None and story.streams.runs and [r.error for r in story.streams.errors] == []
