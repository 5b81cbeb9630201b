"""The reconciler, case by case, and fencing. Pure: plain values in, a Plan out, time injected."""

from __future__ import annotations

import copy

import msgspec
import pytest

from llmgw.services.scheduler import placement
from llmgw.services.scheduler import reasons as R
from llmgw.services.scheduler.cycle import ReconcileConfig
from llmgw.services.scheduler.fence import fence
from llmgw.services.scheduler.reconcile import reconcile
from llmgw.services.scheduler.view import PortRange
from llmgw.shared.schemas import EngineFact, Replica, template_digest

from .builders import (
    apply_plan,
    cluster,
    make_deployment,
    make_lease,
    make_node,
    seed_cluster,
    seed_deployment,
    with_engines,
)

T0 = 1_000.0


class World:
    """The cluster as the shell keeps it between reconciles."""

    def __init__(self, nodes, leases, *deployments, config=None):
        self.nodes, self.leases = nodes, leases
        self.deployments = {d.name: d for d in deployments}
        self.replicas: dict[str, Replica] = {}
        self.config = config
        self.now = T0
        self.plan = None

    def step(self, dt: float = 1.0):
        self.now += dt
        self.plan = reconcile(self.deployments, self.replicas, self.nodes, self.leases, self.now, config=self.config)
        self.replicas, self.deployments = apply_plan(self.plan, self.replicas, self.deployments)
        return self.plan

    def engines(self, rid, **states):
        self.replicas[rid] = with_engines(self.replicas[rid], **states)

    def lease(self, node_id, state):
        self.leases[node_id] = make_lease(node_id, state, since=self.now)

    def state(self, rid):
        return self.replicas[rid].state

    def where(self, rid):
        r = self.replicas[rid]
        return r.fabric, [(m.node_id, m.gpus) for m in r.members]

    def events(self, rid=None):
        return [(e.subject, e.what) for e in self.plan.events if rid is None or e.subject == rid]


# Restart in place off: the failures these tables follow move their replica.
MOVE = ReconcileConfig(restart_in_place=0)


def seed_world(**kw) -> World:
    return World(*seed_cluster(), seed_deployment(**kw))


def ready_seed() -> World:
    w = seed_world()
    w.step()
    for rid in ("sim-g1", "sim-g2"):
        w.engines(rid, all="ready")
    w.step()
    assert w.state("sim-g1") == w.state("sim-g2") == "ready"
    return w


# --------------------------------------------------------------------------
# The seed scenario
# --------------------------------------------------------------------------


def test_seed_places_one_replica_per_fabric_with_launches_for_every_member():
    w = seed_world()
    plan = w.step()
    assert w.where("sim-g1") == ("ib-a", [("node01", [0, 1, 2, 3]), ("node02", [0, 1, 2, 3])])
    assert w.where("sim-g2") == ("ib-b", [("node03", [0, 1, 2, 3]), ("node04", [0, 1, 2, 3])])
    assert plan.generations == {"sim": 2}
    assert w.deployments["sim"].last_generation == 2
    assert [(launch.node_id, launch.replica_id, launch.command.rank) for launch in plan.launches] == [
        ("node01", "sim-g1", 0),
        ("node02", "sim-g1", 1),
        ("node03", "sim-g2", 0),
        ("node04", "sim-g2", 1),
    ]
    assert w.events() == [("sim-g1", "launching"), ("sim-g2", "launching")]
    g1 = w.replicas["sim-g1"]
    assert g1.rendezvous_addr == f"{w.nodes['node01'].mgmt_addr}:20000"
    assert (g1.state, g1.since, g1.created_at, g1.generation) == ("launching", w.now, w.now, 1)


def test_launch_commands_carry_what_an_agent_needs():
    w = seed_world(engine_args=["--max-model-len", "4096"], env={"A": "1"})
    plan = w.step()
    leader, worker = plan.launches[0].command, plan.launches[1].command
    addr = w.nodes["node01"].mgmt_addr
    for c in (leader, worker):
        assert (c.replica_id, c.generation, c.deployment, c.engine, c.nnodes) == ("sim-g1", 1, "sim", "sim", 2)
        assert (c.leader_addr, c.rendezvous_port, c.fabric) == (addr, 20000, "ib-a")
        assert c.engine_args == ["--max-model-len", "4096"] and c.env == {"A": "1"}
        assert c.gpus == [0, 1, 2, 3] and c.hcas == ["mlx5_0"]
    assert (leader.rank, leader.http_port) == (0, 20001)
    assert (worker.rank, worker.http_port) == (1, 0)  # workers serve nothing


def test_seed_node02_lost_fails_reaps_and_rebuilds_on_ib_b_gpus_4_to_7():
    w = ready_seed()
    w.lease("node02", "lost")
    plan = w.step()
    assert w.events("sim-g1") == [("sim-g1", "failed"), ("sim-g1", "reaping")]
    assert "node node02 lost" in w.replicas["sim-g1"].reason
    # node01's leader is stopped; nothing is sent to the lost node02.
    assert [(s.node_id, s.replica_id, s.generation) for s in plan.stops] == [("node01", "sim-g1", 1)]
    # The replacement: next generation, whole on ib-b, the four GPUs sim-g2 does not use.
    assert w.where("sim-g3") == ("ib-b", [("node03", [4, 5, 6, 7]), ("node04", [4, 5, 6, 7])])
    assert w.state("sim-g3") == "launching"
    assert plan.generations == {"sim": 3}
    # node01 is idle once its leader has exited.
    w.engines("sim-g1", node01="exited")
    w.step()
    assert "sim-g1" not in w.replicas and w.plan.deletes == ["sim-g1"]
    assert w.events("sim-g1") == [("sim-g1", "gone")]
    assert all(m.node_id != "node01" for r in w.replicas.values() for m in r.members)
    w.engines("sim-g3", all="ready")
    w.step()
    assert w.state("sim-g3") == "ready"
    assert w.replicas["sim-g3"].endpoint == f"http://{w.nodes['node03'].mgmt_addr}:20003"


def test_seed_with_ib_b_full_the_replacement_stays_pending_and_never_spans():
    w = ready_seed()
    # A third deployment fills the rest of ib-b (node01 cordoned meanwhile so it lands there).
    w.nodes["node01"] = make_node("node01", "ib-a", admin="cordoned")
    w.deployments["filler"] = make_deployment("filler", replicas=1, gpus_per_node=4)
    w.step()
    w.nodes["node01"] = make_node("node01", "ib-a")
    assert w.where("filler-g1") == ("ib-b", [("node03", [4, 5, 6, 7]), ("node04", [4, 5, 6, 7])])
    w.engines("filler-g1", all="ready")
    w.step()
    w.lease("node02", "lost")
    plan = w.step()
    (pending,) = [r for r in w.replicas.values() if r.state == "pending"]
    assert (pending.id, pending.members, pending.fabric) == ("sim-g3", [], None)
    assert "no fabric has 2 nodes that fit" in pending.reason
    assert plan.pending == {"sim": pending.reason}
    assert ("sim-g3", "pending") in w.events()
    # node01 has four free GPUs and ib-b none: never half here, half there.
    assert R.FABRIC_TOO_SMALL in pending.reason
    # Still pending next cycle, same id, no new replica, no new event.
    w.step()
    assert w.state("sim-g3") == "pending" and w.events() == [] and not w.plan.writes
    assert sorted(w.replicas) == ["filler-g1", "sim-g1", "sim-g2", "sim-g3"]
    assert all(len({w.nodes[m.node_id].fabrics[0].name for m in r.members}) <= 1 for r in w.replicas.values())


def test_pending_replica_launches_when_capacity_returns_keeping_id_and_generation():
    w = World(*seed_cluster(node02="lost"), seed_deployment(replicas=1), make_deployment("filler", replicas=1, gpus_per_node=8))
    w.step()
    assert w.where("filler-g1")[0] == "ib-b"
    assert w.state("sim-g1") == "pending"
    w.lease("node02", "ready")
    w.step(5.0)
    assert w.state("sim-g1") == "launching"
    assert w.events("sim-g1") == [("sim-g1", "launching")]
    assert w.replicas["sim-g1"].generation == 1 and w.deployments["sim"].last_generation == 1
    assert w.replicas["sim-g1"].created_at == w.now  # startup timeout counts from launch


# --------------------------------------------------------------------------
# Case 2: launching -> waiting-for-workers -> ready
# --------------------------------------------------------------------------

PROGRESS = [
    # id, engine states, expected state
    ("nothing-reported", {}, "launching"),
    ("leader-started-only", {"node01": "starting"}, "launching"),
    ("all-started", {"all": "starting"}, "waiting-for-workers"),
    ("worker-joined", {"node01": "starting", "node02": "joined"}, "waiting-for-workers"),
    ("leader-ready", {"node01": "ready", "node02": "joined"}, "ready"),
    ("leader-ready-worker-unreported", {"node01": "ready"}, "ready"),
]


@pytest.mark.parametrize("states, expected", [c[1:] for c in PROGRESS], ids=[c[0] for c in PROGRESS])
def test_launch_progress(states, expected):
    w = seed_world(replicas=1)
    w.step()
    w.engines("sim-g1", **states)
    w.step()
    assert w.state("sim-g1") == expected
    if expected == "ready":
        assert w.replicas["sim-g1"].endpoint == f"http://{w.nodes['node01'].mgmt_addr}:20001"
        assert w.events("sim-g1") == [("sim-g1", "ready")]


def test_every_transition_is_one_event_with_from_and_to():
    w = seed_world(replicas=1)
    w.step()
    w.engines("sim-g1", all="starting")
    w.step()
    (e,) = w.plan.events
    assert (e.kind, e.subject, e.what, e.time) == ("replica", "sim-g1", "waiting-for-workers", w.now)
    assert e.data == {"deployment": "sim", "generation": "1", "from": "launching"}
    w.step()
    assert w.plan.events == [] and not w.plan  # nothing changed, nothing to apply


# --------------------------------------------------------------------------
# Case 3: failure
# --------------------------------------------------------------------------


def _lose(w, node):
    w.lease(node, "lost")


def _suspect(w, node):
    w.lease(node, "suspect")


def _forget(w, node):
    del w.nodes[node]


def _exit(w, node):
    w.engines("sim-g1", **{node: "exited"})


def _absent(w, node):
    w.engines("sim-g1", **{node: "absent"})


FAILURES = [
    # id, what happens to node02 / its member, fails?, reason fragment
    ("lease-lost", _lose, True, "node node02 lost"),
    ("record-gone", _forget, True, "node node02 has no record"),
    ("worker-exited", _exit, True, "member rank 1 on node02 exited"),
    ("worker-absent", _absent, True, "member rank 1 on node02 absent"),
    ("suspect-is-not-failure", _suspect, False, ""),
]


@pytest.mark.parametrize("ready_first", [False, True], ids=["launching", "ready"])
@pytest.mark.parametrize("event, fails, why", [c[1:] for c in FAILURES], ids=[c[0] for c in FAILURES])
def test_member_failure(event, fails, why, ready_first):
    # Moving, with restart in place off: a ready replica's exited engine restarts
    # in place otherwise (tests/test_spares_core.py).
    w = World(*seed_cluster(), seed_deployment(replicas=1), config=MOVE)
    w.step()
    if ready_first:
        w.engines("sim-g1", all="ready")
        w.step()
    before = w.state("sim-g1")
    event(w, "node02")
    w.step()
    if not fails:
        assert w.state("sim-g1") == before and w.events("sim-g1") == []
        return
    assert w.events("sim-g1")[:2] == [("sim-g1", "failed"), ("sim-g1", "reaping")]
    assert why in w.plan.events[0].detail
    stopped = sorted(s.node_id for s in w.plan.stops if s.replica_id == "sim-g1")
    # survivors are stopped; an exited member is stopped too, so its agent drops the record
    assert stopped == (["node01", "node02"] if event is _exit else ["node01"])


def test_leader_exit_fails_and_stops_the_worker():
    w = seed_world(replicas=1)
    w.step()
    w.engines("sim-g1", node01="exited", node02="joined")
    plan = w.step()
    assert "member rank 0 on node01 exited" in w.replicas["sim-g1"].reason
    assert sorted(s.node_id for s in plan.stops if s.replica_id == "sim-g1") == ["node01", "node02"]


@pytest.mark.parametrize(
    "elapsed, ready, fails",
    [(599.0, False, False), (601.0, False, True), (10_000.0, True, False)],
    ids=["within-timeout", "past-timeout", "ready-never-times-out"],
)
def test_startup_timeout(elapsed, ready, fails):
    w = seed_world(replicas=1, startup_timeout=600.0)
    w.step()
    w.engines("sim-g1", all="ready" if ready else "starting")
    w.step()
    w.step(elapsed)
    failed = ("sim-g1", "failed") in w.events()
    assert failed is fails
    if fails:
        assert "not ready within 600s" in w.replicas["sim-g1"].reason
        assert "node01: starting" in w.replicas["sim-g1"].reason


def test_leader_ready_reported_after_the_timeout_counts_as_ready():
    w = seed_world(replicas=1, startup_timeout=60.0)
    w.step()
    w.engines("sim-g1", all="ready")
    w.step(61.0)
    assert w.state("sim-g1") == "ready" and w.events() == [("sim-g1", "ready")]


def test_pending_reason_change_is_written_without_an_event():
    w = World(*seed_cluster(node02="lost", node04="lost"), seed_deployment(replicas=1))
    w.step()
    first = w.replicas["sim-g1"].reason
    w.lease("node03", "suspect")
    plan = w.step(5.0)
    assert w.state("sim-g1") == "pending" and plan.events == []
    assert plan.writes["sim-g1"].reason != first and "3 lease_not_ready" in plan.writes["sim-g1"].reason
    assert plan.writes["sim-g1"].since == T0 + 1  # still pending since it was made


# --------------------------------------------------------------------------
# Case 4: reaping -> gone
# --------------------------------------------------------------------------


def _failed_seed_replica():
    w = World(*seed_cluster(), seed_deployment(replicas=1), config=MOVE)
    w.step()
    w.engines("sim-g1", all="ready")
    w.step()
    w.engines("sim-g1", node02="exited")
    w.step()
    assert w.state("sim-g1") == "reaping"
    return w


REAPING = [
    ("leader-still-running", {}, "lost-nothing", False),
    ("leader-exited", {"node01": "exited"}, "", True),
    ("leader-absent", {"node01": "absent"}, "", True),
    ("leader-node-lost", {}, "node01", True),
]


@pytest.mark.parametrize("states, lose, gone", [c[1:] for c in REAPING], ids=[c[0] for c in REAPING])
def test_reaping_ends_when_every_member_has_stopped(states, lose, gone):
    w = _failed_seed_replica()
    if states:
        w.engines("sim-g1", **states)
    if lose in w.nodes:
        w.lease(lose, "lost")
    w.step()
    assert ("sim-g1" not in w.replicas) is gone
    if gone:
        assert w.plan.deletes == ["sim-g1"] and ("sim-g1", "gone") in w.events()


def test_reaping_gives_up_after_reap_timeout():
    nodes, leases = seed_cluster()
    w = World(nodes, leases, seed_deployment(replicas=1), config=ReconcileConfig(reap_timeout=120.0))
    w.step()
    w.engines("sim-g1", node02="exited")
    w.step()
    w.step(119.0)
    assert w.state("sim-g1") == "reaping"
    w.step(2.0)
    assert "sim-g1" not in w.replicas


def test_failed_replica_gpus_stay_held_until_it_is_gone():
    # One fabric of two nodes; a worker exits: the replacement cannot use the
    # failed replica's GPUs while its leader may still run.
    # (No crash-loop backoff: this is about GPUs, the replacement is made at once.)
    w = World(
        *cluster(make_node("node01", "ib-a"), make_node("node02", "ib-a")), make_deployment(replicas=1, gpus_per_node=8), config=ReconcileConfig(backoff_base=0)
    )
    w.step()
    w.engines("sim-g1", node02="exited", node01="joined")
    w.step()
    assert w.state("sim-g1") == "reaping" and w.state("sim-g2") == "pending"
    w.engines("sim-g1", node01="exited")
    w.step()
    assert "sim-g1" not in w.replicas
    w.step()
    assert w.state("sim-g2") == "launching"
    assert w.where("sim-g2") == ("ib-a", [("node01", list(range(8))), ("node02", list(range(8)))])


def test_all_members_on_lost_nodes_go_straight_to_gone():
    # (No crash-loop backoff: the replacement is made in the same cycle.)
    w = World(*seed_cluster(), seed_deployment(replicas=1), config=ReconcileConfig(backoff_base=0))
    w.step()
    w.lease("node01", "lost")
    w.lease("node02", "lost")
    plan = w.step()
    assert w.events("sim-g1") == [("sim-g1", "failed"), ("sim-g1", "reaping"), ("sim-g1", "gone")]
    assert plan.stops == [] and "sim-g1" in plan.deletes and "sim-g1" not in plan.writes
    assert w.where("sim-g2")[0] == "ib-b"


# --------------------------------------------------------------------------
# Case 5: scale down, deployment deleted
# --------------------------------------------------------------------------


def test_scale_down_removes_pending_then_not_ready_then_newest():
    nodes, leases = cluster(*(make_node(f"node0{i}", None) for i in range(1, 5)))
    w = World(nodes, leases, make_deployment(replicas=4, gpus_per_node=8, nodes_per_replica=1))
    w.step()
    for rid in ("sim-g1", "sim-g2", "sim-g3"):
        w.engines(rid, all="ready")
    # sim-g4 stays launching; add a pending sim-g5 by asking for 5 on 4 nodes.
    w.deployments["sim"] = msgspec.structs.replace(w.deployments["sim"], replicas=5)
    w.step()
    assert [w.state(f"sim-g{i}") for i in range(1, 6)] == ["ready"] * 3 + ["launching", "pending"]
    for want, removed in [(4, "sim-g5"), (3, "sim-g4"), (2, "sim-g3")]:
        w.deployments["sim"] = msgspec.structs.replace(w.deployments["sim"], replicas=want)
        plan = w.step()
        if removed == "sim-g5":
            assert plan.deletes == ["sim-g5"] and plan.stops == []
            assert w.events() == [("sim-g5", "gone")]
        else:
            assert w.state(removed) == "reaping"
            leader = w.replicas[removed].members[0].node_id
            assert [(s.node_id, s.replica_id) for s in plan.stops] == [(leader, removed)]
            assert w.replicas[removed].reason == f"scaled down to {want}"
            w.engines(removed, all="exited")
    w.step()
    assert sorted(w.replicas) == ["sim-g1", "sim-g2"]


def test_deleted_deployment_on_a_draining_node_is_reaped_as_deleted():
    w = ready_seed()
    w.nodes["node01"] = make_node("node01", "ib-a", admin="draining")
    del w.deployments["sim"]
    w.step()
    assert w.replicas["sim-g1"].reason == w.replicas["sim-g2"].reason == "deployment deleted"


def test_deleted_deployment_is_stopped_and_reaped():
    w = ready_seed()
    del w.deployments["sim"]
    plan = w.step()
    assert {w.state("sim-g1"), w.state("sim-g2")} == {"reaping"}
    assert sorted(s.node_id for s in plan.stops) == ["node01", "node02", "node03", "node04"]
    assert w.replicas["sim-g1"].reason == "deployment deleted"
    assert plan.launches == [] and plan.generations == {}
    w.engines("sim-g1", all="exited")
    w.engines("sim-g2", all="exited")
    w.step()
    assert w.replicas == {}


# --------------------------------------------------------------------------
# Case 6: draining and cordoned nodes
# --------------------------------------------------------------------------


def test_draining_node_replica_is_replaced_first_then_reaped_once_the_new_is_ready():
    nodes, leases = cluster(*(make_node(f"node0{i}", "ib-a") for i in range(1, 5)))
    w = World(nodes, leases, make_deployment(replicas=1, gpus_per_node=8))
    w.step()
    w.engines("sim-g1", all="ready")
    w.step()
    assert w.where("sim-g1")[1][0][0] == "node01"
    w.nodes["node02"] = make_node("node02", "ib-a", admin="draining")
    w.step()
    assert w.state("sim-g1") == "ready"  # still serving while its replacement starts
    assert w.where("sim-g2") == ("ib-a", [("node03", list(range(8))), ("node04", list(range(8)))])
    w.step()
    assert w.state("sim-g1") == "ready" and not w.plan.stops
    w.engines("sim-g2", all="ready")
    plan = w.step()
    assert w.state("sim-g2") == "ready" and w.state("sim-g1") == "reaping"
    assert "node02 draining" in w.replicas["sim-g1"].reason
    assert sorted(s.node_id for s in plan.stops) == ["node01", "node02"]


def test_draining_node_with_nowhere_to_go_keeps_its_replica():
    w = World(*cluster(make_node("node01", "ib-a"), make_node("node02", "ib-a")), make_deployment(replicas=1, gpus_per_node=8))
    w.step()
    w.engines("sim-g1", all="ready")
    w.step()
    w.nodes["node01"] = make_node("node01", "ib-a", admin="draining")
    w.step()
    w.step()
    assert w.state("sim-g1") == "ready"
    assert w.state("sim-g2") == "pending" and R.DRAINING in w.replicas["sim-g2"].reason


def test_cordoned_node_keeps_its_replica_and_takes_nothing_new():
    w = World(*cluster(make_node("node01", None), make_node("node02", None)), make_deployment(replicas=1, gpus_per_node=4, nodes_per_replica=1))
    w.step()
    w.engines("sim-g1", all="ready")
    w.step()
    assert w.where("sim-g1") == (None, [("node01", [0, 1, 2, 3])])
    w.nodes["node01"] = make_node("node01", None, admin="cordoned")
    w.deployments["sim"] = msgspec.structs.replace(w.deployments["sim"], replicas=4)
    w.step()
    assert w.state("sim-g1") == "ready" and not w.plan.stops
    # node01 has four idle GPUs, but cordoned: both new replicas go to node02, the last waits.
    assert [w.where(f"sim-g{i}")[1][0][0] for i in (2, 3)] == ["node02", "node02"]
    assert w.state("sim-g4") == "pending"
    assert "1 cordoned" in w.replicas["sim-g4"].reason and "1 not_enough_free_gpus" in w.replicas["sim-g4"].reason


# --------------------------------------------------------------------------
# Case 7: rolling update when the engine template changes
# --------------------------------------------------------------------------

TEMPLATE_CHANGES = [
    ("model", {"model": "other"}, True),
    ("engine", {"engine": "vllm"}, True),
    ("args", {"engine_args": ["--max-model-len", "8192"]}, True),
    ("env", {"env": {"NCCL_DEBUG": "INFO"}}, True),
    ("gpus", {"gpus_per_node": 8}, True),
    ("nodes", {"nodes_per_replica": 1}, True),
    ("replica count", {"replicas": 5}, False),
    ("startup timeout", {"startup_timeout": 30.0}, False),
    ("generation counter", {"last_generation": 9}, False),
]


@pytest.mark.parametrize("changes, replaced", [c[1:] for c in TEMPLATE_CHANGES], ids=[c[0] for c in TEMPLATE_CHANGES])
def test_template_digest_covers_what_a_replica_runs_and_nothing_else(changes, replaced):
    base = make_deployment()
    assert (template_digest(base) != template_digest(msgspec.structs.replace(base, **changes))) is replaced
    assert template_digest(base) == template_digest(make_deployment())  # stable: a pure function of the spec


def four_single_node_replicas_world(replicas: int, nodes: int) -> World:
    w = World(*cluster(*(make_node(f"node0{i}", None) for i in range(1, nodes + 1))), make_deployment(replicas=replicas, gpus_per_node=8, nodes_per_replica=1))
    w.step()
    for i in range(1, replicas + 1):
        w.engines(f"sim-g{i}", all="ready")
    w.step()
    assert all(w.state(f"sim-g{i}") == "ready" for i in range(1, replicas + 1))
    return w


def change_template(w: World, **changes) -> None:
    w.deployments["sim"] = msgspec.structs.replace(w.deployments["sim"], **changes)


def test_template_change_with_room_surges_then_retires_old_replicas_as_new_ones_are_ready():
    w = four_single_node_replicas_world(replicas=2, nodes=4)
    change_template(w, engine_args=["--new"])
    plan = w.step()
    # The new ones start beside the old, which keep serving.
    assert [w.state(r) for r in ("sim-g1", "sim-g2", "sim-g3", "sim-g4")] == ["ready", "ready", "launching", "launching"]
    assert plan.stops == [] and {launch.command.engine_args[0] for launch in plan.launches} == {"--new"}
    w.engines("sim-g3", all="ready")
    plan = w.step()
    # One new ready: the oldest old one goes, the other still serves.
    assert (w.state("sim-g1"), w.state("sim-g2")) == ("reaping", "ready")
    assert w.replicas["sim-g1"].reason.startswith("deployment spec changed")
    assert [s.replica_id for s in plan.stops] == ["sim-g1"]
    w.engines("sim-g1", all="exited")
    w.engines("sim-g4", all="ready")
    w.step()
    assert "sim-g1" not in w.replicas and w.state("sim-g2") == "reaping"
    w.engines("sim-g2", all="exited")
    w.step()
    assert sorted(w.replicas) == ["sim-g3", "sim-g4"] and {w.state(r) for r in w.replicas} == {"ready"}


def test_template_change_without_room_replaces_one_at_a_time_and_one_keeps_serving():
    w = four_single_node_replicas_world(replicas=2, nodes=2)
    change_template(w, model="sim-model-v2")
    w.step()
    # No room to surge: the oldest old replica makes room; the other serves meanwhile.
    assert [w.state(r) for r in ("sim-g1", "sim-g2", "sim-g3", "sim-g4")] == ["reaping", "ready", "pending", "pending"]
    assert "makes room" in w.replicas["sim-g1"].reason
    w.engines("sim-g1", all="exited")
    w.step()
    assert "sim-g1" not in w.replicas and w.state("sim-g3") == "launching" and w.state("sim-g4") == "pending"
    w.step()
    assert w.state("sim-g2") == "ready"  # never two down at once: sim-g3 is still on its way up
    w.engines("sim-g3", all="ready")
    w.step()
    assert w.state("sim-g2") == "reaping" and w.replicas["sim-g3"].model == "sim-model-v2"
    w.engines("sim-g2", all="exited")
    w.step()
    w.engines("sim-g4", all="ready")
    w.step()
    assert sorted(w.replicas) == ["sim-g3", "sim-g4"] and {w.replicas[r].model for r in w.replicas} == {"sim-model-v2"}


def test_template_change_without_room_never_takes_two_down_at_once():
    w = four_single_node_replicas_world(replicas=3, nodes=3)
    change_template(w, engine_args=["--v2"])
    w.step()
    assert [w.state(f"sim-g{i}") for i in (1, 2, 3)] == ["reaping", "ready", "ready"]
    for _ in range(3):  # sim-g1's engine has not stopped yet: nothing else goes meanwhile
        w.step()
        assert [w.state(f"sim-g{i}") for i in (1, 2, 3)] == ["reaping", "ready", "ready"]
    w.engines("sim-g1", all="exited")
    w.step()
    w.step()
    assert [w.state(f"sim-g{i}") for i in (2, 3, 4)] == ["ready", "ready", "launching"]  # still only one down


def test_template_change_of_a_single_replica_without_room_waits_serving():
    w = four_single_node_replicas_world(replicas=1, nodes=1)
    change_template(w, env={"X": "1"})
    for _ in range(3):
        plan = w.step()
        assert w.state("sim-g1") == "ready" and plan.stops == []
    assert w.state("sim-g2") == "pending" and R.NOT_ENOUGH_FREE_GPUS in w.replicas["sim-g2"].reason


def test_outdated_replicas_that_serve_nobody_are_retired_at_once():
    w = World(*cluster(*(make_node(f"node0{i}", None) for i in range(1, 4))), make_deployment(replicas=3, gpus_per_node=8, nodes_per_replica=1))
    w.deployments["sim"] = msgspec.structs.replace(w.deployments["sim"], replicas=4)
    w.step()
    assert [w.state(f"sim-g{i}") for i in range(1, 5)] == ["launching"] * 3 + ["pending"]
    change_template(w, engine_args=["--v2"])
    plan = w.step()
    assert [w.state(f"sim-g{i}") for i in range(1, 4)] == ["reaping"] * 3
    assert "sim-g4" not in w.replicas and "sim-g4" in plan.deletes  # pending: held nothing
    assert sorted(s.replica_id for s in plan.stops) == ["sim-g1", "sim-g2", "sim-g3"]


def test_records_without_a_digest_are_never_outdated():
    w = ready_seed()
    for rid in ("sim-g1", "sim-g2"):
        w.replicas[rid] = msgspec.structs.replace(w.replicas[rid], spec_digest="")
    change_template(w, engine_args=["--v2"])
    plan = w.step()
    assert plan.stops == [] and plan.launches == [] and sorted(w.replicas) == ["sim-g1", "sim-g2"]


def test_ctl_deployments_counts_outdated_replicas_during_a_rollout():
    from llmgw.services.ctl.ops import deployment_table

    w = four_single_node_replicas_world(replicas=2, nodes=4)
    assert deployment_table(w.deployments, w.replicas)[1][3:6] == ("2/2", "1 node(s) × 8 GPU(s)", "-")
    change_template(w, engine_args=["--v2"])
    w.step()
    assert deployment_table(w.deployments, w.replicas)[1][3:6] == ("2/2", "1 node(s) × 8 GPU(s)", "2")
    w.engines("sim-g3", all="ready")
    w.step()  # sim-g1 reaping: on its way out, no longer counted as outdated
    assert deployment_table(w.deployments, w.replicas)[1][3:6] == ("2/2", "1 node(s) × 8 GPU(s)", "1")


def test_count_or_timeout_changes_replace_nothing():
    w = ready_seed()
    assert w.replicas["sim-g1"].spec_digest == template_digest(w.deployments["sim"])
    change_template(w, startup_timeout=30.0)
    plan = w.step()
    assert plan.stops == [] and plan.launches == [] and {w.state(r) for r in w.replicas} == {"ready"}


# --------------------------------------------------------------------------
# Generations, ports, purity
# --------------------------------------------------------------------------


def test_generations_never_go_back_even_if_the_spec_counter_lags():
    w = ready_seed()
    w.deployments["sim"] = msgspec.structs.replace(w.deployments["sim"], last_generation=0, replicas=3)
    plan = w.step()
    assert "sim-g3" in plan.writes and plan.generations == {"sim": 3}


def test_ports_never_reused_on_a_node_across_replicas():
    nodes, leases = cluster(make_node("node01", None))
    w = World(nodes, leases, make_deployment(replicas=4, gpus_per_node=2, nodes_per_replica=1))
    w.step()
    ports = [p for r in w.replicas.values() for m in r.members for p in (m.rendezvous_port, m.http_port)]
    assert sorted(ports) == list(range(20000, 20008))


def test_port_range_from_config():
    nodes, leases = cluster(make_node("node01", None))
    cfg = ReconcileConfig(ports=PortRange(base=40000, count=3))
    w = World(nodes, leases, make_deployment(replicas=2, gpus_per_node=1, nodes_per_replica=1), config=cfg)
    w.step()
    assert w.replicas["sim-g1"].members[0].rendezvous_port == 40000
    assert w.state("sim-g2") == "pending" and R.NO_FREE_PORTS in w.replicas["sim-g2"].reason


def test_reconcile_changes_none_of_its_arguments():
    w = ready_seed()
    w.lease("node02", "lost")
    args = (w.deployments, w.replicas, w.nodes, w.leases)
    before = copy.deepcopy(args)
    encoded = msgspec.json.encode([list(a.values()) for a in args])
    reconcile(*args, w.now + 1)
    assert msgspec.json.encode([list(a.values()) for a in args]) == encoded
    assert args == before


def test_same_inputs_same_plan():
    w = ready_seed()
    w.lease("node02", "lost")
    a = reconcile(w.deployments, w.replicas, w.nodes, w.leases, 5_000.0)
    b = reconcile(w.deployments, w.replicas, w.nodes, w.leases, 5_000.0)
    assert a == b


def test_two_thousand_nodes_thousand_two_node_replicas_is_linear_work(monkeypatch):
    """Not a timing test: counts per-node filter walks, which a quadratic design would multiply."""
    calls = {"n": 0}
    real = placement.check_node

    def counting(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(placement, "check_node", counting)
    nodes, leases = cluster(*(make_node(f"n{i:04d}", f"ib-{i % 20}") for i in range(2000)))
    dep = make_deployment("big", replicas=1000, gpus_per_node=8, nodes_per_replica=2)
    plan = reconcile({"big": dep}, {}, nodes, leases, T0)
    assert len(plan.writes) == 1000 and len(plan.launches) == 2000 and plan.pending == {}
    used = [(launch.node_id, g) for launch in plan.launches for g in launch.command.gpus]
    assert len(used) == len(set(used)) == 16_000
    assert calls["n"] <= 2 * 2000  # one verification per chosen node, no walk over all nodes per replica
    # 500 more than fit: the refusal is explained once per cycle, not once per replica.
    calls["n"] = 0
    replicas, deps = apply_plan(plan, {}, {"big": dep})
    deps["big"] = msgspec.structs.replace(deps["big"], replicas=1500)
    plan = reconcile(deps, replicas, nodes, leases, T0 + 1)
    assert sum(1 for r in plan.writes.values() if r.state == "pending") == 500
    assert calls["n"] <= 2000


# --------------------------------------------------------------------------
# Fencing
# --------------------------------------------------------------------------


def _fact(rid, generation, state="ready"):
    return EngineFact(replica_id=rid, generation=generation, state=state)


FENCE = [
    # id, node, reported engine, expected stop reason fragment ("" = left alone)
    ("member-current", "node01", _fact("sim-g1", 1), ""),
    ("unknown-replica", "node01", _fact("sim-g9", 9), "no longer exists"),
    ("older-generation", "node01", _fact("sim-g1", 0), "older than the record's 1"),
    ("not-a-member", "node03", _fact("sim-g1", 1), "node03 is not a member of sim-g1"),
    ("already-exited", "node01", _fact("sim-g9", 9, state="exited"), ""),
    ("replica-reaping", "node01", _fact("sim-r", 5), "sim-r is reaping"),
]


@pytest.mark.parametrize("node, fact, why", [c[1:] for c in FENCE], ids=[c[0] for c in FENCE])
def test_fence(node, fact, why):
    w = seed_world(replicas=1)
    w.step()
    reaping = msgspec.structs.replace(w.replicas["sim-g1"], id="sim-r", generation=5, state="reaping")
    stops = fence({node: [fact]}, {**w.replicas, "sim-r": reaping})
    if not why:
        assert stops == []
        return
    (stop,) = stops
    assert (stop.node_id, stop.replica_id, stop.generation) == (node, fact.replica_id, fact.generation)
    assert why in stop.reason
    assert stop.command.replica_id == fact.replica_id and stop.command.generation == fact.generation


def test_node_back_from_lost_has_its_reaped_engines_fenced():
    w = ready_seed()
    w.lease("node02", "lost")
    w.step()
    w.engines("sim-g1", node01="exited")
    w.step()
    assert "sim-g1" not in w.replicas
    w.lease("node02", "ready")
    stops = fence({"node02": [_fact("sim-g1", 1, state="joined")]}, w.replicas)
    assert [(s.node_id, s.replica_id) for s in stops] == [("node02", "sim-g1")]


def test_a_new_replica_never_takes_the_id_of_one_deleted_in_the_same_cycle():
    # The spec's counter went back (deleted and re-created without its history)
    # while its one replica is torn down now: the replacement must not be
    # written under the id the same plan deletes.
    nodes, leases = seed_cluster(node01="lost")
    spec = make_deployment("d", replicas=1, gpus_per_node=1, nodes_per_replica=1)
    first = reconcile({"d": spec}, {}, nodes, seed_cluster()[1], 100.0)
    replicas, _ = apply_plan(first, {}, {"d": spec})
    assert [m.node_id for r in replicas.values() for m in r.members] == ["node01"]
    plan = reconcile({"d": spec}, replicas, nodes, leases, 200.0)
    assert plan.deletes == ["d-g1"]
    assert set(plan.writes).isdisjoint(plan.deletes) and list(plan.writes) == ["d-g2"]
