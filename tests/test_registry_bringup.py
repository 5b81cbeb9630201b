"""Bring-up at scale (10,000 nodes): inventories in bursts, coalesced registry writes,
no inventory pulls for what already came, and the agents' spread first connect.

The registry runs in the test's loop on a real nats-server; nodes publish
under their own certificates.
"""

from __future__ import annotations

import random

import pytest
from prometheus_client import REGISTRY

from llmgw.services import registry as registry_mod
from llmgw.services.health import service as health_mod
from llmgw.shared import bus
from llmgw.shared import subjects as S
from llmgw.shared.schemas import FabricMembership, Gpu, Heartbeat, Inventory, NodeAddrRequest, NodeRecord, decode, encode

from .conftest import service_config
from .waiting import _UNSET, eventually

pytestmark = pytest.mark.timeout(90)

INVENTORIES = "llmgw_registry_inventories_total"


def inventory(node: str, gpus: int = 8, boot: str = "boot-1", sent_at: float = 0.0) -> Inventory:
    return Inventory(
        node_id=node,
        boot_id=boot,
        mgmt_addr="127.0.1.1",
        gpus=[Gpu(index=i, uuid=f"GPU-{node}-{i}", name="NVIDIA H200", memory_mib=143771) for i in range(gpus)],
        fabrics=[FabricMembership(name="ib-a", hcas=["mlx5_0", "mlx5_1"])],
        sent_at=sent_at,
    )


def counted(result: str) -> float:
    return REGISTRY.get_sample_value(INVENTORIES, {"result": result}) or 0.0


async def wait_for(observe, expected=_UNSET, timeout=10.0, what="condition"):
    return await eventually(observe, expected, timeout=timeout, what=what, interval=0.05)


@pytest.fixture
async def registry(nats_server):
    svc = registry_mod.Registry(service_config(nats_server, "registry"))
    nats_server.reload()
    await svc.start()
    yield svc
    await svc.stop()


async def records(kv, nodes) -> dict[str, int]:
    """node -> GPUs on its stored record (absent nodes left out)."""
    out = {}
    for n in nodes:
        try:
            out[n] = len(decode((await kv.get(n)).value, NodeRecord).gpus)
        except Exception:
            continue
    return out


# --------------------------------------------------------------------------
# first connects
# --------------------------------------------------------------------------


@pytest.mark.parametrize("base", [0.1, 1.0, 30.0], ids=["tests-100ms", "default-1s", "30s"])
def test_first_connects_spread_over_reconnect_base(base):
    rng = random.Random(17)
    draws = [bus.first_connect_delay(base, rng) for _ in range(2000)]
    assert all(0.0 <= d < base for d in draws), (min(draws), max(draws))
    # spread over the whole span, not bunched: each tenth of it gets its share
    tenths = [sum(1 for d in draws if k * base / 10 <= d < (k + 1) * base / 10) for k in range(10)]
    assert all(150 <= t <= 250 for t in tenths), tenths


def test_no_reconnect_base_means_no_wait():
    assert bus.first_connect_delay(0.0, random.Random(1)) == 0.0


# --------------------------------------------------------------------------
# the registry under a burst
# --------------------------------------------------------------------------

NODES = [f"node{i:02d}" for i in range(1, 31)]
# Each node sends these in a row; the last one must be what its record says.
SEQUENCE = (8, 5, 7, 6, 4)


async def test_a_burst_of_inventories_loses_none_and_the_last_one_per_node_wins(registry, connector, nats_server):
    for n in NODES:
        connector.identity(n, "node", reload=False)
    nats_server.reload()
    conns = {n: await connector.as_new(n, "node") for n in NODES}
    ops = await connector.as_new("ops", "operator")
    kv = await ops.jetstream().key_value(S.BUCKET_NODES)
    before = counted("accepted") + counted("superseded")
    for gpus in SEQUENCE:
        for n in NODES:
            await conns[n].publish(S.inventory(n), encode(inventory(n, gpus)))
    for nc in conns.values():
        await nc.flush()
    # Every inventory is either applied or replaced by a newer one of its node: counted once each.
    total = len(NODES) * len(SEQUENCE)
    await wait_for(lambda: counted("accepted") + counted("superseded") - before, float(total), what=f"all {total} inventories judged")
    assert await records(kv, NODES) == {n: SEQUENCE[-1] for n in NODES}
    # The admin-state gauges follow the records (counted as they change, not re-summed).
    gauge = lambda: {a: REGISTRY.get_sample_value("llmgw_registry_nodes", {"admin": a}) for a in ("active", "cordoned", "draining")}  # noqa: E731
    await wait_for(gauge, {"active": 30.0, "cordoned": 0.0, "draining": 0.0}, what="30 active nodes counted")
    reply = await ops.request(S.api("registry", "cordon"), b'{"node_id": "node03"}', timeout=5)
    assert decode(reply.data, NodeRecord).admin == "cordoned"
    await wait_for(gauge, {"active": 29.0, "cordoned": 1.0, "draining": 0.0}, what="one node cordoned")
    await conns["node03"].publish(S.inventory("node03"), encode(inventory("node03", 6)))  # changes the record, not its admin state
    await wait_for(lambda: records(kv, ["node03"]), {"node03": 6}, what="node03's new inventory applied")
    assert gauge() == {"active": 29.0, "cordoned": 1.0, "draining": 0.0}


async def test_an_inventory_equal_to_the_record_writes_nothing(registry, connector):
    node = await connector.as_new("node01", "node")
    ops = await connector.as_new("ops", "operator")
    js = ops.jetstream()
    kv = await js.key_value(S.BUCKET_NODES)
    judged = lambda: counted("accepted") + counted("superseded")  # noqa: E731
    before = judged()
    await node.publish(S.inventory("node01"), encode(inventory("node01", sent_at=1.0)))
    await wait_for(lambda: records(kv, ["node01"]), {"node01": 8}, what="the first record")
    # counted once its event is out too, a moment after the record is visible
    await wait_for(lambda: judged() - before, 1.0, what="the first inventory counted")
    before += 1
    last_seq = (await js.stream_info(S.kv_stream(S.BUCKET_NODES))).state.last_seq
    # what every agent sends after a nats-server restart: the same facts, a newer sent_at
    for k in range(20):
        await node.publish(S.inventory("node01"), encode(inventory("node01", sent_at=2.0 + k)))
    await wait_for(lambda: judged() - before, 20.0, what="the 20 re-sends judged")
    assert (await js.stream_info(S.kv_stream(S.BUCKET_NODES))).state.last_seq == last_seq
    # and a real change after them is still written
    await node.publish(S.inventory("node01"), encode(inventory("node01", gpus=6)))
    await wait_for(lambda: records(kv, ["node01"]), {"node01": 6}, what="the 6-GPU inventory applied")


async def test_a_lease_of_a_boot_whose_inventory_came_asks_for_nothing(nats_server, connector, registry):
    """A lease going ready with a boot id the record lacks makes the registry ask the
    agent for its inventory — unless that boot's inventory already came. Here it came
    and was refused (it claims an address other than the recorded one): the registry
    asks the node once, to hear the real agent rather than whoever published (its
    answer is refused the same way), and a lease change asks nothing more — that
    would only fetch the same refusal, once per lease change, from every such node."""
    health = health_mod.HealthMonitor(
        service_config(nats_server, "health", health=dict(heartbeat_interval=0.2, suspect_after_missed=3, node_lost_after=1.5, leader_ttl=0.6))
    )
    nats_server.reload()
    await health.start()
    try:
        node = await connector.as_new("node07", "node")
        ops = await connector.as_new("ops", "operator")
        asked = []

        async def answer(msg):
            asked.append(msg.subject)
            await msg.respond(encode(inventory("node07", boot="boot-7")))

        await node.subscribe(S.cmd_inventory("node07"), cb=answer)
        await node.flush()
        reply = await ops.request(S.api("registry", "set-addr"), encode(NodeAddrRequest(node_id="node07", addr="127.0.1.7")), timeout=5)
        assert decode(reply.data, NodeRecord).recorded_addr == "127.0.1.7"
        refused, pulled = counted("addr_refused"), counted("pulled")
        await node.publish(S.inventory("node07"), encode(inventory("node07", boot="boot-7")))  # claims 127.0.1.1
        # refused as published, then as the node answers the one question it is asked
        await wait_for(
            lambda: (counted("addr_refused") - refused, asked), (2.0, [S.cmd_inventory("node07")]), what="the inventory refused, asked for once, refused again"
        )
        await node.publish(S.heartbeat("node07"), encode(Heartbeat(node_id="node07", boot_id="boot-7", seq=1)))
        # The registry's own copy of the leases has it ready: its listener has judged it.
        await wait_for(
            lambda: (lease := registry.leases and registry.leases.items.get("node07")) and (lease.state, lease.boot_id),
            ("ready", "boot-7"),
            what="the lease, as the registry sees it",
        )
        assert "node07" not in registry.pulling and asked == [S.cmd_inventory("node07")] and counted("pulled") == pulled
    finally:
        await health.stop()
