"""Scorers: among feasible choices, which is best. Each returns 0..1, higher is better.

Group scorers rank fabrics (for a multi-node replica) or a single-node
replica's group; node scorers rank nodes inside the chosen group.
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


class NodeBinPack:
    """Prefer the node left fullest after placing, so whole nodes stay free.

    ``CapacityIndex.best_fit`` returns nodes in exactly this order (fewest free
    GPUs first, then node id); tests hold the two to each other.
    """

    name = "node_bin_pack"

    def score(self, node: NodeView, request: Request, view: ClusterView) -> float:
        left = max(node.free_gpu_count() - request.gpus_per_node, 0)
        return 1.0 - left / view.max_gpus
