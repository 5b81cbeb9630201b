"""The incremental reconciler: ``reconcile``'s plan, for the work of what changed.

``reconcile`` builds the cluster view from every node and advances every
replica and deployment on every call: at 10,000 nodes and 4,000 replicas that
is half a second of CPU for a cycle with nothing to do. ``Reconciler.step``
takes the same arguments and returns the same plan — the property tests in
``tests/test_incremental_index.py`` hold the two equal, plan for plan, over
random histories — but keeps, between calls:

* a ``LiveView``: the ``ClusterView`` (nodes, what each holds, the spread),
  updated in place by the differences of its inputs instead of rebuilt, and
  beside it placement's memo of it (``PlacementCache``: the static filters'
  verdicts, the capacity indexes), which follows the nodes the view changed;
* what it was given last time. The shell's KV mirrors replace an entry when it
  changes, so an unchanged entry is the same object: a walk comparing
  identities finds what changed. For nodes and leases the shell names the
  keys its mirrors changed (``touched``) and only those are compared: the walk
  of 10,000 of each cost 2–5 ms a step, and while thousands of agents connect
  the scheduler steps for every few of them (60 % of its CPU at bring-up).

A step is three parts: ``changes(previous, now)``, pure, says what is
*dirty*; the cycle's phases (``cycle.run``, the very ones ``reconcile`` runs
over everything) run over the dirty replicas and deployments; ``remember``
keeps what the next step compares against. What is dirty:

* a replica is dirty when its record changed (or appeared, or went), when the
  last plan wrote or deleted it, when the record or the lease state of a node
  it holds changed, when its deployment appeared, went or changed its startup
  timeout (all ``advance`` reads of the spec), or when one of its clocks is due
  (startup timeout, hang timeout, reap timeout: ``deadline``);
* a deployment is dirty when its spec changed, when one of its replicas is
  dirty, or when it is *unsettled*: its last converge produced anything, it
  has a pending replica, or it is short of replicas (waiting for room or a
  backoff). Only an unsettled deployment places anything, so only it reads the
  capacity the others' changes move.

Why that is the full computation: ``advance`` reads a replica, whether its
deployment has a spec and that spec's startup timeout, its members' node
records and leases, and the clock; a
replica none of which changed, whose clocks are not due and which the last
plan left as it was, is advanced to itself (nothing is written). ``converge``
reads its deployment's spec and replicas, its members' admin states and —
only to place — the view; a settled deployment whose spec and replicas did not
change gives nothing. The phases are ``reconcile``'s own code (``cycle.run``),
in its order and in its order within each, so the plans are equal, events in
the same order.

Still pure: nothing is read but the arguments, the clock is ``now``, and what
is kept is a function of the arguments seen. A caller that could not apply a
plan calls ``reset`` (the next step is a full one), and the shell runs a full
step (``full=True``) every so often as a safety net: it rebuilds the view
from nothing and advances and converges everything, exactly as ``reconcile``.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from llmgw.shared.schemas import DeploymentSpec, Lease, NodeRecord, Replica
from llmgw.shared.states import HOLDING_REPLICA, LAUNCHED_REPLICA, UP_ENGINE
from llmgw.shared.states import ReplicaState as RS

from .cycle import Cycle, ReconcileConfig, Scope, run
from .placement import PlacementCache
from .plan import NodeFailure, Plan
from .spares import broken_group
from .view import LIVE, ClusterView, NodeView, PortRange, node_view

# A clock is treated as due this much early: ``now - t > timeout`` and
# ``t + timeout < now`` may round apart, and waking early only costs one look.
DEADLINE_SLACK = 1e-3


class LiveView(ClusterView):
    """A ``ClusterView`` kept current across cycles: nodes are set, replicas held
    and released, and the spread and port counts follow. Equal, at the end of
    each step, to ``ClusterView.build`` of the same nodes, leases, suspects and
    replicas, and its memo to a fresh one's with both shapes' indexes built —
    ``tests/test_incremental_index.py`` checks both.

    Placement's memo is not kept here but beside the view (``Reconciler.memo``):
    every node whose inputs or holdings change is marked ``changed``, and the
    memo follows. Its refusals need no care: every change bumps ``version``,
    which they are valid for."""

    def __init__(self, ports: PortRange):
        super().__init__({}, ports, Counter())
        self.held: dict[str, Replica] = {}  # replica id -> the record whose holdings are in the view
        self._spread_key: dict[str, tuple] = {}  # replica id -> the spread entry it counts in
        # node -> how many held members use each GPU / port: two records naming
        # one GPU (a stale leader's) must not free it when one of them goes.
        self._gpu_refs: dict[str, Counter] = {}
        self._port_refs: dict[str, Counter] = {}
        self.on_node: dict[str, set[str]] = {}  # node -> held replicas with a member there
        self._sizes: Counter = Counter()  # GPUs per node -> nodes (for ``max_gpus``)
        self._inputs: dict[str, tuple] = {}  # node -> (record, lease state, quarantine, suspect) applied

    # -- nodes ---------------------------------------------------------------

    def set_node(self, node_id: str, record: NodeRecord | None, lease: Lease | None, suspect: str) -> None:
        """The node as its record, lease and suspicion now say; what it holds stays."""
        if record is None and lease is None:
            suspect = ""  # as ClusterView.build: only a registered or leased node can be suspect
        inputs = (record, lease.state if lease else None, lease.quarantine if lease else "", suspect)
        old = self.nodes.get(node_id)
        prev = self._inputs.get(node_id, (None, None, "", ""))
        if old is not None and prev[0] is record and prev[1:] == inputs[1:]:
            return
        self.changed.add(node_id)
        old_home = old.home if old is not None else None
        if old is not None:
            self._size(len(old.gpus), -1)
        if record is None and lease is None and not self.on_node.get(node_id):
            self.nodes.pop(node_id, None)
            self._inputs.pop(node_id, None)
            self.version += 1
            return
        node = node_view(node_id, record, lease, suspect)
        node.used_gpus = set(self._gpu_refs.get(node_id, ()))
        node.used_ports = set(self._port_refs.get(node_id, ()))
        self._add_node(node)
        self._inputs[node_id] = inputs
        if node.home != old_home:  # a single-node replica counts under its leader's home
            for rid in sorted(self.on_node.get(node_id, ())):
                self._respread(rid)
        self.version += 1

    def _add_node(self, node: NodeView) -> None:
        self.nodes[node.node_id] = node
        self._size(len(node.gpus), +1)
        self.changed.add(node.node_id)

    def _size(self, gpus: int, delta: int) -> None:
        self._sizes[gpus] += delta
        if self._sizes[gpus] <= 0:
            del self._sizes[gpus]
        self.max_gpus = max(self._sizes, default=0) or 1

    # -- replicas ------------------------------------------------------------

    def set_replica(self, rid: str, replica: Replica | None) -> None:
        """What ``rid`` holds is now what ``replica`` (None: no record) holds."""
        old = self.held.get(rid)
        if old is replica and replica is not None:
            return
        if old is not None and replica is not None and replica.state in HOLDING_REPLICA and _holdings(old) == _holdings(replica):
            # A new state or engine report, the same GPUs and ports: only the spread may move.
            self.held[rid] = replica
            key = self._spread_key.get(rid)
            self._respread(rid)
            if self._spread_key.get(rid) != key:
                self.version += 1
            return
        if rid in self.held:
            self._release(rid)
        if replica is not None and replica.state in HOLDING_REPLICA:
            self._hold(replica)

    def commit(self, replica: Replica) -> None:
        """Reserve a replica placed this cycle (``ClusterView.commit``)."""
        self.set_replica(replica.id, replica)

    def _hold(self, replica: Replica) -> None:
        rid = replica.id
        self.held[rid] = replica
        for m in replica.members:
            nid = m.node_id
            self.on_node.setdefault(nid, set()).add(rid)
            if nid not in self.nodes:  # neither record nor lease: it still holds what it holds
                self._add_node(NodeView(nid, None, None, (), {}))
            self.changed.add(nid)
            node = self.nodes[nid]
            ports = [p for p in (m.rendezvous_port, m.http_port) if p]
            self._gpu_refs.setdefault(nid, Counter()).update(m.gpus)
            self._port_refs.setdefault(nid, Counter()).update(ports)
            node.used_gpus.update(m.gpus)
            node.used_ports.update(ports)
            if self.ports.shared_by_nodes:
                self.host_ports.update(ports)
        self._respread(rid)
        self.version += 1

    def _release(self, rid: str) -> None:
        replica = self.held.pop(rid)
        key = self._spread_key.pop(rid, None)
        if key is not None:
            self._unspread(key)
        for m in replica.members:
            nid = m.node_id
            self.changed.add(nid)
            node = self.nodes[nid]
            gpus, ports = self._gpu_refs[nid], self._port_refs[nid]
            gpus.subtract(m.gpus)
            ports.subtract(p for p in (m.rendezvous_port, m.http_port) if p)
            if self.ports.shared_by_nodes:
                self.host_ports.subtract(p for p in (m.rendezvous_port, m.http_port) if p)
                for k in [k for k, c in self.host_ports.items() if c <= 0]:
                    del self.host_ports[k]
            for refs, used in ((gpus, node.used_gpus), (ports, node.used_ports)):
                for k in [k for k, c in refs.items() if c <= 0]:
                    del refs[k]
                    used.discard(k)
            on = self.on_node.get(nid)
            if on is not None:
                on.discard(rid)
                if not on:
                    del self.on_node[nid]
            if not self.on_node.get(nid) and node.record is None and node.lease is None:
                self._forget_node(nid)
        self.version += 1

    def _forget_node(self, nid: str) -> None:
        """A node with neither record nor lease that no longer holds anything."""
        node = self.nodes.pop(nid)
        self._size(len(node.gpus), -1)
        self._inputs.pop(nid, None)
        self._gpu_refs.pop(nid, None)
        self._port_refs.pop(nid, None)

    def _respread(self, rid: str) -> None:
        replica = self.held.get(rid)
        old = self._spread_key.pop(rid, None)
        if old is not None:
            self._unspread(old)
        if replica is not None and replica.state in LIVE and replica.members:
            key = (replica.deployment, self.group_of(replica))
            self.spread[key] += 1
            self._spread_key[rid] = key

    def _unspread(self, key: tuple) -> None:
        self.spread[key] -= 1
        if self.spread[key] <= 0:
            del self.spread[key]


def _holdings(replica: Replica) -> list[tuple]:
    return [(m.node_id, m.gpus, m.rendezvous_port, m.http_port) for m in replica.members]


def deadline(replica: Replica, spec: DeploymentSpec | None, config: ReconcileConfig) -> float | None:
    """When ``advance`` would next act on ``replica`` if nothing else changed (None: never)."""
    if replica.state in LAUNCHED_REPLICA and replica.members and spec is not None and replica.members[0].engine_state not in UP_ENGINE:
        return replica.created_at + spec.startup_timeout
    if replica.state == RS.DEGRADED:
        return replica.since + (config.peer_lost_grace if broken_group(replica) else config.hang_timeout)
    if replica.state in (RS.REAPING, RS.RESTARTING):
        return replica.since + config.reap_timeout
    return None


# --------------------------------------------------------------------------
# What changed: the previous step's inputs against this one's
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Inputs:
    """One step's arguments (``Reconciler.step``)."""

    deployments: Mapping[str, DeploymentSpec]
    replicas: Mapping[str, Replica]
    nodes: Mapping[str, NodeRecord]
    leases: Mapping[str, Lease]
    now: float
    # The nodes whose record or lease may have changed (a superset will do); None: any.
    touched: Collection[str] | None = None


@dataclass
class Seen:
    """What a reconciler keeps of its previous step (``remember``): what ``changes`` compares against."""

    on_node: Mapping[str, set[str]]  # the live view's: node -> held replicas with a member there
    nodes: dict[str, NodeRecord] = field(default_factory=dict)  # as given last step
    leases: dict[str, tuple] = field(default_factory=dict)  # node -> (state, quarantine) as given last step
    lease_objs: dict[str, Lease] = field(default_factory=dict)  # and the leases themselves (a renewal is a new one)
    replicas: dict[str, Replica] = field(default_factory=dict)
    deployments: dict[str, DeploymentSpec] = field(default_factory=dict)
    # deployment -> its replicas, and back: the index of the records as given
    groups: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    dep_of: dict[str, str] = field(default_factory=dict)
    carry: set[str] = field(default_factory=set)  # written or deleted by the last plan
    unsettled: set[str] = field(default_factory=set)  # deployments ``cycle.run`` left unsettled
    deadlines: list[tuple[float, str]] = field(default_factory=list)  # a heap of (when, replica id)
    deadline_of: dict[str, float] = field(default_factory=dict)  # replica id -> its clock's entry in the heap
    effective: set[str] = field(default_factory=set)  # nodes the last step auto-cordoned (their record here differs from the input's)
    suspects: dict[str, str] = field(default_factory=dict)  # the peer-lost suspects the last step placed around


@dataclass(frozen=True)
class Dirty:
    """What a step looks at: what ``changes`` found, or everything."""

    replicas: set[str]  # advanced (ids of records that are, or were, among the inputs)
    deployments: set[str]  # converged
    nodes: set[str]  # whose record or lease changed: the view redoes them
    joining: Mapping[str, set[str]]  # deployment -> the dirty replicas whose record (now) is of it
    due: list[tuple[float, str]] = field(default_factory=list)  # deadline entries come due (``remember`` retires them)
    everything: bool = False


def everything(now: Inputs) -> Dirty:
    """A full step: every replica, deployment and node is dirty."""
    joining: dict[str, set[str]] = defaultdict(set)
    for rid, replica in now.replicas.items():
        joining[replica.deployment].add(rid)
    return Dirty(set(now.replicas), set(now.deployments) | set(joining), set(now.nodes) | set(now.leases), joining, everything=True)


def changes(previous: Seen, now: Inputs) -> Dirty:
    """What is dirty since ``previous`` (the module docstring says why that is
    all a step must look at). Pure: reads both, changes neither."""
    nodes = changed_nodes(previous, now)
    replicas = {rid for rid, r in now.replicas.items() if previous.replicas.get(rid) is not r}
    replicas.update(rid for rid in previous.replicas if rid not in now.replicas)
    replicas |= previous.carry
    for n in nodes:
        replicas.update(previous.on_node.get(n, ()))
    deployments = {d for d, spec in now.deployments.items() if previous.deployments.get(d) is not spec}
    deployments.update(d for d in previous.deployments if d not in now.deployments)
    for d in deployments:
        # Of its replica's spec ``advance`` reads only whether there is one
        # and its startup timeout. The scheduler's own writes of a spec (a
        # new generation counter, a backoff) change neither, and dirtying
        # 4,000 replicas for them cost ~100 ms a step; converge, which reads
        # all of the spec, runs for the deployment either way.
        was, spec_now = previous.deployments.get(d), now.deployments.get(d)
        if was is None or spec_now is None or was.startup_timeout != spec_now.startup_timeout:
            replicas.update(previous.groups.get(d, ()))
    due = due_deadlines(previous.deadlines, now.now + DEADLINE_SLACK)
    replicas.update(rid for at, rid in due if previous.deadline_of.get(rid) == at)
    deployments |= previous.unsettled
    # A dirty replica's deployment, before and now, is looked at too.
    joining: dict[str, set[str]] = defaultdict(set)
    for rid in replicas:
        old_dep, new = previous.dep_of.get(rid), now.replicas.get(rid)
        if old_dep is not None:
            deployments.add(old_dep)
        if new is not None:
            deployments.add(new.deployment)
            joining[new.deployment].add(rid)
    return Dirty(replicas, deployments, nodes, joining, due)


def changed_nodes(previous: Seen, now: Inputs) -> set[str]:
    """The nodes whose record or lease state (or quarantine) changed; with
    ``now.touched``, only those are compared (the identity walk of every node
    was most of a step's cost at 10,000 nodes)."""
    if now.touched is None:
        changed = {n for n, rec in now.nodes.items() if previous.nodes.get(n) is not rec}
        changed.update(n for n in previous.nodes if n not in now.nodes)
        changed.update(n for n, lease in now.leases.items() if _lease_changed(previous, n, lease))
        changed.update(n for n in previous.leases if n not in now.leases)
        return changed
    changed = set()
    for n in now.touched:
        lease = now.leases.get(n)
        if previous.nodes.get(n) is not now.nodes.get(n) or (n in previous.leases if lease is None else _lease_changed(previous, n, lease)):
            changed.add(n)
    return changed


def _lease_changed(previous: Seen, node: str, lease: Lease) -> bool:
    """A new lease object whose state or quarantine differs (a renewal alone is no change)."""
    return previous.lease_objs.get(node) is not lease and previous.leases.get(node) != (lease.state, lease.quarantine)


def due_deadlines(heap: list[tuple[float, str]], at: float) -> list[tuple[float, str]]:
    """The entries of a heap of (time, id) at or before ``at``, without popping
    them: a walk of the heap's tree that stops below any later entry."""
    out: list[tuple[float, str]] = []
    stack = [0] if heap else []
    while stack:
        i = stack.pop()
        if heap[i][0] <= at:
            out.append(heap[i])
            stack.extend(c for c in (2 * i + 1, 2 * i + 2) if c < len(heap))
    return out


# --------------------------------------------------------------------------
# The reconciler
# --------------------------------------------------------------------------


class Reconciler:
    """``reconcile`` with memory: ``step`` returns what ``reconcile`` would, for
    work proportional to what changed since the previous step (module docstring)."""

    def __init__(self, config: ReconcileConfig | None = None):
        self.config = config or ReconcileConfig()
        self.reset()

    def reset(self) -> None:
        """Forget everything: the next step is a full one (a plan was not applied)."""
        self.view = LiveView(self.config.ports)
        self.memo = PlacementCache.built()  # placement's memo of the view, beside it
        self.seen = Seen(on_node=self.view.on_node)
        self.fresh = True
        # What the last step did, for metrics and logs.
        self.advanced = 0
        self.converged = 0

    def step(
        self,
        deployments: Mapping[str, DeploymentSpec],
        replicas: Mapping[str, Replica],
        nodes: Mapping[str, NodeRecord],
        leases: Mapping[str, Lease],
        now: float,
        *,
        failures: Mapping[str, Sequence[NodeFailure]] | None = None,
        full: bool = False,
        touched: Collection[str] | None = None,
    ) -> Plan:
        """``reconcile``'s plan for these inputs. ``touched``: the nodes whose record or
        lease may have changed since the previous step (a superset will do): only
        those are compared. None compares every node, the identity walk; the shell
        passes what its mirrors told it, since at 10,000 nodes the walk was most
        of a step's cost while thousands of agents came and went."""
        if full:
            self.reset()
        inputs = Inputs(deployments, replicas, nodes, leases, now, touched)
        dirty = everything(inputs) if self.fresh else changes(self.seen, inputs)
        cycle = Cycle(deployments, replicas, nodes, leases, now, self.config)
        unsettled = run(cycle, Scope(dirty.replicas, dirty.deployments, _Members(self.seen.groups, dirty).of), failures or {}, self._sight(dirty))
        self.remember(inputs, dirty, cycle, unsettled)
        return cycle.plan

    def _sight(self, dirty: Dirty):
        """The view phase of a step: the live view brought up to the cycle's nodes
        and replicas — only those that may have changed — and its memo."""

        def see(cycle: Cycle, suspects: Mapping[str, str]) -> tuple[ClusterView, PlacementCache]:
            view, seen = self.view, self.seen
            if dirty.everything:
                touch = sorted(dirty.nodes)
            else:
                effective = {c.node_id for c in cycle.plan.cordons}
                touch = sorted(dirty.nodes | effective | seen.effective | set(suspects) | set(seen.suspects))
            for n in touch:
                view.set_node(n, cycle.nodes.get(n), cycle.leases.get(n), suspects.get(n, ""))
            for rid in sorted(dirty.replicas):
                view.set_replica(rid, cycle.replicas.get(rid))
            return view, self.memo

        return see

    def remember(self, now: Inputs, dirty: Dirty, cycle: Cycle, unsettled: set[str]) -> None:
        """What the next step compares against: the view as the plan leaves it (the
        next full build's, once applied), the clocks, and the inputs as given."""
        plan, seen = cycle.plan, self.seen
        for rid in sorted(plan.writes.keys() | set(plan.deletes)):
            self.view.set_replica(rid, cycle.replicas.get(rid))
        self.memo.follow(self.view)
        for at, rid in dirty.due:
            if seen.deadline_of.get(rid) == at:
                del seen.deadline_of[rid]
        for _ in dirty.due:
            heapq.heappop(seen.deadlines)
        for rid in dirty.replicas | plan.writes.keys():
            self._track_deadline(rid, cycle.replicas.get(rid), now.deployments)
        self.advanced = sum(1 for rid in dirty.replicas if rid in now.replicas)
        self.converged = len(dirty.deployments)
        seen.carry = set(plan.writes) | set(plan.deletes)
        seen.unsettled = unsettled
        seen.replicas = dict(now.replicas)
        seen.deployments = dict(now.deployments)
        self._regroup(dirty, now.replicas)
        self._remember_nodes(now, dirty)
        seen.effective = {c.node_id for c in plan.cordons}
        seen.suspects = cycle.suspects
        self.fresh = False

    def _regroup(self, dirty: Dirty, replicas: Mapping[str, Replica]) -> None:
        """The deployment index follows the records as given."""
        groups, dep_of = self.seen.groups, self.seen.dep_of
        for rid in dirty.replicas:
            old_dep, new = dep_of.get(rid), replicas.get(rid)
            if old_dep is not None and (new is None or new.deployment != old_dep):
                groups[old_dep].discard(rid)
                if not groups[old_dep]:
                    del groups[old_dep]
                del dep_of[rid]
            if new is not None:
                groups[new.deployment].add(rid)
                dep_of[rid] = new.deployment

    def _remember_nodes(self, now: Inputs, dirty: Dirty) -> None:
        seen = self.seen
        if now.touched is None or dirty.everything:
            seen.nodes = dict(now.nodes)
            seen.lease_objs = dict(now.leases)
        else:
            for n in now.touched:
                _keep(seen.nodes, n, now.nodes.get(n))
                _keep(seen.lease_objs, n, now.leases.get(n))
        if dirty.everything:
            seen.leases = {n: (lease.state, lease.quarantine) for n, lease in now.leases.items()}
            return
        for n in dirty.nodes:
            lease = now.leases.get(n)
            _keep(seen.leases, n, (lease.state, lease.quarantine) if lease is not None else None)

    @property
    def suspects(self) -> dict[str, str]:
        """The peer-lost suspects the last step placed around (node -> why)."""
        return self.seen.suspects

    def _track_deadline(self, rid: str, replica: Replica | None, deployments: Mapping[str, DeploymentSpec]) -> None:
        seen = self.seen
        at = deadline(replica, deployments.get(replica.deployment), self.config) if replica is not None else None
        if at is None:
            seen.deadline_of.pop(rid, None)
        elif seen.deadline_of.get(rid) != at:
            seen.deadline_of[rid] = at
            heapq.heappush(seen.deadlines, (at, rid))


class _Members:
    """Each deployment's replicas among this step's inputs, for the phases, before
    the index is brought up to them: the index's ids whose records did not
    change, and the dirty ones whose records now name the deployment."""

    def __init__(self, groups: Mapping[str, set[str]], dirty: Dirty):
        self.groups, self.dirty = groups, dirty

    def of(self, name: str) -> list[str]:
        moved = self.dirty.replicas
        return [rid for rid in self.groups.get(name, ()) if rid not in moved] + list(self.dirty.joining.get(name, ()))


def _keep(store: dict, key: str, value) -> None:
    """``store[key] = value``, or no entry when ``value`` is None."""
    if value is None:
        store.pop(key, None)
    else:
        store[key] = value
