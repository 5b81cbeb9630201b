"""Builders for scheduler tests (after Kubernetes' ``st.MakeNode()``).

Each builder gives a valid, ready value with keyword overrides for the one
thing a test is about, so a test reads as the difference it exercises.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from llmgw.services.scheduler.plan import Plan
from llmgw.shared.schemas import (
    DeploymentSpec,
    FabricMembership,
    Gpu,
    Lease,
    NodeRecord,
    Replica,
)


def make_node(
    node_id: str,
    fabric: str | Iterable[str] | None = "ib-a",
    gpus: int = 8,
    *,
    admin: str = "active",
    usable: bool = True,
    problem: str = "",
    mgmt_addr: str | None = None,
) -> NodeRecord:
    """A registered node; ``fabric`` is a name, several names, or None for no fabric."""
    names = [] if fabric is None else [fabric] if isinstance(fabric, str) else list(fabric)
    digits = "".join(c for c in node_id if c.isdigit()) or "1"
    return NodeRecord(
        node_id=node_id,
        identity=f"CN={node_id},OU=node",
        hostname=node_id,
        mgmt_addr=f"127.0.1.{int(digits) % 250 + 1}" if mgmt_addr is None else mgmt_addr,
        mgmt_interface="lo",
        boot_id=f"boot-{node_id}",
        gpus=[Gpu(index=i, uuid=f"GPU-{node_id}-{i}", name="NVIDIA H200") for i in range(gpus)],
        fabrics=[FabricMembership(name=n, hcas=[f"mlx5_{i}"], usable=usable, problem="" if usable else problem or "port 1 DOWN") for i, n in enumerate(names)],
        admin=admin,
    )


def make_lease(node_id: str, state: str = "ready", *, since: float = 0.0) -> Lease:
    return Lease(node_id=node_id, state=state, boot_id=f"boot-{node_id}", last_seq=1, last_renew=since, since=since)


def make_deployment(
    name: str = "sim",
    *,
    replicas: int = 2,
    gpus_per_node: int = 4,
    nodes_per_replica: int = 2,
    engine: str = "sim",
    model: str = "sim-model",
    startup_timeout: float = 600.0,
    last_generation: int = 0,
    engine_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    spares: int = 0,
) -> DeploymentSpec:
    return DeploymentSpec(
        name=name,
        model=model,
        engine=engine,
        replicas=replicas,
        gpus_per_node=gpus_per_node,
        nodes_per_replica=nodes_per_replica,
        startup_timeout=startup_timeout,
        last_generation=last_generation,
        engine_args=engine_args or [],
        env=env or {},
        spares=spares,
    )


def cluster(*nodes: NodeRecord, leases: Mapping[str, str] | None = None) -> tuple[dict, dict]:
    """Node records and leases keyed by node id; every lease ready unless named in ``leases``."""
    leases = leases or {}
    records = {n.node_id: n for n in nodes}
    return records, {n: make_lease(n, leases.get(n, "ready")) for n in records}


def seed_cluster(**lease_states: str) -> tuple[dict, dict]:
    """The seed: node01+node02 on ib-a, node03+node04 on ib-b, 8 GPUs each."""
    return cluster(
        make_node("node01", "ib-a"),
        make_node("node02", "ib-a"),
        make_node("node03", "ib-b"),
        make_node("node04", "ib-b"),
        leases=lease_states,
    )


def seed_deployment(**overrides) -> DeploymentSpec:
    """The seed's deployment: engine sim, 2 replicas of 2 nodes × 4 GPUs."""
    return make_deployment("sim", **overrides)


def with_engines(replica: Replica, **states: str) -> Replica:
    """The replica as the shell would record agents' reports: ``node01="ready"``; ``all=`` for every member."""
    every = states.pop("all", None)
    members = [msgspec.structs.replace(m, engine_state=states.get(m.node_id, every or m.engine_state)) for m in replica.members]
    return msgspec.structs.replace(replica, members=members)


def apply_plan(plan: Plan, replicas: Mapping[str, Replica], deployments: Mapping[str, DeploymentSpec]) -> tuple[dict[str, Replica], dict[str, DeploymentSpec]]:
    """What the shell does with a plan's records: generations, writes, deletes."""
    deps = {name: msgspec.structs.replace(d, last_generation=plan.generations.get(name, d.last_generation)) for name, d in deployments.items()}
    reps = dict(replicas)
    reps.update(plan.writes)
    for rid in plan.deletes:
        reps.pop(rid, None)
    return reps, deps
