"""Registry and health monitor as real services on a real nats-server."""

from __future__ import annotations

import asyncio
import time

import pytest

from llmgw.services import health as health_mod, registry as registry_mod
from llmgw.shared import subjects as S
from llmgw.shared.schemas import ApiError, FabricMembership, Gpu, Heartbeat, Inventory, Lease, NodeRecord, decode, encode

from .conftest import service_config

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


async def wait_for(pred, timeout=5.0, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = await pred()
        if v:
            return v
        await asyncio.sleep(step)
    raise AssertionError("condition not reached in time")


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
    malformed = registry_mod.INVENTORIES.labels("malformed")._value.get()
    inconsistent = registry_mod.INVENTORIES.labels("inconsistent")._value.get()
    await node.publish(S.inventory("node01"), b'{"node_id": "node01", "gpus": "many"}')
    await node.publish(S.inventory("node01"), encode(inventory("node02", gpus=2)))  # claims another node
    await node.publish(S.inventory("node01"), b"\xff\xfe not json")
    await wait_for(lambda: asyncio.sleep(0, registry_mod.INVENTORIES.labels("malformed")._value.get() >= malformed + 2))
    await wait_for(lambda: asyncio.sleep(0, registry_mod.INVENTORIES.labels("inconsistent")._value.get() >= inconsistent + 1))
    rec = await read(nodes, "node01", NodeRecord)
    assert len(rec.gpus) == 8
    assert await read(nodes, "node02", NodeRecord) is None
    # and it is still serving
    await node.publish(S.inventory("node01"), encode(inventory("node01", gpus=4)))
    await wait_for(lambda: _gpus(nodes, 4))


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
    await wait_for(lambda: _gpus(nodes, 6))
    assert (await read(nodes, "node01", NodeRecord)).admin == "cordoned"
    bad = await ops.request(S.api("registry", "cordon"), b'{"node_id": "node77"}', timeout=3)
    assert decode(bad.data, ApiError).code == "unknown_node"
    bad = await ops.request(S.api("registry", "cordon"), b"{oops", timeout=3)
    assert decode(bad.data, ApiError).code == "bad_request"


# --------------------------------------------------------------------------
# health monitor
# --------------------------------------------------------------------------

FAST = dict(heartbeat_interval=0.2, suspect_after_missed=3, node_lost_after=1.5, leader_ttl=0.6)


class Beater:
    def __init__(self, nc, node, boot="boot-1"):
        self.nc, self.node, self.boot, self.seq = nc, node, boot, 0
        self.task = None

    async def _run(self):
        while True:
            self.seq += 1
            await self.nc.publish(S.heartbeat(self.node), encode(Heartbeat(node_id=self.node, boot_id=self.boot, seq=self.seq)))
            await asyncio.sleep(FAST["heartbeat_interval"])

    def start(self):
        self.task = asyncio.create_task(self._run())
        return self

    async def stop(self):
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.last = time.time()


async def start_health(nats_server, name="health"):
    svc = health_mod.HealthMonitor(service_config(nats_server, "health", name, health=FAST))
    nats_server.reload()
    await svc.start()
    return svc


async def events_of(ops, node):
    js = ops.jetstream()
    out = []
    sub = await js.subscribe(S.event_kind_space("node"), ordered_consumer=True)
    try:
        while True:
            msg = await sub.next_msg(timeout=0.3)
            if msg.subject.split(".")[3] == node:
                out.append(msg.subject.split(".")[-1])
    except Exception:
        pass
    await sub.unsubscribe()
    return out


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
        # same boot id: stays lost; new boot id: ready again
        same = Beater(node, "node02").start()
        await asyncio.sleep(0.6)
        assert (await read(leases, "node02", Lease)).state == "lost"
        await same.stop()
        again = Beater(node, "node02", boot="boot-2").start()
        await wait_for(lambda: _state(leases, "node02", "ready"))
        await again.stop()
        assert await events_of(ops, "node02") == ["ready", "suspect", "lost", "ready"]
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
    await wait_for(lambda: _state(leases, "node01", "ready"))
    await wait_for(lambda: _state(leases, "node02", "ready"))
    await asyncio.sleep(0.5)
    await svc.stop()  # the monitor goes away…
    await b2.stop()  # …and node02 dies while it is away
    await asyncio.sleep(1.0)
    svc2 = await start_health(nats_server, "health-b")
    try:
        lease = await wait_for(lambda: _state(leases, "node02", "lost"), timeout=6)
        # the countdown ran from node02's last heartbeat, not from the restart
        restarted_at = time.time()
        assert lease.since - b2.last <= FAST["node_lost_after"] + 2 * FAST["heartbeat_interval"] + 1.0 + 0.5
        await asyncio.sleep(1.0)
        assert (await read(leases, "node01", Lease)).state == "ready"
        assert restarted_at > 0
    finally:
        await b1.stop()
        await svc2.stop()


async def test_malformed_and_forged_heartbeats_are_counted_not_fatal(nats_server, connector):
    svc = await start_health(nats_server)
    try:
        node = await connector.as_new("node03", "node")
        ops = await connector.as_new("ops", "operator")
        leases = await ops.jetstream().key_value(S.BUCKET_LEASES)
        before = health_mod.HEARTBEATS.labels("malformed")._value.get()
        await node.publish(S.heartbeat("node03"), b"garbage")
        await node.publish(S.heartbeat("node03"), encode(Heartbeat(node_id="node04", boot_id="x", seq=1)))
        await asyncio.sleep(1.0)  # leadership settles, then the messages are judged
        await node.publish(S.heartbeat("node03"), b"garbage")
        await wait_for(lambda: asyncio.sleep(0, health_mod.HEARTBEATS.labels("malformed")._value.get() > before))
        assert await read(leases, "node04", Lease) is None
        beat = Beater(node, "node03").start()
        await wait_for(lambda: _state(leases, "node03", "ready"))
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
