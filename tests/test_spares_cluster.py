"""Warm spares and restart in place with real processes: a real nats-server,
the control plane in-process, real agents running real `sim` engines, faults
as signals (tests/cluster_helpers.py).

What must hold: a node killed under a serving replica has a standby spare
promoted in the very cycle the scheduler sees it (one event time for both),
and a new spare is built after; a spare whose leader cannot make a token (its
worker frozen: the canary gets none) is failed and rebuilt like a serving
replica; SIGKILL of a leader engine on a healthy node restarts the replica in
place — same id, same members, GPUs and ports, a new generation — and it
serves again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import urllib.request

import msgspec
import pytest

from llmgw.services.devcluster import simcluster
from llmgw.shared.schemas import Event

from .cluster_helpers import TIMINGS
from .cluster_helpers import replica_event_records as replica_events
from .cluster_helpers import sim_spec as spec
from .test_control_plane import alive, cluster  # noqa: F401 (cluster: the fixture)

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


async def bring_up(cluster, connector, nodes=4, fabrics=2, timings=TIMINGS):
    await cluster.start_control_plane()
    cluster.add_nodes(simcluster.layout(nodes, fabrics, 4), timings)
    for n in cluster.nodes:
        cluster.start_agent(n)
    await cluster.operator(connector)
    await cluster.wait(lambda: sum(1 for lease in cluster.leases.items.values() if lease.state == "ready") == nodes, timeout=45, what="all nodes ready")


def spared(**kw):
    return msgspec.structs.replace(spec(**kw), spares=1)


def standby(cluster, deployment):
    return [r for r in cluster.live(deployment) if r.state == "standby"]


async def event_of(cluster, rid: str, what: str) -> Event:
    """Replica ``rid``'s first event ``what``, once the stream has it (the record is
    written before its events are published)."""

    async def look():
        return next((e for e in await replica_events(cluster.ops, rid) if e.what == what), None)

    return await cluster.wait(look, timeout=15, what=f"{rid}'s {what} event")


def health(endpoint: str) -> int:
    with urllib.request.urlopen(endpoint + "/health", timeout=5) as r:
        return r.status


async def test_a_node_kill_promotes_the_spare_at_once_and_a_new_spare_follows(cluster, connector):
    await bring_up(cluster, connector)
    await cluster.apply(spared())
    await cluster.wait(lambda: len(cluster.ready("demo")) == 1 and len(standby(cluster, "demo")) == 1, what="one ready, one standby")
    (serving,) = cluster.ready("demo")
    (spare,) = standby(cluster, "demo")
    assert serving.fabric != spare.fabric, "spread over the fabrics, each replica inside one"
    assert spare.endpoint and await asyncio.to_thread(health, spare.endpoint) == 200  # loaded: promotion needs nothing more

    cluster.kill_node(serving.members[0].node_id)  # the serving replica's leader's machine dies
    await cluster.wait(lambda: [r.id for r in cluster.ready("demo")] == [spare.id], what="the spare promoted")
    # One cycle: the serving replica left ready (a peer's word, or the failure) in the
    # cycle that promoted the spare, so both events carry the cycle's time.
    promoted = await event_of(cluster, spare.id, "ready")
    history = await replica_events(cluster.ops, serving.id)
    left = history[[e.what for e in history].index("ready") + 1]
    assert promoted.time == left.time and promoted.detail.startswith("promoted from standby"), (left, promoted)
    # A new spare is built in the background, of a new generation, and stands by.
    (new,) = await cluster.wait(lambda: standby(cluster, "demo"), timeout=45, what="a new spare standing by")
    assert new.generation > max(serving.generation, spare.generation)
    assert [r.id for r in cluster.ready("demo")] == [spare.id]


async def test_a_spare_that_cannot_make_a_token_is_failed_and_rebuilt(cluster, connector):
    probing = dataclasses.replace(TIMINGS, probe_interval=0.5, probe_timeout=0.5)
    await bring_up(cluster, connector, timings=probing)
    await cluster.apply(spared(load="0.2s"))
    await cluster.wait(lambda: len(cluster.ready("demo")) == 1 and len(standby(cluster, "demo")) == 1, what="one ready, one standby")
    (spare,) = standby(cluster, "demo")
    worker = spare.members[1]
    os.kill(worker.pid, signal.SIGSTOP)  # alive, but its leader's generation waits on it: the canary gets no token
    try:
        await cluster.wait(lambda: spare.id not in {r.id for r in cluster.live("demo") if r.state == "standby"}, timeout=30, what="the frozen spare failed")
        failed = await event_of(cluster, spare.id, "failed")
        assert "standby spare's leader" in failed.detail and "no token" in failed.detail, failed.detail
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    (new,) = await cluster.wait(lambda: [r for r in standby(cluster, "demo") if r.id != spare.id], timeout=45, what="a new spare standing by")
    assert new.generation > spare.generation and len(cluster.ready("demo")) == 1


async def test_a_leader_engine_killed_on_a_healthy_node_restarts_in_place(cluster, connector):
    await bring_up(cluster, connector, nodes=2, fabrics=1)
    await cluster.apply(spec(load="0.5s"))
    (first,) = await cluster.wait(lambda: cluster.ready("demo"), what="replica ready")
    os.kill(first.members[0].pid, signal.SIGKILL)  # the leader engine dies; its node and agent live

    def back():
        r = cluster.replicas.items.get(first.id)
        return r if r is not None and r.state == "ready" and r.generation > first.generation else None

    again = await cluster.wait(back, timeout=30, what="the same replica ready again, of a new generation")
    assert [(m.node_id, m.rank, m.gpus, m.http_port, m.rendezvous_port) for m in again.members] == [
        (m.node_id, m.rank, m.gpus, m.http_port, m.rendezvous_port) for m in first.members
    ]
    assert again.endpoint == first.endpoint and await asyncio.to_thread(health, again.endpoint) == 200
    assert again.members[0].pid != first.members[0].pid and len(cluster.live("demo")) == 1
    await event_of(cluster, first.id, "ready")
    events = await replica_events(cluster.ops, first.id)
    whats = [e.what for e in events]
    assert "failed" not in whats and "restarting" in whats, whats
    restarting = next(e for e in events if e.what == "restarting")
    assert restarting.detail.startswith("restart in place: member rank 0 on node01 exited"), restarting.detail
    assert "relaunching on the same members" in restarting.detail
    # The old generation's worker was stopped, not left running beside the new one.
    await cluster.wait(lambda: not alive(first.members[1].pid), timeout=10, what="the old worker stopped")
