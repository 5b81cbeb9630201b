"""Records and events for the console's tests: the seed's four nodes and their story,
and the 10,000-node cluster of the bench, with scripted times (from ``T0``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw.shared.schemas import (
    Event,
    FabricMembership,
    Gpu,
    Hca,
    HcaPort,
    Lease,
    NodeRecord,
    Replica,
    ReplicaMember,
)
from llmgw.tui.cluster import LEASES, NODES, REPLICAS, ClusterModel

T0 = 1_700_000_000.0  # every scripted time counts from here
SEED = (("node01", "ib-a"), ("node02", "ib-a"), ("node03", "ib-b"), ("node04", "ib-b"))


def make_node(node: str, fabric: str | None = "ib-a", gpus: int = 8, admin: str = "active", n: int = 1, addr: str = "") -> NodeRecord:
    return NodeRecord(
        node_id=node,
        identity=f"CN={node},OU=node",
        mgmt_addr=addr or f"127.0.1.{n}",
        mgmt_interface="lo",
        gpus=[Gpu(index=i, uuid=f"GPU-{node}-{i}", name="NVIDIA H200", memory_mib=143771) for i in range(gpus)],
        fabrics=[FabricMembership(name=fabric, hcas=["mlx5_0", "mlx5_1"])] if fabric else [],
        hcas=[
            Hca(name=h, ports=[HcaPort(port=1, state="ACTIVE", phys_state="LinkUp", rate="200 Gb/sec (4X HDR)")], usable=True)
            for h in (["mlx5_0", "mlx5_1"] if fabric else [])
        ],
        admin=admin,
    )


def make_lease(node: str, state: str = "ready", renewed: float = T0, since: float = T0 - 60) -> Lease:
    return Lease(node_id=node, state=state, boot_id=f"boot-{node}-0123456789", last_renew=renewed, since=since)


def make_replica(rid: str, fabric: str | None, state: str, members: list[tuple[str, list[int]]], since: float = T0 - 30, reason: str = "") -> Replica:
    gen = int(rid.rsplit("-g", 1)[1])
    return Replica(
        id=rid,
        deployment=rid.rsplit("-g", 1)[0],
        model="sim-70b",
        engine="sim",
        generation=gen,
        state=state,
        fabric=fabric,
        members=[
            ReplicaMember(node_id=node, rank=i, role="leader" if i == 0 else "worker", gpus=gpus, engine_state="ready" if state == "ready" else "")
            for i, (node, gpus) in enumerate(members)
        ],
        since=since,
        reason=reason,
    )


def ev(t: float, kind: str, subject: str, what: str, detail: str = "", **data: str) -> Event:
    return Event(time=T0 + t, kind=kind, subject=subject, what=what, detail=detail, data=data)


def replica_ev(t: float, rid: str, what: str, detail: str, frm: str) -> Event:
    return ev(t, "replica", rid, what, detail, deployment=rid.rsplit("-g", 1)[0], generation=rid.rsplit("-g", 1)[1], **{"from": frm})


G1 = ("demo-g1", "ib-a", [("node01", [0, 1, 2, 3]), ("node02", [0, 1, 2, 3])])
G2 = ("demo-g2", "ib-b", [("node03", [0, 1, 2, 3]), ("node04", [0, 1, 2, 3])])
G3 = ("demo-g3", "ib-b", [("node03", [4, 5, 6, 7]), ("node04", [4, 5, 6, 7])])

# The seed's story, as the services tell it (times relative to T0).
BRING_UP = [
    ev(-60, "node", "node01", "joined", "8 GPUs, fabrics ib-a"),
    ev(-60, "node", "node02", "joined", "8 GPUs, fabrics ib-a"),
    ev(-60, "node", "node03", "joined", "8 GPUs, fabrics ib-b"),
    ev(-60, "node", "node04", "joined", "8 GPUs, fabrics ib-b"),
    ev(-59, "deployment", "demo", "applied", "2 × 2 node(s) × 4 GPU(s) of sim-70b on sim"),
    replica_ev(-59, "demo-g1", "launching", "placed on ib-a: node01 (leader), node02", ""),
    replica_ev(-59, "demo-g2", "launching", "placed on ib-b: node03 (leader), node04", ""),
    replica_ev(-57, "demo-g1", "ready", "leader on node01 serving", "waiting-for-workers"),
    replica_ev(-57, "demo-g2", "ready", "leader on node03 serving", "waiting-for-workers"),
]
FAILOVER = [
    ev(-6, "node", "node02", "lost", "no heartbeat for 60.1s", previous="suspect"),
    replica_ev(-6, "demo-g1", "failed", "node node02 lost", "ready"),
    replica_ev(-6, "demo-g1", "reaping", "stopping node01", "failed"),
    replica_ev(-6, "demo-g3", "launching", "placed on ib-b: node03 (leader), node04", ""),
]
RECOVERY = [
    replica_ev(-5, "demo-g1", "gone", "all members stopped", "reaping"),
    replica_ev(14.1, "demo-g3", "ready", "leader on node03 serving", "waiting-for-workers"),
]


@dataclass
class Seed:
    """Bucket contents: what the registry, health monitor and scheduler wrote."""

    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    replicas: dict[str, Replica] = field(default_factory=dict)


def seed_state(**over) -> Seed:
    """The seed's four nodes and two ready replicas; ``nodes_x={...}`` etc. add or replace records."""
    nodes = {n: make_node(n, f, n=i + 1) for i, (n, f) in enumerate(SEED)}
    leases = {n: make_lease(n) for n, _ in SEED}
    replicas = {rid: make_replica(rid, fab, "ready", m) for rid, fab, m in (G1, G2)}
    for k, v in over.items():
        {"nodes": nodes, "leases": leases, "replicas": replicas}[k.split("_")[0]].update(v)
    return Seed(nodes, leases, replicas)


def model_of(seed: Seed) -> ClusterModel:
    model = ClusterModel()
    model.replace(NODES, seed.nodes)
    model.replace(LEASES, seed.leases)
    model.replace(REPLICAS, seed.replicas)
    model.take_changes()
    return model


# --------------------------------------------------------------------------
# 10,000 nodes, as bench/console.py builds them (bench/control_plane.py's cluster)
# --------------------------------------------------------------------------


def node_name(i: int, nodes: int) -> str:
    return f"node{i:0{max(2, len(str(nodes)))}d}"


def big_cluster(nodes: int = 10_000, replicas: int = 4_000, fabrics: int = 20) -> Seed:
    """``nodes`` × 8 GPUs on ``fabrics`` fabrics; ``replicas`` of 2 nodes × 4 GPUs, ready,
    placed fabric by fabric; a few nodes not ready, one cordoned, so the aggregates say something."""
    per = -(-nodes // fabrics)
    seed = Seed()
    names = [node_name(i, nodes) for i in range(1, nodes + 1)]
    for i, name in enumerate(names):
        fabric = f"ib-{i // per:02d}"
        seed.nodes[name] = make_node(name, fabric, admin="cordoned" if i == 7 else "active", addr=f"10.0.{(i + 1) >> 8 & 255}.{(i + 1) & 255}")
        state = "lost" if i % 997 == 5 else "suspect" if i % 1999 == 11 else "ready"
        seed.leases[name] = make_lease(name, state, renewed=T0 - (i % 200) if state == "ready" else T0 - 20)
    slots = [(names[i], names[i + 1], g) for g in (0, 4) for i in range(0, nodes - 1, 2) if (i + 1) // per == i // per]
    for k in range(replicas):
        a, b, g = slots[k]
        rid = f"bench-g{k + 1}"
        fabric = seed.nodes[a].fabrics[0].name
        seed.replicas[rid] = make_replica(rid, fabric, "ready", [(a, [g, g + 1, g + 2, g + 3]), (b, [g, g + 1, g + 2, g + 3])], since=T0 - 600 + k * 0.01)
    return seed


def herd_events(nodes: int = 10_000, joined: int = 9_840) -> list[Event]:
    """A bring-up: ``joined`` nodes joined over 60 s, each then ready (first heartbeat)."""
    out = []
    for i in range(1, joined + 1):
        t = -120 + 60 * (i - 1) / max(1, joined - 1)
        name = node_name(i, nodes)
        out.append(ev(t, "node", name, "joined", f"8 GPUs, fabrics ib-{(i - 1) // -(-nodes // 20):02d}"))
        out.append(ev(t + 0.2, "node", name, "ready", "first heartbeat"))
    return out
