"""Weights already on the node, end to end: a real nats-server with the project's
PKI, the control plane, real agents with a model cache on disk, real sim engines.

* staging within a disk budget: real copies into each agent's cache directory,
  progress and eviction on the event stream, the budget never exceeded (sampled
  while the copies run), and a model a running engine reads never evicted;
* a second deployment of a model already cached on a node is placed there
  (``ctl explain`` says so before it is placed) and loads in the cached time.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import yaml

from llmgw.services.devcluster import simcluster
from llmgw.shared import buckets as B
from llmgw.shared import subjects as S
from llmgw.shared.config import write_config
from llmgw.shared.kvmirror import open_mirror
from llmgw.shared.schemas import CommandAck, DeploymentSpec, Event, NodeRecord, StageCommand, decode, decode_reply, encode

from .cluster_helpers import Cluster

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]

MiB = 1 << 20
# Far apart, so "loaded in the cached time" cannot be luck: a replica that loads
# uncached is not ready for UNCACHED seconds, and the test waits less than that.
UNCACHED, CACHED = "60s", "200ms"


@pytest.fixture
async def cluster(nats_server, tmp_path):
    c = Cluster(nats_server, tmp_path / "cluster")
    yield c
    await c.close()


def make_model(root: Path, name: str, size: int) -> Path:
    """A model directory as hubs lay them out: a config and weight shards."""
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model": name}))
    half = size // 2
    (d / "model-00001-of-00002.safetensors").write_bytes(os.urandom(half))
    (d / "model-00002-of-00002.safetensors").write_bytes(os.urandom(size - half))
    return d


def tree_digest(d: Path) -> str:
    """The content digest as the cache defines it (relative path, size, bytes; sorted)."""
    h = hashlib.sha256()
    for p in sorted((p for p in d.rglob("*") if p.is_file()), key=lambda p: str(p.relative_to(d))):
        data = p.read_bytes()
        h.update(f"{p.relative_to(d)}\0{len(data)}\0".encode())
        h.update(data)
    return f"sha256:{h.hexdigest()}"


def du(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file() and p.name != "index.json")


async def bring_up(cluster, connector, tmp_path, *, nodes: int, budget: str, mirror: Path) -> dict[str, Path]:
    """The control plane and ``nodes`` single-GPU-group nodes (no fabric), each with a model cache."""
    await cluster.start_control_plane()
    cluster.add_nodes(simcluster.layout(nodes, 0, 4))
    caches = {}
    for node_id, node in cluster.nodes.items():
        cfg = yaml.safe_load(node.config.read_text())
        caches[node_id] = tmp_path / "disk" / node_id / "model-cache"
        cfg["cache"] = {"dir": str(caches[node_id]), "budget": budget, "mirror": str(mirror), "progress_interval": "100ms", "copy_rate": "4MiB"}
        node.config.write_text(yaml.safe_dump(cfg))
        cluster.start_agent(node_id)
    await cluster.operator(connector)
    cluster.nodes_kv = await open_mirror(cluster.ops.jetstream(), B.NODES, wait=10)
    await cluster.wait(lambda: len([ls for ls in cluster.leases.items.values() if ls.state == "ready"]) == nodes, timeout=45, what="all nodes ready")
    return caches


def cache_of(cluster, node_id: str) -> dict[str, object]:
    rec: NodeRecord | None = cluster.nodes_kv.items.get(node_id)
    if rec is None or rec.model_cache is None:
        return {}
    return {e.source: e for e in rec.model_cache.entries}


def deployment(name: str, *, replicas=1, gpus=1, **weights) -> DeploymentSpec:
    return DeploymentSpec(
        name=name,
        model="sim-7b",
        engine="sim",
        replicas=replicas,
        gpus_per_node=gpus,
        engine_args=["--load-time", UNCACHED, "--cached-load-time", CACHED],
        startup_timeout=120,
        **weights,
    )


async def node_events(cluster, node_id: str) -> list[Event]:
    return await events_on(cluster, f"llmgw.event.node.{node_id}.>")


async def events_on(cluster, subject: str) -> list[Event]:
    """The events stored on ``subject`` so far (read until none comes for half a second)."""
    js = cluster.ops.jetstream()
    sub = await js.subscribe(subject, ordered_consumer=True)
    out = []
    try:
        while True:
            msg = await sub.next_msg(timeout=0.5)
            out.append(decode(msg.data, Event))
    except Exception:
        pass
    finally:
        await sub.unsubscribe()
    return out


def engine_log(cluster, node_id: str, replica_id: str) -> str:
    logs = sorted((cluster.nodes[node_id].work_dir / "engines").glob(f"{replica_id}.g*.r0/engine.log"))
    return logs[-1].read_text(errors="replace") if logs else ""


def ctl(cfg, *args) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "llmgw.services", "ctl", *args, "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"ctl {args}: {r.stderr}"
    return r


async def test_staging_copies_within_the_disk_budget_and_never_evicts_a_model_in_use(cluster, connector, tmp_path):
    mirror = tmp_path / "mirror"
    models = {name: make_model(mirror / "org", name, 3 * MiB) for name in ("a", "b", "c")}
    big = make_model(mirror / "org", "big", 9 * MiB)
    caches = await bring_up(cluster, connector, tmp_path, nodes=1, budget="7MiB", mirror=mirror)
    cache_dir, budget = caches["node01"], 7 * MiB
    peak = 0
    details: set[str] = set()  # what dep-a's member said while it waited

    async def sample():  # the budget holds while copies run, not only between them
        nonlocal peak
        while True:
            peak = max(peak, du(cache_dir))
            details.update(m.engine_detail for r in cluster.live("dep-a") for m in r.members)
            await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample())
    try:
        # a: launched from a model id under the mirror; copied in, then the engine starts on the copy.
        await cluster.apply(deployment("dep-a", weights_model="org/a"))
        (rep_a,) = await cluster.wait(lambda: [r for r in cluster.live("dep-a") if r.members and r.members[0].pid], what="dep-a's engine started", timeout=30)
        await cluster.wait(lambda: "not cached before this launch" in engine_log(cluster, "node01", rep_a.id), what="dep-a loads uncached")
        entry = await cluster.wait(lambda: (e := cache_of(cluster, "node01").get("model:org/a")) and e.complete and e.in_use and e, what="a cached and in use")
        # While it was copied (at 4 MiB/s, ~0.75s) the member was starting, saying how far the copy was.
        assert any(d.startswith("staging weights model:org/a: ") and d.endswith("%)") for d in details), details
        assert (entry.size, entry.digest) == (3 * MiB + len(json.dumps({"model": "a"})), tree_digest(models["a"]))

        # b: pre-staged through the agent's stage command (as the scheduler sends it).
        sched = await connector.as_new("stage-test", "scheduler")
        reply = await sched.request(S.cmd_stage("node01"), encode(StageCommand(weights_model="org/b", reason="a spare may come here")), timeout=5)
        ack = decode_reply(reply.data, CommandAck)
        assert ack.ok, ack.reason
        await cluster.wait(lambda: (e := cache_of(cluster, "node01").get("model:org/b")) and e.complete and not e.in_use, what="b pre-staged")

        # c: 3 x 3 MiB > 7 MiB. b is evicted (not in use), a stays although it is older.
        await cluster.apply(deployment("dep-c", weights_model="org/c"))
        await cluster.wait(lambda: (e := cache_of(cluster, "node01").get("model:org/c")) and e.complete and e.in_use, what="c cached and in use")
        assert sorted(cache_of(cluster, "node01")) == ["model:org/a", "model:org/c"]
        assert len(list((cache_dir / "entries").iterdir())) == 2
        # dep-a still loads (60s) from its copy, the same engine: untouched.
        assert [(r.id, r.state, r.members[0].pid) for r in cluster.live("dep-a")] == [(rep_a.id, "waiting-for-workers", rep_a.members[0].pid)]

        # big does not fit beside two models in use: its engine reads the mirror itself, nothing is evicted.
        await cluster.apply(deployment("dep-big", weights_model="org/big"))
        (rep_big,) = await cluster.wait(lambda: [r for r in cluster.live("dep-big") if r.members and r.members[0].pid], what="dep-big's engine started")
        await cluster.wait(lambda: f"from {big} (not cached" in engine_log(cluster, "node01", rep_big.id), what="dep-big reads the source")
        assert sorted(cache_of(cluster, "node01")) == ["model:org/a", "model:org/c"]
    finally:
        sampler.cancel()
    assert 0 < peak <= budget, f"the cache held {peak} bytes, over its budget of {budget}"

    events = await node_events(cluster, "node01")
    seen = [(ev.what, ev.data.get("source")) for ev in events if ev.what in ("staging", "staged", "evicted")]
    for source in ("model:org/a", "model:org/b", "model:org/c"):
        assert ("staging", source) in seen and ("staged", source) in seen, seen
    assert ("evicted", "model:org/b") in seen and ("evicted", "model:org/a") not in seen
    # At 4 MiB/s a 3 MiB copy takes ~0.75s: progress is reported on the way (every 100ms at most).
    progress = [(int(ev.data["bytes"]), int(ev.data["total"])) for ev in events if ev.what == "staging" and ev.data["source"] == "model:org/a"]
    assert all(total == 3 * MiB + 14 and done <= total for done, total in progress), progress
    assert any(0 < done < total for done, total in progress), progress
    assert [done for done, _ in progress] == sorted(done for done, _ in progress)


async def test_a_second_deployment_of_a_cached_model_goes_where_it_is_cached_and_loads_in_the_cached_time(cluster, connector, tmp_path):
    shared = tmp_path / "shared"
    weights = make_model(shared, "llama-8b", 4 * MiB)
    await bring_up(cluster, connector, tmp_path, nodes=3, budget="64MiB", mirror=tmp_path / "no-mirror")
    # The first deployment fills node01 (bin-packing's first choice); its weights are copied there.
    first = deployment("first", gpus=4, weights_path=str(weights))
    await cluster.apply(msgspec.structs.replace(first, engine_args=["--load-time", "300ms"]))
    (rep1,) = await cluster.wait(lambda: cluster.ready("first"), what="first ready")
    assert rep1.members[0].node_id == "node01"
    source = f"path:{weights}"
    await cluster.wait(lambda: (e := cache_of(cluster, "node01").get(source)) and e.complete, what="node01 holds the weights")
    # And node03 gets them pre-staged. node02 holds nothing: packing alone would pick it (by name).
    sched = await connector.as_new("stage-test", "scheduler")
    reply = await sched.request(S.cmd_stage("node03"), encode(StageCommand(weights_path=str(weights))), timeout=5)
    assert decode_reply(reply.data, CommandAck).ok
    await cluster.wait(lambda: (e := cache_of(cluster, "node03").get(source)) and e.complete, what="node03 holds the weights")

    tls = cluster.server.issue("admin", "operator")
    cluster.server.reload()
    cfg = tmp_path / "operator.yaml"
    write_config(cfg, {"server": cluster.server.url, "tls": {"ca": tls.ca, "cert": tls.cert, "key": tls.key}})
    second = deployment("second", replicas=0, gpus=2, weights_path=str(weights))
    await cluster.apply(second)

    async def explained():
        return json.loads((await asyncio.to_thread(ctl, cfg, "explain", "second", "-o", "json")).stdout)

    ex = await cluster.wait(explained, what="explain answers")
    scores = {n["node_id"]: n["scores"]["weights_cached"] for n in ex["nodes"]}
    assert scores == {"node01": 1.0, "node02": 0.0, "node03": 1.0} and ex["leader"] == "node03"
    table = (await asyncio.to_thread(ctl, cfg, "explain", "second")).stdout
    assert next(line for line in table.splitlines() if line.startswith("node03")).rstrip().endswith("ok; weights cached here"), table

    await cluster.apply(msgspec.structs.replace(second, replicas=1))
    # Ready well inside the uncached load time (60s): it loaded in the cached one.
    (rep2,) = await cluster.wait(lambda: cluster.ready("second"), what="second ready in the cached time", timeout=30)
    assert [m.node_id for m in rep2.members] == ["node03"]
    assert "cached on this node" in engine_log(cluster, "node03", rep2.id)
    assert f"({CACHED})" in engine_log(cluster, "node03", rep2.id)


async def test_weights_a_node_cannot_read_fail_the_replica_with_the_agents_words(cluster, connector, tmp_path):
    await bring_up(cluster, connector, tmp_path, nodes=1, budget="8MiB", mirror=tmp_path / "mirror")
    await cluster.apply(deployment("lost", weights_path=str(tmp_path / "not-mounted" / "llama")))

    # The agent refuses the launch at once, in words naming the path; the scheduler
    # fails the replica (the member is absent) and backs off.
    words = f"weights source {tmp_path / 'not-mounted' / 'llama'} does not exist on this node"
    await cluster.wait(lambda: words in cluster.nodes["node01"].log.read_text(), what="the agent's refusal")
    failed = await cluster.wait(lambda: events_on(cluster, "llmgw.event.replica.lost-g1.failed"), what="the replica failed")
    assert failed[0].detail == "member rank 0 on node01 absent"
    assert cache_of(cluster, "node01") == {}  # nothing staged, nothing reported
