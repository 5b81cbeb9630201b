"""The scheduler: a pure core (this package, minus the shell) and an impure shell.

The core never touches the bus, the clock or a socket: ``reconcile`` turns
deployments, replicas, node records and leases — plus the time, injected — into
a ``Plan`` that the shell applies (KV writes, launch/stop commands, events).
``Reconciler`` returns the same plan for the work of what changed since its
previous step (it keeps a live view; the shell runs it on every wake): both run
the phases of one ``cycle.Cycle``, over everything or over what is dirty.
``place`` and ``explain`` answer where one replica would go and why not.
"""

from .cycle import ReconcileConfig
from .fence import fence
from .incremental import Reconciler
from .placement import PlacementResult, Request, explain, place
from .plan import Launch, Plan, Stop
from .reconcile import reconcile
from .view import ClusterView, PortRange

__all__ = [
    "ClusterView",
    "Launch",
    "PlacementResult",
    "Plan",
    "PortRange",
    "ReconcileConfig",
    "Reconciler",
    "Request",
    "Stop",
    "explain",
    "fence",
    "place",
    "reconcile",
]
