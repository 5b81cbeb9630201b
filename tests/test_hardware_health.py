"""Hardware that degrades on a live node (docs/hardware.md), with real processes.

A control plane on a real nats-server, real agents re-reading their hardware
every 0.3 s, real `sim` engines. Faults are injected the way a real node shows
them: an HCA port's sysfs ``state`` file says ``1: DOWN``; the node's
nvidia-smi (the simulated one, in its real output shape) reports a GPU lost
(XID 79: "Unable to determine the device handle …") or uncorrectable ECC
errors; a process the agent did not launch holds a GPU.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

import pytest

from llmgw.services.devcluster import simcluster
from llmgw.shared import buckets as B
from llmgw.shared.kvmirror import open_mirror
from llmgw.shared.schemas import NodeRecord

from . import spawning
from .cluster_helpers import CLUSTER_ENV, TIMINGS, Cluster
from .cluster_helpers import sim_spec as spec

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

DISCOVERY = 0.3


@pytest.fixture
async def cluster(nats_server, tmp_path):
    c = Cluster(nats_server, tmp_path / "cluster")
    yield c
    if hasattr(c, "nodes_kv"):
        await c.nodes_kv.stop()
    await c.close()


async def bring_up(cluster, connector, *, nodes, fabrics, gpus=4):
    await cluster.start_control_plane()
    timings = dataclasses.replace(TIMINGS, discovery_interval=DISCOVERY)
    for s in simcluster.layout(nodes, fabrics, gpus):
        # As Cluster.add_nodes does: this cluster's own loopback network, so no other run's engine answers for ours.
        s = dataclasses.replace(s, mgmt_addr=f"{cluster.net}.{s.mgmt_addr.rsplit('.', 1)[1]}")
        cluster.nodes[s.node_id] = simcluster.write_node(cluster.root, cluster.server.pki_dir, cluster.server.url, s, timings)
    cluster.server.reload()
    for n in cluster.nodes:
        cluster.start_agent(n)
    await cluster.operator(connector)
    cluster.nodes_kv = await open_mirror(cluster.ops.jetstream(), B.NODES, wait=10)
    await cluster.wait(lambda: len([x for x in cluster.leases.items.values() if x.state == "ready"]) == nodes, timeout=45, what="all nodes ready")


def record(cluster, node_id) -> NodeRecord | None:
    return cluster.nodes_kv.items.get(node_id)


async def failed_event(cluster, rid: str) -> str:
    """The detail of the replica's ``failed`` event, from the event stream."""
    js = cluster.ops.jetstream()
    sub = await js.subscribe(f"llmgw.event.replica.{rid}.failed", ordered_consumer=True)
    try:
        msg = await sub.next_msg(timeout=10)
    finally:
        await sub.unsubscribe()
    import json

    return json.loads(msg.data)["detail"]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_an_hca_port_down_fails_the_multi_node_replica_at_once_and_it_is_rebuilt_on_the_healthy_fabric(cluster, connector):
    await bring_up(cluster, connector, nodes=4, fabrics=2)
    await cluster.apply(spec())
    (first,) = await cluster.wait(lambda: cluster.ready("demo"), what="replica ready")
    victim = first.members[1].node_id  # the worker's node
    other_fabric = "ib-b" if first.fabric == "ib-a" else "ib-a"
    leases_seen: set[str] = set()

    _port, before, now = simcluster.set_hca_port(cluster.nodes[victim].config, "mlx5_0", up=False)
    assert (before, now) == ("4: ACTIVE", "1: DOWN")

    def rebuilt():
        leases_seen.add(cluster.leases.items[victim].state)
        new = [r for r in cluster.ready("demo") if r.id != first.id]
        return first.id not in cluster.replicas.items and len(cluster.live("demo")) == 1 and new and new[0].fabric == other_fabric and new

    (second,) = await cluster.wait(rebuilt, timeout=30, what="old replica reaped, replacement ready on the other fabric, nothing else live")
    assert {m.node_id for m in second.members}.isdisjoint({m.node_id for m in first.members})
    detail = await failed_event(cluster, first.id)
    assert detail == f"fabric {first.fabric} unusable on {victim}: mlx5_0: no ACTIVE port: port 1 is 1: DOWN (3: Disabled)"
    # The node never stopped being alive: it is not lost, only its fabric is.
    assert leases_seen == {"ready"}
    rec = record(cluster, victim)
    assert [(f.name, f.usable) for f in rec.fabrics] == [(first.fabric, False)]
    assert [(p.state, p.phys_state) for h in rec.hcas if h.name == "mlx5_0" for p in h.ports] == [("DOWN", "Disabled")]
    # Both old engines were stopped, the one on the healthy node too.
    await cluster.wait(lambda: not any(alive(m.pid) for m in first.members), timeout=10, what="old engines stopped")

    # Port back up: the agent says so without a reconnect.
    simcluster.set_hca_port(cluster.nodes[victim].config, "mlx5_0", up=True)
    await cluster.wait(lambda: [(f.name, f.usable) for f in record(cluster, victim).fabrics], [(first.fabric, True)], what="fabric usable again")


async def test_a_gpu_fault_fails_exactly_the_replica_holding_it_and_the_gpu_takes_nothing_until_ok(cluster, connector):
    await bring_up(cluster, connector, nodes=1, fabrics=0)
    await cluster.apply(spec(replicas=2, nodes=1, gpus=2))
    reps = await cluster.wait(lambda: len(cluster.ready("demo")) == 2 and cluster.ready("demo"), what="two replicas ready")
    by_gpus = {tuple(r.members[0].gpus): r for r in reps}
    assert sorted(by_gpus) == [(0, 1), (2, 3)]
    hit, spared = by_gpus[(2, 3)], by_gpus[(0, 1)]
    config = cluster.nodes["node01"].config

    simcluster.set_gpu_fault(config, 3, xid=79)

    def replacement_pending():
        pending = [r for r in cluster.live("demo") if r.state == "pending"]
        return hit.id not in cluster.replicas.items and len(pending) == 1 and "gpu_unhealthy" in pending[0].reason and pending

    await cluster.wait(replacement_pending, timeout=20, what="hit replica reaped, its replacement pending on the unhealthy GPU")
    detail = await failed_event(cluster, hit.id)
    assert detail.startswith(
        "GPU 3 on node01 unhealthy: GPU is lost (XID 79, fallen off the bus?): nvidia-smi: Unable to determine the device handle for GPU 00000000:48:00.0: Unknown Error"
    ), detail
    # Exactly that one: the other replica never left ready.
    assert cluster.replicas.items[spared.id].state == "ready" and cluster.replicas.items[spared.id].since == spared.since
    gpu3 = next(g for g in record(cluster, "node01").gpus if g.index == 3)
    assert not gpu3.healthy and "Unable to determine the device handle" in gpu3.problem

    simcluster.set_gpu_fault(config, 3)  # gpu-ok
    (_back,) = await cluster.wait(  # exactly one replacement
        lambda: [r for r in cluster.ready("demo") if r.id != spared.id and r.members[0].gpus == [2, 3]], timeout=20, what="replacement ready on GPUs 2-3"
    )
    assert all(g.healthy for g in record(cluster, "node01").gpus)


async def test_uncorrectable_ecc_errors_fail_the_replica_with_the_count_in_the_reason(cluster, connector):
    await bring_up(cluster, connector, nodes=1, fabrics=0)
    await cluster.apply(spec(replicas=1, nodes=1, gpus=4))
    (first,) = await cluster.wait(lambda: cluster.ready("demo"), what="replica ready")
    simcluster.set_gpu_fault(cluster.nodes["node01"].config, 1, ecc=2)
    await cluster.wait(lambda: first.id not in cluster.replicas.items, timeout=20, what="replica failed and reaped")
    assert await failed_event(cluster, first.id) == "GPU 1 on node01 unhealthy: 2 uncorrectable ECC errors (volatile)"


async def test_a_process_llmgw_did_not_start_keeps_its_gpu_from_placement_and_its_own_engines_do_not(cluster, connector):
    await bring_up(cluster, connector, nodes=1, fabrics=0)
    await cluster.apply(spec(name="a", replicas=1, nodes=1, gpus=1))
    (a,) = await cluster.wait(lambda: cluster.ready("a"), what="replica a ready")
    assert a.members[0].gpus == [0]
    node = cluster.nodes["node01"]
    # A stranger on this machine using GPU 1, as the driver would list it.
    marker = cluster.marker.split(b"=", 1)[1].decode()
    stranger = await spawning.start(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        cwd=node.dir,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "1", simcluster.SIM_ENV: "node01", CLUSTER_ENV: marker},
    )
    cluster.spawned.append(stranger)
    try:

        def seen():
            gpus = {g.index: g for g in record(cluster, "node01").gpus}
            return (gpus[0].foreign_pids, gpus[1].foreign_pids, gpus[1].foreign_mib)

        # Judged in the same discovery round: the engine on GPU 0 is ours, the stranger is not.
        await cluster.wait(seen, ([], [stranger.pid], 1024), timeout=10, what="GPU 1 held by the stranger, GPU 0 by our engine")
        await cluster.apply(spec(name="b", replicas=1, nodes=1, gpus=3))
        (_pending,) = await cluster.wait(  # exactly one, pending
            lambda: [r for r in cluster.live("b") if r.state == "pending" and "gpu_foreign" in r.reason], what="b pending on the busy GPU"
        )
        assert cluster.replicas.items[a.id].state == "ready"  # what runs is left alone
    finally:
        stranger.send_signal(signal.SIGKILL)
        stranger.wait(5)
    (b,) = await cluster.wait(lambda: cluster.ready("b"), timeout=20, what="b placed once the GPU is free")
    assert b.members[0].gpus == [1, 2, 3]
