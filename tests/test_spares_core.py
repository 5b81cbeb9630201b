"""Warm spares and restart in place in the pure core (table tests).

The cases are ``cycle.py``'s 12-14: a standby spare promoted in the cycle a
serving replica is found failed, spares placed by the fabric rule and after
every serving replica, taken back for a serving replica that fits nowhere, and
an engine's exit on healthy nodes restarted in place before anything moves.
"""

from __future__ import annotations

import msgspec
import pytest

from llmgw.services.scheduler.cycle import ReconcileConfig
from llmgw.shared.errors import ConfigError
from llmgw.shared.specs import validate_spec
from llmgw.shared.states import ReplicaState as RS

from .builders import cluster, make_deployment, make_node, seed_cluster, seed_deployment
from .test_reconcile import World


def spared_seed(spares: int = 1, config: ReconcileConfig | None = None) -> World:
    """The seed cluster (two fabrics of two 8-GPU nodes), its deployment of two
    2-node x 4-GPU replicas, and ``spares`` more, every leader up."""
    w = World(*seed_cluster(), seed_deployment(spares=spares), config=config)
    w.step()
    for rid in list(w.replicas):
        w.engines(rid, all="ready")
    w.step()
    return w


def states(w: World) -> dict[str, str]:
    return {rid: r.state for rid, r in sorted(w.replicas.items())}


def detail(w: World, rid: str, what: str) -> str:
    return next(e.detail for e in w.plan.events if e.subject == rid and e.what == what)


# --------------------------------------------------------------------------
# Spares come up standby; one is promoted in the cycle a serving one fails
# --------------------------------------------------------------------------


def test_a_replica_that_comes_up_beside_enough_serving_ones_stands_by():
    w = spared_seed()
    assert states(w) == {"sim-g1": RS.READY, "sim-g2": RS.READY, "sim-g3": RS.STANDBY}
    spare = w.replicas["sim-g3"]
    assert spare.endpoint.startswith("http://"), "a spare is loaded: promotion needs nothing more"
    assert "a warm spare (2 of 2 serving)" in spare.reason


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(lambda w: w.lease("node03", "lost"), id="node-lost"),
        pytest.param(lambda w: w.engines("sim-g2", node04="absent"), id="engine-absent"),
        pytest.param(lambda w: w.engines("sim-g2", node04="peer-lost"), id="peer-lost"),
    ],
)
def test_a_standby_is_promoted_in_the_cycle_a_serving_replica_fails(fault):
    w = spared_seed()
    # one replica per fabric serving; the spare beside the first, on ib-a
    assert w.where("sim-g2")[0] == "ib-b" and w.where("sim-g3")[0] == "ib-a"
    fault(w)  # to sim-g2's node04
    plan = w.step()
    # failed and reaping, or (a peer's word, every lease ready) degraded a moment for an exit report
    assert w.state("sim-g2") in (RS.REAPING, RS.DEGRADED)
    assert w.state("sim-g3") == RS.READY
    assert plan.writes["sim-g3"].endpoint == w.replicas["sim-g3"].endpoint
    assert detail(w, "sim-g3", RS.READY).startswith("promoted from standby: 1 of 2 serving")
    # the failure's events come first, then the promotion, in one plan
    order = [(e.subject, e.what) for e in plan.events]
    assert order.index(("sim-g2", w.state("sim-g2") if w.state("sim-g2") == RS.DEGRADED else RS.FAILED)) < order.index(("sim-g3", RS.READY))
    # and a new spare is on its way (placed, or waiting for room)
    new = [r for r in w.replicas.values() if r.generation > 3]
    assert len(new) == (0 if w.state("sim-g2") == RS.DEGRADED else 1)
    assert all(r.state in (RS.LAUNCHING, RS.PENDING) for r in new)


def test_the_rebuilt_spare_stands_by_when_it_comes_up():
    w = spared_seed()
    w.lease("node04", "lost")  # sim-g2 (ib-b) goes; ib-a is full: the new spare waits for room
    w.step()
    new = next(rid for rid, r in w.replicas.items() if r.generation > 3)
    assert w.state(new) == RS.PENDING
    w.lease("node04", "ready")
    w.step()
    assert w.state(new) == RS.LAUNCHING and w.where(new)[0] == "ib-b"
    w.engines(new, all="ready")
    w.step()
    assert sum(1 for r in w.replicas.values() if r.state == RS.READY) == 2
    assert w.state(new) == RS.STANDBY


def test_a_standby_whose_leader_makes_no_token_is_failed_and_rebuilt():
    w = spared_seed()
    w.replicas["sim-g3"] = msgspec.structs.replace(
        w.replicas["sim-g3"],
        members=[
            msgspec.structs.replace(m, engine_state="stalled", engine_detail="canary got no token in 3s") if m.rank == 0 else m
            for m in w.replicas["sim-g3"].members
        ],
    )
    w.step()
    assert w.events("sim-g3")[:2] == [("sim-g3", RS.FAILED), ("sim-g3", RS.REAPING)]
    assert "standby spare's leader" in detail(w, "sim-g3", RS.FAILED) and "canary got no token" in detail(w, "sim-g3", RS.FAILED)
    assert w.state("sim-g1") == w.state("sim-g2") == RS.READY  # nothing serving moved


def test_scaling_down_keeps_the_spare_and_retires_a_serving_replica():
    w = spared_seed()
    w.deployments["sim"] = msgspec.structs.replace(w.deployments["sim"], replicas=1)
    w.step()
    assert w.state("sim-g3") == RS.STANDBY
    assert sorted(r.state for r in w.replicas.values() if r.state in (RS.READY, RS.REAPING)) == [RS.READY, RS.REAPING]


def test_more_spares_asked_turns_an_extra_serving_replica_into_one():
    w = spared_seed(spares=0)
    w.deployments["sim"] = msgspec.structs.replace(w.deployments["sim"], replicas=1, spares=1)
    w.step()
    assert states(w) == {"sim-g1": RS.READY, "sim-g2": RS.STANDBY}
    assert "kept as a warm spare" in detail(w, "sim-g2", RS.STANDBY)


# --------------------------------------------------------------------------
# The fabric rule, and spares after every serving replica
# --------------------------------------------------------------------------


def test_a_spare_never_spans_two_fabrics():
    # One free node in each fabric: room for a 2-node spare only across them.
    nodes, leases = cluster(
        make_node("node01", "ib-a", gpus=4),
        make_node("node02", "ib-a", gpus=4),
        make_node("node03", "ib-a", gpus=4),
        make_node("node04", "ib-b", gpus=4),
        make_node("node05", "ib-b", gpus=4),
        make_node("node06", "ib-b", gpus=4),
    )
    w = World(nodes, leases, make_deployment("sim", replicas=2, spares=1))
    w.step()
    placed = {rid: r for rid, r in w.replicas.items() if r.members}
    assert len(placed) == 2
    for r in placed.values():
        assert len({f.name for m in r.members for f in nodes[m.node_id].fabrics}) == 1
    spare = next(r for r in w.replicas.values() if not r.members)
    assert spare.state == RS.PENDING and "no fabric has 2 nodes that fit" in spare.reason
    assert all(launch.replica_id != spare.id for launch in w.plan.launches)


def test_spares_are_placed_after_every_deployments_serving_replicas():
    # Room for two 2-node replicas: "a"'s spare must not take "b"'s only room,
    # though "a" is converged first.
    nodes, leases = cluster(*(make_node(f"node0{i}", "ib-a", gpus=4) for i in range(1, 5)))
    w = World(nodes, leases, make_deployment("a", replicas=1, spares=1), make_deployment("b", replicas=1))
    w.step()
    assert {rid: bool(r.members) for rid, r in w.replicas.items()} == {"a-g1": True, "a-g2": False, "b-g1": True}
    assert w.replicas["a-g2"].reason.startswith("no_") or "fit" in w.replicas["a-g2"].reason


def test_a_serving_replica_that_fits_nowhere_takes_another_deployments_spare():
    nodes, leases = cluster(*(make_node(f"node0{i}", "ib-a", gpus=4) for i in range(1, 5)))
    w = World(nodes, leases, make_deployment("a", replicas=1, spares=1))
    w.step()
    for rid in list(w.replicas):
        w.engines(rid, all="ready")
    w.step()
    assert states(w) == {"a-g1": RS.READY, "a-g2": RS.STANDBY}
    spare_nodes = [m.node_id for m in w.replicas["a-g2"].members]

    w.deployments["b"] = make_deployment("b", replicas=1)  # no room left
    w.step()
    assert w.state("a-g2") == RS.REAPING and w.replicas["a-g2"].reason.startswith("preempted: deployment b")
    assert w.state("a-g1") == RS.READY  # serving replicas are never taken
    assert w.replicas["b-g1"].state == RS.PENDING
    w.step()  # still reaping: no second spare is taken, and nothing placed on its GPUs yet
    assert w.state("a-g2") == RS.REAPING and w.replicas["b-g1"].state == RS.PENDING

    w.engines("a-g2", all="exited")
    w.step()
    assert "a-g2" not in w.replicas
    assert w.replicas["b-g1"].state == RS.LAUNCHING
    assert sorted(m.node_id for m in w.replicas["b-g1"].members) == sorted(spare_nodes)
    a_spare = [r for r in w.replicas.values() if r.deployment == "a" and r.id != "a-g1"]
    assert [r.state for r in a_spare] == [RS.PENDING]  # "a" wants its spare back, and waits for room


def test_no_spare_is_taken_that_could_not_make_room():
    nodes, leases = cluster(*(make_node(f"node0{i}", "ib-a", gpus=4) for i in range(1, 4)))
    w = World(nodes, leases, make_deployment("a", replicas=1, spares=1, nodes_per_replica=1))
    w.step()
    for rid in list(w.replicas):
        w.engines(rid, all="ready")
    w.step()
    # three nodes: a's serving replica holds one, so freeing the spare's could never fit three
    w.deployments["b"] = make_deployment("b", replicas=1, nodes_per_replica=3)
    w.step()
    assert any(r.state == RS.STANDBY for r in w.replicas.values())
    assert w.replicas["b-g1"].state == RS.PENDING


# --------------------------------------------------------------------------
# Restart in place versus move
# --------------------------------------------------------------------------


def ready_seed_one(config: ReconcileConfig | None = None) -> World:
    w = World(*seed_cluster(), seed_deployment(replicas=1), config=config)
    w.step()
    w.engines("sim-g1", all="ready")
    w.step()
    return w


def test_an_engine_exit_on_healthy_nodes_restarts_in_place_with_the_same_members():
    w = ready_seed_one()
    before = w.replicas["sim-g1"]
    w.engines("sim-g1", node01="exited", node02="peer-lost")  # the leader died; its worker says so
    plan = w.step()
    assert w.state("sim-g1") == RS.RESTARTING
    assert "restart in place: member rank 0 on node01 exited; nodes node01, node02 healthy" in detail(w, "sim-g1", RS.RESTARTING)
    assert sorted((s.node_id, s.generation) for s in plan.stops) == [("node01", 1), ("node02", 1)]
    assert plan.launches == [], "the worker still runs: nothing is launched on GPUs it holds"

    w.engines("sim-g1", node02="exited")
    plan = w.step()
    after = w.replicas["sim-g1"]
    assert after.state == RS.LAUNCHING and after.generation == 2 and after.id == "sim-g1"
    assert [(m.node_id, m.gpus, m.http_port, m.rendezvous_port) for m in after.members] == [
        (m.node_id, m.gpus, m.http_port, m.rendezvous_port) for m in before.members
    ]
    assert all(m.engine_state == "" for m in after.members)
    assert sorted((la.node_id, la.command.generation) for la in plan.launches) == [("node01", 2), ("node02", 2)]
    assert plan.generations == {"sim": 2} and after.restarts == [w.now - 1.0]
    assert "restarted in place on node01, node02 as generation 2" in detail(w, "sim-g1", RS.LAUNCHING)


def test_a_restart_in_place_whose_engines_all_ended_relaunches_in_the_same_cycle():
    w = ready_seed_one()
    w.engines("sim-g1", all="exited")
    w.step()
    assert w.events("sim-g1") == [("sim-g1", RS.RESTARTING), ("sim-g1", RS.LAUNCHING)]


def _exit_and_come_back(w: World) -> None:
    w.engines("sim-g1", all="exited")
    w.step()
    w.engines("sim-g1", all="ready")
    w.step()
    assert w.state("sim-g1") == RS.READY


MOVES = [
    # id, what else is true when the engine exits, why it moves
    ("lease-suspect", lambda w: w.lease("node02", "suspect"), "node node02's lease is suspect"),
    ("node-cordoned", lambda w: w.nodes.__setitem__("node02", msgspec.structs.replace(w.nodes["node02"], admin="cordoned")), "node node02 is cordoned"),
    ("spec-changed", lambda w: w.deployments.__setitem__("sim", msgspec.structs.replace(w.deployments["sim"], engine_args=["--x"])), "deployment spec changed"),
]


@pytest.mark.parametrize("fact, why", [c[1:] for c in MOVES], ids=[c[0] for c in MOVES])
def test_an_engine_exit_moves_when_a_node_is_not_healthy(fact, why):
    w = ready_seed_one()
    fact(w)
    w.engines("sim-g1", node01="exited")
    w.step()
    assert w.events("sim-g1")[:2] == [("sim-g1", RS.FAILED), ("sim-g1", RS.REAPING)]
    assert detail(w, "sim-g1", RS.FAILED) == f"member rank 0 on node01 exited; moved, not restarted in place: {why}"


def test_a_peer_lost_word_waits_a_moment_for_the_exit_and_restarts_in_place():
    w = ready_seed_one()
    w.engines("sim-g1", node02="peer-lost")  # the worker's word comes first; the leader's exit races it
    w.step(0.1)
    assert w.state("sim-g1") == RS.DEGRADED
    assert "waiting 0.5s for an engine exit to restart in place, else it moves" in detail(w, "sim-g1", RS.DEGRADED)
    w.engines("sim-g1", node01="exited")
    w.step(0.1)
    assert w.state("sim-g1") == RS.RESTARTING


def test_a_peer_lost_word_with_no_exit_moves_after_the_grace():
    w = ready_seed_one()
    w.engines("sim-g1", node02="peer-lost")
    w.step(0.1)
    w.step(0.3)
    assert w.state("sim-g1") == RS.DEGRADED
    w.step(0.3)
    assert w.events("sim-g1")[:2] == [("sim-g1", RS.FAILED), ("sim-g1", RS.REAPING)]
    assert detail(w, "sim-g1", RS.FAILED).endswith("moved, not restarted in place: no engine exit was reported (a node or its agent may be gone)")


def test_an_absent_engine_moves_at_once():
    w = ready_seed_one()
    w.engines("sim-g1", node02="absent")
    w.step()
    assert w.events("sim-g1")[:2] == [("sim-g1", RS.FAILED), ("sim-g1", RS.REAPING)]


def test_restarts_in_place_are_bounded_within_the_window():
    w = ready_seed_one(ReconcileConfig(restart_in_place=2, restart_window=600.0))
    _exit_and_come_back(w)
    _exit_and_come_back(w)
    assert len(w.replicas["sim-g1"].restarts) == 2
    w.engines("sim-g1", node01="exited")
    w.step()
    assert w.events("sim-g1")[:2] == [("sim-g1", RS.FAILED), ("sim-g1", RS.REAPING)]
    assert detail(w, "sim-g1", RS.FAILED).endswith("moved, not restarted in place: restarted in place 2 time(s) within 10m (restart_in_place 2)")


def test_restarts_older_than_the_window_no_longer_count():
    w = ready_seed_one(ReconcileConfig(restart_in_place=1, restart_window=60.0))
    _exit_and_come_back(w)
    w.step(61.0)
    w.engines("sim-g1", node01="exited")
    w.step()
    assert w.state("sim-g1") in (RS.RESTARTING, RS.LAUNCHING)
    assert len(w.replicas["sim-g1"].restarts) == 1


def test_restart_in_place_off_moves():
    w = ready_seed_one(ReconcileConfig(restart_in_place=0))
    w.engines("sim-g1", node01="exited")
    w.step()
    assert w.state("sim-g1") == RS.REAPING


def test_an_exit_before_the_replica_ever_came_up_is_a_crash_loop_not_a_restart():
    w = World(*seed_cluster(), seed_deployment(replicas=1))
    w.step()
    w.engines("sim-g1", node01="exited")
    w.step()
    assert w.events("sim-g1")[:2] == [("sim-g1", RS.FAILED), ("sim-g1", RS.REAPING)]
    assert w.deployments["sim"].failures == 0 or w.plan.backoffs  # the backoff path, as before


def test_a_node_lost_while_restarting_fails_the_replica_and_it_moves():
    w = ready_seed_one()
    w.engines("sim-g1", node01="exited", node02="peer-lost")
    w.step()
    w.lease("node02", "lost")
    w.step()
    assert w.events("sim-g1")[:2] == [("sim-g1", RS.FAILED), ("sim-g1", RS.REAPING)]
    assert "a node went while restarting" in detail(w, "sim-g1", RS.FAILED)


def test_a_serving_replica_restarting_in_place_is_covered_by_a_spare_and_comes_back_as_one():
    w = spared_seed()
    w.engines("sim-g1", all="exited")
    w.step()
    assert w.state("sim-g3") == RS.READY and w.state("sim-g1") == RS.LAUNCHING
    w.engines("sim-g1", all="ready")
    w.step()
    assert w.state("sim-g1") == RS.STANDBY


# --------------------------------------------------------------------------
# A rolling update brings the spares to the new spec
# --------------------------------------------------------------------------


def test_a_rolling_update_brings_spares_to_the_new_spec():
    w = spared_seed()
    old = set(w.replicas)
    w.deployments["sim"] = msgspec.structs.replace(w.deployments["sim"], engine_args=["--new"])
    w.step()
    assert w.state("sim-g3") == RS.REAPING and "deployment spec changed" in w.replicas["sim-g3"].reason
    assert w.state("sim-g1") == w.state("sim-g2") == RS.READY  # serving until covered
    for _ in range(12):  # agents stop what is stopped, start what is launched
        for rid, r in list(w.replicas.items()):
            if r.state == RS.REAPING:
                w.engines(rid, all="exited")
            elif r.state in (RS.LAUNCHING, RS.WAITING):
                w.engines(rid, all="ready")
        w.step()
        assert sum(1 for r in w.replicas.values() if r.state == RS.READY) >= 1  # never nothing serving
    digest = w.replicas[next(iter(set(w.replicas) - old))].spec_digest
    assert not old & set(w.replicas)
    assert sorted(r.state for r in w.replicas.values()) == [RS.READY, RS.READY, RS.STANDBY]
    assert all(r.spec_digest == digest for r in w.replicas.values())


# --------------------------------------------------------------------------
# The deployment's word, and what ctl shows
# --------------------------------------------------------------------------


def test_ctl_shows_the_standby_spares_and_why_they_stand_by():
    from llmgw.services.ctl.ops import deployment_table, explain_lines, replica_rows
    from llmgw.services.scheduler.service import explain_reply
    from llmgw.services.scheduler.view import ClusterView

    w = spared_seed()
    table = deployment_table(w.deployments, w.replicas, now=w.now)
    assert table[0][6] == "STANDBY/SPARES" and table[1][3] == "2/2" and table[1][6] == "1/1"
    rows = {r["id"]: r for r in replica_rows(w.replicas)}
    assert rows["sim-g3"]["state"] == "standby" and rows["sim-g1"]["state"] == "ready"
    ex = explain_reply(w.deployments["sim"], ClusterView.build(w.nodes, w.leases, w.replicas.values()), w.replicas.values(), w.now)
    assert any(line.startswith("replica sim-g3 standby: leader on node01 loaded; a warm spare") for line in explain_lines(ex))


def test_negative_spares_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"spares: must be 0 or more .* got -1"):
        validate_spec(seed_deployment(spares=-1))


def test_llmgw_up_spares_adds_a_fabric_per_spare_and_refuses_a_negative_count(tmp_path):
    import argparse
    import subprocess
    import sys

    from llmgw.services.devcluster.up import spare_nodes

    args = argparse.Namespace(nodes=4, fabrics=2, spares=1, no_demo=False)
    spare_nodes(args)
    assert (args.nodes, args.fabrics) == (6, 3)  # two nodes a fabric, as the seed's
    args = argparse.Namespace(nodes=4, fabrics=2, spares=0, no_demo=False)
    spare_nodes(args)
    assert (args.nodes, args.fabrics) == (4, 2)
    r = subprocess.run(
        [sys.executable, "-m", "llmgw.services", "up", "--spares", "-1", "--dir", str(tmp_path / "c")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "--spares -1: must be 0 or more" in r.stderr
    assert not (tmp_path / "c").exists(), "refused before touching DIR"


def test_a_replica_coming_up_beside_a_broken_group_serves_rather_than_stands_by():
    w = World(*seed_cluster(), seed_deployment(replicas=1, spares=1))
    w.step()
    w.engines("sim-g1", all="ready")
    w.step()
    assert w.state("sim-g1") == RS.READY and w.state("sim-g2") == RS.LAUNCHING
    # in one cycle: sim-g1's group breaks (a peer's word, every node healthy) and sim-g2 comes up
    w.engines("sim-g1", node02="peer-lost")
    w.engines("sim-g2", all="ready")
    w.step(0.1)
    assert w.state("sim-g1") == RS.DEGRADED and w.state("sim-g2") == RS.READY
    assert w.events("sim-g2") == [("sim-g2", RS.READY)]  # straight to serving, not standby and promoted
