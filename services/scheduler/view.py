"""The cluster as one scheduling cycle sees it (a Kubernetes ``CycleState``).

Built once per cycle from node records, leases and replicas, then updated in
place as the cycle places replicas (``commit``), so filters and scorers read
precomputed facts instead of walking every replica for every node.

The view holds the cluster's state; what placement memoises about it (static
verdicts, capacity indexes, refusals) is placement's own ``PlacementCache``,
kept beside the view by the cycle. The view knows nothing of it: it marks the
nodes whose inputs or holdings change (``changed``), and the memo follows them.

Capacity only ever shrinks during a cycle: nothing is freed here. Replicas are
freed by being deleted (``gone``) before the view is built. That monotonicity
is what lets placement cache a failure until the next commit.
"""

from __future__ import annotations

import bisect
import functools
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from llmgw.shared.errors import ConfigError
from llmgw.shared.readmodel import gpu_blocks  # the operator tools read the same facts
from llmgw.shared.schemas import FabricMembership, Lease, NodeRecord, Replica
from llmgw.shared.states import ACTIVE_REPLICA, HOLDING_REPLICA, AdminState, ReplicaState

# Replicas that count for spreading: the ones meant to keep serving.
LIVE = ACTIVE_REPLICA | {ReplicaState.RESTARTING}  # comes back on what it holds
# A leader binds a rendezvous port and an HTTP port; workers bind none.
PORTS_PER_LEADER = 2


@dataclass(frozen=True)
class PortRange:
    """The ports the scheduler hands out on every node, ``base`` … ``base+count-1``."""

    base: int = 20000
    count: int = 1000
    # Every node is one host (``llmgw up``'s simulated nodes share one machine):
    # a port held on any node is not handed out on another. Real engines bind
    # some ports on every address of their host — vLLM's rendezvous (torch's
    # TCPStore) listens on ``*:master_port`` — so two "nodes" of one machine
    # given the same port collide, and the second launch is refused port_busy.
    shared_by_nodes: bool = False

    def __post_init__(self) -> None:
        if self.count < PORTS_PER_LEADER:
            raise ConfigError(f"port range needs at least {PORTS_PER_LEADER} ports, got count={self.count}")
        if self.base < 1 or self.base + self.count - 1 > 65535:
            raise ConfigError(f"port range {self.base}..{self.base + self.count - 1} is outside 1..65535; choose a base and count that fit")

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.base <= port < self.base + self.count


@dataclass(eq=False)
class NodeView:
    """One node, with what this cycle knows it has and has given away."""

    node_id: str
    record: NodeRecord | None
    lease: str | None  # lease state, None when there is no lease
    gpus: tuple[int, ...]  # GPU indices the inventory lists, ascending
    fabrics: dict[str, FabricMembership]  # configured fabrics by name
    used_gpus: set[int] = field(default_factory=set)
    used_ports: set[int] = field(default_factory=set)
    # GPUs the agent reports out of service (docs/hardware.md), index -> why: unhealthy
    # (XID, ECC, lost) or busy with a process llmgw did not start. Never free.
    blocked: dict[int, str] = field(default_factory=dict)
    unhealthy: frozenset[int] = frozenset()
    quarantine: str = ""  # the lease's: two agents answer for this node
    # Why the node is suspect since a peer reported it lost (no heartbeat heard
    # after that); "" when it is not.
    suspect: str = ""

    @property
    def admin(self) -> str:
        return self.record.admin if self.record is not None else AdminState.ACTIVE

    @property
    def mgmt_addr(self) -> str:
        return self.record.mgmt_addr if self.record is not None else ""

    @functools.cached_property
    def usable_fabrics(self) -> tuple[str, ...]:
        # Asked for every node by every filter and index update; ``fabrics`` never
        # changes once the view is made (a changed record makes a new NodeView).
        return tuple(name for name, f in self.fabrics.items() if f.usable)

    @property
    def home(self) -> str | None:
        """The group a single-node replica here counts under when spreading."""
        return next(iter(self.fabrics), None)

    def free_gpus(self) -> list[int]:
        return [i for i in self.gpus if i not in self.used_gpus and i not in self.blocked]

    @functools.cached_property
    def _gpu_set(self) -> frozenset[int]:
        return frozenset(self.gpus)

    def free_gpu_count(self) -> int:
        # Set arithmetic in C: placement asks this for every node it indexes.
        return len(self._gpu_set.difference(self.used_gpus, self.blocked))

    def idle_blocked(self) -> list[int]:
        """Out-of-service GPUs no replica holds: what would be free if they were healthy."""
        return [i for i in sorted(self.blocked) if i not in self.used_gpus]

    def blocked_text(self) -> str:
        return "; ".join(f"GPU {i} {self.blocked[i]}" for i in sorted(self.blocked))

    def free_port_count(self, ports: PortRange) -> int:
        used = self.used_ports
        if not used:
            return ports.count
        if min(used) >= ports.base and max(used) < ports.base + ports.count:  # the usual case: all in range
            return ports.count - len(used)
        return ports.count - sum(1 for p in used if p in ports)


def node_view(node_id: str, record: NodeRecord | None, lease: Lease | None, suspect: str = "") -> NodeView:
    """A node as a cycle first sees it, holding nothing yet (``ClusterView.build``
    and the incremental ``LiveView`` both make their nodes here)."""
    return NodeView(
        node_id=node_id,
        record=record,
        lease=lease.state if lease is not None else None,
        gpus=tuple(sorted(g.index for g in record.gpus)) if record else (),
        fabrics={f.name: f for f in record.fabrics} if record else {},
        blocked=gpu_blocks(record) if record else {},
        unhealthy=frozenset(g.index for g in record.gpus if not g.healthy) if record else frozenset(),
        quarantine=lease.quarantine if lease is not None else "",
        suspect=suspect,
    )


class CapacityIndex:
    """Eligible nodes of one group (a fabric), bucketed by free GPUs.

    Placement asks "which nodes have at least g free GPUs" a thousand times a
    cycle; the buckets answer in O(max GPUs per node) instead of O(nodes). Each
    bucket keeps node ids sorted, so ties break by node id, deterministically.
    Placement's memo owns the indexes (``PlacementCache.indexes``); the class
    is defined here, under placement, because the group scorers placement
    imports take one as an argument.
    """

    __slots__ = ("buckets", "total_gpus", "used_gpus")

    def __init__(self) -> None:
        self.buckets: dict[int, list[str]] = {}
        self.total_gpus = 0
        self.used_gpus = 0

    def add(self, node_id: str, free: int, total: int) -> None:
        bisect.insort(self.buckets.setdefault(free, []), node_id)
        self.total_gpus += total
        self.used_gpus += total - free

    def remove(self, node_id: str, free: int, total: int) -> None:
        bucket = self.buckets[free]
        del bucket[bisect.bisect_left(bucket, node_id)]
        if not bucket:
            del self.buckets[free]
        self.total_gpus -= total
        self.used_gpus -= total - free

    def count_at_least(self, gpus: int) -> int:
        n = 0
        for free, bucket in self.buckets.items():
            if free >= gpus:
                n += len(bucket)
        return n

    def best_fit(self, gpus: int, n: int) -> list[str]:
        """``n`` nodes with at least ``gpus`` free, fullest first (bin-packing).

        This is what chooses a replica's nodes inside its group in production:
        fewest free GPUs first, then node id. ``scorers.NodeBinPack`` states the
        same order as a score; the property tests hold this walk to it.
        """
        chosen: list[str] = []
        for free in sorted(k for k in self.buckets if k >= gpus):
            chosen.extend(self.buckets[free][: n - len(chosen)])
            if len(chosen) == n:
                break
        return chosen


class ClusterView:
    """Nodes, what they hold, and the spread: the cluster as this cycle sees it."""

    def __init__(self, nodes: dict[str, NodeView], ports: PortRange, spread: Counter):
        self.nodes = nodes
        self.ports = ports
        # (deployment, group) -> live replicas of that deployment in that group
        self.spread = spread
        # Bumped by every change to what nodes hold or can take; placement's
        # cached refusals are valid for one version.
        self.version = 0
        # The largest node: the scale of the bin-packing oracle's node scores
        # (``scorers.NodeBinPack``), which tests hold ``best_fit`` to.
        self.max_gpus = max((len(n.gpus) for n in nodes.values()), default=0) or 1
        # Nodes whose inputs or holdings changed since placement's memo last
        # followed the view (``take_changed``).
        self.changed: set[str] = set()
        # With ``ports.shared_by_nodes``: how many held members use each port, on any node.
        self.host_ports: Counter = Counter()

    @classmethod
    def build(
        cls,
        nodes: Mapping[str, NodeRecord],
        leases: Mapping[str, Lease],
        replicas: Iterable[Replica],
        *,
        ports: PortRange | None = None,
        suspects: Mapping[str, str] | None = None,
    ) -> ClusterView:
        """``suspects``: node -> why it is suspect (``NodeView.suspect``)."""
        ports = ports or PortRange()
        suspects = suspects or {}
        views: dict[str, NodeView] = {}
        for node_id in sorted(set(nodes) | set(leases)):
            views[node_id] = node_view(node_id, nodes.get(node_id), leases.get(node_id), suspects.get(node_id, ""))
        view = cls(views, ports, Counter())
        for replica in replicas:
            if replica.state in HOLDING_REPLICA:
                view._hold(replica)
        return view

    def _node(self, node_id: str) -> NodeView:
        # A member on a node with neither record nor lease still holds what it
        # holds; keep it so a returning node does not look empty.
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeView(node_id, None, None, (), {})
        return node

    def group_of(self, replica: Replica) -> str | None:
        if replica.fabric is not None or not replica.members:
            return replica.fabric
        leader = self.nodes.get(replica.members[0].node_id)
        return leader.home if leader is not None else None

    def _hold(self, replica: Replica) -> None:
        for m in replica.members:
            node = self._node(m.node_id)
            node.used_gpus.update(m.gpus)
            ports = [p for p in (m.rendezvous_port, m.http_port) if p]
            node.used_ports.update(ports)
            if self.ports.shared_by_nodes:
                self.host_ports.update(ports)
        if replica.state in LIVE and replica.members:
            self.spread[(replica.deployment, self.group_of(replica))] += 1

    def commit(self, replica: Replica) -> None:
        """Reserve a replica placed this cycle; its nodes are marked changed."""
        self._hold(replica)
        self.changed.update(m.node_id for m in replica.members)
        self.version += 1

    def take_changed(self) -> set[str]:
        """The nodes changed since the last call (for placement's memo to follow)."""
        changed, self.changed = self.changed, set()
        return changed

    # -- what placement's capacity indexes are keyed on ----------------------

    def groups(self, node: NodeView, multi: bool) -> tuple[str | None, ...]:
        """The groups a node is indexed under: its usable fabrics, or its home."""
        return node.usable_fabrics if multi else (node.home,)

    def index_key(self, node_id: str) -> int | None:
        """Bucket of a node in the indexes (its free GPUs), None when it cannot take a leader."""
        node = self.nodes[node_id]
        if node.free_port_count(self.ports) < PORTS_PER_LEADER:
            return None
        return node.free_gpu_count()

    def free_ports(self, node: NodeView, n: int) -> list[int]:
        """The ``n`` lowest ports of the range not held on ``node`` — nor, when the
        nodes share one host's ports, on any other node.

        Which nodes can take a leader (``index_key``, the port filter) is still
        judged on each node's own ports: should the shared pool run out, the
        node's own free ports are handed out, and an agent that finds one held
        refuses the launch (port_busy) as it would on any machine.
        """
        shared = self.host_ports if self.ports.shared_by_nodes else None
        out: list[int] = []
        port = self.ports.base
        end = self.ports.base + self.ports.count
        while len(out) < n and port < end:
            if port not in node.used_ports and (shared is None or port not in shared):
                out.append(port)
            port += 1
        if len(out) < n and shared is not None:
            out = [p for p in range(self.ports.base, end) if p not in node.used_ports][:n]
        return out
