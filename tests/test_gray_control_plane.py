"""Crash loops against a real control plane: a real nats-server, the registry,
health monitor and scheduler in-process, real agents launching real `sim`
engines that exit at start-up (an argument the engine refuses: exit 2).

What must hold: the scheduler backs off between attempts (each gap at least
the backoff, doubling from base to max) instead of relaunching every cycle;
a node implicated in repeated failures is auto-cordoned through the
registry, with the reason on its record; the circuit breaker withholds a
second one in a fabric of four at share 0.25; ``explain`` shows the backoff;
an operator's uncordon clears the reason.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from llmgw.services.devcluster import simcluster
from llmgw.services.health.service import HealthMonitor
from llmgw.services.registry import Registry
from llmgw.services.scheduler.service import Scheduler
from llmgw.shared import buckets as B
from llmgw.shared import subjects as S
from llmgw.shared.kvmirror import open_mirror
from llmgw.shared.schemas import DeploymentSpec, Event, NameRequest, NodeRecord, NodeRequest, decode, encode
from llmgw.shared.states import ReplicaState as RS

from .cluster_helpers import HEALTH, SCHED, Cluster
from .waiting import eventually

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

BASE, CAP = 0.25, 1.0
GRAY = dict(
    SCHED,
    backoff_base=BASE,
    backoff_max=CAP,
    auto_cordon_after=2,
    auto_cordon_window=120.0,
    auto_cordon_max_share=0.25,
)


@pytest.fixture
async def cluster(nats_server, tmp_path):
    c = Cluster(nats_server, tmp_path / "cluster")
    yield c
    await c.close()


def crashing(name="crash") -> DeploymentSpec:
    # The sim engine refuses an unknown argument and exits 2 at once, on every node.
    return DeploymentSpec(
        name=name,
        model="sim-7b",
        engine="sim",
        replicas=1,
        nodes_per_replica=1,
        gpus_per_node=4,
        engine_args=["--no-such-flag"],
        startup_timeout=30,
    )


async def test_crash_loop_backs_off_and_auto_cordon_stays_within_the_share(cluster, connector):
    await cluster.start_service(Registry, "registry")
    await cluster.start_service(HealthMonitor, "health", health=HEALTH)
    await cluster.start_service(Scheduler, "scheduler", scheduler=GRAY)
    cluster.add_nodes(simcluster.layout(4, 1, 4))  # one fabric, ib-a, of four nodes
    for n in cluster.nodes:
        cluster.start_agent(n)
    ops = await cluster.operator(connector)
    js = ops.jetstream()
    nodes = await open_mirror(js, B.NODES, wait=10)
    deployments = await open_mirror(js, B.DEPLOYMENTS, wait=10)
    events: list[Event] = []
    sub = await js.subscribe(S.ALL_EVENTS, ordered_consumer=True)

    async def collect():
        async for msg in sub.messages:
            events.append(B.EVENTS.decode(msg.data))

    collector = asyncio.create_task(collect())
    try:
        await cluster.wait(
            lambda: (sum(1 for lease in cluster.leases.items.values() if lease.state == "ready"), len(nodes.items)),
            (4, 4),
            what="four nodes registered and ready",
        )
        await cluster.apply(crashing())

        def launches() -> list[float]:
            return [e.time for e in events if e.kind == "replica" and e.what == RS.LAUNCHING and e.data.get("deployment") == "crash"]

        def withheld() -> list[Event]:
            return [e for e in events if e.kind == "node" and e.what == "auto-cordon-withheld"]

        def auto_cordoned() -> list[str]:
            return sorted(n for n, r in nodes.items.items() if r.admin == "cordoned" and r.admin_by == "auto")

        # Enough attempts to see the doubling reach its cap, one node
        # auto-cordoned (the record shows it) and a second one withheld.
        await cluster.wait(
            lambda: len(launches()) >= 5 and len(auto_cordoned()) == 1 and withheld(),
            timeout=45,
            what="5 attempts, one node auto-cordoned and another withheld",
        )

        # -- backoff: every gap between attempts is at least the backoff due.
        times = launches()
        gaps = [b - a for a, b in itertools.pairwise(times)]
        due = [min(CAP, BASE * 2**k) for k in range(len(gaps))]
        assert all(g >= d - 0.01 for g, d in zip(gaps, due, strict=True)), (gaps, due)
        failed = [e for e in events if e.kind == "replica" and e.what == RS.FAILED and e.data.get("deployment") == "crash"]
        assert len(failed) >= len(times) - 1 and all("exited" in e.detail for e in failed)
        spec = deployments.items["crash"]
        assert spec.failures >= 4 and "exited" in spec.last_failure and spec.retry_at > 0
        assert [e for e in events if e.kind == "deployment" and e.what == "backoff"]

        # -- explain names the backoff (what `llmgw ctl explain` prints).
        reply = await ops.request(S.api("scheduler", "explain"), encode(NameRequest(name="crash")), timeout=5)
        ex = json.loads(reply.data)
        assert ex["backoff"]["failures"] >= 4 and "exited" in ex["backoff"]["last_failure"]
        assert ex["summary"]  # the placement part is still there

        # -- auto-cordon: one node of four, its reason on the record and in the event.
        (node,) = auto_cordoned()
        rec = nodes.items[node]
        assert rec.admin_reason.startswith("2 replica failures in 2m: crash-g")
        (cordoned,) = [e for e in events if e.kind == "node" and e.what == "cordoned"]
        assert cordoned.subject == node and cordoned.detail.startswith("2 replica failures in 2m: ")
        other = withheld()[0]
        assert other.subject != node
        assert other.detail.startswith("auto-cordon withheld: fabric ib-a already has 1 of 4 nodes auto-cordoned")
        assert nodes.items[other.subject].admin == "active"

        # -- the operator's uncordon clears the reason.
        reply = await ops.request(S.api("registry", "uncordon"), encode(NodeRequest(node_id=node)), timeout=5)
        assert decode(reply.data, NodeRecord).admin == "active"
        await cluster.wait(
            lambda: (nodes.items[node].admin, nodes.items[node].admin_reason, nodes.items[node].admin_by),
            ("active", "", "operator"),
            what="uncordoned record",
        )
        # An auto-cordon never comes from anyone's bad request: a malformed one is refused, the registry keeps going.
        reply = await ops.request(S.api("registry", "uncordon"), encode(NodeRequest(node_id=node, auto=True)), timeout=5)
        assert reply.headers and reply.headers.get("Nats-Service-Error-Code") and b"only a cordon" in reply.data
    finally:
        collector.cancel()
        await sub.unsubscribe()
        await nodes.stop()
        await deployments.stop()


async def test_the_scheduler_identity_may_ask_the_registry_to_cordon_and_nothing_else(cluster, connector):
    await cluster.start_service(Registry, "registry")
    sched = await connector.as_new("scheduler-x", "scheduler")
    # Allowed: the registry answers (here: no such node, a clear error, and it keeps running).
    reply = await sched.request(S.api("registry", "cordon"), encode(NodeRequest(node_id="node09", reason="r", auto=True)), timeout=5)
    assert reply.headers.get("Nats-Service-Error-Code") and b"no node 'node09'" in reply.data
    # A malformed request gets a specific error too.
    reply = await sched.request(S.api("registry", "cordon"), b'{"node_id": 7}', timeout=5)
    assert reply.headers.get("Nats-Service-Error-Code") and b"node_id" in reply.data
    # Not allowed: the server drops the request, nobody answers.
    for verb in ("uncordon", "drain"):
        with pytest.raises(Exception) as e:
            await sched.request(S.api("registry", verb), encode(NodeRequest(node_id="node09")), timeout=1)
        assert type(e.value).__name__ in ("TimeoutError", "NoRespondersError")


async def test_the_scheduler_identity_may_ask_the_health_monitor_for_a_lease_and_nothing_else(cluster, connector):
    # The scheduler asks whether a node a peer reported lost was heard since (the bucket
    # holds renewals only as checkpoints): it may read a lease, not release a quarantine.
    await cluster.start_service(HealthMonitor, "health")
    sched = await connector.as_new("scheduler-y", "scheduler")

    async def acting_answer() -> bytes | None:
        reply = await sched.request(S.api("health", "lease"), encode(NodeRequest(node_id="node09")), timeout=5)
        assert reply.headers and reply.headers.get("Nats-Service-Error-Code")
        return None if b"standing by" in reply.data else reply.data

    # Allowed: the acting monitor answers (no such node: a clear error, and it keeps running).
    assert b"no lease for node 'node09'" in await eventually(acting_answer, what="the health monitor to act")
    with pytest.raises(Exception) as e:
        await sched.request(S.api("health", "release"), encode(NodeRequest(node_id="node09")), timeout=1)
    assert type(e.value).__name__ in ("TimeoutError", "NoRespondersError")
