"""Feasibility filters: can this node take one member of this replica?

Each filter is a tiny object with one ``check`` (Nomad's ``FeasibilityChecker``)
returning a ``Verdict`` with a reason constant, so every rejection can be shown
to an operator. ``static`` filters depend only on the node and the shape of the
request (single- or multi-node), never on what this cycle has placed, so
placement evaluates them once per node per cycle; the others are re-checked as
capacity is handed out.

The order they run in is decided in ``placement.py``, not here.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.shared.states import AdminBy, AdminState, LeaseState

from . import reasons as R
from .view import PORTS_PER_LEADER, ClusterView, NodeView


@dataclass(frozen=True)
class Request:
    """What one replica asks of the cluster."""

    deployment: str
    gpus_per_node: int
    nodes_per_replica: int = 1
    # The deployment's weights source (``schemas.weights_source``), "" for none:
    # placement prefers nodes whose model cache holds it (``scorers.WeightsCached``).
    weights: str = ""

    def __post_init__(self) -> None:
        if self.nodes_per_replica < 1 or self.gpus_per_node < 0:
            raise ValueError(f"{self.deployment}: nodes_per_replica must be >= 1 and gpus_per_node >= 0, got {self.nodes_per_replica} × {self.gpus_per_node}")

    @property
    def multi(self) -> bool:
        return self.nodes_per_replica > 1

    def describe(self) -> str:
        return f"{self.nodes_per_replica} node(s) × {self.gpus_per_node} GPU(s)"


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""
    detail: str = ""


OK = Verdict(True)


class HasRecord:
    """Without a record there is no inventory to place on and no address to give peers."""

    name = "has_record"
    static = True

    def check(self, node: NodeView, request: Request, view: ClusterView) -> Verdict:
        if node.record is None:
            return Verdict(False, R.NO_RECORD, "lease but no node record")
        if not node.mgmt_addr:
            return Verdict(False, R.NO_MGMT_ADDR, "node record has no mgmt_addr")
        if node.record.addr_problem:
            return Verdict(False, R.ADDR_PROBLEM, node.record.addr_problem)
        return OK


class LeaseReady:
    """A node whose heartbeats are in doubt gets nothing new (suspect is not failure, but not trust either)."""

    name = "lease_ready"
    static = True

    def check(self, node: NodeView, request: Request, view: ClusterView) -> Verdict:
        if node.lease is None:
            return Verdict(False, R.NO_LEASE, "no lease yet")
        if node.lease != LeaseState.READY:
            return Verdict(False, R.LEASE_NOT_READY, f"lease is {node.lease}")
        if node.quarantine:
            return Verdict(False, R.QUARANTINED, node.quarantine)
        if node.suspect:
            return Verdict(False, R.PEER_LOST_SUSPECT, node.suspect)
        return OK


class Schedulable:
    """Cordoned and draining nodes keep what they run but take nothing new."""

    name = "schedulable"
    static = True

    def check(self, node: NodeView, request: Request, view: ClusterView) -> Verdict:
        if node.admin == AdminState.CORDONED:
            rec = node.record
            if rec is not None and rec.admin_by == AdminBy.AUTO:
                return Verdict(False, R.CORDONED, f"cordoned automatically: {rec.admin_reason or 'repeated replica failures'}")
            why = f": {rec.admin_reason}" if rec is not None and rec.admin_reason else ""
            return Verdict(False, R.CORDONED, f"cordoned by an operator{why}")
        if node.admin == AdminState.DRAINING:
            rec = node.record
            return Verdict(False, R.DRAINING, f"draining: {rec.admin_reason}" if rec is not None and rec.admin_reason else "draining")
        return OK


class FabricFit:
    """A multi-node replica needs a usable fabric on every member; NCCL across fabrics hangs."""

    name = "fabric_fit"
    static = True

    def check(self, node: NodeView, request: Request, view: ClusterView) -> Verdict:
        if not request.multi:
            return OK
        if not node.fabrics:
            return Verdict(False, R.NO_FABRIC, "on no fabric; hosts single-node replicas only")
        if not node.usable_fabrics:
            problems = "; ".join(f"{name}: {f.problem or 'no ACTIVE HCA'}" for name, f in node.fabrics.items())
            return Verdict(False, R.FABRIC_UNUSABLE, problems)
        return OK


class GpuCapacity:
    """Enough GPUs not held by any replica that has not yet been reaped."""

    name = "gpu_capacity"
    static = False

    def check(self, node: NodeView, request: Request, view: ClusterView) -> Verdict:
        need = request.gpus_per_node
        if len(node.gpus) < need:
            return Verdict(False, R.NOT_ENOUGH_GPUS, f"has {len(node.gpus)} GPUs, needs {need}")
        free = node.free_gpu_count()
        if free < need:
            text = f"{free} of {len(node.gpus)} GPUs free, needs {need}"
            idle = node.idle_blocked()
            if not idle:
                return Verdict(False, R.NOT_ENOUGH_FREE_GPUS, text)
            # Healthy and unused they would fit: say which GPU keeps it out, and why.
            out = "; ".join(f"GPU {i} {node.blocked[i]}" for i in idle)
            if free + len(idle) < need:
                return Verdict(False, R.NOT_ENOUGH_FREE_GPUS, f"{text}; out of service: {out}")
            reason = R.GPU_UNHEALTHY if any(i in node.unhealthy for i in idle) else R.GPU_FOREIGN
            return Verdict(False, reason, f"{text}; out of service: {out}")
        return OK


class PortCapacity:
    """Room for a leader's rendezvous and HTTP ports.

    Checked on every member, not only the leader: conservative, but it keeps
    one index for all ranks, and a range of hundreds of ports per node is not
    what runs out first.
    """

    name = "port_capacity"
    static = False

    def check(self, node: NodeView, request: Request, view: ClusterView) -> Verdict:
        free = node.free_port_count(view.ports)
        if free < PORTS_PER_LEADER:
            return Verdict(
                False,
                R.NO_FREE_PORTS,
                f"{free} free in {view.ports.base}..{view.ports.base + view.ports.count - 1}",
            )
        return OK
