"""The reconciler's hardware cases (case 11, docs/hardware.md) and placement around bad GPUs, as tables.

Pure: node records as the registry would hold them after an agent re-read its
hardware (an HCA port DOWN, a GPU with an XID, memory held by a foreign
process), a Plan out. ``World`` applies plans the way the shell does.
"""

from __future__ import annotations

import msgspec
import pytest

from llmgw.services.scheduler import reasons as R
from llmgw.services.scheduler.placement import explain, place, request_for
from llmgw.services.scheduler.view import ClusterView
from llmgw.shared.schemas import FabricMembership, NodeRecord
from llmgw.shared.states import EngineState as E
from llmgw.shared.states import ReplicaState as RS

from .builders import cluster, make_deployment, make_node, seed_cluster, seed_deployment
from .test_reconcile_gray import World

HCA_DOWN = "mlx5_1: no ACTIVE port: port 1 is 1: DOWN (3: Disabled)"
XID79 = "XID 79: GPU has fallen off the bus (nvidia-smi: Unable to determine the device handle for GPU 0000:38:00.0: Unknown Error)"


def fabric_down(rec: NodeRecord, fabric: str, problem: str = HCA_DOWN) -> NodeRecord:
    fabrics = [msgspec.structs.replace(f, usable=False, problem=problem) if f.name == fabric else f for f in rec.fabrics]
    return msgspec.structs.replace(rec, fabrics=fabrics)


def gpu(rec: NodeRecord, index: int, **health) -> NodeRecord:
    gpus = [msgspec.structs.replace(g, **health) if g.index == index else g for g in rec.gpus]
    return msgspec.structs.replace(rec, gpus=gpus)


def seed_ready(replicas: int = 2) -> World:
    """The seed's deployment ready: sim-g1 on ib-a (node01 leader), sim-g2 on ib-b."""
    w = World(*seed_cluster(), seed_deployment(replicas=replicas))
    w.step()
    for rid in list(w.replicas):
        w.all_members(rid, E.READY)
    w.step()
    assert all(r.state == RS.READY for r in w.replicas.values())
    return w


def where(w: World, rid: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(m.node_id, tuple(m.gpus)) for m in w.replicas[rid].members]


# --------------------------------------------------------------------------
# Fabric unusable on a node
# --------------------------------------------------------------------------


@pytest.mark.parametrize("state", [RS.READY, RS.DEGRADED, RS.WAITING, RS.LAUNCHING])
def test_a_fabric_going_unusable_fails_the_multi_node_replica_on_it_at_once(state):
    w = World(*seed_cluster(), seed_deployment(replicas=1))
    w.step()
    assert [n for n, _ in where(w, "sim-g1")] == ["node01", "node02"] and w.replicas["sim-g1"].fabric == "ib-a"
    if state != RS.LAUNCHING:
        w.all_members("sim-g1", E.JOINED if state == RS.WAITING else E.READY)
        w.step()
        if state == RS.DEGRADED:
            w.member("sim-g1", "node01", E.STALLED, "canary got no token")
            w.step()
    assert w.state("sim-g1") == state
    w.nodes["node02"] = fabric_down(w.nodes["node02"], "ib-a")
    plan = w.step(0.1)  # no lease involved: the very next cycle
    assert w.events("sim-g1")[:2] == [("sim-g1", RS.FAILED), ("sim-g1", RS.REAPING)]
    failed = plan.events[0]
    assert failed.detail == f"fabric ib-a unusable on node02: {HCA_DOWN}"
    # Both engines still run (NCCL hangs, nothing exits): both are stopped.
    assert sorted(s.node_id for s in plan.stops) == ["node01", "node02"]
    # Rebuilt whole where the fabric is healthy, in the same cycle, no backoff:
    # a hardware failure is not the deployment crash-looping.
    assert w.state("sim-g2") == RS.LAUNCHING and w.replicas["sim-g2"].fabric == "ib-b"
    assert sorted(n for n, _ in where(w, "sim-g2")) == ["node03", "node04"]
    assert plan.backoffs == {}
    # The node is implicated (towards auto-cordon), not cordoned by one failure.
    assert [f.node_id for f in plan.implicated] == ["node02"] and plan.cordons == []


def test_a_fabric_going_unusable_leaves_replicas_on_other_fabrics_and_single_node_ones_alone():
    recs, leases = seed_cluster()
    single = make_deployment("one", replicas=1, nodes_per_replica=1, gpus_per_node=4)
    w = World(recs, leases, seed_deployment(replicas=2), single)
    w.step()
    for rid in list(w.replicas):
        w.all_members(rid, E.READY)
    w.step()
    multi_on_a = next(r.id for r in w.replicas.values() if r.deployment == "sim" and r.fabric == "ib-a")
    multi_on_b = next(r.id for r in w.replicas.values() if r.deployment == "sim" and r.fabric == "ib-b")
    one = next(r.id for r in w.replicas.values() if r.deployment == "one")
    # Put the single-node replica on node02 whatever placement chose.
    r1 = w.replicas[one]
    w.replicas[one] = msgspec.structs.replace(r1, members=[msgspec.structs.replace(r1.members[0], node_id="node02", gpus=[4, 5, 6, 7])])
    w.nodes["node02"] = fabric_down(w.nodes["node02"], "ib-a")
    w.step(0.1)
    assert w.state(multi_on_a) in (RS.REAPING, RS.FAILED)
    assert w.state(multi_on_b) == RS.READY
    assert w.state(one) == RS.READY


def test_a_node_whose_fabric_is_down_still_takes_single_node_work():
    recs, leases = cluster(make_node("node01", "ib-a"), make_node("node02", "ib-a", usable=False, problem=HCA_DOWN))
    view = ClusterView.build(recs, leases, [])
    multi = place(request_for(make_deployment(replicas=1, nodes_per_replica=2, gpus_per_node=4)), view)
    assert not multi.placed and multi.reasons["node02"] == R.FABRIC_UNUSABLE and HCA_DOWN in multi.details["node02"]
    single = make_deployment("one", nodes_per_replica=1, gpus_per_node=8)
    recs["node01"] = msgspec.structs.replace(recs["node01"], admin="cordoned")
    result = place(request_for(single), ClusterView.build(recs, leases, []))
    assert result.placed and result.members[0].node_id == "node02"


def test_a_fabric_dropped_from_a_members_record_fails_the_replica():
    w = seed_ready(replicas=1)
    rec = w.nodes["node02"]
    w.nodes["node02"] = msgspec.structs.replace(rec, fabrics=[FabricMembership(name="ib-x", hcas=["mlx5_9"])])
    w.step(0.1)
    assert w.plan.events[0].what == RS.FAILED
    assert w.plan.events[0].detail == "fabric ib-a no longer configured on node02"


def test_a_usable_fabric_and_healthy_gpus_change_nothing():
    w = seed_ready()
    before = dict(w.replicas)
    w.step(5.0)
    assert w.replicas == before and w.plan.events == [] and w.plan.stops == []


# --------------------------------------------------------------------------
# GPU health
# --------------------------------------------------------------------------


def two_single_node_replicas() -> World:
    """node01 only, 8 GPUs; deployment of 2 single-node replicas × 4 GPUs, ready."""
    recs, leases = cluster(make_node("node01", None))
    w = World(recs, leases, make_deployment("one", replicas=2, nodes_per_replica=1, gpus_per_node=4))
    w.step()
    for rid in list(w.replicas):
        w.all_members(rid, E.READY)
    w.step()
    assert sorted(where(w, r)[0][1] for r in w.replicas) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    return w


@pytest.mark.parametrize(
    "health, words",
    [
        ({"healthy": False, "problem": XID79}, f"GPU 5 on node01 unhealthy: {XID79}"),
        ({"healthy": False, "problem": "2 uncorrectable ECC errors (volatile)"}, "GPU 5 on node01 unhealthy: 2 uncorrectable ECC errors (volatile)"),
        ({"healthy": False}, "GPU 5 on node01 unhealthy: reported unhealthy by its agent"),
    ],
)
def test_an_unhealthy_gpu_fails_exactly_the_replica_holding_it(health, words):
    w = two_single_node_replicas()
    holder = next(r for r in w.replicas if 5 in where(w, r)[0][1])
    other = next(r for r in w.replicas if r != holder)
    w.nodes["node01"] = gpu(w.nodes["node01"], 5, **health)
    plan = w.step(0.1)
    assert [(e.subject, e.what) for e in plan.events][:2] == [(holder, RS.FAILED), (holder, RS.REAPING)]
    assert plan.events[0].detail == words
    assert [s.replica_id for s in plan.stops] == [holder]
    assert w.state(other) == RS.READY
    # Its replacement cannot go anywhere: GPUs 4-7 are held until reaped, and
    # once freed GPU 5 is out of service.
    assert plan.backoffs == {}
    w.member(holder, "node01", E.EXITED)
    w.step()
    assert holder not in w.replicas
    pending = [r for r in w.replicas.values() if r.state == RS.PENDING]
    assert len(pending) == 1
    assert R.GPU_UNHEALTHY in pending[0].reason
    # Healthy again: the pending replica is placed on GPUs 4-7.
    w.nodes["node01"] = gpu(w.nodes["node01"], 5, healthy=True, problem="")
    w.step()
    assert pending[0].id in w.replicas and w.state(pending[0].id) == RS.LAUNCHING
    assert where(w, pending[0].id) == [("node01", (4, 5, 6, 7))]


def test_a_gpu_no_longer_listed_fails_the_replica_holding_it():
    w = two_single_node_replicas()
    rec = w.nodes["node01"]
    w.nodes["node01"] = msgspec.structs.replace(rec, gpus=[g for g in rec.gpus if g.index != 2])
    plan = w.step(0.1)
    holder = plan.events[0].subject
    assert plan.events[0].what == RS.FAILED and plan.events[0].detail == "GPU 2 on node01 no longer listed by its agent"
    assert 2 in where(w, holder)[0][1]


def test_a_gpu_failure_while_launching_does_not_start_a_backoff():
    recs, leases = cluster(make_node("node01", None), make_node("node02", None))
    w = World(recs, leases, make_deployment("one", replicas=1, nodes_per_replica=1, gpus_per_node=8))
    w.step()
    node = where(w, "one-g1")[0][0]
    w.nodes[node] = gpu(w.nodes[node], 0, healthy=False, problem=XID79)
    plan = w.step(0.1)
    assert plan.backoffs == {} and "one" not in plan.pending
    assert w.state("one-g2") == RS.LAUNCHING and where(w, "one-g2")[0][0] != node


def test_a_foreign_process_keeps_its_gpu_out_of_placement_but_fails_nothing():
    w = two_single_node_replicas()
    w.nodes["node01"] = gpu(w.nodes["node01"], 1, foreign_mib=20480, foreign_pids=[4242])
    w.step(0.1)
    assert all(r.state == RS.READY for r in w.replicas.values()) and w.plan.stops == []
    # Scale to 3 on a 12-GPU node whose free GPUs 8-11 include a busy one? Use a
    # fresh node instead: 8 GPUs, GPU 1 busy, 8 wanted.
    recs, leases = cluster(gpu(make_node("node01", None), 1, foreign_mib=20480, foreign_pids=[4242]))
    view = ClusterView.build(recs, leases, [])
    result = place(request_for(make_deployment("one", nodes_per_replica=1, gpus_per_node=8)), view)
    assert not result.placed and result.reasons == {"node01": R.GPU_FOREIGN}
    assert result.details["node01"] == ("7 of 8 GPUs free, needs 8; out of service: GPU 1 busy: 20480 MiB held by process(es) llmgw did not start (pid 4242)")
    four = place(request_for(make_deployment("one", nodes_per_replica=1, gpus_per_node=4)), view)
    assert four.placed and four.members[0].gpus == [0, 2, 3, 4]


@pytest.mark.parametrize(
    "unhealthy, foreign, need, reason",
    [
        ([3], [], 8, R.GPU_UNHEALTHY),
        ([], [3], 8, R.GPU_FOREIGN),
        ([3], [4], 8, R.GPU_UNHEALTHY),  # either way it fits only if both were fine; unhealthy is named
        ([3], [], 7, None),
        ([], [], 8, None),
    ],
)
def test_gpu_capacity_reasons(unhealthy, foreign, need, reason):
    rec = make_node("node01", None)
    for i in unhealthy:
        rec = gpu(rec, i, healthy=False, problem=XID79)
    for i in foreign:
        rec = gpu(rec, i, foreign_mib=100, foreign_pids=[7])
    recs, leases = cluster(rec)
    result = place(request_for(make_deployment("one", nodes_per_replica=1, gpus_per_node=need)), ClusterView.build(recs, leases, []))
    if reason is None:
        assert result.placed and not set(result.members[0].gpus) & set(unhealthy + foreign)
    else:
        assert result.reasons == {"node01": reason}


def test_a_node_short_of_gpus_even_counting_bad_ones_keeps_the_plain_reason_and_names_them():
    from .test_placement import holding

    rec = gpu(make_node("node01", None, gpus=4), 3, healthy=False, problem=XID79)
    recs, leases = cluster(rec)
    busy = holding("x-g1", ("node01", [0, 1]))
    view = ClusterView.build(recs, leases, [busy])
    result = place(request_for(make_deployment("one", nodes_per_replica=1, gpus_per_node=3)), view)
    assert result.reasons == {"node01": R.NOT_ENOUGH_FREE_GPUS}
    assert result.details["node01"] == f"1 of 4 GPUs free, needs 3; out of service: GPU 3 unhealthy: {XID79}"


def test_explain_shows_which_gpu_is_out_of_service_and_why():
    recs, leases = seed_cluster()
    recs["node03"] = gpu(recs["node03"], 6, healthy=False, problem=XID79)
    exp = explain(seed_deployment(replicas=1), ClusterView.build(recs, leases, []))
    node03 = next(n for n in exp.nodes if n.node_id == "node03")
    assert node03.ok and node03.free_gpus == 7
    assert node03.detail == f"7 of 8 GPUs free; ib-b; out of service: GPU 6 unhealthy: {XID79}"
