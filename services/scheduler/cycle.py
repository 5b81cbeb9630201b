"""One reconcile cycle: the phases, over a scope, and the cases they decide.

A cycle turns deployments, replicas, node records and leases — plus the time,
injected — into a ``Plan`` the shell applies. It reads nothing but its inputs
and changes none of them. Its phases run in this order (``run``):

* **status** — each replica in scope is moved along its state machine by its
  own facts (its members' nodes and engine states): cases 2, 3, 4, 8 and 11;
* **nodes** — case 10: auto-cordon of nodes implicated in repeated failures,
  before placing, so a node cordoned now takes no replacement; and the nodes a
  peer reported lost, which placement avoids (case 3);
* **view** — the cluster as placement reads it (``ClusterView``) and
  placement's memo of it (``PlacementCache``), side by side: made afresh, or
  brought up to date, by the caller's ``Sight``; a failed or reaping replica
  still holds its GPUs (a degraded one too);
* **deployments** — each deployment in scope, by name, is brought to its
  replica count: cases 5, 6, 7 and then 1, so what is removed is removed
  before what is added; case 9 (backoff) gates case 1.

The scope says which replicas and deployments the phases look at.
``reconcile.reconcile`` runs them over everything, with a view built from
nothing: the reference. ``incremental.Reconciler`` runs them over what changed
since its previous step (``incremental.changes``), with a view it keeps: the
property tests hold the two to the same plan. Nothing else differs.

The cases (after LWS' numbered case analysis):

1. A deployment has fewer wanted replicas (pending, launching,
   waiting-for-workers, ready, degraded — not on a draining node) than it
   asks for, and is not backing off (case 9):
   first its pending replicas are retried (oldest generation first; they keep
   their id and generation), then new ones are made. A new replica gets the
   next generation (``last_generation + 1``, one per replica, recorded in
   ``Plan.generations``) and id ``<deployment>-g<generation>``. Placed: state
   ``launching``, members ranked leader-first, a launch per member. Not
   placeable: state ``pending`` holding nothing, its reason the placement
   summary, and the deployment's entry in ``Plan.pending``.
2. Launching / waiting-for-workers: the shell records each member's
   ``engine_state`` (and ``engine_detail``) from agent status reports. Every
   member's engine running -> ``waiting-for-workers``; the leader's engine
   ``ready`` -> ``ready`` with ``endpoint = http://<leader mgmt_addr>:<http_port>``
   (``stalled`` -> ``degraded``, same endpoint: it came up and stopped).
3. Failure of an active replica (launching, waiting, ready or degraded) ->
   ``failed``, the reason naming the node or member: a member's node lease is
   ``lost`` or its node record is gone; a member's engine ``exited`` (or is
   ``absent`` from a full report); a member's engine ``peer-lost`` (its group
   is broken for good: failed at once, whatever the state, the agent's detail
   in the reason); before ready, ``startup_timeout`` passed since its launch
   (``created_at``); degraded for ``hang_timeout``. A ``suspect`` lease is not
   failure. A peer-lost engine still runs, so reaping stops it.
4. ``failed`` -> ``reaping`` at once: a stop for every member whose node is not
   lost and whose engine has not ended. ``reaping`` -> ``gone`` once every
   member's engine is ``exited``/``absent`` or its node is lost or gone (or
   after ``reap_timeout``; fencing stops any straggler): the record is deleted
   and its GPUs freed. The replacement comes from case 1; in the same cycle it
   can only use GPUs the failed replica does not hold, because the view is
   built with the reaping replica in it.
5. Too many wanted replicas (scale down, or the deployment was deleted): the
   extra ones are removed, pending first, then not ready, then the newest.
   A pending one goes straight to ``gone``; others go to ``reaping`` (case 4).
6. A replica with a member on a draining node is not counted as wanted, so
   case 1 places its replacement first; it is reaped once enough ready
   replicas elsewhere make up the count. Cordoned nodes take nothing new
   (placement filters) and keep what they run.
7. Rolling update: a replica made from another engine template than the
   deployment's now (``template_digest``: model, engine, shape, args, env —
   not the replica count or timeouts) is *outdated*. Not ready, it is retired
   at once (it serves nobody). Ready, it is not counted, so case 1 places its
   replacement first (surge), and it is retired once ready replicas of the new
   template make up the count, oldest first. If a replacement cannot be placed
   and nothing of the deployment is on its way up or down, one outdated
   replica is retired to make room — but only while another ready replica
   keeps serving: a deployment of one waits, pending, for room to surge.

8. Progress (gray failures): a ``ready`` replica whose leader's engine is
   ``stalled`` (the agent's canary or the gateways' traffic shows no token) ->
   ``degraded``, the event's detail the agent's words; the gateway routes only
   ``ready``. Leader ``ready`` again -> ``ready``. Degraded for
   ``hang_timeout`` -> ``failed`` (case 3). A degraded replica stays active
   and wanted: it holds its GPUs and no replacement is made while it may recover.
9. Crash-loop backoff: each replica that fails before it served (from
   launching or waiting-for-workers) adds one to its deployment's
   ``failures`` and puts the next attempt ``backoff_base · 2^(failures-1)``
   (at most ``backoff_max``) ahead in ``retry_at``; until then case 1 neither
   retries nor creates, and ``Plan.pending`` says "backing off after N
   failures: <last reason>; next attempt at HH:MM:SS". A replica of the
   deployment becoming ready clears it. Recorded on the deployment
   (``Plan.backoffs``), so a new scheduler leader keeps it.
10. Auto-cordon: every replica failure implicates nodes (``Plan.implicated``):
   a lost node, a member whose engine ended, the members that did *not* report
   a lost peer (all of them if every one did), the members not up at a startup
   timeout, every member of a replica that hung. A node active and implicated
   ``auto_cordon_after`` times within ``auto_cordon_window`` (the shell's
   history, ``failures``, plus this cycle's) is cordoned (``Plan.cordons``,
   asked of the registry) — unless that would put more than
   ``floor(auto_cordon_max_share · nodes)`` of one of its fabrics (or of the
   cluster, for a node on no fabric) auto-cordoned: the circuit breaker, which
   withholds it with a ``node`` event. Either way its history is used up
   (``Plan.settled``), so an operator's uncordon starts it afresh.
11. Hardware on a live node, from the node's inventory as its
   agent re-reads it every ``discovery.interval``: an active multi-node
   replica with a member on a node where the replica's fabric is no longer
   usable (an HCA has no ACTIVE port: its collectives will hang) is
   ``failed`` at once, not after a lease; an active replica holding a GPU its
   node reports unhealthy (XID, uncorrectable ECC, "GPU is lost") or no
   longer lists is ``failed`` at once. The reason says what the hardware
   reported. Single-node replicas on a node whose fabric went down are left
   alone. Such a failure implicates the node (case 10) but is not a crash
   loop of the deployment (case 9): the replacement is placed at once, and
   placement keeps it off the bad fabric (``fabric_unusable``) and the bad
   GPU (``gpu_unhealthy``); a GPU busy with a foreign process is not offered
   either (``gpu_foreign``), though what already runs on it is left alone.

12. Warm spares (``DeploymentSpec.spares``): a deployment counts its
   ``replicas`` serving (ready, degraded) and its ``spares`` standby, and
   places ``replicas + spares``. A replica whose leader comes up becomes
   ``ready`` while its deployment has fewer serving than ``replicas``, else
   ``standby`` (decided in converge, which sees the deployment whole). When a
   serving replica is found failed, the deployment is short in the same
   cycle, and a standby becomes ``ready`` at once (promoted, oldest first);
   case 1 then builds a new spare. Too many serving while spares are short
   (a scale-down): the newest ready becomes ``standby``. A standby whose
   leader makes no progress (the agent's canary got no token) is failed at
   once. Draining or outdated (case 7) spares are retired at once: their
   replacements are built as spares, of the new spec.
13. Spares yield: replicas that must be placed to serve are placed first, in
   every deployment, before any spare; no spare is placed in a cycle in which
   a serving replica fits nowhere. Such a serving replica takes a standby
   spare of another deployment whose members cover its shape (``spares.covers``:
   the freed members share one fabric): the spare is reaped, and the
   replica is placed on what it frees. One spare at a time.
14. Restart in place: a ready, degraded or standby replica one of whose
   engines *exited* (its agent said so), on nodes whose lease is ready, whose
   hardware is healthy and which are active, is not failed: it goes
   ``restarting`` (its group's old engines are stopped) and, once every old
   engine has ended, ``launching`` again on the same members, GPUs and ports
   under a new generation. At most ``restart_in_place`` times within
   ``restart_window`` (``Replica.restarts``); past that, or for any other
   failure, it fails and moves, and its ``failed`` event says why it was not
   restarted in place. A node lost (or its old engines not ended within
   ``reap_timeout``) while restarting fails it.

Every state transition is a ``replica`` event whose ``what`` is the new state.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from llmgw.shared.durations import format_duration
from llmgw.shared.schemas import (
    DeploymentSpec,
    Event,
    LaunchCommand,
    Lease,
    NodeRecord,
    Replica,
    template_digest,
)
from llmgw.shared.specs import is_outdated
from llmgw.shared.states import (
    ACTIVE_REPLICA,
    BROKEN_ENGINE,
    ENDED_ENGINE,
    IN_FLIGHT_REPLICA,
    LAUNCHED_REPLICA,
    RUNNING_ENGINE,
    SERVING_REPLICA,
    UP_ENGINE,
    WANTED_REPLICA,
    AdminBy,
    AdminState,
    EventKind,
    EventWhat,
    LeaseState,
)
from llmgw.shared.states import (
    EngineState as E,
)
from llmgw.shared.states import (
    ReplicaState as RS,
)

from .filters import Request
from .placement import PlacementCache, PlacementResult, place, request_for
from .plan import Backoff, Cordon, Launch, NodeFailure, Plan, Stop
from .spares import GROUP_BROKEN, PREEMPTED, Roles, broken_group, preemption_victim, recent_restarts, removal_order
from .view import ClusterView, PortRange

SPEC_CHANGED = "deployment spec changed"
# A replica that had come up: one of its engines exiting may restart it in place (case 14).
_UP = SERVING_REPLICA | {RS.STANDBY}


@dataclass(frozen=True)
class ReconcileConfig:
    ports: PortRange = field(default_factory=PortRange)
    # A reaping replica whose engines never report exited (a node that stays
    # suspect) is dropped after this long so its GPUs are not lost for ever;
    # fencing stops the engine if it turns up, and an agent refuses a launch on
    # a GPU that is still busy.
    reap_timeout: float = 300.0
    # Degraded this long (its leader makes no progress) -> failed and rebuilt.
    hang_timeout: float = 30.0
    # Crash loops (case 9): base delay, doubling per consecutive failure, capped.
    backoff_base: float = 5.0
    backoff_max: float = 300.0
    # Auto-cordon (case 10); a share of 0 turns it off.
    auto_cordon_after: int = 3
    auto_cordon_window: float = 600.0
    auto_cordon_max_share: float = 0.25
    # Restart in place (case 14): at most this many within the window; 0: always move.
    restart_in_place: int = 2
    restart_window: float = 600.0
    # A member of a replica that had come up says a peer is gone, every node is
    # healthy and no engine exit is reported yet: wait this long for the exit
    # (the two reports race) before moving it. 0: move at once.
    peer_lost_grace: float = 0.5

    @classmethod
    def from_section(cls, sc) -> ReconcileConfig:
        """From ``cfg.scheduler`` (``shared.config.SchedulerSection``)."""
        return cls(
            ports=PortRange(base=sc.port_base, count=sc.port_count, shared_by_nodes=sc.nodes_share_ports),
            hang_timeout=sc.hang_timeout,
            backoff_base=sc.backoff_base,
            backoff_max=sc.backoff_max,
            auto_cordon_after=sc.auto_cordon_after,
            auto_cordon_window=sc.auto_cordon_window,
            auto_cordon_max_share=sc.auto_cordon_max_share,
            restart_in_place=sc.restart_in_place,
            restart_window=sc.restart_window,
            peer_lost_grace=sc.peer_lost_grace,
        )

    def backoff(self, failures: int) -> float:
        """The wait before the next attempt after ``failures`` in a row."""
        if failures <= 0 or self.backoff_base <= 0:
            return 0.0
        return min(self.backoff_max, self.backoff_base * 2.0 ** min(failures - 1, 60))


@dataclass(frozen=True)
class Scope:
    """What one cycle looks at: the replicas it advances, the deployments it
    converges, and a deployment's replicas among the inputs (their ids)."""

    replicas: Collection[str]
    deployments: Collection[str]
    members: Callable[[str], Collection[str]]

    @classmethod
    def everything(cls, deployments: Mapping[str, DeploymentSpec], replicas: Mapping[str, Replica]) -> Scope:
        """Every replica and every deployment, named by a spec or by a replica."""
        groups: dict[str, set[str]] = defaultdict(set)
        for rid, replica in replicas.items():
            groups[replica.deployment].add(rid)
        return cls(replicas.keys(), set(deployments) | set(groups), lambda name: groups.get(name, ()))


# The view phase: given the cycle after its status and nodes phases, and the
# peer-lost suspects, the view placement reads and placement's memo of it.
Sight = Callable[["Cycle", Mapping[str, str]], tuple[ClusterView, PlacementCache]]


def run(cycle: Cycle, scope: Scope, failures: Mapping[str, Sequence[NodeFailure]], sight: Sight) -> set[str]:
    """The phases, in order, over ``scope`` (the module docstring); the plan is
    ``cycle.plan``. Returns the deployments left *unsettled*: those whose
    converge produced anything, or that are pending or backing off — the ones
    that may place something next time even if nothing of theirs changes."""
    cycle.advance_all(scope.replicas)
    cycle.judge(failures)  # before placing: a node cordoned now takes nothing new, a suspect is avoided
    cycle.view, cycle.memo = sight(cycle, cycle.suspects)
    return cycle.converge_all(scope) | cycle.place_spares()


def replica_order(replica: Replica) -> tuple[int, str]:
    """A deployment's replicas in the order ``converge`` sees them: by generation,
    whatever order the caller's mapping has (so the incremental reconciler, which
    keeps its own index, sees them in the same order)."""
    return (replica.generation, replica.id)


def advance_order(replica: Replica) -> tuple[str, int, str]:
    """The order phase 1 advances replicas in (and so the order of their events)."""
    return (replica.deployment, replica.generation, replica.id)


class Cycle:
    """One cycle's working state: the replicas as they stand now, the view and
    placement's memo of it side by side, and the plan."""

    def __init__(self, deployments, replicas, nodes, leases, now, config):
        self.deployments: Mapping[str, DeploymentSpec] = deployments
        self.replicas: dict[str, Replica] = dict(replicas)
        self.nodes: Mapping[str, NodeRecord] = nodes  # with this cycle's auto-cordons, once judged
        self.leases: Mapping[str, Lease] = leases
        self.now: float = now
        self.config: ReconcileConfig = config
        self.plan = Plan()
        # The view placement reads and its memo, side by side (``run``'s view phase):
        # the memo follows the view's changes; the view knows nothing of it.
        self.view: ClusterView | None = None
        self.memo: PlacementCache | None = None
        self.suspects: dict[str, str] = {}  # node -> why a peer's report makes it suspect (``judge``)
        # deployment -> reasons of its replicas that failed before serving, this cycle
        self.early_failures: dict[str, list[str]] = defaultdict(list)
        # replica id -> the members' nodes that did not report the lost peer (case 3)
        self.peer_lost_quiet: dict[str, list[str]] = {}
        # deployment -> the replica that became ready this cycle
        self.became_ready: dict[str, str] = {}
        # ids deleted this cycle: a new replica must not take one (the plan would
        # write its record and then delete it, after launching it)
        self.deleted: set[str] = set()
        self._draining: frozenset[str] | None = None  # nodes draining, once asked (``draining``)
        # replica id -> its leader's endpoint: came up this cycle, ready or standby decided in converge (case 12)
        self.came_up: dict[str, str] = {}
        self.placed_new = 0  # of the last ``create``: how many it placed
        # deployment -> its serving replicas that fit nowhere this cycle (case 13), with the request
        self.serving_short: dict[str, tuple[Request, int]] = {}
        # (spec, pending spares to retry, spares to make, its replicas) placed after every serving one (case 13)
        self.spare_work: list[tuple[DeploymentSpec, list[Replica], int, list[Replica]]] = []

    # -- recording ----------------------------------------------------------

    def transition(self, replica: Replica, state: RS, reason: str, *, detail: str = "", new: bool = False, **changes) -> Replica:
        """Record ``replica`` entering ``state``; ``new`` when it had no record before."""
        after = msgspec.structs.replace(replica, state=state, since=self.now, reason=reason, **changes)
        self.replicas[after.id] = after
        self.plan.writes[after.id] = after
        self.plan.events.append(
            Event(
                time=self.now,
                kind=EventKind.REPLICA,
                subject=after.id,
                what=EventWhat(state),
                detail=detail or reason,
                data={
                    "deployment": after.deployment,
                    "generation": str(after.generation),
                    "from": "" if new else replica.state,
                },
            )
        )
        return after

    def delete(self, replica: Replica, reason: str) -> None:
        if replica.state != RS.GONE:
            self.transition(replica, RS.GONE, reason)
        self.replicas.pop(replica.id, None)
        self.plan.writes.pop(replica.id, None)
        self.plan.deletes.append(replica.id)
        self.deleted.add(replica.id)

    # -- facts about nodes --------------------------------------------------

    def node_down(self, node_id: str) -> str:
        """Why a member's node can no longer run it ("" when it can)."""
        if node_id not in self.nodes:
            return f"node {node_id} has no record"
        lease = self.leases.get(node_id)
        if lease is not None and lease.state == LeaseState.LOST:
            return f"node {node_id} lost"
        return ""

    def draining(self, replica: Replica) -> list[str]:
        # The draining nodes are looked up once a cycle: converge asks this of
        # every replica of a deployment, thousands, and mostly none is draining.
        if self._draining is None:
            self._draining = frozenset(n for n, rec in self.nodes.items() if rec.admin == AdminState.DRAINING)
        if not self._draining:
            return []
        return [m.node_id for m in replica.members if m.node_id in self._draining]

    # -- the phases over a scope (``run``) -------------------------------------

    def advance_all(self, ids: Iterable[str]) -> None:
        """Phase 1 for the replicas ``ids`` names (those not among the inputs are gone)."""
        inputs = self.replicas
        for replica in sorted((inputs[rid] for rid in ids if rid in inputs), key=advance_order):
            self.advance(replica)

    def judge(self, history: Mapping[str, Sequence[NodeFailure]]) -> None:
        """Phase 2: auto-cordon (case 10), then the nodes placement must avoid (case 3)."""
        self.judge_nodes(history)
        self.suspects = self.peer_lost_suspects(history)

    def converge_all(self, scope: Scope) -> set[str]:
        """Phase 3 for the deployments in scope, by name; returns those left unsettled (``run``)."""
        plan = self.plan
        unsettled: set[str] = set()
        for name in sorted(scope.deployments):
            spec = self.deployments.get(name)
            mine = sorted((self.replicas[r] for r in scope.members(name) if r in self.replicas), key=replica_order)
            if spec is None and not mine:
                continue
            before = (len(plan.writes), len(plan.deletes), len(plan.events), len(plan.launches), len(plan.stops))
            self.converge(name, spec, mine)
            after = (len(plan.writes), len(plan.deletes), len(plan.events), len(plan.launches), len(plan.stops))
            if after != before or name in plan.pending or name in plan.backoffs or any(r.state == RS.PENDING for r in mine):
                unsettled.add(name)
        return unsettled

    # -- phase 1: each replica's own facts (cases 2, 3, 4, 8, 11) -------------

    def advance(self, replica: Replica) -> None:
        if replica.state == RS.GONE:  # a leftover record: nothing holds, nothing to say
            self.replicas.pop(replica.id, None)
            self.plan.deletes.append(replica.id)
            self.deleted.add(replica.id)
            return
        if replica.state in _UP and self.awaiting_exit(replica):
            if not broken_group(replica) or replica.state != RS.DEGRADED:
                lost = "; ".join(
                    f"member rank {m.rank} on {m.node_id} {m.engine_state}: {m.engine_detail}" for m in replica.members if m.engine_state in BROKEN_ENGINE
                )
                why = f"{GROUP_BROKEN}: {lost}"
                detail = f"{why}; every node healthy: waiting {self.config.peer_lost_grace:g}s for an engine exit to restart in place, else it moves"
                self.transition(replica, RS.DEGRADED, why, detail=detail)
            return
        if replica.state in ACTIVE_REPLICA:
            why, implicated = self.failure(replica)
            if not why:
                self.progress(replica)  # cases 2, 8
                return
            not_in_place = self.in_place(replica)
            if not not_in_place:
                self.restart_in_place(replica, why)  # case 14
                return
            self.failed(replica, why, implicated)  # cases 3, 9, 10
            exited = replica.state in _UP and (any(m.engine_state == E.EXITED for m in replica.members) or broken_group(replica))
            moved = f"{why}; moved, not restarted in place: {not_in_place}" if exited else why
            replica = self.transition(replica, RS.FAILED, why, detail=moved)
        if replica.state == RS.RESTARTING:
            replica = self.restarting(replica)  # case 14
            if replica.state != RS.FAILED:
                return
        if replica.state == RS.FAILED:
            replica = self.start_reaping(replica, replica.reason)  # case 4
        if replica.state == RS.REAPING:
            self.finish_reaping(replica)  # case 4

    def failure(self, replica: Replica) -> tuple[str, list[str]]:
        """Why an active replica has failed ("" if it has not), and the nodes that implicates."""
        if not replica.members:
            return "no members recorded", []
        down = [(m.node_id, why) for m in replica.members if (why := self.node_down(m.node_id))]
        if down:
            return "; ".join(why for _, why in down), _unique(n for n, _ in down)
        broken_hw = self.hardware(replica)  # case 11
        if broken_hw:
            return "; ".join(why for _, why in broken_hw), _unique(n for n, _ in broken_hw)
        ended = [m for m in replica.members if m.engine_state in ENDED_ENGINE]
        if ended:
            why = "; ".join(f"member rank {m.rank} on {m.node_id} {m.engine_state}" for m in ended)
            return why, _unique(m.node_id for m in ended)
        broken = [m for m in replica.members if m.engine_state in BROKEN_ENGINE]
        if broken:
            why = "; ".join(f"member rank {m.rank} on {m.node_id} {m.engine_state}" + (f": {m.engine_detail}" if m.engine_detail else "") for m in broken)
            # The one that says a peer is gone is not the suspect; the peers are.
            quiet = [m.node_id for m in replica.members if m.engine_state not in BROKEN_ENGINE]
            self.peer_lost_quiet[replica.id] = _unique(quiet)
            return why, _unique(quiet or [m.node_id for m in replica.members])
        spec = self.deployments.get(replica.deployment)
        leader = replica.members[0]
        late = spec is not None and self.now - replica.created_at > spec.startup_timeout
        if spec is not None and replica.state in LAUNCHED_REPLICA and leader.engine_state not in UP_ENGINE and late:  # up, however late we look
            states = ", ".join(f"{m.node_id}: {m.engine_state or 'unreported'}" for m in replica.members)
            laggards = [m.node_id for m in replica.members if m.engine_state not in (E.READY, E.JOINED, E.STALLED)]
            return f"not ready within {spec.startup_timeout:g}s of launch ({states})", _unique(laggards)
        if replica.state == RS.STANDBY and leader.engine_state == E.STALLED:  # case 12: no spare
            detail = leader.engine_detail or "no detail from its agent"
            return f"standby spare's leader on {leader.node_id} makes no progress: {detail}", [leader.node_id]
        hung_for = self.now - replica.since
        if replica.state == RS.DEGRADED and hung_for >= self.config.hang_timeout:
            detail = leader.engine_detail or replica.reason
            why = f"leader on {leader.node_id} made no progress for {format_duration(round(hung_for, 1))}" + (f": {detail}" if detail else "")
            return why, _unique(m.node_id for m in replica.members)
        return "", []

    def hardware(self, replica: Replica) -> list[tuple[str, str]]:
        """Case 11: (node, what its hardware reported) for each member its node's inventory breaks."""
        out: list[tuple[str, str]] = []
        multi = len(replica.members) > 1 and bool(replica.fabric)
        for m in replica.members:
            rec = self.nodes.get(m.node_id)
            if rec is None:
                continue
            if multi:
                fabric = next((f for f in rec.fabrics if f.name == replica.fabric), None)
                if fabric is None:
                    out.append((m.node_id, f"fabric {replica.fabric} no longer configured on {m.node_id}"))
                elif not fabric.usable:
                    out.append((m.node_id, f"fabric {replica.fabric} unusable on {m.node_id}: {fabric.problem or 'no ACTIVE HCA port'}"))
            if m.gpus and rec.gpus:  # a record with no GPUs listed at all is no GPU news
                by_index = {g.index: g for g in rec.gpus}
                for i in m.gpus:
                    g = by_index.get(i)
                    if g is None:
                        out.append((m.node_id, f"GPU {i} on {m.node_id} no longer listed by its agent"))
                    elif not g.healthy:
                        out.append((m.node_id, f"GPU {i} on {m.node_id} unhealthy: {g.problem or 'reported unhealthy by its agent'}"))
        return out

    def failed(self, replica: Replica, why: str, implicated: list[str]) -> None:
        """Evidence from a failure: towards the deployment's backoff and the nodes' records."""
        # A lost node and broken hardware are the node's failure, not the
        # deployment's crash loop (cases 3, 11): its replacement is placed at once.
        node_failure = any(self.node_down(m.node_id) for m in replica.members) or bool(self.hardware(replica))
        if replica.state in LAUNCHED_REPLICA and not node_failure:
            self.early_failures[replica.deployment].append(f"{replica.id}: {why}")
        quiet = set(self.peer_lost_quiet.get(replica.id, ()))
        for node_id in implicated:
            kind = E.PEER_LOST if node_id in quiet else ""
            self.plan.implicated.append(NodeFailure(node_id, self.now, f"{replica.id} {why}", kind))

    def peer_lost_suspects(self, history: Mapping[str, Sequence[NodeFailure]]) -> dict[str, str]:
        """Nodes a peer reported lost (case 3) and not heard from since: node -> why.

        A peer's word comes seconds before the node's lease can go lost; without
        this the replacement of the replica that just failed is placed right back
        on the dead node (its lease still ready), fails there when the lease runs
        out, and costs a crash-loop backoff — the seed story's node kill took 8 s
        more that way. A node that is alive is heard from within a heartbeat
        (its lease renewed after the report), and offered again."""
        out: dict[str, str] = {}
        for f in [*(f for fs in history.values() for f in fs), *self.plan.implicated]:
            if f.kind != E.PEER_LOST:
                continue
            lease = self.leases.get(f.node_id)
            if lease is not None and lease.last_renew > f.time:
                continue  # heard from since
            when = dt.datetime.fromtimestamp(f.time).strftime("%H:%M:%S")
            out[f.node_id] = f"a peer reported it lost at {when} ({f.reason.split(':', 1)[0]}); no heartbeat heard since"
        return out

    def progress(self, replica: Replica) -> None:
        leader = replica.members[0]
        stalled_why = leader.engine_detail or "no detail from its agent"
        if replica.state == RS.READY:
            if leader.engine_state == E.STALLED:
                self.transition(replica, RS.DEGRADED, f"leader on {leader.node_id} stalled: {stalled_why}", detail=stalled_why)
            return
        if replica.state == RS.DEGRADED:
            if leader.engine_state == E.READY:
                self.transition(replica, RS.READY, f"leader on {leader.node_id} making progress again")
                self.became_ready[replica.deployment] = replica.id
            return
        if replica.state == RS.STANDBY:
            return
        if leader.engine_state in UP_ENGINE:
            # Serving or standby: converge decides, seeing the whole deployment (case 12).
            addr = self.nodes[leader.node_id].mgmt_addr
            self.came_up[replica.id] = f"http://{_hostport(addr, leader.http_port)}"
        elif replica.state == RS.LAUNCHING and all(m.engine_state in RUNNING_ENGINE for m in replica.members):
            self.transition(replica, RS.WAITING, "all engines started; leader waiting for workers")

    def start_reaping(self, replica: Replica, reason: str) -> Replica:
        stopping = [m for m in replica.members if not self.node_down(m.node_id) and m.engine_state not in ENDED_ENGINE]
        # An exited engine gets a stop too: the agent keeps an exited engine's
        # record (and its log) until told, so without one it would stay forever.
        exited = [m for m in replica.members if not self.node_down(m.node_id) and m.engine_state == E.EXITED]
        for m in stopping + exited:
            self.plan.stops.append(Stop(m.node_id, replica.id, replica.generation, reason))
        # The why and the what: an operator following events sees both on one line.
        detail = f"{reason}; " + ("stopping " + ", ".join(m.node_id for m in stopping) if stopping else "nothing left to stop")
        return self.transition(replica, RS.REAPING, reason, detail=detail)

    def finish_reaping(self, replica: Replica) -> None:
        if all(self.node_down(m.node_id) or m.engine_state in ENDED_ENGINE for m in replica.members):
            self.delete(replica, "all members stopped")
        elif self.now - replica.since >= self.config.reap_timeout:
            self.delete(replica, f"engines not reported exited within {self.config.reap_timeout:g}s; released")

    # -- phase 3: each deployment against its count (cases 5, 6, 7, 9, 1) ---

    def converge(self, name: str, spec: DeploymentSpec | None, mine: list[Replica]) -> None:
        want = spec.replicas if spec is not None else 0
        spares = spec.spares if spec is not None else 0
        mine = self.settle_up(mine, want, spec)  # case 12: came up, serving or standby
        digest = template_digest(spec) if spec is not None else ""
        # One pass, each replica in the first list it belongs to (in ``mine``'s
        # order): a deployment of thousands is partitioned on every step that
        # touches it.
        outdated: list[Replica] = []
        draining: list[Replica] = []
        counted: list[Replica] = []
        for r in mine:
            if r.state not in WANTED_REPLICA:
                continue
            if is_outdated(r, digest):
                outdated.append(r)
            elif self.draining(r):
                draining.append(r)
            else:
                counted.append(r)

        # case 5: too many — pending first, then not up, then the role there is
        # too much of (serving or standby), then the newest.
        extra = len(counted) - want - spares
        if extra > 0:
            why = "deployment deleted" if spec is None else f"scaled down to {want}" + (f" and {spares} spare(s)" if spares else "")
            serving_excess = Roles.of(counted).serving > want
            counted.sort(key=lambda r: removal_order(r, serving_excess))
            for replica in counted[:extra]:
                self.retire(replica, why)
            counted = sorted(counted[extra:], key=replica_order)
        counted = self.promote(counted, want, spares)  # case 12

        # case 6: a draining replica stays until ready replicas elsewhere cover it;
        # a draining spare serves no one: its replacement is built elsewhere.
        ready = sum(1 for r in counted if r.state == RS.READY)
        keep = max(0, want - ready)
        draining.sort(key=lambda r: (r.state != RS.READY, r.generation))
        spare_draining = [r for r in draining if r.state == RS.STANDBY]
        draining = [r for r in draining if r.state != RS.STANDBY]
        for replica in draining[keep:] + spare_draining:
            nodes = ", ".join(self.draining(replica))
            self.retire(replica, "deployment deleted" if spec is None else f"node {nodes} draining; replaced")

        if spec is None:
            return
        # case 7: outdated replicas serve until the new template covers them.
        serving_old = self.roll(outdated, max(0, keep - len(draining)))
        # case 9: a deployment in a crash loop waits before its next attempt.
        backoff = self.backoff(spec)
        if backoff.retry_at > self.now:
            if want > len(counted) or any(r.state == RS.PENDING for r in counted):
                self.plan.pending[name] = backoff_text(backoff)
            return
        self.fill(spec, counted, mine)  # case 1
        if serving_old:
            self.make_room(name, serving_old)

    # -- case 12: warm spares ----------------------------------------------------

    def settle_up(self, mine: list[Replica], want: int, spec: DeploymentSpec | None) -> list[Replica]:
        """The replicas of ``mine`` that came up this cycle become ready while the
        deployment serves fewer than ``want``, else standby; ``mine`` as it is after."""
        up = [r for r in mine if r.id in self.came_up]
        if not up:
            return mine
        digest = template_digest(spec) if spec is not None else ""
        serving = sum(1 for r in mine if r.state in SERVING_REPLICA and not broken_group(r) and not is_outdated(r, digest) and not self.draining(r))
        for replica in up:
            leader = replica.members[0]
            endpoint = self.came_up.pop(replica.id)
            # An outdated or draining replica (or one of a deleted deployment) is
            # judged by cases 5-7 as it always was; only a current one may stand by.
            counts = spec is not None and not is_outdated(replica, digest) and not self.draining(replica)
            if counts and serving >= want and leader.engine_state == E.READY:
                self.transition(replica, RS.STANDBY, f"leader on {leader.node_id} loaded; a warm spare ({serving} of {want} serving)", endpoint=endpoint)
                self.became_ready[replica.deployment] = replica.id
                continue
            if leader.engine_state == E.READY:
                self.transition(replica, RS.READY, f"leader on {leader.node_id} serving", endpoint=endpoint)
                self.became_ready[replica.deployment] = replica.id
            else:  # it came up and stopped making progress before we saw it serve
                why = leader.engine_detail or "no detail from its agent"
                self.transition(replica, RS.DEGRADED, f"leader on {leader.node_id} stalled: {why}", detail=why, endpoint=endpoint)
            serving += counts
        return [self.replicas.get(r.id, r) for r in mine]

    def promote(self, counted: list[Replica], want: int, spares: int) -> list[Replica]:
        """Short of serving replicas: standby spares become ready, oldest first.
        Too many serving while spares are short: the newest ready stand by."""
        roles = Roles.of(counted)
        short = want - roles.serving
        if short > 0 and roles.standby:
            for replica in [r for r in counted if r.state == RS.STANDBY][:short]:
                why = f"promoted from standby: {roles.serving} of {want} serving"
                self.transition(replica, RS.READY, why, detail=f"{why}; a new spare is built in the background")
        elif short < 0 and roles.standby < spares:
            ready = [r for r in counted if r.state == RS.READY][::-1]
            for replica in ready[: min(-short, spares - roles.standby)]:
                self.transition(replica, RS.STANDBY, f"{roles.serving} serving of {want}: kept as a warm spare")
        else:
            return counted
        return [self.replicas[r.id] for r in counted]

    # -- case 13: spares yield to serving replicas ------------------------------

    def place_spares(self) -> set[str]:
        """After every deployment in scope has placed what must serve: take a spare
        for a serving replica that fits nowhere, else place the spares. Returns
        the deployments with spares still to place (unsettled)."""
        unsettled = {spec.name for spec, *_ in self.spare_work}
        if self.serving_short:
            self.preempt()
            for spec, pending, _count, _ in self.spare_work:
                short = ", ".join(sorted(self.serving_short))
                why = f"spares wait: serving replicas of {short} fit nowhere"
                self.plan.pending.setdefault(spec.name, why)
                for replica in pending:
                    if replica.reason != why:
                        new = msgspec.structs.replace(replica, reason=why)
                        self.replicas[new.id] = self.plan.writes[new.id] = new
            return unsettled
        for spec, pending, count, mine in self.spare_work:
            for replica in pending:
                self.retry(spec, replica)
            if count:
                self.create(spec, count, mine)
        return unsettled

    def preempt(self) -> None:
        """Case 13: a standby spare of another deployment reaped for each serving
        replica that fits nowhere, one spare at a time."""
        if any(r.state == RS.REAPING and r.reason.startswith(PREEMPTED) for r in self.replicas.values()):
            return  # its GPUs are on their way
        standby = sorted((r for r in self.replicas.values() if r.state == RS.STANDBY), key=lambda r: r.id)
        for name in sorted(self.serving_short):
            request, _ = self.serving_short[name]
            victim = preemption_victim(standby, request)
            if victim is not None:
                self.retire(victim, f"{PREEMPTED}: deployment {name} has a serving replica that fits nowhere ({request.describe()}); a spare yields first")
                return

    # -- case 14: restart in place -------------------------------------------------

    def awaiting_exit(self, replica: Replica) -> bool:
        """Case 14's race: a peer says the group broke, no exit is reported yet, and
        every node is healthy: within ``peer_lost_grace`` the exit may still come."""
        if not any(m.engine_state in BROKEN_ENGINE for m in replica.members):
            return False
        if any(m.engine_state in ENDED_ENGINE for m in replica.members) or self.config.peer_lost_grace <= 0:
            return False
        if replica.state == RS.DEGRADED and replica.reason.startswith(GROUP_BROKEN) and self.now - replica.since >= self.config.peer_lost_grace:
            return False
        if len(recent_restarts(replica, self.now, self.config.restart_window)) >= self.config.restart_in_place:
            return False
        for m in replica.members:
            lease = self.leases.get(m.node_id)
            if self.node_down(m.node_id) or lease is None or lease.state != LeaseState.READY or self.nodes[m.node_id].admin != AdminState.ACTIVE:
                return False
        return not self.hardware(replica)

    def in_place(self, replica: Replica) -> str:
        """Why a failed replica is not restarted in place ("" when it is)."""
        if replica.state not in _UP:
            return "it never came up"
        if not any(m.engine_state == E.EXITED for m in replica.members):
            return "no engine exit was reported (a node or its agent may be gone)"
        for m in replica.members:
            if why := self.node_down(m.node_id):
                return why
            lease = self.leases.get(m.node_id)
            if lease is None or lease.state != LeaseState.READY:
                return f"node {m.node_id}'s lease is {lease.state if lease else 'missing'}"
            if self.nodes[m.node_id].admin != AdminState.ACTIVE:
                return f"node {m.node_id} is {self.nodes[m.node_id].admin}"
        if broken := self.hardware(replica):
            return broken[0][1]
        spec = self.deployments.get(replica.deployment)
        if spec is None:
            return "its deployment is deleted"
        if is_outdated(replica, template_digest(spec)):
            return SPEC_CHANGED
        budget, window = self.config.restart_in_place, self.config.restart_window
        recent = recent_restarts(replica, self.now, window)
        if len(recent) >= budget:
            return f"restarted in place {len(recent)} time(s) within {format_duration(window)} (restart_in_place {budget})"
        return ""

    def restart_in_place(self, replica: Replica, why: str) -> None:
        """Stop the group's old engines; ``restarting`` relaunches once all ended."""
        restarts = [*recent_restarts(replica, self.now, self.config.restart_window), self.now]
        for m in replica.members:  # an exited engine gets one too: the agent keeps its record until told
            self.plan.stops.append(Stop(m.node_id, replica.id, replica.generation, f"restart in place: {why}"))
        nodes = ", ".join(_unique(m.node_id for m in replica.members))
        detail = (
            f"restart in place: {why}; nodes {nodes} healthy, relaunching on the same members "
            f"(restart {len(restarts)} of {self.config.restart_in_place} within {format_duration(self.config.restart_window)})"
        )
        after = self.transition(replica, RS.RESTARTING, f"restart in place: {why}", detail=detail, restarts=restarts, endpoint="")
        self.restarting(after)

    def restarting(self, replica: Replica) -> Replica:
        """Case 14: relaunch once every old engine ended; fail if a node goes or they never end."""
        down = [why for m in replica.members if (why := self.node_down(m.node_id))] + [why for _, why in self.hardware(replica)]
        if down:
            why = "; ".join(down)
            self.failed(replica, why, _unique(m.node_id for m in replica.members if self.node_down(m.node_id)))
            return self.transition(replica, RS.FAILED, why, detail=f"{why}; moved, not restarted in place: a node went while restarting")
        spec = self.deployments.get(replica.deployment)
        if spec is None or is_outdated(replica, template_digest(spec)):
            return replica  # converge retires it
        if all(m.engine_state in ENDED_ENGINE for m in replica.members):
            return self.relaunch(spec, replica)
        if self.now - replica.since >= self.config.reap_timeout:
            why = f"old engines not reported exited within {self.config.reap_timeout:g}s of a restart in place"
            return self.transition(replica, RS.FAILED, why, detail=f"{why}; moved")
        return replica

    def relaunch(self, spec: DeploymentSpec, replica: Replica) -> Replica:
        """The same members, GPUs and ports, a new generation (the agents fence the old one)."""
        generation = max(spec.last_generation, self.plan.generations.get(spec.name, 0), replica.generation) + 1
        self.plan.generations[spec.name] = generation
        members = [msgspec.structs.replace(m, engine_state=E.UNREPORTED, engine_detail="", pid=0) for m in replica.members]
        nodes = ", ".join(_unique(m.node_id for m in members))
        placed = self.transition(
            replica,
            RS.LAUNCHING,
            f"restarted in place on {nodes} as generation {generation}",
            generation=generation,
            members=members,
            created_at=self.now,
        )
        self.plan.launches.extend(launches_for(spec, placed, self.nodes))
        return placed

    def fill(self, spec: DeploymentSpec, counted: list[Replica], mine: list[Replica]) -> None:
        """Case 1: retry pending replicas, then make the missing ones — those that
        are to serve now, the spares after every deployment's (case 13)."""
        pending = sorted((r for r in counted if r.state == RS.PENDING), key=lambda r: r.generation)
        missing = max(0, spec.replicas + spec.spares - len(counted))
        gap = Roles.of(counted).serving_gap(spec.replicas)
        retry_now, create_now = pending[:gap], min(missing, max(0, gap - len(pending)))
        for replica in retry_now:
            self.retry(spec, replica)
        self.placed_new = 0
        if create_now:
            self.create(spec, create_now, mine)
        short = sum(1 for r in retry_now if self.replicas.get(r.id, r).state == RS.PENDING) + max(0, create_now - self.placed_new)
        if short > 0:
            self.serving_short[spec.name] = (request_for(spec), short)
        if len(pending) > len(retry_now) or missing > create_now:
            self.spare_work.append((spec, pending[len(retry_now) :], missing - create_now, mine))

    def backoff(self, spec: DeploymentSpec) -> Backoff:
        """Case 9: the deployment's backoff after this cycle's failures and recoveries."""
        before = Backoff(spec.failures, spec.retry_at, spec.last_failure)
        after = before
        ready = self.became_ready.get(spec.name)
        if ready and (after.failures or after.retry_at):
            after = Backoff()
            self.deployment_event(spec.name, EventWhat.RECOVERED, f"{ready} ready; crash-loop backoff after {before.failures} failure(s) cleared")
        early = self.early_failures.get(spec.name, [])
        if early:
            failures = after.failures + len(early)
            after = Backoff(failures, self.now + self.config.backoff(failures), early[-1])
            self.deployment_event(spec.name, EventWhat.BACKOFF, backoff_text(after))
        if after != before:
            self.plan.backoffs[spec.name] = after
        return after

    def deployment_event(self, name: str, what: EventWhat, detail: str) -> None:
        self.plan.events.append(Event(time=self.now, kind=EventKind.DEPLOYMENT, subject=name, what=what, detail=detail))

    # -- phase 2: nodes implicated in repeated failures (case 10) -------------

    def judge_nodes(self, history: Mapping[str, Sequence[NodeFailure]]) -> None:
        cfg = self.config
        evidence: dict[str, list[NodeFailure]] = defaultdict(list)
        for node_id, past in history.items():
            evidence[node_id].extend(f for f in past if self.now - f.time < cfg.auto_cordon_window)
        for f in self.plan.implicated:
            evidence[f.node_id].append(f)
        # Every auto-cordoned node, for the breaker: a walk of all nodes, so only
        # once some node has reached the threshold (most cycles none has).
        cordoned: set[str] | None = None
        for node_id in sorted(evidence):
            seen = evidence[node_id]
            rec = self.nodes.get(node_id)
            if rec is None or rec.admin != AdminState.ACTIVE:
                if history.get(node_id):
                    self.plan.settled.append(node_id)  # taken out of service already: start afresh when back
                continue
            if cfg.auto_cordon_max_share <= 0 or len(seen) < cfg.auto_cordon_after:
                continue
            why = f"{len(seen)} replica failures in {format_duration(cfg.auto_cordon_window)}: {seen[-1].reason}"
            if cordoned is None:
                cordoned = {n for n, r in self.nodes.items() if r.admin == AdminState.CORDONED and r.admin_by == AdminBy.AUTO}
            full = self.breaker(rec, cordoned)
            self.plan.settled.append(node_id)
            if full:
                self.plan.events.append(
                    Event(
                        time=self.now, kind=EventKind.NODE, subject=node_id, what=EventWhat.AUTO_CORDON_WITHHELD, detail=f"auto-cordon withheld: {full} ({why})"
                    )
                )
                continue
            self.plan.cordons.append(Cordon(node_id, why))
            cordoned.add(node_id)
        if self.plan.cordons:
            self.nodes = dict(self.nodes)
            self._draining = None  # asked again of the nodes as judged
            for c in self.plan.cordons:
                self.nodes[c.node_id] = msgspec.structs.replace(self.nodes[c.node_id], admin=AdminState.CORDONED, admin_by=AdminBy.AUTO, admin_reason=c.reason)

    def breaker(self, rec: NodeRecord, cordoned: set[str]) -> str:
        """Why cordoning ``rec`` would exceed ``auto_cordon_max_share`` ("" if it would not)."""
        groups: list[tuple[str, list[str]]]
        if rec.fabrics:
            groups = [(f"fabric {f.name}", [n for n, r in self.nodes.items() if any(g.name == f.name for g in r.fabrics)]) for f in rec.fabrics]
        else:
            groups = [("the cluster", list(self.nodes))]
        share = self.config.auto_cordon_max_share
        for label, members in groups:
            limit = math.floor(share * len(members) + 1e-9)
            already = sum(1 for n in members if n in cordoned)
            if already + 1 > limit:
                return f"{label} already has {already} of {len(members)} nodes auto-cordoned (at most {limit} at share {share:g})"
        return ""

    def roll(self, outdated: list[Replica], keep: int) -> list[Replica]:
        """Case 7: retire outdated replicas not needed for serving; return those kept."""
        serving = sorted((r for r in outdated if r.state == RS.READY), key=lambda r: r.generation)
        for replica in [r for r in outdated if r.state != RS.READY] + serving[: max(0, len(serving) - keep)]:
            self.retire(replica, f"{SPEC_CHANGED}; replaced by a replica of the new spec")
        return serving[max(0, len(serving) - keep) :]

    def make_room(self, name: str, serving_old: list[Replica]) -> None:
        """Case 7, no room to surge: retire the oldest outdated replica so its GPUs
        take a replacement — one at a time, and never the last one serving."""
        mine = [r for r in self.replicas.values() if r.deployment == name]
        if not any(r.state == RS.PENDING for r in mine) or any(r.state in IN_FLIGHT_REPLICA for r in mine):
            return
        if sum(1 for r in mine if r.state == RS.READY) < 2:
            return
        self.retire(serving_old[0], f"{SPEC_CHANGED}; no room for its replacement alongside it, so it makes room")

    def retire(self, replica: Replica, reason: str) -> None:
        if replica.state == RS.PENDING:  # holds nothing, runs nothing
            self.delete(replica, reason)
            return
        replica = self.start_reaping(replica, reason)
        self.finish_reaping(replica)

    def placing(self) -> tuple[ClusterView, PlacementCache]:
        """The view placement reads and commits to, and its memo: made before any replica is placed."""
        if self.view is None or self.memo is None:
            raise RuntimeError("a replica placed before the cycle's view was made")
        return self.view, self.memo

    def retry(self, spec: DeploymentSpec, replica: Replica) -> None:
        result = place(request_for(spec), *self.placing())
        if result.placed:
            self.launch(spec, replica, result)
            return
        self.plan.pending[spec.name] = result.summary
        if replica.reason != result.summary:  # a new reason, not a new state: no event
            new = msgspec.structs.replace(replica, reason=result.summary)
            self.replicas[new.id] = self.plan.writes[new.id] = new

    def create(self, spec: DeploymentSpec, count: int, mine: list[Replica]) -> None:
        # Never behind a generation already in use, even if the spec's counter
        # lags (a write of it was lost): generations only grow, ids never repeat.
        generation = max([spec.last_generation, *(r.generation for r in mine), self.plan.generations.get(spec.name, 0)])
        digest = template_digest(spec)
        self.placed_new = 0
        for _ in range(count):
            generation += 1
            while f"{spec.name}-g{generation}" in self.replicas or f"{spec.name}-g{generation}" in self.deleted:
                generation += 1
            replica = Replica(
                id=f"{spec.name}-g{generation}",
                deployment=spec.name,
                model=spec.model,
                engine=spec.engine,
                generation=generation,
                state=RS.PENDING,
                created_at=self.now,
                since=self.now,
                spec_digest=digest,
            )
            self.plan.generations[spec.name] = generation
            result = place(request_for(spec), *self.placing())
            if result.placed:
                self.launch(spec, replica, result, new=True)
                self.placed_new += 1
            else:
                self.plan.pending[spec.name] = result.summary
                self.transition(replica, RS.PENDING, result.summary, new=True)

    def launch(self, spec: DeploymentSpec, replica: Replica, result: PlacementResult, *, new: bool = False) -> None:
        members = result.members
        if not members:
            raise ValueError(f"launch of {replica.id}: its placement placed no member ({result.summary})")
        leader = members[0]
        leader_addr = self.nodes[leader.node_id].mgmt_addr
        placed = self.transition(
            replica,
            RS.LAUNCHING,
            result.summary,
            fabric=result.fabric,
            members=members,
            rendezvous_addr=_hostport(leader_addr, leader.rendezvous_port),
            endpoint="",
            created_at=self.now,  # the startup timeout counts from here
            spec_digest=template_digest(spec),  # what it is launched with, whatever it was made for
            new=new,
        )
        self.placing()[0].commit(placed)  # the memo follows at its next use
        self.plan.launches.extend(launches_for(spec, placed, self.nodes))


def launches_for(spec: DeploymentSpec, replica: Replica, nodes: Mapping[str, NodeRecord]) -> list[Launch]:
    """The launch of every member of a placed replica.

    Also used by a scheduler that takes over leadership: launches are
    idempotent on the agent, so re-sending those of a replica still launching
    finishes what the previous leader may not have sent.
    """
    leader = replica.members[0]
    leader_addr = nodes[leader.node_id].mgmt_addr
    out = []
    for m in replica.members:
        record = nodes[m.node_id]
        fabric = next((f for f in record.fabrics if f.name == replica.fabric), None)
        command = LaunchCommand(
            replica_id=replica.id,
            generation=replica.generation,
            deployment=spec.name,
            model=spec.model,
            engine=spec.engine,
            nnodes=len(replica.members),
            rank=m.rank,
            leader_addr=leader_addr,
            rendezvous_port=leader.rendezvous_port,
            http_port=m.http_port,
            gpus=list(m.gpus),
            fabric=replica.fabric,
            hcas=list(fabric.hcas) if fabric is not None else [],
            engine_args=list(spec.engine_args),
            env=dict(spec.env),
            weights_path=spec.weights_path,
            weights_model=spec.weights_model,
        )
        out.append(Launch(m.node_id, replica.id, m, command))
    return out


def remember_failures(history: Mapping[str, Sequence[NodeFailure]], plan: Plan, now: float, window: float) -> dict[str, list[NodeFailure]]:
    """The shell's failure history after ``plan``: this cycle's ``implicated`` in,
    the ``settled`` nodes' history out, and what is older than ``window`` dropped."""
    out: dict[str, list[NodeFailure]] = {n: [f for f in fs if now - f.time < window] for n, fs in history.items()}
    for f in plan.implicated:
        out.setdefault(f.node_id, []).append(f)
    for node_id in plan.settled:
        out.pop(node_id, None)
    return {n: fs for n, fs in out.items() if fs}


def backoff_text(backoff: Backoff) -> str:
    """What an operator reads for a deployment that is backing off (case 9)."""
    n = backoff.failures
    at = dt.datetime.fromtimestamp(backoff.retry_at).strftime("%H:%M:%S")
    return f"backing off after {n} failure{'s' if n != 1 else ''} before serving: {backoff.last_failure}; next attempt at {at}"


def _unique(items) -> list[str]:
    return list(dict.fromkeys(items))


def _hostport(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
