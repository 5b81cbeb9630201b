"""Scorers: among feasible choices, which is best. Each returns 0..1, higher is better.

Group scorers rank fabrics (for a multi-node replica) or a single-node
replica's group; placement runs them (``placement.GROUP_SCORERS``).

``WeightsCached`` is the one node scorer placement runs: inside the chosen
group, nodes whose model cache holds the replica's weights come first (they
load in the cached time); ``FabricWeightsCached`` ranks groups by how many of
a replica's nodes could be such nodes.

Nodes inside the chosen group are not scored in production:
``CapacityIndex.best_fit`` picks them by walking its buckets. ``NodeBinPack``
below states that order as a score — the oracle the tests check ``best_fit``'s
choices against — and nothing in the scheduler runs it.
"""

from __future__ import annotations

from .filters import Request
from .view import CapacityIndex, ClusterView, NodeView

# A copy in progress counts for less than a finished one: it may still fail,
# and the engine waits for the rest of it.
STAGING_WEIGHT = 0.5


class FabricBinPack:
    """Prefer a fabric already partly used, so whole fabrics (and nodes) stay free for big replicas."""

    name = "fabric_bin_pack"

    def score(self, group: str | None, index: CapacityIndex, request: Request, view: ClusterView) -> float:
        if index.total_gpus == 0:
            return 0.0
        return index.used_gpus / index.total_gpus


class FabricSpread:
    """Prefer a fabric hosting fewer replicas of this deployment: one fabric's loss takes fewer."""

    name = "fabric_spread"

    def score(self, group: str | None, index: CapacityIndex, request: Request, view: ClusterView) -> float:
        return 1.0 / (1 + view.spread[(request.deployment, group)])


class WeightsCached:
    """Prefer a node whose model cache holds the replica's weights (1.0), or is
    copying them (up to ``STAGING_WEIGHT``, by the share copied); 0.0 otherwise,
    and for a deployment that names no weights source."""

    name = "weights_cached"

    def score(self, node: NodeView, request: Request, view: ClusterView) -> float:
        if not request.weights or node.record is None or node.record.model_cache is None:
            return 0.0
        for e in node.record.model_cache.entries:
            if e.source == request.weights and not e.problem:
                if e.complete:
                    return 1.0
                return STAGING_WEIGHT * min(e.staged_bytes / e.size, 1.0) if e.size else 0.0
        return 0.0


class FabricWeightsCached:
    """Prefer a group with more nodes that fit a member and hold the weights,
    up to the replica's node count (1.0: every member can load from cache)."""

    name = "fabric_weights_cached"
    node_scorer = WeightsCached()

    def score(self, group: str | None, index: CapacityIndex, request: Request, view: ClusterView) -> float:
        if not request.weights:
            return 0.0
        need, n = request.gpus_per_node, request.nodes_per_replica
        held = 0.0
        for free, bucket in index.buckets.items():
            if free >= need:
                held += sum(self.node_scorer.score(view.nodes[nid], request, view) for nid in bucket)
        return min(held, n) / n


# --------------------------------------------------------------------------
# Test oracle: not part of the pipeline
# --------------------------------------------------------------------------


class NodeBinPack:
    """The oracle ``CapacityIndex.best_fit``'s order is checked against.

    Prefers the node left fullest after placing, so whole nodes stay free:
    ``best_fit`` returns nodes in this order (fewest free GPUs first, then node
    id), and ``tests/test_scheduler_properties.py`` holds it to this score.
    Placement never calls it; it stays a score so the rule reads as one line.
    """

    name = "node_bin_pack"

    def score(self, node: NodeView, request: Request, view: ClusterView) -> float:
        left = max(node.free_gpu_count() - request.gpus_per_node, 0)
        return 1.0 - left / view.max_gpus
