"""A node is not trusted: one node cannot stall the scheduler for the others.

Found: the status handler, shared by every node, awaited the stops it sent to
fence a node's stale engines; a node that never answers held it for
``command_timeout``, and the death of an engine on *another* node was noticed
60 s late instead of in 70 ms. Here node03 is an attacker with a real node
certificate: it heartbeats (so it holds a lease and its reports are believed),
reports an engine of a replica that does not exist (so the scheduler fences
it), and holds the stop request unanswered. Meanwhile a real engine of a real
replica on node02 is SIGKILLed: the replica must fail while node03's stop is
still unanswered.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import pytest

from llmgw.services.devcluster import simcluster
from llmgw.services.health.service import HealthMonitor
from llmgw.services.registry import Registry
from llmgw.services.scheduler.service import Scheduler
from llmgw.shared import subjects as S
from llmgw.shared.schemas import DeploymentSpec, EngineFact, Heartbeat, StatusReport, encode

from .cluster_helpers import HB, HEALTH, SCHED, Cluster


@pytest.fixture
async def cluster(nats_server, tmp_path):
    c = Cluster(nats_server, tmp_path / "cluster")
    yield c
    await c.close()


async def test_a_node_that_never_answers_a_stop_does_not_delay_another_nodes_failure(cluster, connector):
    # A command timeout far longer than the waits below: the old handler would sit on it.
    await cluster.start_service(Registry, "registry")
    await cluster.start_service(HealthMonitor, "health", health=HEALTH)
    await cluster.start_service(Scheduler, "scheduler", "scheduler-0", scheduler={**SCHED, "command_timeout": 60.0})
    cluster.add_nodes(simcluster.layout(2, 1, 4))
    for n in cluster.nodes:
        cluster.start_agent(n)
    await cluster.operator(connector)
    await cluster.wait(lambda: sum(1 for lease in cluster.leases.items.values() if lease.state == "ready") == 2, what="node01 and node02 ready")
    await cluster.apply(
        DeploymentSpec(
            name="demo", model="sim-7b", engine="sim", replicas=1, nodes_per_replica=2, gpus_per_node=2, engine_args=["--load-time", "0.2s"], startup_timeout=30
        )
    )
    (rep,) = await cluster.wait(lambda: cluster.ready("demo"), what="replica ready")

    # node03: a real node identity that heartbeats, reports a stale engine, and holds every stop.
    attacker = await connector.as_new("node03", "node")
    held: list = []
    stop_seen = asyncio.Event()

    async def hold(msg):
        held.append(msg)  # never answered
        stop_seen.set()

    await attacker.subscribe(S.cmd_stop("node03"), cb=hold)
    await attacker.flush()
    boot = uuid.uuid4().hex
    seq = 0

    async def heartbeats():
        nonlocal seq
        while True:
            seq += 1
            await attacker.publish(S.heartbeat("node03"), encode(Heartbeat(node_id="node03", boot_id=boot, seq=seq)))
            await asyncio.sleep(HB)

    beating = asyncio.create_task(heartbeats())
    try:
        await cluster.wait(lambda: getattr(cluster.leases.items.get("node03"), "state", None) == "ready", what="node03's lease ready")
        stale = EngineFact(replica_id="ghost-g1", generation=1, deployment="ghost", rank=0, pid=4242, state="ready")

        async def report_until_stopped():
            # Reports until the scheduler fences the ghost (it believes a node's reports
            # once its boot has held the lease a few heartbeats).
            while not stop_seen.is_set():
                await attacker.publish(S.status("node03"), encode(StatusReport(node_id="node03", boot_id=boot, full=True, engines=[stale])))
                await asyncio.sleep(HB)
            return True

        await cluster.wait(report_until_stopped, what="the scheduler's stop for node03's stale engine", timeout=20)

        # Now an engine of the real replica dies on node02.
        worker = next(m for m in rep.members if m.node_id != rep.members[0].node_id)
        os.kill(worker.pid, signal.SIGKILL)
        # node03 keeps reporting, as a live node does, while its stop is held.
        reporting = asyncio.create_task(_keep_reporting(attacker, boot, stale))
        try:
            await cluster.wait(
                lambda: cluster.replicas.items.get(rep.id) is None or cluster.replicas.items[rep.id].state != "ready",
                what=f"{rep.id} failed after its worker's engine died",
                timeout=15,
            )
        finally:
            reporting.cancel()
        # ...while node03's stop is unanswered (never answered here; the old handler waited
        # on it for the whole 60 s command timeout before reading node02's report).
        assert held and all(m.subject == S.cmd_stop("node03") for m in held)
    finally:
        beating.cancel()


async def _keep_reporting(nc, boot: str, stale: EngineFact) -> None:
    while True:
        await nc.publish(S.status("node03"), encode(StatusReport(node_id="node03", boot_id=boot, full=True, engines=[stale])))
        await asyncio.sleep(HB)
