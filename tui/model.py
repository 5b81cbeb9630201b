"""What the console shows, computed from the buckets: pure functions, no Textual, no bus.

The widgets only draw the frozen views built here, so every decision about a
word, a colour class or an order is unit-testable with plain records, and the
clock is a parameter (``now``) — snapshot tests pin it. The facts themselves
(GPUs in use and free, a node's state word, ages, backoff) come from the read
model ``llmgw ctl`` uses too (``shared/readmodel.py``); this module only
arranges them into panels, rows and colours.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from llmgw.shared.readmodel import (
    age_since,
    backing_off,
    backoff_line,
    format_age,
    gpu_blocks,
    gpu_holders,
    gpus_in_use,
    lease_age,
    lease_age_text,
    lease_line,
    lease_state,
    node_gpu_counts,
    node_state,
)
from llmgw.shared.schemas import DeploymentSpec, Event, Lease, NodeRecord, Replica
from llmgw.shared.states import ENDING_REPLICA, ReplicaState

# The panel of nodes configured on no fabric (they host single-node replicas only).
NO_FABRIC = "no fabric"

# Replica states grouped by what an operator should feel about them.
STARTING = (ReplicaState.PENDING, ReplicaState.LAUNCHING, ReplicaState.WAITING)
FAILING = tuple(ENDING_REPLICA)
# Not a replica state: the row a deployment in a crash-loop backoff shows in the
# replicas table, where its replacement would be.
BACKOFF = "backing-off"


@dataclass(frozen=True)
class ClusterState:
    """The buckets the console mirrors, as last seen."""

    nodes: Mapping[str, NodeRecord] = field(default_factory=dict)
    leases: Mapping[str, Lease] = field(default_factory=dict)
    replicas: Mapping[str, Replica] = field(default_factory=dict)
    deployments: Mapping[str, DeploymentSpec] = field(default_factory=dict)


def replica_tone(state: str) -> str:
    """ready | degraded | starting | failing | gone | backoff: the colour family of a replica state."""
    if state in STARTING:
        return "starting"
    if state in FAILING:
        return "failing"
    if state == BACKOFF:
        return "backoff"
    return state if state in (ReplicaState.READY, ReplicaState.DEGRADED, ReplicaState.GONE) else "starting"


def matches(pattern: str, *texts: str) -> bool:
    """Every word of the filter occurs somewhere in ``texts`` (case-insensitive)."""
    words = pattern.lower().split()
    if not words:
        return True
    hay = " ".join(texts).lower()
    return all(w in hay for w in words)


# --------------------------------------------------------------------------
# replica marks: the letter a GPU cell shows for the replica holding it
# --------------------------------------------------------------------------

MARK_SYMBOLS = string.ascii_uppercase + string.ascii_lowercase + string.digits


class MarkBook:
    """One symbol per replica for the whole session.

    Symbols are never handed to another replica while the console runs, so a
    letter seen on a GPU during an incident still means the same replica a
    minute later. Replicas arriving together get symbols in id order, which
    keeps the first screen the same from run to run.
    """

    def __init__(self) -> None:
        self.marks: dict[str, str] = {}

    def update(self, replica_ids: Iterable[str]) -> None:
        for rid in sorted(set(replica_ids) - self.marks.keys()):
            self.marks[rid] = MARK_SYMBOLS[len(self.marks) % len(MARK_SYMBOLS)]

    def get(self, replica_id: str) -> str:
        return self.marks.get(replica_id, "?")


# --------------------------------------------------------------------------
# fabrics and their nodes
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuCell:
    index: int
    mark: str  # "·" when free
    replica: str = ""
    tone: str = "free"  # free | ready | degraded | starting | failing | broken | foreign


@dataclass(frozen=True)
class NodeView:
    node_id: str
    fabric: str  # the panel this row sits in
    state: str
    lease_age: str
    cells: tuple[GpuCell, ...] = ()
    gpus_free: int = 0
    mgmt_addr: str = ""
    problem: str = ""  # e.g. a configured fabric whose HCAs are down
    # The admin state when the state word does not already say it (a lost node
    # that is also cordoned), so an operator's cordon never looks ignored.
    admin: str = ""
    # Why it is cordoned/draining ("auto: 3 replica failures in 10m: …").
    admin_reason: str = ""

    @property
    def key(self) -> str:
        return f"{self.fabric}/{self.node_id}"


@dataclass(frozen=True)
class FabricView:
    name: str
    nodes: tuple[NodeView, ...]
    summary: str  # "2 nodes · 8/16 GPUs free"


def admin_reason(record: NodeRecord) -> str:
    """Why a node is out of rotation, and who said so ("" when active or not said)."""
    if record.admin == "active":
        return ""
    if record.admin_by == "auto":
        return f"auto: {record.admin_reason or 'repeated replica failures'}"
    return record.admin_reason


def _problem(record: NodeRecord) -> str:
    broken = [f"{f.name}: {f.problem or 'unusable'}" for f in record.fabrics if not f.usable]
    broken += [f"GPU {g.index} unhealthy: {g.problem or 'reported by its agent'}" for g in record.gpus if not g.healthy]
    return "; ".join(broken)


# Marks of GPUs out of service (issue #14); an unhealthy GPU shows it even while
# the replica that held it is still being reaped.
UNHEALTHY_MARK, FOREIGN_MARK = "✗", "f"


def _cell(g, held: dict, marks: MarkBook) -> GpuCell:
    if not g.healthy:
        return GpuCell(g.index, UNHEALTHY_MARK, held[g.index].id if g.index in held else "", "broken")
    if g.index in held:
        return GpuCell(g.index, marks.get(held[g.index].id), held[g.index].id, replica_tone(held[g.index].state))
    if g.foreign_mib or g.foreign_pids:
        return GpuCell(g.index, FOREIGN_MARK, "", "foreign")
    return GpuCell(g.index, "·")


def fabric_views(state: ClusterState, now: float, marks: MarkBook, pattern: str = "") -> tuple[FabricView, ...]:
    holders = gpu_holders(state.replicas)
    members: dict[str, list[str]] = {}
    for rid, rec in state.nodes.items():
        for fab in rec.fabrics or ():
            members.setdefault(fab.name, []).append(rid)
        if not rec.fabrics:
            members.setdefault(NO_FABRIC, []).append(rid)
    in_use = gpus_in_use(state.replicas)
    free = {node_id: node_gpu_counts(rec, in_use).free for node_id, rec in state.nodes.items()}
    out = []
    for fabric in sorted(members, key=lambda f: (f == NO_FABRIC, f)):
        views = []
        for node_id in sorted(members[fabric]):
            rec, lease = state.nodes[node_id], state.leases.get(node_id)
            word = node_state(rec, lease)
            held = holders.get(node_id, {})
            cells = tuple(_cell(g, held, marks) for g in sorted(rec.gpus, key=lambda g: g.index))
            holders_text = " ".join(sorted({c.replica for c in cells if c.replica}))
            if not matches(pattern, node_id, fabric, word, rec.mgmt_addr, holders_text):
                continue
            views.append(
                NodeView(
                    node_id=node_id,
                    fabric=fabric,
                    state=word,
                    lease_age=lease_age_text(lease_state(lease), lease_age(lease, now)),
                    cells=cells,
                    gpus_free=free[node_id],
                    mgmt_addr=rec.mgmt_addr,
                    problem=_problem(rec),
                    admin=rec.admin if rec.admin not in ("active", word) else "",
                    admin_reason=admin_reason(rec),
                )
            )
        total = sum(len(state.nodes[n].gpus) for n in members[fabric])
        count = len(members[fabric])
        summary = f"{count} node{'s' if count != 1 else ''} · {sum(free[n] for n in members[fabric])}/{total} GPUs free"
        if views or not pattern:
            out.append(FabricView(fabric, tuple(views), summary))
    return tuple(out)


# --------------------------------------------------------------------------
# replicas
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaView:
    mark: str
    id: str
    deployment: str
    fabric: str
    members: str  # "node03:0 node04:1"
    state: str
    age: str
    reason: str
    tone: str
    rebuild: bool = False  # the replacement of a failed replica


def members_text(replica: Replica) -> str:
    return " ".join(f"{m.node_id}:{m.rank}" for m in sorted(replica.members, key=lambda m: m.rank)) or "-"


def replica_views(state: ClusterState, now: float, marks: MarkBook, *, rebuilding: frozenset[str] = frozenset(), pattern: str = "") -> tuple[ReplicaView, ...]:
    out = []
    for r in sorted(state.replicas.values(), key=lambda r: (r.deployment, r.generation, r.id)):
        members = members_text(r)
        if not matches(pattern, r.id, r.deployment, r.fabric or "", members, r.state):
            continue
        out.append(
            ReplicaView(
                mark=marks.get(r.id),
                id=r.id,
                deployment=r.deployment,
                fabric=r.fabric or "-",
                members=members,
                state=r.state,
                age=age_since(r.since, now),
                reason=r.reason,
                tone=replica_tone(r.state),
                rebuild=r.id in rebuilding and r.state != ReplicaState.READY,
            )
        )
    # A deployment in a crash-loop backoff has no replica on its way: a row says so.
    for d in sorted(state.deployments.values(), key=lambda d: d.name):
        if not backing_off(d, now):
            continue
        if not matches(pattern, d.name, BACKOFF, d.last_failure):
            continue
        out.append(
            ReplicaView(
                mark="…",
                id=f"({d.name})",
                deployment=d.name,
                fabric="-",
                members="-",
                state=BACKOFF,
                age=f"in {format_age(d.retry_at - now)}",
                reason=backoff_line(d, now),
                tone="backoff",
            )
        )
    return tuple(out)


# --------------------------------------------------------------------------
# one node, in detail
# --------------------------------------------------------------------------


def remember_members(seen: dict[str, set[str]], replicas: Mapping[str, Replica]) -> None:
    """Which nodes each replica ever had, so a node's history outlives reaped records."""
    for r in replicas.values():
        seen.setdefault(r.id, set()).update(m.node_id for m in r.members)


def touches_node(ev: Event, node_id: str, members_seen: Mapping[str, set[str]]) -> bool:
    if ev.kind == "node":
        return ev.subject == node_id
    if ev.kind == "replica" and node_id in members_seen.get(ev.subject, ()):
        return True
    return re.search(rf"(?<![\w-]){re.escape(node_id)}(?![\w-])", ev.detail) is not None


@dataclass(frozen=True)
class GpuLine:
    index: int
    name: str
    memory: str
    replica: str  # "" when free
    # Why it is out of service (issue #14): "unhealthy: XID 79 …", "busy: … MiB held by …"
    problem: str = ""


@dataclass(frozen=True)
class HcaLine:
    name: str
    ports: str  # "1: ACTIVE 200 Gb/sec (4X HDR)"
    usable: bool
    problem: str


@dataclass(frozen=True)
class MemberLine:
    replica: str
    state: str
    rank: int
    role: str
    gpus: str
    engine_state: str
    engine_detail: str = ""  # what the agent saw (a stalled canary, a lost peer)


@dataclass(frozen=True)
class NodeDetailView:
    node_id: str
    known: bool
    state: str = "unknown"
    admin: str = ""
    admin_reason: str = ""
    lease: str = ""  # "ready since 19:27:34, renewed 0.4s ago, boot 72424447"
    mgmt: str = ""
    fabrics: str = ""
    gpus: tuple[GpuLine, ...] = ()
    hcas: tuple[HcaLine, ...] = ()
    members: tuple[MemberLine, ...] = ()
    events: tuple[Event, ...] = ()


def memory_text(mib: int | None) -> str:
    return "?" if mib is None else f"{mib / 1024:.0f} GiB"


def node_detail(
    node_id: str,
    state: ClusterState,
    events: Iterable[Event],
    members_seen: Mapping[str, set[str]],
    now: float,
    *,
    recent: int = 12,
) -> NodeDetailView:
    rec = state.nodes.get(node_id)
    relevant = tuple(e for e in events if touches_node(e, node_id, members_seen))[-recent:]
    if rec is None:
        return NodeDetailView(node_id=node_id, known=False, events=relevant)
    lease = state.leases.get(node_id)
    held = gpu_holders(state.replicas).get(node_id, {})
    blocked = gpu_blocks(rec)
    members = []
    for r in sorted(state.replicas.values(), key=lambda r: r.id):
        for m in r.members:
            if m.node_id == node_id:
                gpus = ",".join(map(str, m.gpus)) or "-"
                members.append(MemberLine(r.id, r.state, m.rank, m.role, gpus, m.engine_state or "-", m.engine_detail))
    hcas = tuple(
        HcaLine(
            name=h.name,
            ports="; ".join(f"{p.port}: {p.state} {p.rate}".strip() for p in h.ports) or "no ports",
            usable=h.usable,
            problem=h.problem,
        )
        for h in rec.hcas
    )
    fabrics = ", ".join(f"{f.name} [{', '.join(f.hcas)}]" + ("" if f.usable else f" UNUSABLE: {f.problem}") for f in rec.fabrics)
    return NodeDetailView(
        node_id=node_id,
        known=True,
        state=node_state(rec, lease),
        admin=rec.admin,
        admin_reason=admin_reason(rec),
        lease=lease_line(lease, now),
        mgmt=f"{rec.mgmt_addr} ({rec.mgmt_interface})" if rec.mgmt_interface else rec.mgmt_addr,
        fabrics=fabrics or NO_FABRIC,
        gpus=tuple(
            GpuLine(g.index, g.name, memory_text(g.memory_mib), held[g.index].id if g.index in held else "", blocked.get(g.index, ""))
            for g in sorted(rec.gpus, key=lambda g: g.index)
        ),
        hcas=hcas,
        members=tuple(members),
        events=relevant,
    )
