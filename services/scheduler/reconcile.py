"""The reconciler as a pure function: the cycle's phases over everything.

``reconcile(deployments, replicas, nodes, leases, now, config=…, failures=…) -> Plan``
reads nothing but its arguments (the clock is ``now``) and changes none of
them; the shell applies the plan. It is the reference: every replica advanced,
every deployment converged, the view built from nothing. The phases and the
cases they decide are ``cycle.py``'s; ``incremental.Reconciler`` runs the same
phases over what changed, and the property tests hold it to this.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llmgw.shared.schemas import DeploymentSpec, Lease, NodeRecord, Replica

from .cycle import Cycle, ReconcileConfig, Scope, run
from .placement import PlacementCache
from .plan import NodeFailure, Plan
from .view import ClusterView


def reconcile(
    deployments: Mapping[str, DeploymentSpec],
    replicas: Mapping[str, Replica],
    nodes: Mapping[str, NodeRecord],
    leases: Mapping[str, Lease],
    now: float,
    *,
    config: ReconcileConfig | None = None,
    failures: Mapping[str, Sequence[NodeFailure]] | None = None,
) -> Plan:
    """``failures``: node -> the failures that implicated it before (the shell's
    history of ``Plan.implicated``, any age: the window is applied here)."""
    cycle = Cycle(deployments, replicas, nodes, leases, now, config or ReconcileConfig())
    run(cycle, Scope.everything(deployments, replicas), failures or {}, fresh_sight)
    return cycle.plan


def fresh_sight(cycle: Cycle, suspects: Mapping[str, str]) -> tuple[ClusterView, PlacementCache]:
    """The view phase from nothing: built from the nodes as judged and the
    replicas as advanced, with an empty memo (placement fills it as it goes)."""
    view = ClusterView.build(cycle.nodes, cycle.leases, cycle.replicas.values(), ports=cycle.config.ports, suspects=suspects)
    return view, PlacementCache()
