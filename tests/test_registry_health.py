"""Registry and health monitor as real services on a real nats-server."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from llmgw.services import registry as registry_mod
from llmgw.services.health import service as health_mod
from llmgw.services.health.leases import CHECKPOINT_HEARTBEATS
from llmgw.shared import subjects as S
from llmgw.shared.schemas import ApiError, FabricMembership, Gpu, Heartbeat, Inventory, Lease, NodeRecord, decode, encode
from llmgw.shared.tasks import cancel_and_wait

from .conftest import service_config
from .waiting import _UNSET, eventually

pytestmark = pytest.mark.timeout(90)


def inventory(node: str, gpus: int = 8, **kw) -> Inventory:
    return Inventory(
        node_id=node,
        boot_id="boot-1",
        mgmt_addr="127.0.1.1",
        gpus=[Gpu(index=i, uuid=f"GPU-{node}-{i}", name="NVIDIA H200", memory_mib=143771) for i in range(gpus)],
        fabrics=[FabricMembership(name="ib-a", hcas=["mlx5_0", "mlx5_1"])],
        **kw,
    )


async def wait_for(observe, expected=_UNSET, timeout=5.0, what="condition"):
    """Until ``observe()`` is truthy (or equals ``expected``); fails with the last value seen."""
    return await eventually(observe, expected, timeout=timeout, what=what, interval=0.05)


def sample(name: str, result: str) -> float:
    """A counter's value from the prometheus registry (0 before its first increment)."""
    return REGISTRY.get_sample_value(name, {"result": result}) or 0.0


INVENTORIES = "llmgw_registry_inventories_total"
HEARTBEATS = "llmgw_health_heartbeats_total"


@pytest.fixture
async def registry(nats_server):
    svc = registry_mod.Registry(service_config(nats_server, "registry"))
    nats_server.reload()
    await svc.start()
    yield svc
    await svc.stop()


async def read(kv, key, schema):
    try:
        return decode((await kv.get(key)).value, schema)
    except Exception:
        return None


async def test_inventory_becomes_a_node_record(registry, connector):
    node = await connector.as_new("node01", "node")
    ops = await connector.as_new("ops", "operator")
    nodes = await ops.jetstream().key_value(S.BUCKET_NODES)
    await node.publish(S.inventory("node01"), encode(inventory("node01")))
    rec = await wait_for(lambda: read(nodes, "node01", NodeRecord))
    assert [g.index for g in rec.gpus] == list(range(8))
    assert rec.identity == "CN=node01,OU=node" and rec.admin == "active"
    assert rec.fabrics[0].name == "ib-a"


async def test_bad_inventories_are_rejected_and_counted_and_the_record_kept(registry, connector):
    node = await connector.as_new("node01", "node")
    ops = await connector.as_new("ops", "operator")
    nodes = await ops.jetstream().key_value(S.BUCKET_NODES)
    await node.publish(S.inventory("node01"), encode(inventory("node01", gpus=8)))
    await wait_for(lambda: read(nodes, "node01", NodeRecord))
    counts = lambda: (sample(INVENTORIES, "malformed"), sample(INVENTORIES, "inconsistent"))  # noqa: E731
    malformed, inconsistent = counts()
    await node.publish(S.inventory("node01"), b'{"node_id": "node01", "gpus": "many"}')
    await node.publish(S.inventory("node01"), encode(inventory("node02", gpus=2)))  # claims another node
    await node.publish(S.inventory("node01"), b"\xff\xfe not json")
    # exactly these three, each counted once under its reason
    await wait_for(counts, (malformed + 2, inconsistent + 1), what="two malformed and one inconsistent inventory counted")
    rec = await read(nodes, "node01", NodeRecord)
    assert len(rec.gpus) == 8
    assert await read(nodes, "node02", NodeRecord) is None
    # and it is still serving
    await node.publish(S.inventory("node01"), encode(inventory("node01", gpus=4)))
    await wait_for(lambda: _gpus(nodes, 4), what="the 4-GPU inventory applied")


async def _gpus(kv, n):
    rec = await read(kv, "node01", NodeRecord)
    return rec is not None and len(rec.gpus) == n


async def test_cordon_uncordon_drain_through_the_api(registry, connector):
    node = await connector.as_new("node01", "node")
    ops = await connector.as_new("ops", "operator")
    nodes = await ops.jetstream().key_value(S.BUCKET_NODES)
    await node.publish(S.inventory("node01"), encode(inventory("node01")))
    await wait_for(lambda: read(nodes, "node01", NodeRecord))
    for verb, state in (("cordon", "cordoned"), ("drain", "draining"), ("uncordon", "active")):
        reply = await ops.request(S.api("registry", verb), b'{"node_id": "node01"}', timeout=3)
        assert decode(reply.data, NodeRecord).admin == state
        assert (await read(nodes, "node01", NodeRecord)).admin == state
    # a re-sent inventory keeps the admin state
    await ops.request(S.api("registry", "cordon"), b'{"node_id": "node01"}', timeout=3)
    await node.publish(S.inventory("node01"), encode(inventory("node01", gpus=6)))
    await wait_for(lambda: _gpus(nodes, 6), what="the 6-GPU inventory applied")
    assert (await read(nodes, "node01", NodeRecord)).admin == "cordoned"
    bad = await ops.request(S.api("registry", "cordon"), b'{"node_id": "node77"}', timeout=3)
    assert decode(bad.data, ApiError).code == "unknown_node"
    bad = await ops.request(S.api("registry", "cordon"), b"{oops", timeout=3)
    assert decode(bad.data, ApiError).code == "bad_request"


# --------------------------------------------------------------------------
# health monitor
# --------------------------------------------------------------------------

FAST = dict(heartbeat_interval=0.2, suspect_after_missed=3, node_lost_after=1.5, leader_ttl=0.6)
# Renewals reach the bucket as checkpoints, one per node per this long (leases.Timings.checkpoint_interval).
CHECKPOINT = CHECKPOINT_HEARTBEATS * FAST["heartbeat_interval"]


class Beater:
    def __init__(self, nc, node, boot="boot-1", interval=FAST["heartbeat_interval"]):
        self.nc, self.node, self.boot, self.seq = nc, node, boot, 0
        self.interval = interval
        self.task = None

    async def _run(self):
        while True:
            self.seq += 1
            self.last = time.time()  # when the last heartbeat was sent (not when the beater was stopped)
            await self.nc.publish(S.heartbeat(self.node), encode(Heartbeat(node_id=self.node, boot_id=self.boot, seq=self.seq)))
            await asyncio.sleep(self.interval)  # the beat itself: a node's heartbeat interval

    def start(self):
        self.task = asyncio.create_task(self._run())
        return self

    async def stop(self):
        await cancel_and_wait([self.task])


async def start_health(nats_server, name="health", health=FAST):
    svc = health_mod.HealthMonitor(service_config(nats_server, "health", name, health=health))
    nats_server.reload()
    await svc.start()
    return svc


async def events_of(ops, node):
    """Every node event of ``node`` stored so far, in order: read up to the last one the
    consumer reports pending (not "until nothing came for a while")."""
    js = ops.jetstream()
    out = []
    sub = await js.subscribe(S.event("node", node, "*"), ordered_consumer=True)
    try:
        while True:
            msg = await sub.next_msg(timeout=5)
            out.append(msg.subject.split(".")[-1])
            if msg.metadata.num_pending == 0:
                return out
    finally:
        await sub.unsubscribe()


async def test_heartbeats_drive_ready_suspect_lost_and_rejoin(nats_server, connector):
    svc = await start_health(nats_server)
    try:
        node = await connector.as_new("node02", "node")
        ops = await connector.as_new("ops", "operator")
        leases = await ops.jetstream().key_value(S.BUCKET_LEASES)
        beat = Beater(node, "node02").start()
        await wait_for(lambda: _state(leases, "node02", "ready"))
        await beat.stop()
        await wait_for(lambda: _state(leases, "node02", "suspect"), timeout=3)
        lease = await wait_for(lambda: _state(leases, "node02", "lost"), timeout=4)
        # lost within one heartbeat of node_lost_after, measured from the last heartbeat sent
        assert FAST["node_lost_after"] - 0.05 <= lease.since - beat.last <= FAST["node_lost_after"] + FAST["heartbeat_interval"] + 0.3
        # same boot id, heard again (a slow reconnect, a healed partition): ready again
        same = Beater(node, "node02")
        same.seq = beat.seq  # the same agent, carrying on
        same.start()
        back = await wait_for(lambda: _state(leases, "node02", "ready"), what="node02 ready on the same boot")
        await same.stop()
        assert back.boot_id == lease.boot_id
        await wait_for(lambda: _state(leases, "node02", "lost"), timeout=4, what="node02 lost again")
        again = Beater(node, "node02", boot="boot-2").start()
        await wait_for(lambda: _state(leases, "node02", "ready"), what="node02 ready on its new boot")
        await again.stop()
        # the monitor publishes each event just after it stores the lease: wait for the last one
        await wait_for(lambda: events_of(ops, "node02"), ["ready", "suspect", "lost", "ready", "suspect", "lost", "ready"], what="node02's events")
    finally:
        await svc.stop()


async def _state(kv, node, state):
    lease = await read(kv, node, Lease)
    return lease if lease is not None and lease.state == state else None


async def test_restart_keeps_countdowns_and_spares_healthy_nodes(nats_server, connector):
    svc = await start_health(nats_server, "health-a")
    node1 = await connector.as_new("node01", "node")
    node2 = await connector.as_new("node02", "node")
    ops = await connector.as_new("ops", "operator")
    leases = await ops.jetstream().key_value(S.BUCKET_LEASES)
    b1, b2 = Beater(node1, "node01").start(), Beater(node2, "node02").start()
    first = {n: await wait_for(lambda n=n: _state(leases, n, "ready"), what=f"{n} ready") for n in ("node01", "node02")}

    async def renewed_since_ready(n):  # a checkpoint stored after the first write: a countdown to continue from
        lease = await read(leases, n, Lease)
        return lease is not None and lease.last_renew > first[n].last_renew

    for n in first:
        await wait_for(lambda n=n: renewed_since_ready(n), timeout=CHECKPOINT + 5, what=f"a checkpoint of {n} stored")
    await svc.stop()  # the monitor goes away…
    await b2.stop()  # …and node02 dies while it is away
    await asyncio.sleep(1.0)  # not a wait for anything: part of node02's countdown passes with no monitor
    checkpoint = await read(leases, "node02", Lease)
    restarted_at = time.time()
    svc2 = await start_health(nats_server, "health-b")
    try:
        lease = await wait_for(lambda: _state(leases, "node02", "lost"), timeout=6, what="node02 lost")
        # the countdown ran from node02's stored checkpoint (never newer than its last heartbeat),
        # not from the restart: restarted, it would end node_lost_after after the restart at the earliest
        assert checkpoint.last_seq <= b2.seq and lease.last_renew == checkpoint.last_renew
        assert lease.since - restarted_at < FAST["node_lost_after"], (lease.since - restarted_at, lease)
        assert lease.since - b2.last <= FAST["node_lost_after"] + 2 * FAST["heartbeat_interval"] + 1.0 + 0.5

        # node01 kept beating: the new monitor renews it without a transition (its since is unchanged),
        # and its renewals reach the bucket as the new monitor's checkpoints
        async def renewed_by_the_new_monitor():
            l1 = await read(leases, "node01", Lease)
            return l1 is not None and l1.last_renew > restarted_at and l1

        node01 = await wait_for(renewed_by_the_new_monitor, timeout=CHECKPOINT + 5, what="node01 checkpointed by the restarted monitor")
        assert (node01.state, node01.since) == ("ready", first["node01"].since)
        assert await events_of(ops, "node01") == ["ready"]  # never declared lost by either monitor
    finally:
        await b1.stop()
        await svc2.stop()


async def test_malformed_and_forged_heartbeats_are_counted_not_fatal(nats_server, connector):
    svc = await start_health(nats_server)
    try:
        node = await connector.as_new("node03", "node")
        ops = await connector.as_new("ops", "operator")
        leases = await ops.jetstream().key_value(S.BUCKET_LEASES)
        # leading and acting on heartbeats (not a second's sleep "until leadership settles")
        await wait_for(lambda: svc.acting, what="the monitor acting as leader")
        counts = lambda: (sample(HEARTBEATS, "malformed"), sample(HEARTBEATS, "inconsistent"))  # noqa: E731
        malformed, inconsistent = counts()
        await node.publish(S.heartbeat("node03"), b"garbage")
        await node.publish(S.heartbeat("node03"), encode(Heartbeat(node_id="node04", boot_id="x", seq=1)))  # forged
        await wait_for(counts, (malformed + 1, inconsistent + 1), what="the garbage and the forged heartbeat counted")
        assert await read(leases, "node04", Lease) is None
        beat = Beater(node, "node03").start()
        await wait_for(lambda: _state(leases, "node03", "ready"), what="node03 ready")
        await beat.stop()
    finally:
        await svc.stop()


async def test_registry_started_after_an_agent_asks_it_for_its_inventory(nats_server, connector):
    """The agent's connect-time inventory went out before the registry listened."""
    svc = await start_health(nats_server)
    node = await connector.as_new("node05", "node")
    asked = []

    async def answer(msg):
        asked.append(msg.subject)
        await msg.respond(encode(inventory("node05", gpus=8)))

    await node.subscribe(S.cmd_inventory("node05"), cb=answer)
    await node.publish(S.inventory("node05"), encode(inventory("node05")))  # nobody listens yet
    beat = Beater(node, "node05", boot="boot-1").start()
    ops = await connector.as_new("ops", "operator")
    leases = await ops.jetstream().key_value(S.BUCKET_LEASES)
    await wait_for(lambda: _state(leases, "node05", "ready"))
    reg = registry_mod.Registry(service_config(nats_server, "registry"))
    nats_server.reload()
    await reg.start()
    try:
        nodes = await ops.jetstream().key_value(S.BUCKET_NODES)
        rec = await wait_for(lambda: read(nodes, "node05", NodeRecord), timeout=10)
        assert len(rec.gpus) == 8 and asked == [S.cmd_inventory("node05")]
    finally:
        await beat.stop()
        await reg.stop()
        await svc.stop()
