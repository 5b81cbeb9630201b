"""A node proves what it claims, the control plane's side.

Real nats-server, real services, real agents and `sim` engines; the attacker is
a second connection under a node's *own* certificate (the agent's files), as a
stolen certificate would be used:

1. an inventory claiming another mgmt_addr is refused and counted, the record
   keeps the recorded address, and no replica endpoint ever points at the claim;
3. a clone (a second agent with the same certificate and an empty work dir)
   gets the node quarantined: no launch goes to it and its reports tear
   nothing down; a legitimate agent restart is never taken for a clone;
4. 500,000 fake engine facts leave the scheduler's ``reported`` bounded;
5. absurd inventories and heartbeat sequences are refused and counted while
   the node's real heartbeats keep its lease ready.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys

import pytest
import yaml
from prometheus_client import REGISTRY

from llmgw.services.devcluster import simcluster
from llmgw.services.health.leases import LeaseBook, Timings
from llmgw.services.scheduler.service import MAX_UNKNOWN_PER_NODE
from llmgw.shared import buckets as B
from llmgw.shared import subjects as S
from llmgw.shared.kvmirror import KvMirror, open_bucket
from llmgw.shared.schemas import (
    MAX_ENGINES,
    EngineFact,
    Event,
    FabricMembership,
    Gpu,
    Heartbeat,
    Inventory,
    NodeAddrRequest,
    NodeRequest,
    StatusReport,
    encode,
)
from llmgw.shared.states import BOOT_SETTLED_HEARTBEATS
from llmgw.shared.tls import TlsFiles

from .cluster_helpers import CLUSTER_ENV, Cluster, sim_spec
from .waiting import eventually

pytestmark = pytest.mark.timeout(120)


def counter(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def cluster(nats_server, tmp_path):
    c = Cluster(nats_server, tmp_path / "cluster")
    yield c
    await c.close()


def node_tls(cluster: Cluster, node: str) -> TlsFiles:
    """The agent's own certificate files: what an attacker holding them would use."""
    cfg = yaml.safe_load(cluster.nodes[node].config.read_text())
    return TlsFiles(**cfg["tls"])


async def api(nc, service: str, verb: str, req) -> tuple[bool, bytes]:
    reply = await nc.request(S.api(service, verb), encode(req), timeout=5)
    return not (reply.headers or {}).get("Nats-Service-Error-Code"), reply.data


async def events_of(nc, kind: str, what: str) -> list[Event]:
    """Collects events ``llmgw.event.<kind>.*.<what>`` as they are published."""
    seen: list[Event] = []

    async def on(msg) -> None:
        seen.append(B.EVENTS.decode(msg.data))

    await nc.subscribe(f"llmgw.event.{kind}.*.{what}", cb=on)
    return seen


async def bring_up(cluster: Cluster, connector, nodes: int, record: bool = True):
    scheds = await cluster.start_control_plane()
    # Loopback addresses of our own: other runs on this machine use the 127.0.1.N of 'llmgw up'.
    net = f"127.{random.randint(100, 250)}.{random.randint(0, 250)}"
    cluster.add_nodes([dataclasses.replace(n, mgmt_addr=f"{net}.{i + 1}") for i, n in enumerate(simcluster.layout(nodes, 1, 4))])
    ops = await cluster.operator(connector)
    if record:
        for n, node in cluster.nodes.items():
            ok, data = await api(ops, "registry", "set-addr", NodeAddrRequest(node_id=n, addr=node.spec.mgmt_addr))
            assert ok, data
    for n in cluster.nodes:
        cluster.start_agent(n)
    await cluster.wait(lambda: len([lease for lease in cluster.leases.items.values() if lease.state == "ready"]) == nodes, timeout=45, what="all nodes ready")
    nodes_kv = await open_bucket(ops.jetstream(), S.BUCKET_NODES, wait=10)
    cluster.node_records = await KvMirror(nodes_kv, B.NODES).start()
    await cluster.wait(
        lambda: all(r.boot_id for r in cluster.node_records.items.values()) and len(cluster.node_records.items) == nodes, what="all nodes registered"
    )
    return scheds[0], ops


# ----------------------------------------------------------------------------------
# 1. addresses come from onboarding
# ----------------------------------------------------------------------------------


async def test_an_inventory_claiming_another_address_is_refused_and_never_routed_to(cluster, connector):
    _sched, ops = await bring_up(cluster, connector, nodes=1)
    try:
        recorded = cluster.nodes["node01"].spec.mgmt_addr
        endpoints: list[str] = []
        cluster.replicas.listeners.append(lambda _k, _old, new: endpoints.append(new.endpoint) if new is not None and new.endpoint else None)
        refused = await events_of(ops, "node", "addr-refused")
        before = counter("llmgw_registry_addr_refused_total")

        thief = await connector.connect(node_tls(cluster, "node01"), label="thief")
        real = cluster.node_records.items["node01"]
        claim = Inventory(
            node_id="node01",
            boot_id=real.boot_id,
            mgmt_addr="127.0.0.2",
            gpus=real.gpus,
            fabrics=real.fabrics,
            hcas=real.hcas,
        )
        await thief.publish(S.inventory("node01"), encode(claim))
        await cluster.wait(lambda: counter("llmgw_registry_addr_refused_total") > before and refused, what="the claim refused, with an event")
        assert refused[0].detail == f"node01's inventory claims mgmt_addr 127.0.0.2 but its recorded address is {recorded}; refused"
        rec = cluster.node_records.items["node01"]
        assert (rec.mgmt_addr, rec.recorded_addr) == (recorded, recorded)

        await cluster.apply(sim_spec("demo", 1, 1, 2))
        (rep,) = await cluster.wait(lambda: cluster.ready("demo"), what="replica ready")
        assert rep.endpoint.startswith(f"http://{recorded}:")
        # once more, now that a replica is there to be hijacked
        await thief.publish(S.inventory("node01"), encode(claim))
        await cluster.wait(lambda: counter("llmgw_registry_addr_refused_total") >= before + 2, what="second claim refused")
        assert cluster.node_records.items["node01"].mgmt_addr == recorded
        assert endpoints and not [e for e in endpoints if "127.0.0.2" in e]
    finally:
        await cluster.node_records.stop()


async def test_set_addr_validates_and_a_node_without_one_is_unverified(cluster, connector):
    _sched, ops = await bring_up(cluster, connector, nodes=1, record=False)
    try:
        rec = cluster.node_records.items["node01"]
        assert rec.recorded_addr == "" and rec.mgmt_addr == cluster.nodes["node01"].spec.mgmt_addr  # today's behaviour
        for bad in ("127.0.1.1:80", "http://127.0.1.1", "a/b", "[::1]", ""):
            ok, data = await api(ops, "registry", "set-addr", NodeAddrRequest(node_id="node01", addr=bad))
            assert not ok and b"addr" in data, (bad, data)
        ok, data = await api(ops, "registry", "set-addr", NodeAddrRequest(node_id="Node_01", addr="10.0.0.1"))
        assert not ok and b"node_id" in data
        ok, _ = await api(ops, "registry", "set-addr", NodeAddrRequest(node_id="node01", addr="127.0.1.1"))
        assert ok
        await cluster.wait(lambda: cluster.node_records.items["node01"].recorded_addr == "127.0.1.1", what="address recorded")
    finally:
        await cluster.node_records.stop()


# ----------------------------------------------------------------------------------
# 3. clones are quarantined
# ----------------------------------------------------------------------------------


def start_clone(cluster: Cluster, node: str, tmp_path) -> subprocess.Popen:
    """A second agent with ``node``'s certificate and an empty work dir."""
    cfg = yaml.safe_load(cluster.nodes[node].config.read_text())
    cfg["supervisor"]["work_dir"] = str(tmp_path / "clone-work")
    path = tmp_path / "clone.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = open(tmp_path / "clone.log", "ab")
    marker = cluster.marker.split(b"=", 1)[1].decode()
    p = subprocess.Popen(
        [sys.executable, "-m", "llmgw.services", "agent", "--config", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, simcluster.SIM_ENV: node, CLUSTER_ENV: marker},
    )
    log.close()
    cluster.spawned.append(p)
    return p


async def test_a_clone_is_quarantined_and_tears_nothing_down(cluster, connector, tmp_path):
    _sched, ops = await bring_up(cluster, connector, nodes=2)
    try:
        await cluster.apply(sim_spec("demo", 1, 2, 2))
        (demo,) = await cluster.wait(lambda: cluster.ready("demo"), what="demo ready")
        quarantined = await events_of(ops, "node", "quarantined")

        clone = start_clone(cluster, "node02", tmp_path)
        lease = await cluster.wait(lambda: (held := cluster.leases.items.get("node02")) is not None and held.quarantine and held, what="node02 quarantined")
        assert lease.quarantine.startswith("node02: two agents with one identity — boot ids ")
        assert "heartbeat in alternation; quarantined until an operator resolves it" in lease.quarantine
        await cluster.wait(lambda: quarantined, what="the quarantine event")
        # The clone's reports reached the scheduler and were not believed.
        await cluster.wait(
            lambda: (
                counter("llmgw_scheduler_status_reports_total", result="other_boot") + counter("llmgw_scheduler_status_reports_total", result="quarantined") > 0
            ),
            what="clone reports refused",
        )

        # Nothing new goes to node02: of two single-node replicas, one fits on node01, the other waits.
        await cluster.apply(sim_spec("more", 2, 1, 2))
        await cluster.wait(
            lambda: len(cluster.ready("more")) == 1 and any("quarantined" in r.reason for r in cluster.live("more") if r.state == "pending"),
            what="one 'more' replica ready on node01, the other pending: node02 quarantined",
        )
        assert [m.node_id for r in cluster.ready("more") for m in r.members] == ["node01"]
        clone_engines = tmp_path / "clone-work" / "engines"
        assert not clone_engines.exists() or not any(p.name.startswith("more-") for p in clone_engines.iterdir())
        real_engines = cluster.nodes["node02"].dir / "work" / "engines"
        assert not any(p.name.startswith("more-") for p in real_engines.iterdir())
        # …and the replica on node02 was not torn down by the clone's empty report.
        now = cluster.replicas.items[demo.id]
        assert now.state == "ready" and now.generation == demo.generation, now
        assert [(m.node_id, m.pid) for m in now.members] == [(m.node_id, m.pid) for m in demo.members]
        assert not [m for m in now.members if m.engine_state in ("absent", "exited", "peer-lost")], now

        # The operator stops the impostor and releases the node: it takes work again.
        clone.send_signal(signal.SIGKILL)
        clone.wait(5)
        ok, data = await api(ops, "health", "release", NodeRequest(node_id="node02"))
        assert ok, data
        await cluster.wait(lambda: len(cluster.ready("more")) == 2, what="the second 'more' replica placed on node02 after release")
        assert not cluster.leases.items["node02"].quarantine
        assert cluster.replicas.items[demo.id].state == "ready"
        ok, data = await api(ops, "health", "release", NodeRequest(node_id="node02"))
        assert not ok and b"not quarantined" in data
    finally:
        await cluster.node_records.stop()


def test_a_legit_restart_changes_the_boot_id_once_and_is_not_quarantined():
    t = Timings(heartbeat_interval=1.0, suspect_after_missed=3, node_lost_after=10.0)
    book = LeaseBook(t)

    def hb(seq: int, boot: str) -> Heartbeat:
        return Heartbeat(node_id="n1", boot_id=boot, seq=seq)

    for i in range(1, 4):
        book.heartbeat(hb(i, "A"), float(i))
    # the agent restarts; one heartbeat of the old one arrives late, reordered
    book.heartbeat(hb(1, "B"), 4.0)
    book.heartbeat(hb(4, "A"), 4.1)
    for i in range(2, 20):
        assert book.heartbeat(hb(i, "B"), 4.0 + i) is None
    lease = book.leases["n1"]
    assert (lease.boot_id, lease.quarantine, lease.state) == ("B", "", "ready")
    assert lease.boot_heartbeats >= BOOT_SETTLED_HEARTBEATS


def test_alternating_boot_ids_quarantine_and_release_starts_afresh():
    t = Timings(heartbeat_interval=1.0, suspect_after_missed=3, node_lost_after=10.0)
    book = LeaseBook(t)

    def hb(seq: int, boot: str) -> Heartbeat:
        return Heartbeat(node_id="n1", boot_id=boot, seq=seq)

    seen = []
    # B takes the lease (it could be a restart); A's first return is refused (it could be
    # the old agent's last heartbeat, late); its second return within the window: two agents.
    for i, boot in enumerate(["A", "B", "A", "B", "A"]):
        tr = book.heartbeat(hb(i + 1, boot), i * 0.5)
        seen.append(tr.new if tr else None)
    assert seen == ["ready", None, None, None, "quarantined"]
    assert "boot ids A and B heartbeat in alternation" in book.leases["n1"].quarantine
    # either agent keeps the lease renewed; its boot id does not flip any more
    book.heartbeat(hb(9, "A"), 10.0)
    assert book.expire(12.5) == [] and book.leases["n1"].boot_id == "B"
    assert book.release("n1", 15.0).new == "released"
    assert book.leases["n1"].quarantine == ""
    assert book.release("n1", 15.5) is None


# ----------------------------------------------------------------------------------
# 4. what one node can make the scheduler keep
# ----------------------------------------------------------------------------------


async def test_half_a_million_fake_engines_leave_reported_bounded(cluster, connector):
    (sched,) = await cluster.start_control_plane()
    await cluster.wait(lambda: sched.leadership.is_leader, what="the scheduler leads")
    node = await connector.as_new("node09", "node")
    before = counter("llmgw_scheduler_status_facts_dropped_total")
    malformed = counter("llmgw_scheduler_status_reports_total", result="malformed")
    total = 500_000
    sent = 0
    while sent < total:
        n = min(MAX_ENGINES, total - sent)
        engines = [EngineFact(replica_id=f"fake-{sent + i}-g1", generation=1) for i in range(n)]
        await node.publish(S.status("node09"), encode(StatusReport(node_id="node09", boot_id="b", full=False, engines=engines)))
        sent += n
        if sent % (50 * MAX_ENGINES) == 0:
            await node.flush()
    await node.flush()
    # More than MAX_ENGINES in one report is refused whole.
    too_many = [EngineFact(replica_id=f"x-{i}-g1", generation=1) for i in range(MAX_ENGINES + 1)]
    await node.publish(S.status("node09"), encode(StatusReport(node_id="node09", boot_id="b", full=True, engines=too_many)))
    await eventually(
        lambda: (
            counter("llmgw_scheduler_status_facts_dropped_total") - before,
            counter("llmgw_scheduler_status_reports_total", result="malformed") > malformed,
        ),
        (total - MAX_UNKNOWN_PER_NODE, True),
        timeout=90,
        interval=0.05,
        what="every fake fact kept or dropped, and the oversized report refused",
    )
    assert len(sched.reported["node09"]) == MAX_UNKNOWN_PER_NODE
    assert sum(len(v) for v in sched.reported.values()) == MAX_UNKNOWN_PER_NODE


# ----------------------------------------------------------------------------------
# 5. absurd claims are refused, the node keeps living
# ----------------------------------------------------------------------------------


def raw_inventory(gpus: list[dict], boot: str) -> bytes:
    import json

    return json.dumps({"node_id": "node01", "boot_id": boot, "mgmt_addr": "127.0.1.1", "gpus": gpus}).encode()


async def test_absurd_inventories_and_heartbeats_are_refused_and_the_real_ones_kept(cluster, connector):
    await bring_up(cluster, connector, nodes=1)
    try:
        thief = await connector.connect(node_tls(cluster, "node01"), label="thief")
        rec = cluster.node_records.items["node01"]

        def gpu(i: int) -> dict:
            return {"index": i, "uuid": f"GPU-{i}", "name": "H200"}

        malformed = counter("llmgw_registry_inventories_total", result="malformed")
        for gpus in ([gpu(i) for i in range(10_000)], [gpu(-1)], [gpu(2**70)]):
            await thief.publish(S.inventory("node01"), raw_inventory(gpus, rec.boot_id))
        await cluster.wait(lambda: counter("llmgw_registry_inventories_total", result="malformed") - malformed, 3, what="three absurd inventories refused")
        assert cluster.node_records.items["node01"].gpus == rec.gpus

        lease = cluster.leases.items["node01"]
        hb_malformed = counter("llmgw_health_heartbeats_total", result="malformed")
        jumps = counter("llmgw_health_heartbeats_total", result="seq_jump")
        await thief.publish(S.heartbeat("node01"), b'{"node_id": "node01", "boot_id": "%s", "seq": %d}' % (lease.boot_id.encode(), 2**70))
        await thief.publish(S.heartbeat("node01"), encode(Heartbeat(node_id="node01", boot_id=lease.boot_id, seq=2**53 - 1)))
        await cluster.wait(
            lambda: (
                counter("llmgw_health_heartbeats_total", result="malformed") - hb_malformed,
                counter("llmgw_health_heartbeats_total", result="seq_jump") - jumps,
            ),
            (1, 1),
            what="2**70 malformed, 2**53-1 a jump",
        )
        # The agent's own heartbeats keep renewing the lease (its seq moves on, well below the jump):
        # asked of the acting monitor, since the bucket holds renewals only as checkpoints.
        seq = (await cluster.wait(lambda: cluster.monitor_lease("node01"), what="the monitor's lease of node01")).last_seq

        async def renewed() -> bool:
            now = await cluster.monitor_lease("node01")
            return now is not None and now.state == "ready" and seq < now.last_seq < 2**40 and now.boot_id == lease.boot_id

        await cluster.wait(renewed, what="real heartbeats still accepted")
        # and the registry still takes the agent's own inventory after all that
        good = Inventory(
            node_id="node01",
            boot_id=rec.boot_id,
            mgmt_addr=rec.mgmt_addr,
            gpus=[Gpu(index=0, uuid="GPU-0", name="H200")],
            fabrics=[FabricMembership(name="ib-a")],
        )
        await thief.publish(S.inventory("node01"), encode(good))
        await cluster.wait(lambda: len(cluster.node_records.items["node01"].gpus), 1, what="a sane inventory still accepted")
    finally:
        await cluster.node_records.stop()
