"""What the console shows, computed from the folded cluster: pure functions, no Textual, no bus.

The widgets draw the frozen views built here, one row at a time and only for
the rows on screen, so every decision about a word, a colour class or an order
is unit-testable with plain records, and the clock is a parameter (``now``) —
snapshot tests pin it. The facts themselves (GPUs in use and free, a node's
state word, ages, backoff) come from the read model ``llmgw ctl`` uses too
(``shared/readmodel.py``), through the console's folded copy of the cluster
(``cluster.py``); this module only arranges them into rows and colours.
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from llmgw.shared.readmodel import (
    age_since,
    backing_off,
    backoff_line,
    format_age,
    gpu_blocks,
    lease_age,
    lease_age_text,
    lease_line,
    lease_state,
    node_state,
)
from llmgw.shared.schemas import Event, Replica
from llmgw.shared.states import COMING_UP_REPLICA, ENDING_REPLICA, NODE_ORDER, AdminBy, AdminState, ReplicaState

from .cluster import NO_FABRIC, ClusterModel, FabricTotals, members_text

__all__ = ["NO_FABRIC", "format_age", "members_text", "node_state"]  # re-exported: the console's words come from the read model


class Tone(StrEnum):
    """The console's colour families: replica states grouped by what an operator
    should feel about them, and the GPU cells' (the palette maps each to colours)."""

    READY = "ready"
    DEGRADED = "degraded"
    STANDBY = "standby"  # a warm spare: up, loaded, not routed
    STARTING = "starting"  # states.COMING_UP_REPLICA
    FAILING = "failing"  # states.ENDING_REPLICA
    GONE = "gone"
    BACKOFF = "backoff"  # a deployment in a crash-loop backoff (BACKOFF's row)
    # GPU cells only
    FREE = "free"
    BROKEN = "broken"  # unhealthy
    FOREIGN = "foreign"  # busy with a process llmgw did not start


# Not a replica state: the row a deployment in a crash-loop backoff shows in the
# replicas table, where its replacement would be.
BACKOFF = "backing-off"
# The tones that are a replica state's own word.
_OWN_TONE: dict[str, Tone] = {
    ReplicaState.READY: Tone.READY,
    ReplicaState.DEGRADED: Tone.DEGRADED,
    ReplicaState.STANDBY: Tone.STANDBY,
    ReplicaState.GONE: Tone.GONE,
}


def replica_tone(state: str) -> Tone:
    """The colour family of a replica state (or of ``BACKOFF``'s row)."""
    if state in COMING_UP_REPLICA:
        return Tone.STARTING
    if state in ENDING_REPLICA:
        return Tone.FAILING
    if state == BACKOFF:
        return Tone.BACKOFF
    return _OWN_TONE.get(state, Tone.STARTING)


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
# fabrics: the aggregates
# --------------------------------------------------------------------------

# The order node states are counted in: most urgent first.
STATE_ORDER: tuple[str, ...] = NODE_ORDER
# The order replica states are counted in: problems first.
REPLICA_URGENCY: tuple[str, ...] = (
    ReplicaState.FAILED,
    ReplicaState.REAPING,
    ReplicaState.DEGRADED,
    ReplicaState.RESTARTING,
    ReplicaState.PENDING,
    ReplicaState.LAUNCHING,
    ReplicaState.WAITING,
    ReplicaState.READY,
    ReplicaState.STANDBY,
    ReplicaState.GONE,
)


@dataclass(frozen=True)
class FabricRow:
    """One fabric's aggregates, as a row of the fabrics panel."""

    name: str
    nodes: int
    node_states: tuple[tuple[str, int], ...]  # most urgent first, zero counts left out
    gpus_total: int
    gpus_free: int
    gpus_used: int
    gpus_out: int
    replicas: int
    replica_states: tuple[tuple[str, int], ...]


def ordered_counts(counts, order: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    known = [(s, counts[s]) for s in order if counts.get(s)]
    return (*known, *sorted((s, n) for s, n in counts.items() if s not in order and n))


def fabric_row(name: str, t: FabricTotals) -> FabricRow:
    return FabricRow(
        name=name,
        nodes=t.node_count,
        node_states=ordered_counts(t.nodes, STATE_ORDER),
        gpus_total=t.gpus_total,
        gpus_free=t.gpus_free,
        gpus_used=t.gpus_used,
        gpus_out=t.gpus_out,
        replicas=t.replica_count,
        replica_states=ordered_counts(t.replicas, REPLICA_URGENCY),
    )


def fabric_rows(model: ClusterModel) -> tuple[FabricRow, ...]:
    return tuple(fabric_row(name, model.totals[name]) for name in model.fabric_names())


# --------------------------------------------------------------------------
# nodes: one row each, built only for the rows on screen
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuCell:
    index: int
    mark: str  # "·" when free
    replica: str = ""
    tone: Tone = Tone.FREE


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


def admin_reason(record) -> str:
    """Why a node is out of rotation, and who said so ("" when active or not said)."""
    if record.admin == AdminState.ACTIVE:
        return ""
    if record.admin_by == AdminBy.AUTO:
        return f"auto: {record.admin_reason or 'repeated replica failures'}"
    return record.admin_reason


def _problem(record) -> str:
    broken = [f"{f.name}: {f.problem or 'unusable'}" for f in record.fabrics if not f.usable]
    broken += [f"GPU {g.index} unhealthy: {g.problem or 'reported by its agent'}" for g in record.gpus if not g.healthy]
    return "; ".join(broken)


# Marks of GPUs out of service; an unhealthy GPU shows it even while the replica
# that held it is still being reaped.
UNHEALTHY_MARK, FOREIGN_MARK = "✗", "f"


def _cell(g, held: dict[int, Replica], marks: MarkBook) -> GpuCell:
    if not g.healthy:
        return GpuCell(g.index, UNHEALTHY_MARK, held[g.index].id if g.index in held else "", Tone.BROKEN)
    if g.index in held:
        return GpuCell(g.index, marks.get(held[g.index].id), held[g.index].id, replica_tone(held[g.index].state))
    if g.foreign_mib or g.foreign_pids:
        return GpuCell(g.index, FOREIGN_MARK, "", Tone.FOREIGN)
    return GpuCell(g.index, "·")


def node_view(model: ClusterModel, fabric: str, node_id: str, now: float, marks: MarkBook) -> NodeView:
    """One node's row in ``fabric``'s part of the list."""
    rec, lease, facts = model.nodes[node_id], model.leases.get(node_id), model.facts[node_id]
    held = model.holders(node_id)
    return NodeView(
        node_id=node_id,
        fabric=fabric,
        state=facts.state,
        lease_age=lease_age_text(lease_state(lease), lease_age(lease, now)),
        cells=tuple(_cell(g, held, marks) for g in sorted(rec.gpus, key=lambda g: g.index)),
        gpus_free=facts.gpus.free,
        mgmt_addr=rec.mgmt_addr,
        problem=_problem(rec),
        admin=rec.admin if rec.admin != AdminState.ACTIVE and rec.admin != facts.state else "",
        admin_reason=admin_reason(rec),
    )


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
    tone: Tone
    rebuild: bool = False  # the replacement of a failed replica


# Problems first: at 4,000 replicas the failed one and its replacement must not
# be row 3,000 of the table.
TONE_RANK = {Tone.FAILING: 0, Tone.BACKOFF: 1, Tone.STARTING: 2, Tone.DEGRADED: 3, Tone.READY: 4, Tone.GONE: 5}


def replica_order(model: ClusterModel, pattern: str = "", among: list[str] | None = None) -> list[str]:
    """The ids of the replicas the table lists, problems first, then by deployment and
    generation; ``among``: only those (the matches of a pattern this one narrows)."""
    words = pattern.lower().split()
    text = model.replica_text
    if among is not None:  # the matches of a pattern narrowed are in order already
        ids = [rid for rid in among if rid in model.replicas]
    else:  # every replica in order, sorted once per change of the replicas, not per letter
        version, ordered = model.replica_order_cache
        if version != model.versions["replicas"]:
            reps = model.replicas
            ordered = sorted(reps, key=lambda rid: (TONE_RANK[replica_tone(reps[rid].state)], reps[rid].deployment, reps[rid].generation, rid))
            model.replica_order_cache = (model.versions["replicas"], ordered)
        ids = ordered
    if len(words) == 1:
        w = words[0]
        ids = [rid for rid in ids if w in text[rid][1]]
    elif words:
        ids = [rid for rid in ids if all(w in text[rid][1] for w in words)]
    return ids if words or among is not None else list(ids)


def replica_view(r: Replica, now: float, marks: MarkBook, rebuilding: frozenset[str] = frozenset()) -> ReplicaView:
    return ReplicaView(
        mark=marks.get(r.id),
        id=r.id,
        deployment=r.deployment,
        fabric=r.fabric or "-",
        members=members_text(r),  # one row: cheap enough
        state=r.state,
        age=age_since(r.since, now),
        reason=r.reason,
        tone=replica_tone(r.state),
        rebuild=r.id in rebuilding and r.state != ReplicaState.READY,
    )


def backoff_views(model: ClusterModel, now: float, pattern: str = "") -> tuple[ReplicaView, ...]:
    """A deployment in a crash-loop backoff has no replica on its way: a row says so."""
    out = []
    for d in sorted(model.deployments.values(), key=lambda d: d.name):
        if not backing_off(d, now) or not matches(pattern, d.name, BACKOFF, d.last_failure):
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
                tone=Tone.BACKOFF,
            )
        )
    return tuple(out)


def replica_summary(model: ClusterModel, rebuilding: frozenset[str], backoffs: int) -> str:
    """The replicas by what they are doing: "3,998 ready · 2 rebuilding"."""

    def key(state: str) -> str:
        tone = replica_tone(state)
        return ReplicaState.FAILED if tone == Tone.FAILING else tone

    counts: dict[str, int] = {}
    for state, n in model.all.replicas.items():
        counts[key(state)] = counts.get(key(state), 0) + n
    for rid in rebuilding:  # a replacement on its way counts as that, not as its state
        if (r := model.replicas.get(rid)) is not None and r.state != ReplicaState.READY:
            counts[key(r.state)] -= 1
            counts["rebuilding"] = counts.get("rebuilding", 0) + 1
    if backoffs:
        counts[Tone.BACKOFF] = backoffs
    order = (Tone.READY, Tone.STANDBY, Tone.DEGRADED, "rebuilding", Tone.STARTING, ReplicaState.FAILED, Tone.BACKOFF, Tone.GONE)
    return " · ".join(f"{counts[k]:,} {k}" for k in order if counts.get(k))


# --------------------------------------------------------------------------
# one node, in detail
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuLine:
    index: int
    name: str
    memory: str
    replica: str  # "" when free
    # Why it is out of service: "unhealthy: XID 79 …", "busy: … MiB held by …"
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


def node_detail(node_id: str, model: ClusterModel, events: Iterable[Event], now: float, *, recent: int = 12) -> NodeDetailView:
    """``events``: those touching the node, oldest first (``Timeline.node_events``)."""
    relevant = tuple(events)[-recent:]
    rec = model.nodes.get(node_id)
    if rec is None:
        return NodeDetailView(node_id=node_id, known=False, events=relevant)
    lease = model.leases.get(node_id)
    held = model.holders(node_id)
    blocked = gpu_blocks(rec)
    members = []
    for rid in sorted(model.members_now.get(node_id, ())):
        r = model.replicas[rid]
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
