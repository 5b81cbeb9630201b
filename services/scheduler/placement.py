"""Where one replica goes, and why not: the placement pipeline.

A multi-node replica picks a fabric first, then nodes inside it (LWS group
placement: the group is pinned to one topology domain). The leader, rank 0,
is the first node chosen. Placement never splits a replica across fabrics:
when no single fabric holds all of it, it does not go anywhere.

``place`` is a query: it reserves nothing. The reconciler commits what it
decides to place with ``ClusterView.commit``.

What decides: the filters (in ``FILTERS``' order) say which nodes can take a
member; the group scorers (``GROUP_SCORERS``) choose the fabric, or a
single-node replica's group; inside it ``CapacityIndex.best_fit`` chooses the
nodes, fullest first — after the nodes that hold the replica's weights in
their model cache, for a deployment that names a weights source (``NODE_SCORERS``). ``scorers.NodeBinPack`` is not part of the pipeline: it
is the oracle the tests hold ``best_fit``'s order to.

Placement's memo of a view is a ``PlacementCache``, kept beside the view (the
cycle holds both; the view knows nothing of it): static verdicts and capacity
indexes, which follow the nodes the view says changed, and refusals, which hold
until the view's next change.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from llmgw.shared.schemas import DeploymentSpec, NodeVerdict, ReplicaMember, weights_source

from . import reasons as R
from .filters import (
    OK,
    FabricFit,
    GpuCapacity,
    HasRecord,
    LeaseReady,
    PortCapacity,
    Request,
    Schedulable,
    Verdict,
)
from .scorers import FabricBinPack, FabricSpread, FabricWeightsCached, WeightsCached
from .view import PORTS_PER_LEADER, CapacityIndex, ClusterView, NodeView

# --------------------------------------------------------------------------
# The pipeline, assembled here and only here, in the order it runs.
# --------------------------------------------------------------------------

FILTERS = (
    # First: without a record nothing else about the node is known.
    HasRecord(),
    # Health before the operator's intent, so a lost node reads "lease not
    # ready" even if it is also cordoned: that is the more urgent fact.
    LeaseReady(),
    # Cordoned / draining: the operator said so.
    Schedulable(),
    # Multi-node only. Before capacity, so "no fabric" is not hidden behind
    # "full", and because it is static the capacity index can leave such
    # nodes out entirely.
    FabricFit(),
    # Dynamic from here on: these change as this cycle places replicas, and
    # the capacity index answers them in bulk; run one by one only to verify a
    # choice and to explain a refusal.
    GpuCapacity(),
    # Last: a range of hundreds of ports per node is rarely what runs out.
    PortCapacity(),
)
STATIC_FILTERS = tuple(f for f in FILTERS if f.static)
DYNAMIC_FILTERS = tuple(f for f in FILTERS if not f.static)

# Ranking fabrics (or a single-node replica's group), in priority order: a
# later scorer only breaks ties of the earlier ones. Spread comes first: a
# weighted sum let a deployment's second replica land beside its first when
# that fabric was small and already half full (the seed cluster), and losing
# one fabric must not take both. Bin-packing then keeps whole fabrics free.
# Weights already on a group's nodes come between: the fabric rule first, then
# a load from local disk over a copy, then packing.
GROUP_SCORERS = (
    FabricSpread(),
    FabricWeightsCached(),
    FabricBinPack(),
)
# Nodes inside the chosen group: ``CapacityIndex.best_fit`` picks them (fewest
# GPUs left, then node id), a bucket walk rather than a sort of every node.
# ``scorers.NodeBinPack`` is its test oracle. For a deployment with a weights
# source, the nodes whose cache holds it go first, in that order among
# themselves (``NODE_SCORERS``, whose scores ``ctl explain`` shows per node).
NODE_SCORERS = (WeightsCached(),)


@dataclass(frozen=True)
class Refusal:
    """Why a replica of one shape fits nowhere: ``PlacementResult``'s why-not fields."""

    reasons: dict[str, str]  # node id -> reason constant
    details: dict[str, str]  # node id -> human detail
    summary: str


# The shapes the static filters tell apart: single-node and multi-node.
SHAPES = {False: Request("", 0, 1), True: Request("", 0, 2)}


@dataclass(eq=False)
class PlacementCache:
    """What placement memoises about one ``ClusterView``, kept beside it.

    ``static`` holds while a node's ``NodeView`` is the same object (a node
    whose record, lease or suspicion changes gets a new one). ``indexes`` hold
    a shape's nodes by free GPUs; they follow the nodes the view marks changed
    (``follow``, at the start of every query), so one memo serves a view that
    is only committed to (one cycle's) and one that is kept across cycles (the
    incremental ``LiveView``) alike. ``refusals`` hold for one ``view.version``:
    capacity only shrinks between changes, so until the next one a shape fails
    the same way. One memo per view: following takes the view's changed nodes.
    """

    # (node id, multi-node shape) -> (the node view judged, the static filters' verdict)
    static: dict[tuple[str, bool], tuple[NodeView, Verdict]] = field(default_factory=dict)
    # multi-node shape -> group -> capacity index of the nodes passing ``static``;
    # a shape is present once its indexes are built
    indexes: dict[bool, dict[str | None, CapacityIndex]] = field(default_factory=dict)
    # (node id, multi-node shape) -> (bucket, groups, total GPUs) the node was entered under
    entered: dict[tuple[str, bool], tuple[int, tuple[str | None, ...], int]] = field(default_factory=dict)
    # (GPUs per node, nodes per replica) -> why that shape fits nowhere
    refusals: dict[tuple[int, int], Refusal] = field(default_factory=dict)
    refusals_version: int = -1  # the view version ``refusals`` hold for

    @classmethod
    def built(cls) -> PlacementCache:
        """A memo with both shapes' indexes present (empty): for a view that starts
        empty and is filled node by node, every node is indexed as it comes."""
        return cls(indexes={multi: {} for multi in SHAPES})

    def follow(self, view: ClusterView) -> None:
        """Bring the indexes up to the view: each node it marked changed is taken
        out of them and put back as it is now (or left out, if gone or refused)."""
        changed = view.take_changed()
        for node_id in changed:  # the indexes keep their buckets sorted: any order will do
            node = view.nodes.get(node_id)
            for multi in self.indexes:
                self._take_out(node_id, multi)
                if node is not None and static_verdict(node, SHAPES[multi], view, self).ok:
                    self.index_add(view, multi, node_id)
            if node is None:
                for multi in SHAPES:
                    self.static.pop((node_id, multi), None)

    def _take_out(self, node_id: str, multi: bool) -> None:
        entry = self.entered.pop((node_id, multi), None)
        if entry is None:
            return
        key, groups, total = entry
        by_group = self.indexes[multi]
        for group in groups:
            index = by_group[group]
            index.remove(node_id, key, total)
            if not index.buckets:
                del by_group[group]

    def index_add(self, view: ClusterView, multi: bool, node_id: str) -> None:
        """Put a node the static filters passed into its groups' indexes."""
        key = view.index_key(node_id)
        if key is None:
            return
        node = view.nodes[node_id]
        groups = view.groups(node, multi)
        total = len(node.gpus)
        for group in groups:
            self.indexes[multi].setdefault(group, CapacityIndex()).add(node_id, key, total)
        self.entered[(node_id, multi)] = (key, groups, total)


@dataclass
class PlacementResult:
    """Members (leader first) and fabric when placeable; otherwise None and why.

    ``reasons``/``details`` map node id -> reason constant / human detail for
    every node that was rejected. They are filled when placement fails; a
    success skips the full walk (use ``explain`` for the whole picture).
    """

    members: list[ReplicaMember] | None
    fabric: str | None
    reasons: dict[str, str] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)
    summary: str = ""

    @property
    def placed(self) -> bool:
        return self.members is not None


@dataclass(frozen=True)
class Explanation:
    """``llmgw ctl explain``: node by node, could it take a member of this deployment."""

    deployment: str
    request: Request
    nodes: list[NodeVerdict]  # as ``ctl explain`` shows them (shared/schemas.py)
    # fabric -> how many nodes there fit one member (multi-node replicas only)
    fabrics: dict[str, int]
    placeable: bool
    fabric: str | None  # where the next replica would go
    leader: str | None
    summary: str


def request_for(spec: DeploymentSpec) -> Request:
    return Request(spec.name, spec.gpus_per_node, spec.nodes_per_replica, weights_source(spec.weights_path, spec.weights_model))


# --------------------------------------------------------------------------
# Node verdicts
# --------------------------------------------------------------------------


def static_verdict(node: NodeView, request: Request, view: ClusterView, memo: PlacementCache | None = None) -> Verdict:
    """The static filters' verdict, computed once per node view and shape (with a memo)."""
    key = (node.node_id, request.multi)
    if memo is not None:
        seen = memo.static.get(key)
        if seen is not None and seen[0] is node:
            return seen[1]
    verdict = OK
    for f in STATIC_FILTERS:
        verdict = f.check(node, request, view)
        if not verdict.ok:
            break
    if memo is not None:
        memo.static[key] = (node, verdict)
    return verdict


def check_node(node: NodeView, request: Request, view: ClusterView, memo: PlacementCache | None = None) -> Verdict:
    """The whole filter pipeline for one node; the first rejection wins."""
    verdict = static_verdict(node, request, view, memo)
    if not verdict.ok:
        return verdict
    for f in DYNAMIC_FILTERS:
        verdict = f.check(node, request, view)
        if not verdict.ok:
            return verdict
    return OK


def _indexes(view: ClusterView, memo: PlacementCache, multi: bool) -> dict[str | None, CapacityIndex]:
    """The capacity index of nodes passing the static filters, built on first use
    and brought up to the view's changes since (``PlacementCache.follow``)."""
    memo.follow(view)
    by_group = memo.indexes.get(multi)
    if by_group is None:
        by_group = memo.indexes[multi] = {}
        shape = SHAPES[multi]
        for node in view.nodes.values():
            if static_verdict(node, shape, view, memo).ok:
                memo.index_add(view, multi, node.node_id)
    return by_group


# --------------------------------------------------------------------------
# place
# --------------------------------------------------------------------------


def _group_rank(group: str | None, index: CapacityIndex, request: Request, view: ClusterView) -> tuple:
    """Sort key, best first; the fabric name last so ties are repeatable."""
    return (*[-round(s.score(group, index, request, view), 9) for s in GROUP_SCORERS], group or "")


def place(request: Request, view: ClusterView, memo: PlacementCache | None = None) -> PlacementResult:
    """Choose nodes, GPUs and ports for one replica, or say why none fit. ``memo``:
    placement's memo of ``view``, kept beside it across queries (None: a fresh one)."""
    if memo is None:
        memo = PlacementCache()
    by_group = _indexes(view, memo, request.multi)
    need, n = request.gpus_per_node, request.nodes_per_replica
    # The best-ranked group that fits (the first of equals, as ``min`` would).
    best: tuple | None = None
    for g, idx in by_group.items():
        if idx.count_at_least(need) >= n:
            rank = _group_rank(g, idx, request, view)
            if best is None or rank < best[0]:
                best = (rank, g, idx)
    if best is None:
        return _unplaceable(request, view, memo)
    _rank, group, index = best
    node_ids = _choose(index, request, view)
    for node_id in node_ids:
        verdict = check_node(view.nodes[node_id], request, view, memo)
        if not verdict.ok:  # the index and the filters disagree: a bug, never a placement
            raise AssertionError(f"capacity index chose {node_id} but {verdict.reason}: {verdict.detail}")
    members = _members(node_ids, request, view)
    where = f"on {group}: " if request.multi else ""
    names = ", ".join(f"{m.node_id}{' (leader)' if m.rank == 0 else ''}" for m in members)
    return PlacementResult(members, group if request.multi else None, summary=f"placed {where}{names}")


def _choose(index: CapacityIndex, request: Request, view: ClusterView) -> list[str]:
    """The replica's nodes in its group, leader first: fullest first, and for a
    deployment with a weights source, the nodes scored higher before the rest
    (a stable sort keeps fullest-first among equals)."""
    need, n = request.gpus_per_node, request.nodes_per_replica
    if not request.weights:
        return index.best_fit(need, n)
    fitting = index.best_fit(need, index.count_at_least(need))
    return sorted(fitting, key=lambda nid: [-s.score(view.nodes[nid], request, view) for s in NODE_SCORERS])[:n]


def node_scores(node: NodeView, request: Request, view: ClusterView) -> dict[str, float]:
    """What the node scorers say of ``node`` for ``request`` (``ctl explain``)."""
    return {s.name: round(s.score(node, request, view), 3) for s in NODE_SCORERS}


def _members(node_ids: list[str], request: Request, view: ClusterView) -> list[ReplicaMember]:
    members = []
    for rank, node_id in enumerate(node_ids):
        node = view.nodes[node_id]
        leader = rank == 0
        # Only the leader listens: a rendezvous port and an HTTP port, distinct.
        rendezvous, http = view.free_ports(node, PORTS_PER_LEADER) if leader else (0, 0)
        members.append(
            ReplicaMember(
                node_id=node_id,
                rank=rank,
                role="leader" if leader else "worker",
                gpus=node.free_gpus()[: request.gpus_per_node],  # lowest free indices
                rendezvous_port=rendezvous,
                http_port=http,
                serves_http=leader,
            )
        )
    return members


# --------------------------------------------------------------------------
# Why not: the full walk
# --------------------------------------------------------------------------


def _node_verdicts(request: Request, view: ClusterView, memo: PlacementCache) -> tuple[dict[str, Verdict], dict[str, int]]:
    """Every node's verdict, with fabric-level refusals; and fits per fabric."""
    verdicts = {nid: check_node(view.nodes[nid], request, view, memo) for nid in sorted(view.nodes)}
    fits: dict[str, int] = {}
    if not request.multi:
        return verdicts, fits
    for nid, v in verdicts.items():
        for fabric in view.nodes[nid].usable_fabrics if v.ok else ():
            fits[fabric] = fits.get(fabric, 0) + 1
    for node in view.nodes.values():
        for fabric in node.fabrics:
            fits.setdefault(fabric, 0)
    n = request.nodes_per_replica
    for nid, v in verdicts.items():
        usable = view.nodes[nid].usable_fabrics
        if v.ok and all(fits[f] < n for f in usable):
            counts = ", ".join(f"{f} has {fits[f]}" for f in usable)
            verdicts[nid] = Verdict(False, R.FABRIC_TOO_SMALL, f"needs {n} nodes that fit in one fabric; {counts}")
    return verdicts, dict(sorted(fits.items()))


def _summary(request: Request, verdicts: dict[str, Verdict], fits: dict[str, int]) -> str:
    if not verdicts:
        return f"{R.NO_NODES}: no nodes registered"
    ok = sum(1 for v in verdicts.values() if v.ok)
    by_reason = Counter(v.reason for v in verdicts.values() if not v.ok)
    parts = ", ".join(f"{c} {r}" for r, c in sorted(by_reason.items(), key=lambda rc: (-rc[1], rc[0])))
    text = f"{ok}/{len(verdicts)} nodes fit {request.describe()}"
    if parts:
        text += f": {parts}"
    if request.multi:
        # The fabrics closest to fitting, a few at most: a summary, not a listing.
        best = sorted(fits.items(), key=lambda fc: (-fc[1], fc[0]))
        counts = ", ".join(f"{f}: {c}" for f, c in best[:4]) or "none"
        if len(best) > 4:
            counts += f", {len(best) - 4} more"
        text += f"; no fabric has {request.nodes_per_replica} nodes that fit ({counts})"
    return text


def _unplaceable(request: Request, view: ClusterView, cache: PlacementCache) -> PlacementResult:
    # Capacity only shrinks within a cycle, so until the next commit the same
    # shape fails the same way: a thousand pending replicas cost one walk.
    if cache.refusals_version != view.version:
        cache.refusals.clear()
        cache.refusals_version = view.version
    shape = (request.gpus_per_node, request.nodes_per_replica)
    refusal = cache.refusals.get(shape)
    if refusal is None:
        verdicts, fits = _node_verdicts(request, view, cache)
        if request.multi and any(c >= request.nodes_per_replica for c in fits.values()):
            raise AssertionError(f"capacity index found no fabric but the filters did: {fits}")
        refusal = cache.refusals[shape] = Refusal(
            {nid: v.reason for nid, v in verdicts.items() if not v.ok},
            {nid: v.detail for nid, v in verdicts.items() if not v.ok},
            _summary(request, verdicts, fits),
        )
    return PlacementResult(None, None, dict(refusal.reasons), dict(refusal.details), refusal.summary)


def explain(deployment: DeploymentSpec, view: ClusterView, memo: PlacementCache | None = None) -> Explanation:
    """Node by node, why each can or cannot take a member of ``deployment``'s next replica."""
    request = request_for(deployment)
    if memo is None:
        memo = PlacementCache()
    verdicts, fits = _node_verdicts(request, view, memo)
    result = place(request, view, memo)
    nodes = [
        NodeVerdict(
            node_id=nid,
            ok=v.ok,
            reason=v.reason,
            detail=v.detail or _fit_detail(view.nodes[nid]),
            fabrics=list(view.nodes[nid].fabrics),
            free_gpus=view.nodes[nid].free_gpu_count(),
            total_gpus=len(view.nodes[nid].gpus),
            scores=node_scores(view.nodes[nid], request, view),
        )
        for nid, v in verdicts.items()
    ]
    return Explanation(
        deployment=deployment.name,
        request=request,
        nodes=nodes,
        fabrics=fits,
        placeable=result.placed,
        fabric=result.fabric,
        leader=result.members[0].node_id if result.members else None,
        summary=result.summary if result.placed else _summary(request, verdicts, fits),
    )


def _fit_detail(node: NodeView) -> str:
    fabrics = ", ".join(node.usable_fabrics) or "no usable fabric"
    out = f"; out of service: {node.blocked_text()}" if node.blocked else ""
    return f"{node.free_gpu_count()} of {len(node.gpus)} GPUs free; {fabrics}{out}"
