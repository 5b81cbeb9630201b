"""The reconciler: desired deployments against actual replicas, as a pure function.

``reconcile(deployments, replicas, nodes, leases, now, config=…) -> Plan``
reads nothing but its arguments (the clock is ``now``) and changes none of
them; the shell applies the plan. It runs in three phases:

* **status** — each replica's own facts (its members' nodes and engine states)
  move it along its state machine: cases 2, 3 and 4 below;
* **view** — the cluster is computed once (``ClusterView``) from what is left,
  so a failed or reaping replica still holds its GPUs;
* **deployments** — each deployment, by name, is brought to its replica count:
  cases 5, 6 and then 1, so what is removed is removed before what is added.

The cases (after LWS' numbered case analysis):

1. A deployment has fewer wanted replicas (pending, launching,
   waiting-for-workers, ready — not on a draining node) than it asks for:
   first its pending replicas are retried (oldest generation first; they keep
   their id and generation), then new ones are made. A new replica gets the
   next generation (``last_generation + 1``, one per replica, recorded in
   ``Plan.generations``) and id ``<deployment>-g<generation>``. Placed: state
   ``launching``, members ranked leader-first, a launch per member. Not
   placeable: state ``pending`` holding nothing, its reason the placement
   summary, and the deployment's entry in ``Plan.pending``.
2. Launching / waiting-for-workers: the shell records each member's
   ``engine_state`` from agent status reports. Every member's engine running
   (starting, joined or ready) -> ``waiting-for-workers``; the leader's engine
   ``ready`` -> ``ready`` with ``endpoint = http://<leader mgmt_addr>:<http_port>``.
3. Failure of a launching, waiting or ready replica -> ``failed``, the reason
   naming the node or member: a member's node lease is ``lost`` or its node
   record is gone; a member's engine ``exited`` (or is ``absent`` from a full
   report); or, before ready, ``startup_timeout`` passed since its launch
   (``created_at``). A ``suspect`` lease is not failure.
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

Every state transition is a ``replica`` event whose ``what`` is the new state.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from llmgw.shared.schemas import (
    DeploymentSpec,
    Event,
    LaunchCommand,
    Lease,
    NodeRecord,
    Replica,
    template_digest,
)

from .placement import PlacementResult, place, request_for
from .plan import Launch, Plan, Stop
from .view import ClusterView, PortRange

# Engine states an agent reports (``EngineState``), plus "absent": the shell
# writes it when a full status report from the member's node lacks the engine,
# or when the agent refused the launch.
RUNNING = frozenset({"starting", "joined", "ready"})
ENDED = frozenset({"exited", "absent"})

ACTIVE = frozenset({"launching", "waiting-for-workers", "ready"})
WANTED = ACTIVE | {"pending"}
IN_FLIGHT = frozenset({"launching", "waiting-for-workers", "failed", "reaping"})
SPEC_CHANGED = "deployment spec changed"


@dataclass(frozen=True)
class ReconcileConfig:
    ports: PortRange = field(default_factory=PortRange)
    # A reaping replica whose engines never report exited (a node that stays
    # suspect) is dropped after this long so its GPUs are not lost for ever;
    # fencing stops the engine if it turns up, and an agent refuses a launch on
    # a GPU that is still busy.
    reap_timeout: float = 300.0


def reconcile(
    deployments: Mapping[str, DeploymentSpec],
    replicas: Mapping[str, Replica],
    nodes: Mapping[str, NodeRecord],
    leases: Mapping[str, Lease],
    now: float,
    *,
    config: ReconcileConfig | None = None,
) -> Plan:
    cycle = _Cycle(deployments, replicas, nodes, leases, now, config or ReconcileConfig())
    for replica in sorted(replicas.values(), key=lambda r: (r.deployment, r.generation, r.id)):
        cycle.advance(replica)
    cycle.view = ClusterView.build(nodes, leases, cycle.replicas.values(), ports=cycle.config.ports)
    by_deployment: dict[str, list[Replica]] = defaultdict(list)
    for replica in cycle.replicas.values():
        by_deployment[replica.deployment].append(replica)
    for name in sorted(set(deployments) | set(by_deployment)):
        cycle.converge(name, deployments.get(name), by_deployment.get(name, []))
    return cycle.plan


class _Cycle:
    """One reconcile's working state: the replicas as they stand now, and the plan."""

    def __init__(self, deployments, replicas, nodes, leases, now, config):
        self.deployments: Mapping[str, DeploymentSpec] = deployments
        self.replicas: dict[str, Replica] = dict(replicas)
        self.nodes: Mapping[str, NodeRecord] = nodes
        self.leases: Mapping[str, Lease] = leases
        self.now: float = now
        self.config: ReconcileConfig = config
        self.plan = Plan()
        self.view: ClusterView | None = None

    # -- recording ----------------------------------------------------------

    def transition(
        self, replica: Replica, state: str, reason: str, *, detail: str = "", new: bool = False, **changes
    ) -> Replica:
        """Record ``replica`` entering ``state``; ``new`` when it had no record before."""
        after = msgspec.structs.replace(replica, state=state, since=self.now, reason=reason, **changes)
        self.replicas[after.id] = after
        self.plan.writes[after.id] = after
        self.plan.events.append(
            Event(
                time=self.now,
                kind="replica",
                subject=after.id,
                what=state,
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
        if replica.state != "gone":
            self.transition(replica, "gone", reason)
        self.replicas.pop(replica.id, None)
        self.plan.writes.pop(replica.id, None)
        self.plan.deletes.append(replica.id)

    # -- facts about nodes --------------------------------------------------

    def node_down(self, node_id: str) -> str:
        """Why a member's node can no longer run it ("" when it can)."""
        if node_id not in self.nodes:
            return f"node {node_id} has no record"
        lease = self.leases.get(node_id)
        if lease is not None and lease.state == "lost":
            return f"node {node_id} lost"
        return ""

    def draining(self, replica: Replica) -> list[str]:
        return [
            m.node_id
            for m in replica.members
            if (rec := self.nodes.get(m.node_id)) is not None and rec.admin == "draining"
        ]

    # -- phase 1: each replica's own facts (cases 2, 3, 4) ------------------

    def advance(self, replica: Replica) -> None:
        if replica.state == "gone":  # a leftover record: nothing holds, nothing to say
            self.replicas.pop(replica.id, None)
            self.plan.deletes.append(replica.id)
            return
        if replica.state in ACTIVE:
            why = self.failure(replica)
            if why:
                replica = self.transition(replica, "failed", why)  # case 3
            else:
                self.progress(replica)  # case 2
                return
        if replica.state == "failed":
            replica = self.start_reaping(replica, replica.reason)  # case 4
        if replica.state == "reaping":
            self.finish_reaping(replica)  # case 4

    def failure(self, replica: Replica) -> str:
        if not replica.members:
            return "no members recorded"
        down = [why for m in replica.members if (why := self.node_down(m.node_id))]
        if down:
            return "; ".join(down)
        ended = [m for m in replica.members if m.engine_state in ENDED]
        if ended:
            return "; ".join(f"member rank {m.rank} on {m.node_id} {m.engine_state}" for m in ended)
        spec = self.deployments.get(replica.deployment)
        leader_ready = replica.members[0].engine_state == "ready"  # made it, however late we look
        late = spec is not None and self.now - replica.created_at > spec.startup_timeout
        if replica.state != "ready" and not leader_ready and late:
            states = ", ".join(f"{m.node_id}: {m.engine_state or 'unreported'}" for m in replica.members)
            return f"not ready within {spec.startup_timeout:g}s of launch ({states})"
        return ""

    def progress(self, replica: Replica) -> None:
        leader = replica.members[0]
        if leader.engine_state == "ready" and replica.state != "ready":
            addr = self.nodes[leader.node_id].mgmt_addr
            endpoint = f"http://{_hostport(addr, leader.http_port)}"
            self.transition(replica, "ready", f"leader on {leader.node_id} serving", endpoint=endpoint)
        elif replica.state == "launching" and all(m.engine_state in RUNNING for m in replica.members):
            self.transition(replica, "waiting-for-workers", "all engines started; leader waiting for workers")

    def start_reaping(self, replica: Replica, reason: str) -> Replica:
        stopping = [
            m for m in replica.members if not self.node_down(m.node_id) and m.engine_state not in ENDED
        ]
        # An exited engine gets a stop too: the agent keeps an exited engine's
        # record (and its log) until told, so without one it would stay forever.
        exited = [m for m in replica.members if not self.node_down(m.node_id) and m.engine_state == "exited"]
        for m in stopping + exited:
            self.plan.stops.append(Stop(m.node_id, replica.id, replica.generation, reason))
        # The why and the what: an operator following events sees both on one line.
        detail = f"{reason}; " + ("stopping " + ", ".join(m.node_id for m in stopping) if stopping else "nothing left to stop")
        return self.transition(replica, "reaping", reason, detail=detail)

    def finish_reaping(self, replica: Replica) -> None:
        if all(self.node_down(m.node_id) or m.engine_state in ENDED for m in replica.members):
            self.delete(replica, "all members stopped")
        elif self.now - replica.since >= self.config.reap_timeout:
            self.delete(replica, f"engines not reported exited within {self.config.reap_timeout:g}s; released")

    # -- phase 3: each deployment against its count (cases 5, 6, 1) ---------

    def converge(self, name: str, spec: DeploymentSpec | None, mine: list[Replica]) -> None:
        want = spec.replicas if spec is not None else 0
        wanted = [r for r in mine if r.state in WANTED]
        digest = template_digest(spec) if spec is not None else ""
        outdated = [r for r in wanted if digest and r.spec_digest and r.spec_digest != digest]
        stale = {r.id for r in outdated}
        draining = [r for r in wanted if r.id not in stale and self.draining(r)]
        counted = [r for r in wanted if r.id not in stale and not self.draining(r)]

        # case 5: too many — pending first, then not ready, then the newest.
        extra = len(counted) - want
        if extra > 0:
            why = "deployment deleted" if spec is None else f"scaled down to {want}"
            counted.sort(key=_removal_order)
            for replica in counted[:extra]:
                self.retire(replica, why)
            counted = counted[extra:]

        # case 6: a draining replica stays until ready replicas elsewhere cover it.
        ready = sum(1 for r in counted if r.state == "ready")
        keep = max(0, want - ready)
        draining.sort(key=lambda r: (r.state != "ready", r.generation))
        for replica in draining[keep:]:
            nodes = ", ".join(self.draining(replica))
            self.retire(replica, "deployment deleted" if spec is None else f"node {nodes} draining; replaced")

        if spec is None:
            return
        # case 7: outdated replicas serve until the new template covers them.
        serving_old = self.roll(outdated, max(0, keep - len(draining)))
        # case 1: retry pending replicas, then make the missing ones.
        for replica in sorted((r for r in counted if r.state == "pending"), key=lambda r: r.generation):
            self.retry(spec, replica)
        if want > len(counted):
            self.create(spec, want - len(counted), mine)
        if serving_old:
            self.make_room(name, serving_old)

    def roll(self, outdated: list[Replica], keep: int) -> list[Replica]:
        """Case 7: retire outdated replicas not needed for serving; return those kept."""
        serving = sorted((r for r in outdated if r.state == "ready"), key=lambda r: r.generation)
        for replica in [r for r in outdated if r.state != "ready"] + serving[: max(0, len(serving) - keep)]:
            self.retire(replica, f"{SPEC_CHANGED}; replaced by a replica of the new spec")
        return serving[max(0, len(serving) - keep):]

    def make_room(self, name: str, serving_old: list[Replica]) -> None:
        """Case 7, no room to surge: retire the oldest outdated replica so its GPUs
        take a replacement — one at a time, and never the last one serving."""
        mine = [r for r in self.replicas.values() if r.deployment == name]
        if not any(r.state == "pending" for r in mine) or any(r.state in IN_FLIGHT for r in mine):
            return
        if sum(1 for r in mine if r.state == "ready") < 2:
            return
        self.retire(serving_old[0], f"{SPEC_CHANGED}; no room for its replacement alongside it, so it makes room")

    def retire(self, replica: Replica, reason: str) -> None:
        if replica.state == "pending":  # holds nothing, runs nothing
            self.delete(replica, reason)
            return
        replica = self.start_reaping(replica, reason)
        self.finish_reaping(replica)

    def retry(self, spec: DeploymentSpec, replica: Replica) -> None:
        result = place(request_for(spec), self.view)
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
        generation = max([spec.last_generation, *(r.generation for r in mine)])
        digest = template_digest(spec)
        for _ in range(count):
            generation += 1
            while f"{spec.name}-g{generation}" in self.replicas:
                generation += 1
            replica = Replica(
                id=f"{spec.name}-g{generation}",
                deployment=spec.name,
                model=spec.model,
                engine=spec.engine,
                generation=generation,
                state="pending",
                created_at=self.now,
                since=self.now,
                spec_digest=digest,
            )
            self.plan.generations[spec.name] = generation
            result = place(request_for(spec), self.view)
            if result.placed:
                self.launch(spec, replica, result, new=True)
            else:
                self.plan.pending[spec.name] = result.summary
                self.transition(replica, "pending", result.summary, new=True)

    def launch(self, spec: DeploymentSpec, replica: Replica, result: PlacementResult, *, new: bool = False) -> None:
        members = result.members
        leader = members[0]
        leader_addr = self.nodes[leader.node_id].mgmt_addr
        placed = self.transition(
            replica,
            "launching",
            result.summary,
            fabric=result.fabric,
            members=members,
            rendezvous_addr=_hostport(leader_addr, leader.rendezvous_port),
            endpoint="",
            created_at=self.now,  # the startup timeout counts from here
            spec_digest=template_digest(spec),  # what it is launched with, whatever it was made for
            new=new,
        )
        self.view.commit(placed)
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
        )
        out.append(Launch(m.node_id, replica.id, m, command))
    return out


def _removal_order(replica: Replica) -> tuple[int, int]:
    rank = 0 if replica.state == "pending" else 1 if replica.state != "ready" else 2
    return (rank, -replica.generation)


def _hostport(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
