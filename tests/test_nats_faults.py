"""The control plane on a 3-server NATS cluster, losing servers.

Three real nats-server processes (``NatsCluster``: routes over mutual TLS, each
its own store, SIGKILL = a machine dying, restart on the same config and
store), the registry, health monitor and scheduler in the test's loop with
``kv_replicas: 3`` (tests/cluster_helpers.py), real agents and ``sim`` engines.

1. One server of three dies — the one leading the replicas bucket's stream,
   and the meta leader when it is the same — while a node dies too: the node is
   still declared lost, its replica rebuilt on the other fabric, and the
   restarted server catches up.
2. Two of three die: no quorum, writes stop. Services say so (log, and
   ``llmgw_bus_write_failures_total``) and keep their last view, engines keep
   running, no node is declared lost; quorum returns and everything resumes
   without a restart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import urllib.request

import pytest
from nats.errors import TimeoutError as NatsTimeout
from prometheus_client import REGISTRY

from llmgw.services.devcluster import simcluster
from llmgw.services.health.service import HealthMonitor
from llmgw.services.registry import Registry
from llmgw.services.scheduler.service import Scheduler
from llmgw.shared import buckets as B
from llmgw.shared import bus
from llmgw.shared import subjects as S
from llmgw.shared.config import GatewaySection, HealthSection, SchedulerSection, ServiceConfig, TlsSection
from llmgw.shared.kvmirror import open_mirror
from llmgw.shared.natsserver import NatsCluster

from . import cluster_helpers
from .cluster_helpers import HEALTH, SCHED, Cluster
from .test_control_plane import alive, spec

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]

# Heartbeats of 0.1 s (agents and monitor alike) for the two-of-three test: it waits
# until every lease's renewal after the outage is in KV, and renewals are written once
# per checkpoint interval (services/health/leases.py: 40 heartbeat intervals, 12 s at the
# suite's 0.3 s, 4 s at 0.1 s). It checks that nothing is lost and that writes
# resume, not how fast a silent node is suspected: node_lost_after stays 1.5 s, and
# suspect needs 5 missed heartbeats (0.5 s) instead of 3 × 0.3 s.
FAST_HB = 0.1
FAST_HEALTH = {**HEALTH, "heartbeat_interval": FAST_HB, "suspect_after_missed": 5}
# How long quorum stays lost there: longer than node_lost_after (1.5 s), 20 heartbeats.
OUTAGE = 2.0


class ServerView:
    """What tests/cluster_helpers.Cluster needs of its server, for a whole cluster."""

    def __init__(self, nats: NatsCluster):
        self.nats = nats

    @property
    def url(self):
        return self.nats.urls  # agents get the list, as 'llmgw up --nats-servers 3' writes it

    @property
    def pki_dir(self):
        return self.nats.pki_dir

    def issue(self, name, role):
        return self.nats.issue(name, role)

    def reload(self):
        self.nats.reload()


class ClusterOn3(Cluster):
    async def start_service(self, cls, role, name=None, **sections):
        tls = self.server.issue(name or role, role)
        kinds = {"health": HealthSection, "scheduler": SchedulerSection, "gateway": GatewaySection}
        cfg = ServiceConfig(
            server=self.server.nats.urls,
            tls=TlsSection(ca=tls.ca, cert=tls.cert, key=tls.key),
            kv_replicas=3,
            reconnect_base=0.1,
            reconnect_max=0.5,
            source=f"<test {role}>",
            **{k: kinds[k](**v) for k, v in sections.items()},
        )
        svc = cls(cfg)
        self.server.reload()
        await svc.start()
        self.services.append(svc)
        return svc

    async def operator3(self):
        tls = self.server.issue("ops", "operator")
        self.server.reload()
        self.ops = await bus.connect(self.server.nats.urls, tls, name="ops", initial_attempts=5, reconnect_base=0.1, reconnect_max=0.5)
        js = self.ops.jetstream(timeout=5)
        self.replicas = await open_mirror(js, B.REPLICAS, wait=20)
        self.leases = await open_mirror(js, B.LEASES, wait=20)

    async def close(self):
        await super().close()
        if getattr(self, "ops", None) is not None:
            await self.ops.close()


@pytest.fixture
async def c3(tmp_path):
    nats = NatsCluster(root=tmp_path / "nats", size=3, hosts=HOSTS)
    nats.prepare()
    nats.start()
    c = ClusterOn3(ServerView(nats), tmp_path / "cluster")
    yield c
    await c.close()
    nats.stop()


async def bring_up(c: ClusterOn3, nodes=4, fabrics=2, health=HEALTH):
    await c.start_service(Registry, "registry")
    await c.start_service(HealthMonitor, "health", health=health)
    await c.start_service(Scheduler, "scheduler", scheduler=SCHED)
    c.add_nodes(simcluster.layout(nodes, fabrics, 4))
    for n in c.nodes:
        c.start_agent(n)
    await c.operator3()
    await c.wait(lambda: sum(1 for lease in c.leases.items.values() if lease.state == "ready") == nodes, timeout=30, what="all nodes ready")


def monitor(m, path: str) -> dict:
    with urllib.request.urlopen(f"{m.monitor_url}{path}", timeout=5) as r:
        return json.load(r)


def stream_last_seq(m, stream: str):
    """A server's own copy of ``stream``, as its monitoring reports it."""
    for acc in monitor(m, "/jsz?accounts=true&streams=true").get("account_details", []):
        for st in acc.get("stream_detail") or []:
            if st["name"] == stream:
                return st["state"]["last_seq"]
    return None


def write_failures(service: str) -> float:
    return REGISTRY.get_sample_value("llmgw_bus_write_failures_total", {"service": service}) or 0.0


async def test_one_server_of_three_dies_while_a_node_dies(c3):
    nats = c3.server.nats
    await bring_up(c3)
    await c3.apply(spec(load="0.3s"))
    (first,) = await c3.wait(lambda: c3.ready("demo"), timeout=30, what="replica ready")
    assert first.fabric == "ib-a"
    js = c3.ops.jetstream(timeout=5)
    stream = S.kv_stream(S.BUCKET_REPLICAS)
    leader = (await js.stream_info(stream)).cluster.leader
    meta = next((monitor(m, "/jsz").get("meta_cluster") or {}).get("leader") for m in nats.members)
    victim = next(i for i, m in enumerate(nats.members) if m.name == leader)
    print(f"killing {leader} (leader of {stream}; meta leader {meta}{': the same server' if meta == leader else ''})")
    t0 = time.monotonic()
    nats.kill(victim)
    c3.kill_node(first.members[1].node_id)
    # The node is still declared lost and the replica rebuilt on the other fabric.
    await c3.wait(lambda: c3.leases.items[first.members[1].node_id].state == "lost", timeout=30, what="node lost")
    (second,) = await c3.wait(
        lambda: first.id not in c3.replicas.items and len(c3.live("demo")) == 1 and [r for r in c3.ready("demo") if r.fabric == "ib-b"],
        timeout=60,
        what="rebuilt on ib-b",
    )
    print(f"rebuilt on ib-b {time.monotonic() - t0:.1f}s after the kill")
    assert all(alive(m.pid) for m in second.members)
    # The killed server comes back on its store and catches up with what was written meanwhile.
    await asyncio.to_thread(nats.restart, victim)  # off the loop: the services run on it while the server catches up
    want = (await js.stream_info(stream)).state.last_seq
    await c3.wait(lambda: (stream_last_seq(nats.members[victim], stream) or 0) >= want, timeout=30, what="the restarted server caught up")


async def test_two_of_three_die_writes_stop_nothing_is_lost_and_quorum_resumes_it(c3, monkeypatch):
    nats = c3.server.nats
    monkeypatch.setattr(cluster_helpers, "TIMINGS", dataclasses.replace(cluster_helpers.TIMINGS, heartbeat_interval=FAST_HB))
    await bring_up(c3, nodes=2, fabrics=1, health=FAST_HEALTH)
    await c3.apply(spec(load="0.3s"))
    (rep,) = await c3.wait(lambda: c3.ready("demo"), timeout=30, what="replica ready")
    pids = [m.pid for m in rep.members]
    health = next(s for s in c3.services if isinstance(s, HealthMonitor))
    failures = write_failures("health")
    nats.kill(1)
    nats.kill(2)
    # Writes stop: the monitor's writes (its leadership renewal, its leases) fail and are counted.
    await c3.wait(lambda: write_failures("health") > failures, timeout=30, what="the health monitor's writes failing")
    # The services keep their last view meanwhile, and the engines run on.
    sched = next(s for s in c3.services if isinstance(s, Scheduler))
    assert sched.replicas.items[rep.id].state == "ready"
    assert all(alive(p) for p in pids)
    down_at = time.time()
    await asyncio.sleep(OUTAGE)  # the fault lasts longer than node_lost_after (1.5 s)
    # Both together and off the loop (each restart waits until its server is current; the
    # services under test run on this loop meanwhile and must not be frozen by the wait).
    await asyncio.gather(asyncio.to_thread(nats.restart, 1), asyncio.to_thread(nats.restart, 2))
    # Quorum back: leases are written again (renewed after the outage), nobody lost, same replica.
    await c3.wait(
        lambda: (
            health.acting
            and not health.write_blocked
            and all(lease.last_renew > down_at + OUTAGE and lease.state == "ready" for lease in c3.leases.items.values())
        ),
        timeout=60,
        what="leases written again",
    )
    assert [(r.id, r.state) for r in c3.live("demo")] == [(rep.id, "ready")]
    assert all(alive(p) for p in pids)
    js = c3.ops.jetstream(timeout=5)
    sub = await js.subscribe("llmgw.event.node.*.lost", ordered_consumer=True)
    try:
        with pytest.raises(NatsTimeout):
            await sub.next_msg(timeout=1)  # no lost event at all
    finally:
        await sub.unsubscribe()
