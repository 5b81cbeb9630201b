"""The periodic full pass runs beside the event loop (``scheduler/fullpass.py``).

A full pass at 10,000 nodes is 1-2 s of CPU; on the loop, a lease that went
lost meanwhile waited for it. Here a full pass is held in its worker thread
while a node dies: the replacement is placed and launched all the same, and
the held pass, which saw the cluster before, is dropped rather than applied.
A pass that nothing outdated is adopted: its plan and its rebuilt reconciler
become the scheduler's.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from prometheus_client import REGISTRY

from llmgw.services.scheduler.cycle import ReconcileConfig
from llmgw.services.scheduler.fullpass import MAX_DROPPED, FullPass, Snapshot
from llmgw.services.scheduler.incremental import Reconciler

from .builders import apply_plan, make_deployment, make_lease, make_node, with_engines
from .cluster_helpers import Cluster
from .cluster_helpers import sim_spec as spec
from .test_control_plane import bring_up

LOG = logging.getLogger("test_full_pass")


def passes(outcome: str) -> float:
    return REGISTRY.get_sample_value("llmgw_scheduler_full_passes_total", {"outcome": outcome}) or 0.0


def small_cluster(nodes: int = 6, replicas: int = 2):
    """Nodes, leases and a deployment; the replicas placed, launched and ready."""
    records = {f"node{i:02d}": make_node(f"node{i:02d}", "ib-a" if i < nodes // 2 else "ib-b") for i in range(nodes)}
    leases = {n: make_lease(n) for n in records}
    deployments = {"demo": make_deployment("demo", replicas=replicas)}
    plan = Reconciler(ReconcileConfig()).step(deployments, {}, records, leases, 1000.0, full=True)
    replicas_, deployments = apply_plan(plan, {}, deployments)
    replicas_ = {rid: with_engines(r, all="ready") for rid, r in replicas_.items()}
    return deployments, replicas_, records, leases


async def test_a_pass_nothing_outdated_is_adopted_with_the_plan_a_full_step_gives():
    deployments, replicas, nodes, leases = small_cluster()
    snapshot = Snapshot.copy(deployments, replicas, replicas, nodes, leases, 1001.0, {})
    ended = asyncio.Event()
    fp = FullPass(ReconcileConfig(), LOG)
    fp.start(snapshot, epoch=7, on_end=ended.set)
    assert fp.running
    with pytest.raises(RuntimeError, match="already running"):
        fp.start(snapshot, epoch=7, on_end=ended.set)
    await asyncio.wait_for(ended.wait(), 30)
    outcome = fp.collect(epoch=7)
    assert outcome is not None and fp.dropped == 0 and not fp.ended
    expected = Reconciler(ReconcileConfig()).step(deployments, replicas, nodes, leases, 1001.0, full=True)
    assert outcome.plan == expected
    assert outcome.snapshot is snapshot and not outcome.reconciler.fresh
    # The adopted reconciler steps on from the snapshot: a lost node's replica is failed.
    victim = next(iter(replicas.values())).members[0].node_id
    lost = {**leases, victim: make_lease(victim, "lost")}
    plan = outcome.reconciler.step(deployments, replicas, nodes, lost, 1002.0)
    assert plan == Reconciler(ReconcileConfig()).step(deployments, replicas, nodes, lost, 1002.0, full=True)
    assert any(ev.what == "failed" for ev in plan.events)


async def test_a_pass_outdated_by_an_applied_plan_is_dropped_and_too_many_drops_move_it_onto_the_loop():
    deployments, replicas, nodes, leases = small_cluster()
    fp = FullPass(ReconcileConfig(), LOG)
    for n in range(1, MAX_DROPPED + 1):
        assert not fp.must_run_on_loop
        ended = asyncio.Event()
        fp.start(Snapshot.copy(deployments, replicas, replicas, nodes, leases, 1001.0, {}), epoch=n, on_end=ended.set)
        await asyncio.wait_for(ended.wait(), 30)
        assert fp.collect(epoch=n + 1) is None  # a plan was applied since its snapshot
        assert fp.dropped == n
    assert fp.must_run_on_loop
    with pytest.raises(RuntimeError, match="no full pass has ended"):
        fp.collect(epoch=0)


async def test_a_failing_pass_is_dropped_and_logged(caplog):
    deployments, replicas, nodes, leases = small_cluster()
    fp = FullPass(ReconcileConfig(), LOG)
    fp.compute = lambda reconciler, snapshot: 1 / 0  # type: ignore[method-assign]
    ended = asyncio.Event()
    fp.start(Snapshot.copy(deployments, replicas, replicas, nodes, leases, 1001.0, {}), epoch=1, on_end=ended.set)
    await asyncio.wait_for(ended.wait(), 30)
    with caplog.at_level(logging.ERROR, logger=LOG.name):
        assert fp.collect(epoch=1) is None
    assert fp.dropped == 1 and "full reconcile pass failed beside the loop" in caplog.text


@pytest.fixture
async def cluster(nats_server, tmp_path):
    c = Cluster(nats_server, tmp_path / "cluster")
    yield c
    await c.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_node_lost_while_a_full_pass_runs_is_rebuilt_before_the_pass_ends(cluster, connector):
    (sched,) = await bring_up(cluster, connector, nodes=3)
    await cluster.apply(spec())
    (first,) = await cluster.wait(lambda: cluster.ready("demo"), what="replica ready")
    # Hold the next full pass in its worker thread until the rebuild is done.
    entered, release = threading.Event(), threading.Event()
    compute = sched.full_pass.compute

    def held(reconciler, snapshot):
        entered.set()
        release.wait(60)
        return compute(reconciler, snapshot)

    sched.full_pass.compute = held
    sched.full_pass_interval = 0.0
    try:
        await cluster.wait(entered.is_set, what="a full pass started beside the loop")
        sched.full_pass_interval = 3600.0  # no other pass starts on its own from here
        # Counted once the held pass runs: none other can end before it is let go
        # (one already running when the gate went in would have been adopted first).
        dropped, adopted = passes("dropped"), passes("adopted")
        worker = first.members[1].node_id
        cluster.kill_node(worker)  # the agent and its engines: the node is gone
        await cluster.wait(lambda: cluster.leases.items[worker].state == "lost", what="node lost")
        # The rebuild goes on while the pass is held: the loop is not waiting for it.
        (second,) = await cluster.wait(
            lambda: first.id not in cluster.replicas.items and [r for r in cluster.ready("demo") if r.id != first.id],
            what="old replica reaped, replacement ready",
        )
        assert worker not in {m.node_id for m in second.members}
        assert sched.full_pass.running and not release.is_set() and passes("adopted") == adopted
        before = sched.reconciler
    finally:
        release.set()
    # The held pass saw the node alive and the old replica in place: it is dropped
    # (and starts again at once, on the cluster as it is now).
    await cluster.wait(lambda: passes("dropped") > dropped, what="the held full pass dropped")
    # Once nothing changes, a pass is adopted: its reconciler becomes the scheduler's.
    sched.full_pass_interval = 0.0
    await cluster.wait(lambda: passes("adopted") > adopted and sched.reconciler is not before, what="a full pass adopted")
    sched.full_pass_interval = 3600.0
    assert [r.id for r in cluster.live("demo")] == [second.id]
