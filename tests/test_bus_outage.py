"""A bus outage never counts against a node, and a write reported
failed during one is never applied later.

A real single nats-server is SIGKILLed for longer than ``node_lost_after``
while real agents (whose reconnect backoff is longer than the lost timeout)
run a ready replica of real ``sim`` engines; the server restarts on the same
store. Services run in the test's loop (tests/cluster_helpers.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import nats.errors
import nats.js.errors
import pytest

from llmgw.services.devcluster import simcluster
from llmgw.services.health.service import HealthMonitor
from llmgw.shared import subjects as S
from llmgw.shared.schemas import Lease, encode

from . import cluster_helpers
from .cluster_helpers import HB, HEALTH, Cluster
from .conftest import service_config
from .test_control_plane import alive, spec

pytestmark = [pytest.mark.timeout(90)]

OUTAGE = 3.0  # seconds the server is away: twice node_lost_after (1.5 s)
# The agents come back slowly: their first reconnect attempt waits longer than the lost timeout.
AGENT_TIMINGS = dataclasses.replace(cluster_helpers.TIMINGS, reconnect_base=2.0, reconnect_max=2.5)
# The monitor's grace covers them: 2.5 s + 20 % jitter + a heartbeat.
GRACE = 2.5 * 1.2 + HB + 0.2


@pytest.fixture
async def cluster(nats_server, tmp_path, monkeypatch):
    monkeypatch.setattr(cluster_helpers, "TIMINGS", AGENT_TIMINGS)
    c = Cluster(nats_server, tmp_path / "cluster")
    yield c
    await c.close()


async def node_events(ops, since_seq: int = 0) -> list[tuple[str, str]]:
    """Every node event stored, as (node, what), read up to the stream's last message."""
    js = ops.jetstream()
    info = await js.stream_info(S.EVENT_STREAM)
    out = []
    if info.state.last_seq == 0:
        return out
    sub = await js.subscribe("llmgw.event.node.>", ordered_consumer=True)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=1)
            except Exception:
                break
            out.append((msg.subject.split(".")[3], msg.subject.rsplit(".", 1)[1]))
            if msg.metadata.sequence.stream >= info.state.last_seq or msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return out


async def test_outage_longer_than_node_lost_after_counts_against_no_node(cluster, connector, nats_server):
    await cluster.start_service(cluster_helpers.Registry, "registry")
    await cluster.start_service(HealthMonitor, "health", health={**HEALTH, "reconnect_grace": GRACE})
    await cluster.start_service(cluster_helpers.Scheduler, "scheduler", scheduler=cluster_helpers.SCHED)
    cluster.add_nodes(simcluster.layout(2, 1, 4))
    for n in cluster.nodes:
        cluster.start_agent(n)
    await cluster.operator(connector)
    await cluster.wait(lambda: sum(1 for lease in cluster.leases.items.values() if lease.state == "ready") == 2, what="both nodes ready")
    await cluster.apply(spec())
    (rep,) = await cluster.wait(lambda: cluster.ready("demo"), what="replica ready")
    pids = [m.pid for m in rep.members]
    js = cluster.ops.jetstream()
    events_before = (await js.stream_info(S.EVENT_STREAM)).state.messages
    leases_before = dict(cluster.leases.items)

    nats_server.kill()  # SIGKILL: the whole control plane loses its bus
    await asyncio.sleep(OUTAGE)  # the fault itself lasts this long
    assert all(alive(p) for p in pids), "an engine died during the outage"
    nats_server.launch()
    await asyncio.to_thread(nats_server.wait_ready)  # off the loop: the services reconnect on it as soon as the server is up
    back = time.time()

    # Every agent reconnected and renewed its lease after the server came back (the
    # agents' backoff makes that take longer than node_lost_after) — as the acting
    # monitor holds it: the bucket has renewals only as checkpoints…
    async def renewed_since_back() -> bool:
        leases = [await cluster.monitor_lease(n) for n in sorted(cluster.leases.items)]
        return len(leases) == 2 and all(lease is not None and lease.last_renew > back and lease.state == "ready" for lease in leases)

    await cluster.wait(renewed_since_back, timeout=30, what="both leases renewed after the restart")
    # …and no node was declared suspect-then-lost meanwhile: the events say so (the stream survived too).
    events = await node_events(cluster.ops)
    assert not [e for e in events if e[1] == "lost"], events
    assert (await js.stream_info(S.EVENT_STREAM)).state.messages >= events_before
    for node, lease in cluster.leases.items.items():
        assert lease.boot_id == leases_before[node].boot_id  # the same agents, never lost
    # No replica rebuilt: the same one, ready, same generation, engines alive throughout.
    assert [(r.id, r.state, r.generation) for r in cluster.live("demo")] == [(rep.id, "ready", rep.generation)]
    assert [m.pid for m in cluster.live("demo")[0].members] == pids
    assert all(alive(p) for p in pids)
    assert "demo" in {k for k in await (await js.key_value(S.BUCKET_DEPLOYMENTS)).keys()}


async def test_a_write_failed_during_an_outage_is_not_applied_later(nats_server):
    """The services' connections buffer nothing while disconnected (pending_size 0):
    a KV put during the outage fails at once and never reaches the restarted server.
    With nats-py's default buffer the put timed out, was reported failed, and was
    replayed on reconnect."""
    svc = HealthMonitor(service_config(nats_server, "health", health=HEALTH))
    nats_server.reload()
    await svc.start()
    try:
        kv = svc.leases_kv
        nats_server.kill()
        await cluster_wait(lambda: not svc.nc.is_connected, "the monitor notices the outage")
        stale = Lease(node_id="ghost", state="ready", boot_id="b", last_seq=1, last_renew=1.0, since=1.0)
        started = time.monotonic()
        with pytest.raises(nats.errors.OutboundBufferLimitError):  # nothing buffered: refused at once, not queued for the reconnect
            await kv.put("ghost", encode(stale))
        assert time.monotonic() - started < 1.0, "the write waited for an ack instead of failing at once"
        nats_server.launch()
        await asyncio.to_thread(nats_server.wait_ready)
        await cluster_wait(lambda: svc.nc.is_connected, "the monitor reconnected", timeout=20)
        # A write after the reconnect, acknowledged: anything buffered went before it.
        for _ in range(100):
            try:
                await kv.put("marker", b"1")
                break
            except Exception:
                await asyncio.sleep(0.1)  # JetStream recovering its streams after the restart
        assert (await kv.get("marker")).value == b"1"
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get("ghost")
    finally:
        await svc.stop()


async def cluster_wait(pred, what, timeout=10.0):
    from .waiting import eventually

    return await eventually(pred, timeout=timeout, what=what, interval=0.05)
