"""The incremental reconciler: ``reconcile``'s plan, for the work of what changed.

``reconcile`` builds the cluster view from every node and advances every
replica and deployment on every call: at 10,000 nodes and 4,000 replicas that
is half a second of CPU for a cycle with nothing to do. ``Reconciler.step``
takes the same arguments and returns the same plan — the property tests in
``tests/test_incremental_index.py`` hold the two equal, plan for plan, over
random histories — but keeps, between calls:

* a ``LiveView``: the ``ClusterView`` (nodes, what each holds, the spread)
  with placement's memo of it (``PlacementCache``: the static filters'
  verdicts, the capacity indexes), updated in place by the differences of its
  inputs instead of rebuilt;
* what it was given last time. The shell's KV mirrors replace an entry when it
  changes, so an unchanged entry is the same object: a walk comparing
  identities finds what changed. For nodes and leases the shell names the
  keys its mirrors changed (``touched``) and only those are compared: the walk
  of 10,000 of each cost 2–5 ms a step, and while thousands of agents connect
  the scheduler steps for every few of them (60 % of its CPU at bring-up).

A step advances only the *dirty* replicas and converges only the *dirty*
deployments:

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
change gives nothing. Phase order, and the order within each phase, are the
full pass's, so the plans are equal, events in the same order.

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

from llmgw.shared.schemas import DeploymentSpec, Lease, NodeRecord, Replica
from llmgw.shared.states import ReplicaState as RS

from .filters import Request
from .placement import PlacementCache, static_verdict
from .plan import NodeFailure, Plan
from .reconcile import _LEADER_UP, _STARTING, ReconcileConfig, _Cycle, advance_order, replica_order
from .view import HOLDS_RESOURCES, LIVE, ClusterView, NodeView, PortRange, node_view

# The shapes the static filters tell apart (``_indexes`` in placement.py).
SHAPES = {False: Request("", 0, 1), True: Request("", 0, 2)}
# A clock is treated as due this much early: ``now - t > timeout`` and
# ``t + timeout < now`` may round apart, and waking early only costs one look.
DEADLINE_SLACK = 1e-3


class LiveView(ClusterView):
    """A ``ClusterView`` kept current across cycles: nodes are set, replicas held
    and released, and every index follows. Equal, at the end of each step, to
    ``ClusterView.build`` of the same nodes, leases, suspects and replicas (with
    both shapes' indexes built) — ``tests/test_incremental_index.py`` checks it.

    Placement's memo is kept here too, since the view changes in ways
    ``commit`` alone does not: both shapes' static verdicts and indexes from
    the start, each node's redone when it changes. Its refusals need no care:
    every change bumps ``version``, which they are valid for."""

    placement: PlacementCache

    def __init__(self, ports: PortRange):
        super().__init__({}, ports, Counter())
        self.placement = PlacementCache(indexes={False: {}, True: {}})
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
        self._unindex(node_id)
        old_home = old.home if old is not None else None
        if old is not None:
            self._size(len(old.gpus), -1)
        if record is None and lease is None and not self.on_node.get(node_id):
            self.nodes.pop(node_id, None)
            self._inputs.pop(node_id, None)
            self._forget_verdicts(node_id)
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
        self._forget_verdicts(node.node_id)
        for shape in SHAPES.values():
            static_verdict(node, shape, self)
        self._index(node.node_id)

    def _forget_verdicts(self, node_id: str) -> None:
        for multi in SHAPES:
            self.placement.static.pop((node_id, multi), None)

    def _size(self, gpus: int, delta: int) -> None:
        self._sizes[gpus] += delta
        if self._sizes[gpus] <= 0:
            del self._sizes[gpus]
        self.max_gpus = max(self._sizes, default=0) or 1

    def _index(self, node_id: str) -> None:
        for multi in SHAPES:
            if self.placement.indexed(node_id, multi):
                self.placement.index_add(self, multi, node_id)

    def _unindex(self, node_id: str) -> None:
        node = self.nodes.get(node_id)
        if node is None:
            return
        key = self.index_key(node_id)
        if key is None:
            return
        indexes = self.placement.indexes
        for multi in SHAPES:
            if not self.placement.indexed(node_id, multi):
                continue
            for group in self.groups(node, multi):
                index = indexes[multi][group]
                index.remove(node_id, key, len(node.gpus))
                if not index.buckets:
                    del indexes[multi][group]

    # -- replicas ------------------------------------------------------------

    def set_replica(self, rid: str, replica: Replica | None) -> None:
        """What ``rid`` holds is now what ``replica`` (None: no record) holds."""
        old = self.held.get(rid)
        if old is replica and replica is not None:
            return
        if old is not None and replica is not None and replica.state in HOLDS_RESOURCES and _holdings(old) == _holdings(replica):
            # A new state or engine report, the same GPUs and ports: only the spread may move.
            self.held[rid] = replica
            key = self._spread_key.get(rid)
            self._respread(rid)
            if self._spread_key.get(rid) != key:
                self.version += 1
            return
        if rid in self.held:
            self._release(rid)
        if replica is not None and replica.state in HOLDS_RESOURCES:
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
            self._unindex(nid)
            node = self.nodes[nid]
            ports = [p for p in (m.rendezvous_port, m.http_port) if p]
            self._gpu_refs.setdefault(nid, Counter()).update(m.gpus)
            self._port_refs.setdefault(nid, Counter()).update(ports)
            node.used_gpus.update(m.gpus)
            node.used_ports.update(ports)
            if self.ports.shared_by_nodes:
                self.host_ports.update(ports)
            self._index(nid)
        self._respread(rid)
        self.version += 1

    def _release(self, rid: str) -> None:
        replica = self.held.pop(rid)
        key = self._spread_key.pop(rid, None)
        if key is not None:
            self._unspread(key)
        for m in replica.members:
            nid = m.node_id
            self._unindex(nid)
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
            self._index(nid)
            if not self.on_node.get(nid) and node.record is None and node.lease is None:
                self._forget_node(nid)
        self.version += 1

    def _forget_node(self, nid: str) -> None:
        """A node with neither record nor lease that no longer holds anything."""
        node = self.nodes.pop(nid)
        self._size(len(node.gpus), -1)
        self._inputs.pop(nid, None)
        self._forget_verdicts(nid)
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
    if replica.state in _STARTING and replica.members and spec is not None and replica.members[0].engine_state not in _LEADER_UP:
        return replica.created_at + spec.startup_timeout
    if replica.state == RS.DEGRADED:
        return replica.since + config.hang_timeout
    if replica.state == RS.REAPING:
        return replica.since + config.reap_timeout
    return None


class Reconciler:
    """``reconcile`` with memory: ``step`` returns what ``reconcile`` would, for
    work proportional to what changed since the previous step (module docstring)."""

    def __init__(self, config: ReconcileConfig | None = None):
        self.config = config or ReconcileConfig()
        self.reset()

    def reset(self) -> None:
        """Forget everything: the next step is a full one (a plan was not applied)."""
        self.view = LiveView(self.config.ports)
        self._nodes: dict[str, NodeRecord] = {}  # as given last step
        self._leases: dict[str, tuple] = {}  # node -> (state, quarantine) as given last step
        self._lease_objs: dict[str, Lease] = {}  # and the leases themselves (a renewal is a new one)
        self._replicas: dict[str, Replica] = {}
        self._deployments: dict[str, DeploymentSpec] = {}
        # deployment -> its replicas, and back: the index of the records as given
        self._by_deployment: dict[str, set[str]] = defaultdict(set)
        self._dep_of: dict[str, str] = {}
        self._effective: set[str] = set()  # nodes this step auto-cordoned (their record here differs from the input's)
        self._suspects: dict[str, str] = {}
        self._carry_replicas: set[str] = set()  # written or deleted by the last plan
        self._unsettled: set[str] = set()
        self._deadlines: list[tuple[float, str]] = []
        self._deadline_of: dict[str, float] = {}
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
        full = self.fresh
        cfg = self.config
        view = self.view
        # -- what changed ------------------------------------------------------
        if full:
            dirty_reps = set(replicas)
            dirty_deps = set(deployments)
            changed_nodes = set(nodes) | set(leases)
        else:
            dirty_reps = {rid for rid, r in replicas.items() if self._replicas.get(rid) is not r}
            dirty_reps.update(rid for rid in self._replicas if rid not in replicas)
            dirty_reps |= self._carry_replicas
            seen = self._lease_objs
            if touched is None:
                changed_nodes = {n for n, rec in nodes.items() if self._nodes.get(n) is not rec}
                changed_nodes.update(n for n in self._nodes if n not in nodes)
                for n, lease in leases.items():
                    if seen.get(n) is not lease and self._leases.get(n) != (lease.state, lease.quarantine):
                        changed_nodes.add(n)
                changed_nodes.update(n for n in self._leases if n not in leases)
            else:
                # The same comparisons, for the touched nodes only.
                changed_nodes = set()
                for n in touched:
                    now_lease = leases.get(n)
                    if self._nodes.get(n) is not nodes.get(n):
                        changed_nodes.add(n)
                    elif now_lease is None:
                        if n in self._leases:
                            changed_nodes.add(n)
                    elif seen.get(n) is not now_lease and self._leases.get(n) != (now_lease.state, now_lease.quarantine):
                        changed_nodes.add(n)
            for n in changed_nodes:
                dirty_reps.update(view.on_node.get(n, ()))
            dirty_deps = {d for d, spec in deployments.items() if self._deployments.get(d) is not spec}
            dirty_deps.update(d for d in self._deployments if d not in deployments)
            for d in dirty_deps:
                # Of its replica's spec ``advance`` reads only whether there is one
                # and its startup timeout. The scheduler's own writes of a spec (a
                # new generation counter, a backoff) change neither, and dirtying
                # 4,000 replicas for them cost ~100 ms a step; converge, which reads
                # all of the spec, runs for the deployment either way.
                was, spec_now = self._deployments.get(d), deployments.get(d)
                if was is None or spec_now is None or was.startup_timeout != spec_now.startup_timeout:
                    dirty_reps.update(self._by_deployment.get(d, ()))
            while self._deadlines and self._deadlines[0][0] <= now + DEADLINE_SLACK:
                at, rid = heapq.heappop(self._deadlines)
                if self._deadline_of.get(rid) == at:
                    del self._deadline_of[rid]
                    dirty_reps.add(rid)
            dirty_deps |= self._unsettled
        # The deployment index follows the records as given.
        for rid in dirty_reps:
            old_dep, new = self._dep_of.get(rid), replicas.get(rid)
            if old_dep is not None:
                dirty_deps.add(old_dep)
                if new is None or new.deployment != old_dep:
                    self._by_deployment[old_dep].discard(rid)
                    if not self._by_deployment[old_dep]:
                        del self._by_deployment[old_dep]
                    del self._dep_of[rid]
            if new is not None:
                dirty_deps.add(new.deployment)
                self._by_deployment[new.deployment].add(rid)
                self._dep_of[rid] = new.deployment

        cycle = _Cycle(deployments, replicas, nodes, leases, now, cfg)
        cycle.view = view
        # -- phase 1: the dirty replicas' own facts ----------------------------
        advancing = sorted((replicas[rid] for rid in dirty_reps if rid in replicas), key=advance_order)
        for replica in advancing:
            cycle.advance(replica)
        # -- phase 2: nodes (auto-cordon) and peer-lost suspects ---------------
        cycle.judge_nodes(failures or {})
        suspects = cycle.peer_lost_suspects(failures or {})
        # -- the view: nodes whose inputs changed, then what replicas hold -----
        effective = {c.node_id for c in cycle.plan.cordons}
        if full:
            touch = sorted(set(nodes) | set(leases))
        else:
            touch = sorted(changed_nodes | effective | self._effective | set(suspects) | set(self._suspects))
        for n in touch:
            view.set_node(n, cycle.nodes.get(n), leases.get(n), suspects.get(n, ""))
        for rid in sorted(dirty_reps):
            view.set_replica(rid, cycle.replicas.get(rid))
        # -- phase 3: the dirty deployments, by name ---------------------------
        unsettled: set[str] = set()
        plan = cycle.plan
        for name in sorted(dirty_deps):
            spec = deployments.get(name)
            mine = sorted((cycle.replicas[r] for r in self._by_deployment.get(name, ()) if r in cycle.replicas), key=replica_order)
            if spec is None and not mine:
                continue
            before = (len(plan.writes), len(plan.deletes), len(plan.events), len(plan.launches), len(plan.stops))
            cycle.converge(name, spec, mine)
            after = (len(plan.writes), len(plan.deletes), len(plan.events), len(plan.launches), len(plan.stops))
            if after != before or name in plan.pending or name in plan.backoffs or any(r.state == RS.PENDING for r in mine):
                unsettled.add(name)
        # -- what the next step compares against -------------------------------
        # The view as the plan leaves it: the next full build's, once applied.
        for rid in sorted(plan.writes.keys() | set(plan.deletes)):
            view.set_replica(rid, cycle.replicas.get(rid))
        for rid in dirty_reps | plan.writes.keys():
            self._track_deadline(rid, cycle.replicas.get(rid), deployments)
        self.advanced, self.converged = len(advancing), len(dirty_deps)
        self._carry_replicas = set(plan.writes) | set(plan.deletes)
        self._unsettled = unsettled
        self._replicas = dict(replicas)
        if touched is None or full:
            self._nodes = dict(nodes)
            self._lease_objs = dict(leases)
        else:
            for n in touched:
                rec, now_lease = nodes.get(n), leases.get(n)
                if rec is None:
                    self._nodes.pop(n, None)
                else:
                    self._nodes[n] = rec
                if now_lease is None:
                    self._lease_objs.pop(n, None)
                else:
                    self._lease_objs[n] = now_lease
        if full:
            self._leases = {n: (lease.state, lease.quarantine) for n, lease in leases.items()}
        else:
            for n in changed_nodes:
                now_held = leases.get(n)
                if now_held is not None:
                    self._leases[n] = (now_held.state, now_held.quarantine)
                else:
                    self._leases.pop(n, None)
        self._deployments = dict(deployments)
        self._effective = effective
        self._suspects = suspects
        self.fresh = False
        return plan

    @property
    def suspects(self) -> dict[str, str]:
        """The peer-lost suspects the last step placed around (node -> why)."""
        return self._suspects

    def _track_deadline(self, rid: str, replica: Replica | None, deployments: Mapping[str, DeploymentSpec]) -> None:
        at = deadline(replica, deployments.get(replica.deployment), self.config) if replica is not None else None
        if at is None:
            self._deadline_of.pop(rid, None)
        elif self._deadline_of.get(rid) != at:
            self._deadline_of[rid] = at
            heapq.heappush(self._deadlines, (at, rid))
