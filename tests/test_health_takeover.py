"""A health monitor taking over from the stored leases: what a new monitor knows, and what it costs at scale.

Leases are stored as checkpoints (``services/health/leases.py``): a takeover must
still know every stored lease, never declare a live node lost, and declare a
dead one lost — no later than its countdown would have ended, and not before
the grace. Real nats-server, real bucket; the acting monitor crashes (no
resignation, no goodbye).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from llmgw.services.health import service as health_mod
from llmgw.services.health.leases import CHECKPOINT_HEARTBEATS
from llmgw.shared import buckets as B
from llmgw.shared import subjects as S
from llmgw.shared.kvmirror import open_mirror
from llmgw.shared.schemas import ApiError, Lease, NodeRequest, decode, encode

from .cluster_helpers import crash as crash_service
from .conftest import service_config
from .test_registry_health import FAST, Beater, events_of, start_health, wait_for

pytestmark = pytest.mark.timeout(90)


# The standby test waits for two checkpoints of node01 (one before the crash, one by
# the new monitor), each up to a checkpoint interval away: 40 heartbeats, 8 s at FAST's
# 0.2 s, 4 s at 0.1 s. Suspect still after 0.6 s of silence (6 × 0.1 s, as 3 × 0.2 s),
# lost after FAST's 1.5 s: only the checkpoints come sooner.
TAKEOVER = {**FAST, "heartbeat_interval": 0.1, "suspect_after_missed": 6}
TAKEOVER_CHECKPOINT = CHECKPOINT_HEARTBEATS * TAKEOVER["heartbeat_interval"]  # Timings.checkpoint_interval


async def crash(svc: health_mod.HealthMonitor) -> None:
    await crash_service(svc, [svc.stored_leases])


async def test_a_monitor_starting_on_a_full_bucket_knows_every_stored_lease(nats_server, connector):
    """nats-py's key listing can come back empty (or short) from a bucket holding values
    when the watch behind it races its own consumer; a monitor that took that for "no
    leases" never expired the nodes it missed. Here the bucket holds 300 leases of nodes
    that died with the previous monitor — rewritten while the new one starts, as that
    monitor's last checkpoints would be — and every one of them must go lost."""
    previous = await connector.as_new("health-old", "health")
    kv = await previous.jetstream(timeout=5).create_key_value(bucket=S.BUCKET_LEASES)
    dead = [f"dead{i:03d}" for i in range(300)]
    died = time.time()
    stored = {n: encode(Lease(node_id=n, state="ready", boot_id="b1", last_seq=7, last_renew=died, since=died - 60)) for n in dead}
    for n in dead:
        await kv.put(n, stored[n])

    started = asyncio.Event()

    async def checkpoints() -> None:
        # A flag, not cancel(): nats-py's put can swallow a cancellation and carry on.
        while not started.is_set():
            for n in dead:
                await kv.put(n, stored[n])
                if started.is_set():
                    return

    writer = asyncio.create_task(checkpoints())
    node = await connector.as_new("live01", "node")
    beat = Beater(node, "live01").start()
    ops = await connector.as_new("ops", "operator")
    svc = health_mod.HealthMonitor(service_config(nats_server, "health", "health-new", health=FAST))
    nats_server.reload()
    try:
        await svc.start()
        started.set()
        await writer
        leases = await open_mirror(ops.jetstream(timeout=5), B.LEASES)
        try:
            await wait_for(
                lambda: sorted(n for n, lease in leases.items.items() if lease.state == "lost"),
                dead,
                timeout=20,
                what="every stored lease of a dead node declared lost",
            )
            await wait_for(lambda: (lease := leases.items.get("live01")) is not None and lease.state == "ready", what="live01 ready")
            # Lost after the grace, counted from the stored renewal (how soon after it is the pure
            # core's table, tests/test_leases.py: this machine may be busy).
            assert all(leases.items[n].since >= svc.book.not_before for n in dead)
            assert {svc.book.leases[n].last_renew for n in dead} == {died}
        finally:
            await leases.stop()
        await beat.stop()
        assert await events_of(ops, "live01") == ["ready"]  # never suspect, never lost
    finally:
        started.set()
        await writer
        await svc.stop()


async def test_a_standby_takes_over_from_checkpoints_and_what_it_heard(nats_server, connector):
    """The acting monitor crashes a moment after node02 dies; node01 lives on. The
    standby held a live copy of the stored leases (no bulk read at takeover) and
    the heartbeats it heard: node01 is never lost, node02 is lost no later than its
    own countdown ends — and not before the grace."""
    a = await start_health(nats_server, "health-a", health=TAKEOVER)
    await wait_for(lambda: a.acting, what="health-a acting")
    n1, n2 = await connector.as_new("node01", "node"), await connector.as_new("node02", "node")
    ops = await connector.as_new("ops", "operator")
    leases = await open_mirror(ops.jetstream(timeout=5), B.LEASES)
    beat = TAKEOVER["heartbeat_interval"]
    b1, b2 = Beater(n1, "node01", interval=beat).start(), Beater(n2, "node02", interval=beat).start()
    b = None
    try:
        await wait_for(lambda: {n: lease.state for n, lease in leases.items.items()}, {"node01": "ready", "node02": "ready"}, what="both ready")
        first = dict(leases.items)
        # A checkpoint of node01's renewals: what a standby started now would resume from.
        await wait_for(lambda: leases.items["node01"].last_renew > first["node01"].last_renew, timeout=TAKEOVER_CHECKPOINT + 5, what="a checkpoint of node01")
        b = await start_health(nats_server, "health-b", health=TAKEOVER)
        await wait_for(lambda: b.heard.keys() >= {"node01", "node02"}, what="the standby hearing both nodes")
        assert not b.acting
        await b2.stop()  # node02 dies …
        await crash(a)  # … and the acting monitor with it
        stored = leases.items["node02"]
        assert stored.state == "ready" and stored.last_seq <= b2.seq  # a checkpoint: never newer than the truth
        await wait_for(lambda: b.acting, timeout=10, what="the standby taking over")
        took_over = b.book.not_before - b.book.grace()
        lost = await wait_for(lambda: (lease := leases.items["node02"]).state == "lost" and lease, timeout=10, what="node02 lost")
        # Its countdown ran from its last heartbeat, which the standby heard (not from the older
        # checkpoint), and waited for the grace. (How soon: tests/test_leases.py's table.)
        assert lost.since >= b.book.not_before
        assert stored.last_renew <= b.book.leases["node02"].last_renew == pytest.approx(b2.last, abs=0.5)
        # node01 beat on: renewed by the new monitor's checkpoints, the same lease (since unchanged).
        await wait_for(lambda: leases.items["node01"].last_renew > took_over, timeout=TAKEOVER_CHECKPOINT + 5, what="node01 checkpointed by health-b")
        assert (leases.items["node01"].state, leases.items["node01"].since) == ("ready", first["node01"].since)
        await b1.stop()
        assert await events_of(ops, "node01") == ["ready"]
        # suspect first or not, as the grace ended before or after its suspect_after
        assert (await events_of(ops, "node02"))[-1] == "lost"
    finally:
        for beater in (b1, b2):
            await beater.stop()
        await leases.stop()
        if b is not None:
            await b.stop()


async def test_the_acting_monitor_answers_a_nodes_exact_lease(nats_server, connector):
    """The bucket holds renewals as checkpoints; ``llmgw.api.health.lease`` answers the
    lease as the acting monitor holds it, renewed by the latest heartbeat."""
    svc = await start_health(nats_server)
    node = await connector.as_new("node07", "node")
    ops = await connector.as_new("ops", "operator")
    leases = await open_mirror(ops.jetstream(timeout=5), B.LEASES)
    beat = Beater(node, "node07").start()

    async def ask(node_id: str):
        reply = await ops.request(S.api("health", "lease"), encode(NodeRequest(node_id=node_id)), timeout=5)
        if (reply.headers or {}).get("Nats-Service-Error-Code"):
            return decode(reply.data, ApiError)
        return decode(reply.data, Lease)

    try:
        first = await wait_for(lambda: leases.items.get("node07"), what="node07's lease stored")

        async def ahead_of_the_bucket():
            # Heartbeats renew it in memory; the bucket's copy waits for its checkpoint.
            stored = leases.items["node07"]
            lease = await ask("node07")
            return lease if isinstance(lease, Lease) and lease.last_seq > stored.last_seq and lease.last_renew > stored.last_renew else None

        exact = await wait_for(ahead_of_the_bucket, what="the answered lease ahead of the stored one")
        assert (exact.state, exact.boot_id, exact.since) == ("ready", first.boot_id, first.since)
        unknown = await ask("node99")
        assert (unknown.code, unknown.description) == ("unknown_lease", "no lease for node 'node99': never heard")
        assert (await ask("Not A Node")).code == "unknown_lease"
    finally:
        await beat.stop()
        await leases.stop()
        await svc.stop()
