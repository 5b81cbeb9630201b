"""The console's copy of the cluster, folded in one bus update at a time: pure, no Textual, no bus.

At 10,000 nodes the console cannot rebuild its views from the whole cluster on
every update (a lease bucket alone takes 65 writes a second there). So each
update — one node record, lease, replica or deployment, put or deleted — is
folded in here at a cost that does not grow with the cluster: the record is
stored, the indexes it touches are adjusted (which replicas claim which GPU,
each fabric's counts, the sorted node rows) and what changed is noted in
``changes`` for the next frame, which draws only the rows on screen and the
aggregates.

The facts are the operator read model's (``shared/readmodel.py``): a node's
state word is ``node_state``, its GPUs free/used/out of service are
``gpu_counts`` over the GPUs replicas hold (``states.HOLDING_REPLICA``) and ``gpu_blocks``,
and of two replicas naming one GPU ``holder_precedence`` decides — the same
functions ``llmgw ctl`` reads, so the two never disagree.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from llmgw.shared.readmodel import GpuCounts, gpu_blocks, gpu_counts, holder_precedence, node_state
from llmgw.shared.schemas import DeploymentSpec, Lease, NodeRecord, Replica
from llmgw.shared.states import HOLDING_REPLICA

# The panel of nodes configured on no fabric (they host single-node replicas only).
NO_FABRIC = "no fabric"

NODES, LEASES, REPLICAS, DEPLOYMENTS = "nodes", "leases", "replicas", "deployments"


@dataclass(frozen=True)
class NodeFacts:
    """What the aggregates count of one node, and what the filter searches."""

    state: str
    fabrics: tuple[str, ...]  # the panels its row sits in (NO_FABRIC when none)
    gpus: GpuCounts
    hay: str  # node id, its fabrics, state word, address, the replicas holding its GPUs; lower case


@dataclass
class FabricTotals:
    """One fabric's aggregates: its nodes by state, their GPUs, its replicas by state."""

    nodes: Counter[str] = field(default_factory=Counter)
    gpus_total: int = 0
    gpus_free: int = 0
    gpus_used: int = 0
    gpus_out: int = 0
    replicas: Counter[str] = field(default_factory=Counter)

    @property
    def node_count(self) -> int:
        return sum(self.nodes.values())

    @property
    def replica_count(self) -> int:
        return sum(self.replicas.values())

    def add_node(self, facts: NodeFacts, sign: int) -> None:
        self.nodes[facts.state] += sign
        if not self.nodes[facts.state]:
            del self.nodes[facts.state]
        self.gpus_total += sign * facts.gpus.total
        self.gpus_free += sign * facts.gpus.free
        self.gpus_used += sign * facts.gpus.used
        self.gpus_out += sign * facts.gpus.out_of_service

    def add_replica(self, state: str, sign: int) -> None:
        self.replicas[state] += sign
        if not self.replicas[state]:
            del self.replicas[state]

    @property
    def empty(self) -> bool:
        return not self.nodes and not self.replicas


@dataclass
class Changes:
    """What the folds since the last frame changed, for the frame to redraw just that."""

    nodes: set[str] = field(default_factory=set)  # rows that may look different
    order: bool = False  # rows joined, left, or moved to another fabric
    facts: bool = False  # some node's state, GPU counts or filter text changed
    totals: bool = False  # some fabric's aggregates changed
    replicas: bool = False  # some replica record changed
    deployments: bool = False

    def __bool__(self) -> bool:
        return bool(self.nodes) or self.order or self.facts or self.totals or self.replicas or self.deployments


def narrows(new: str, old: str) -> bool:
    """Whether everything ``new`` matches, ``old`` matched too (``old`` typed on to ``new``)."""
    return bool(old.strip()) and new.lower().startswith(old.lower()) and len(new.split()) >= len(old.split())


def members_text(replica: Replica) -> str:
    return " ".join(f"{m.node_id}:{m.rank}" for m in sorted(replica.members, key=lambda m: m.rank)) or "-"


def row_key(fabric: str, node_id: str) -> tuple[bool, str, str]:
    """Rows sort by fabric (nodes on no fabric last), then node id."""
    return (fabric == NO_FABRIC, fabric, node_id)


def replica_fabric(replica: Replica) -> str:
    """The fabric a replica counts in: where it was placed; single-node replicas on none."""
    return replica.fabric or NO_FABRIC


class ClusterModel:
    """The four buckets as last seen, with the indexes the screen reads.

    ``fold(bucket, key, value)`` applies one update (``value`` None: deleted);
    ``replace(bucket, items)`` makes a bucket what a fresh read found, folding
    only the differences. ``take_changes()`` hands the frame what changed.
    """

    def __init__(self) -> None:
        self.nodes: dict[str, NodeRecord] = {}
        self.leases: dict[str, Lease] = {}
        self.replicas: dict[str, Replica] = {}
        self.deployments: dict[str, DeploymentSpec] = {}
        self.facts: dict[str, NodeFacts] = {}
        self.totals: dict[str, FabricTotals] = {}
        # Every node once (a node on two fabrics counts in both panels, here once) and every replica.
        self.all = FabricTotals()
        # node -> GPU index -> the replicas (in a state that holds GPUs) naming it
        self.claims: dict[str, dict[int, set[str]]] = {}
        # node -> the replicas with a member on it now, and ever (a node's history
        # outlives reaped records: its detail lists their events)
        self.members_now: dict[str, set[str]] = {}
        self.members_seen: dict[str, set[str]] = {}
        self.rows: list[tuple[bool, str, str]] = []  # row_key of every (fabric, node), sorted
        self.replica_order_cache: tuple[int, list[str]] = (-1, [])  # (versions["replicas"], model.replica_order's whole list)
        self.name_width = 0  # the longest node id seen
        # replica -> (its members as text, what a filter searches), kept with the record
        self.replica_text: dict[str, tuple[str, str]] = {}
        self.replica_widths = dict.fromkeys(("id", "deployment", "fabric", "members", "state"), 0)
        self.changes = Changes()
        # node -> how many times its row may have changed (the screen keeps drawn rows by it)
        self.row_versions: dict[str, int] = {}
        self.replica_versions: dict[str, int] = {}  # replica -> how many times it changed
        self.versions = Counter[str]()  # bumped per fold: "order", "facts", "replicas", ...

    # -- folding ------------------------------------------------------------------

    def fold(self, bucket: str, key: str, value: object | None) -> None:
        if bucket == NODES:
            self._node(key, value)  # type: ignore[arg-type]
        elif bucket == LEASES:
            self._lease(key, value)  # type: ignore[arg-type]
        elif bucket == REPLICAS:
            self._replica(key, value)  # type: ignore[arg-type]
        elif bucket == DEPLOYMENTS:
            self._deployment(key, value)  # type: ignore[arg-type]
        else:
            raise ValueError(f"unknown bucket {bucket!r}")

    def replace(self, bucket: str, items: Mapping[str, object]) -> None:
        """Make ``bucket`` what a fresh read found: only keys that differ are folded."""
        buckets: dict[str, Mapping[str, object]] = {NODES: self.nodes, LEASES: self.leases, REPLICAS: self.replicas, DEPLOYMENTS: self.deployments}
        current = buckets[bucket]
        for key in [k for k in current if k not in items]:
            self.fold(bucket, key, None)
        for key, value in items.items():
            if current.get(key) != value:
                self.fold(bucket, key, value)

    def take_changes(self) -> Changes:
        changes, self.changes = self.changes, Changes()
        return changes

    def _touch(self, node_id: str) -> None:
        """The node's row may look different: noted for the frame, and its version moves on."""
        self.changes.nodes.add(node_id)
        self.row_versions[node_id] = self.row_versions.get(node_id, 0) + 1

    def _node(self, node_id: str, record: NodeRecord | None) -> None:
        if record is None:
            if self.nodes.pop(node_id, None) is not None:
                self._refresh(node_id)
            return
        self.nodes[node_id] = record
        self.name_width = max(self.name_width, len(node_id))
        self._refresh(node_id)

    def _lease(self, node_id: str, lease: Lease | None) -> None:
        if lease is None:
            self.leases.pop(node_id, None)
        else:
            self.leases[node_id] = lease
        if node_id in self.nodes:
            # A ready lease's checkpoint changes only its age: the row, not the facts.
            self._touch(node_id)
            self._refresh(node_id)

    def _deployment(self, name: str, spec: DeploymentSpec | None) -> None:
        if spec is None:
            self.deployments.pop(name, None)
        else:
            self.deployments[name] = spec
        self.changes.deployments = True
        self.versions["deployments"] += 1

    def _replica(self, rid: str, new: Replica | None) -> None:
        old = self.replicas.get(rid)
        if old is None and new is None:
            return
        touched: set[str] = set()
        if old is not None:
            self._claim(rid, old, -1, touched)
        if new is None:
            del self.replicas[rid]
            del self.replica_text[rid]
        else:
            self.replicas[rid] = new
            members = members_text(new)
            self.replica_text[rid] = (members, " ".join((rid, new.deployment, new.fabric or "", members, new.state)).lower())
            # the widest of each column ever seen: the table's columns, without a walk of 4,000 rows
            w = self.replica_widths
            w["id"], w["deployment"] = max(w["id"], len(rid)), max(w["deployment"], len(new.deployment))
            w["fabric"], w["members"], w["state"] = max(w["fabric"], len(new.fabric or "-")), max(w["members"], len(members)), max(w["state"], len(new.state))
            self._claim(rid, new, +1, touched)
        for node_id in touched:
            self._touch(node_id)
            self._refresh(node_id)
        self.replica_versions[rid] = self.replica_versions.get(rid, 0) + 1
        self.changes.replicas = True
        self.versions["replicas"] += 1

    def _claim(self, rid: str, replica: Replica, sign: int, touched: set[str]) -> None:
        fabric = replica_fabric(replica)
        totals = self.totals.setdefault(fabric, FabricTotals())
        totals.add_replica(replica.state, sign)
        if totals.empty:
            del self.totals[fabric]
        self.all.add_replica(replica.state, sign)
        self.changes.totals = True
        holds = replica.state in HOLDING_REPLICA
        for m in replica.members:
            touched.add(m.node_id)
            if sign > 0:
                self.members_now.setdefault(m.node_id, set()).add(rid)
                self.members_seen.setdefault(m.node_id, set()).add(rid)
            else:
                now = self.members_now.get(m.node_id)
                if now is not None:
                    now.discard(rid)
                    if not now:
                        del self.members_now[m.node_id]
            if not holds:
                continue
            node = self.claims.setdefault(m.node_id, {})
            for g in m.gpus:
                if sign > 0:
                    node.setdefault(g, set()).add(rid)
                elif (claimants := node.get(g)) is not None:
                    claimants.discard(rid)
                    if not claimants:
                        del node[g]
            if not node:
                del self.claims[m.node_id]

    def _refresh(self, node_id: str) -> None:
        """Recompute one node's facts; move its counts and rows if they changed."""
        old = self.facts.get(node_id)
        record = self.nodes.get(node_id)
        new = self._facts(node_id, record) if record is not None else None
        if new == old:
            return
        self._touch(node_id)
        self.changes.facts = True
        self.versions["facts"] += 1
        self.changes.totals = True
        if old is not None:
            for fabric in old.fabrics:
                self.totals[fabric].add_node(old, -1)
            self.all.add_node(old, -1)
        if new is not None:
            for fabric in new.fabrics:
                self.totals.setdefault(fabric, FabricTotals()).add_node(new, +1)
            self.all.add_node(new, +1)
            self.facts[node_id] = new
        else:
            del self.facts[node_id]
        old_fabrics = old.fabrics if old is not None else ()
        new_fabrics = new.fabrics if new is not None else ()
        if old_fabrics != new_fabrics:
            for fabric in old_fabrics:
                i = bisect.bisect_left(self.rows, row_key(fabric, node_id))
                del self.rows[i]
            for fabric in new_fabrics:
                bisect.insort(self.rows, row_key(fabric, node_id))
            self.changes.order = True
            self.versions["order"] += 1
        for fabric in old_fabrics:
            if fabric in self.totals and self.totals[fabric].empty:
                del self.totals[fabric]

    def _facts(self, node_id: str, record: NodeRecord) -> NodeFacts:
        word = node_state(record, self.leases.get(node_id))
        claims = self.claims.get(node_id, {})
        counts = gpu_counts((g.index for g in record.gpus), (g for g, who in claims.items() if who), gpu_blocks(record))
        holders = sorted({rid for who in claims.values() for rid in who})
        fabrics = tuple(sorted({f.name for f in record.fabrics})) or (NO_FABRIC,)
        hay = " ".join([node_id, *fabrics, word, record.mgmt_addr, *holders]).lower()
        return NodeFacts(state=word, fabrics=fabrics, gpus=counts, hay=hay)

    # -- reading --------------------------------------------------------------------

    def holder(self, node_id: str, gpu: int) -> Replica | None:
        """The replica holding one GPU (``gpu_holders``' answer, from the index)."""
        claimants = self.claims.get(node_id, {}).get(gpu)
        if not claimants:
            return None
        return min((self.replicas[rid] for rid in claimants), key=holder_precedence)

    def holders(self, node_id: str) -> dict[int, Replica]:
        """GPU index -> its holder, for one node."""
        out = {}
        for g in self.claims.get(node_id, {}):
            r = self.holder(node_id, g)
            if r is not None:
                out[g] = r
        return out

    def fabric_names(self) -> list[str]:
        return sorted(self.totals, key=lambda f: (f == NO_FABRIC, f))

    def matching_rows(self, pattern: str, among: list[tuple[bool, str, str]] | None = None) -> list[tuple[bool, str, str]]:
        """The rows whose node matches every word of ``pattern`` (case-insensitive), in row
        order; ``among``: only those rows (the matches of a pattern this one narrows)."""
        words = pattern.lower().split()
        rows = self.rows if among is None else among
        if not words:
            return rows
        facts = self.facts
        if len(words) == 1:  # the common case, typed letter by letter: no generator per row
            w = words[0]
            return [key for key in rows if w in facts[key[2]].hay]
        return [key for key in rows if all(w in facts[key[2]].hay for w in words)]


def fold_all(model: ClusterModel, bucket: str, items: Iterable[tuple[str, object | None]]) -> ClusterModel:
    """Fold a sequence of updates in order (tests and the initial read)."""
    for key, value in items:
        model.fold(bucket, key, value)
    return model
