"""Scorers: among feasible choices, which is best. Each returns 0..1, higher is better.

Group scorers rank fabrics (for a multi-node replica) or a single-node
replica's group; placement runs them (``placement.GROUP_SCORERS``).

Nodes inside the chosen group are not scored in production:
``CapacityIndex.best_fit`` picks them by walking its buckets. ``NodeBinPack``
below states that order as a score — the oracle the tests check ``best_fit``'s
choices against — and nothing in the scheduler runs it.
"""

from __future__ import annotations

from .filters import Request
from .view import CapacityIndex, ClusterView, NodeView


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
