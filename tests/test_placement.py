"""Placement: filters with reasons, scorers, fabric-first group placement, GPUs and ports.

Pure: no bus, no clock. Tables of named cases over the seed cluster and small
variations of it.
"""

from __future__ import annotations

import pytest

from llmgw.services.scheduler import reasons as R
from llmgw.services.scheduler.placement import (
    FILTERS,
    GROUP_SCORERS,
    PlacementCache,
    Request,
    _indexes,
    check_node,
    explain,
    place,
)
from llmgw.services.scheduler.scorers import NodeBinPack
from llmgw.services.scheduler.view import ClusterView, PortRange
from llmgw.shared.errors import ConfigError
from llmgw.shared.schemas import Replica, ReplicaMember

from .builders import cluster, make_deployment, make_lease, make_node, seed_cluster, seed_deployment

SEED_REQ = Request("sim", gpus_per_node=4, nodes_per_replica=2)


def holding(rid, *members, state="ready", fabric=None, deployment="other"):
    """A replica holding ``members``: (node, gpus[, rendezvous, http])."""
    ms = []
    for rank, spec in enumerate(members):
        node_id, gpus, *ports = spec
        rdzv, http = ports if ports else (0, 0)
        ms.append(
            ReplicaMember(
                node_id=node_id,
                rank=rank,
                role="leader" if rank == 0 else "worker",
                gpus=list(gpus),
                rendezvous_port=rdzv,
                http_port=http,
                serves_http=rank == 0,
            )
        )
    return Replica(
        id=rid,
        deployment=deployment,
        model="m",
        engine="sim",
        generation=1,
        state=state,
        fabric=fabric,
        members=ms,
    )


def view_of(nodes, leases, *replicas, ports=None):
    return ClusterView.build(nodes, leases, replicas, ports=ports)


def place_and_commit(request, view, rid):
    result = place(request, view)
    assert result.placed, result.summary
    replica = Replica(
        id=rid,
        deployment=request.deployment,
        model="m",
        engine="sim",
        generation=1,
        state="launching",
        fabric=result.fabric,
        members=result.members,
    )
    view.commit(replica)
    return result


# --------------------------------------------------------------------------
# The seed cluster
# --------------------------------------------------------------------------


def test_seed_two_replicas_land_one_per_fabric():
    view = view_of(*seed_cluster())
    first = place_and_commit(SEED_REQ, view, "sim-g1")
    second = place_and_commit(SEED_REQ, view, "sim-g2")
    assert (first.fabric, second.fabric) == ("ib-a", "ib-b")
    assert [(m.node_id, m.gpus) for m in first.members] == [("node01", [0, 1, 2, 3]), ("node02", [0, 1, 2, 3])]
    assert [(m.node_id, m.gpus) for m in second.members] == [("node03", [0, 1, 2, 3]), ("node04", [0, 1, 2, 3])]


def test_second_replica_on_a_node_gets_gpus_4_to_7_and_node01_stays_idle():
    nodes, leases = seed_cluster(node02="lost")
    view = view_of(
        nodes,
        leases,
        holding("sim-g1", ("node01", range(4)), ("node02", range(4)), state="reaping", fabric="ib-a", deployment="sim"),
        holding("sim-g2", ("node03", range(4), 20000, 20001), ("node04", range(4)), fabric="ib-b", deployment="sim"),
    )
    result = place(SEED_REQ, view)
    assert result.fabric == "ib-b"
    assert [(m.node_id, m.gpus) for m in result.members] == [("node03", [4, 5, 6, 7]), ("node04", [4, 5, 6, 7])]
    assert "node01" not in {m.node_id for m in result.members}


def test_leader_is_rank_0_and_the_only_member_with_ports():
    view = view_of(*seed_cluster())
    leader, worker = place(SEED_REQ, view).members
    assert (leader.rank, leader.role, leader.serves_http) == (0, "leader", True)
    assert (worker.rank, worker.role, worker.serves_http) == (1, "worker", False)
    assert (leader.rendezvous_port, leader.http_port) == (20000, 20001)
    assert (worker.rendezvous_port, worker.http_port) == (0, 0)


def test_place_is_a_query_it_reserves_nothing():
    view = view_of(*seed_cluster())
    a, b = place(SEED_REQ, view), place(SEED_REQ, view)
    assert a.members == b.members and a.fabric == b.fabric == "ib-a"


# --------------------------------------------------------------------------
# Filters: one reason per refused node
# --------------------------------------------------------------------------

SINGLE_4 = Request("d", gpus_per_node=4, nodes_per_replica=1)
SINGLE_8 = Request("d", gpus_per_node=8, nodes_per_replica=1)
MULTI_4 = Request("d", gpus_per_node=4, nodes_per_replica=2)


def _full_node03(nodes, leases):
    return [holding("x", ("node03", range(8)))]


def _ports_used(nodes, leases):
    return [holding("x", ("node03", [0], 20000, 20001))]


FILTER_CASES = [
    # id, node03 as built, its lease, request, replicas already there, ports, expected reason
    ("ready-active-fits", make_node("node03", "ib-b"), "ready", MULTI_4, None, None, ""),
    ("suspect", make_node("node03", "ib-b"), "suspect", SINGLE_4, None, None, R.LEASE_NOT_READY),
    ("lost", make_node("node03", "ib-b"), "lost", SINGLE_4, None, None, R.LEASE_NOT_READY),
    ("no-lease", make_node("node03", "ib-b"), None, SINGLE_4, None, None, R.NO_LEASE),
    ("no-record", None, "ready", SINGLE_4, None, None, R.NO_RECORD),
    ("no-mgmt-addr", make_node("node03", "ib-b", mgmt_addr=""), "ready", SINGLE_4, None, None, R.NO_MGMT_ADDR),
    ("cordoned", make_node("node03", "ib-b", admin="cordoned"), "ready", SINGLE_4, None, None, R.CORDONED),
    ("draining", make_node("node03", "ib-b", admin="draining"), "ready", SINGLE_4, None, None, R.DRAINING),
    ("lost-beats-cordoned", make_node("node03", "ib-b", admin="cordoned"), "lost", SINGLE_4, None, None, R.LEASE_NOT_READY),
    ("no-fabric-multi", make_node("node03", None), "ready", MULTI_4, None, None, R.NO_FABRIC),
    ("no-fabric-single-ok", make_node("node03", None), "ready", SINGLE_4, None, None, ""),
    ("hca-down-multi", make_node("node03", "ib-b", usable=False), "ready", MULTI_4, None, None, R.FABRIC_UNUSABLE),
    ("hca-down-single-ok", make_node("node03", "ib-b", usable=False), "ready", SINGLE_4, None, None, ""),
    ("too-few-gpus", make_node("node03", "ib-b", gpus=4), "ready", SINGLE_8, None, None, R.NOT_ENOUGH_GPUS),
    ("full", make_node("node03", "ib-b"), "ready", SINGLE_4, _full_node03, None, R.NOT_ENOUGH_FREE_GPUS),
    ("ports-used-up", make_node("node03", "ib-b"), "ready", SINGLE_4, _ports_used, PortRange(20000, 3), R.NO_FREE_PORTS),
    ("ports-left", make_node("node03", "ib-b"), "ready", SINGLE_4, _ports_used, PortRange(20000, 4), ""),
]


@pytest.mark.parametrize(
    "record, lease, request_, existing, ports, reason",
    [c[1:] for c in FILTER_CASES],
    ids=[c[0] for c in FILTER_CASES],
)
def test_filter_reason_for_node(record, lease, request_, existing, ports, reason):
    nodes, leases = cluster(make_node("node04", "ib-b"))
    if record is not None:
        nodes["node03"] = record
    if lease is not None:
        leases["node03"] = _lease(lease)
    view = view_of(nodes, leases, *(existing(nodes, leases) if existing else ()), ports=ports)
    verdict = check_node(view.nodes["node03"], request_, view)
    assert (verdict.ok, verdict.reason) == (reason == "", reason)
    if reason:
        assert verdict.detail  # an operator gets more than a constant


def _lease(state):
    return make_lease("node03", state)


def test_pipeline_order_is_static_first():
    kinds = [f.static for f in FILTERS]
    assert kinds == sorted(kinds, reverse=True), "static filters must run before dynamic ones"


@pytest.mark.parametrize(
    "lease_states, expected",
    [
        ("suspect", {"node02": R.LEASE_NOT_READY}),
        ("lost", {"node02": R.LEASE_NOT_READY}),
    ],
    ids=["suspect", "lost"],
)
def test_rejections_recorded_per_node_when_unplaceable(lease_states, expected):
    nodes, leases = cluster(make_node("node01", "ib-a"), make_node("node02", "ib-a"), leases={"node02": lease_states})
    result = place(MULTI_4, view_of(nodes, leases))
    assert not result.placed
    assert result.reasons == {"node02": R.LEASE_NOT_READY, "node01": R.FABRIC_TOO_SMALL}
    assert "1 fabric_too_small" in result.summary and "1 lease_not_ready" in result.summary
    assert "ib-a: 1" in result.summary


# --------------------------------------------------------------------------
# Fabrics: first the fabric, then nodes in it; never split
# --------------------------------------------------------------------------


def test_never_splits_a_replica_across_fabrics():
    # One free node on each fabric: four GPUs idle on each side, and still no place.
    nodes, leases = seed_cluster()
    view = view_of(
        nodes,
        leases,
        holding("a", ("node02", range(8))),
        holding("b", ("node04", range(8))),
    )
    result = place(MULTI_4, view)
    assert not result.placed and result.members is None
    assert result.reasons == {
        "node01": R.FABRIC_TOO_SMALL,
        "node02": R.NOT_ENOUGH_FREE_GPUS,
        "node03": R.FABRIC_TOO_SMALL,
        "node04": R.NOT_ENOUGH_FREE_GPUS,
    }


def test_no_fabric_nodes_take_single_node_replicas_only():
    nodes, leases = cluster(make_node("node01", None), make_node("node02", None))
    view = view_of(nodes, leases)
    single = place(SINGLE_4, view)
    assert single.placed and single.fabric is None and [m.node_id for m in single.members] == ["node01"]
    multi = place(MULTI_4, view)
    assert not multi.placed
    assert set(multi.reasons.values()) == {R.NO_FABRIC}


def test_unusable_fabric_is_skipped_for_a_usable_one():
    nodes, leases = cluster(
        make_node("node01", "ib-a", usable=False),
        make_node("node02", "ib-a", usable=False),
        make_node("node03", "ib-b"),
        make_node("node04", "ib-b"),
    )
    result = place(MULTI_4, view_of(nodes, leases))
    assert result.fabric == "ib-b"


def test_node_on_two_fabrics_joins_either_but_one_replica_uses_one():
    nodes, leases = cluster(
        make_node("node01", ["ib-a", "ib-b"]),
        make_node("node02", "ib-a"),
        make_node("node03", "ib-b"),
    )
    view = view_of(nodes, leases)
    first = place_and_commit(Request("d", 8, 2), view, "r1")
    assert first.fabric == "ib-a" and {m.node_id for m in first.members} == {"node01", "node02"}
    second = place(Request("d", 8, 2), view)
    assert not second.placed  # node01 is taken; ib-b has only node03 left


def test_replica_wider_than_any_fabric_stays_unplaced():
    result = place(Request("d", 1, 3), view_of(*seed_cluster()))
    assert not result.placed
    assert "no fabric has 3 nodes that fit (ib-a: 2, ib-b: 2)" in result.summary


# --------------------------------------------------------------------------
# Scorers
# --------------------------------------------------------------------------


def test_bin_packs_single_node_replicas_onto_a_partly_used_node():
    nodes, leases = cluster(make_node("node01", None), make_node("node02", None))
    view = view_of(nodes, leases, holding("x", ("node02", range(4))))
    result = place(SINGLE_4, view)
    assert [(m.node_id, m.gpus) for m in result.members] == [("node02", [4, 5, 6, 7])]


def test_bin_packs_into_a_partly_used_fabric_for_another_deployment():
    nodes, leases = seed_cluster()
    view = view_of(nodes, leases, holding("x", ("node03", range(2)), fabric="ib-b", deployment="other"))
    result = place(SEED_REQ, view)
    assert result.fabric == "ib-b"


def test_spread_beats_bin_packing_for_the_same_deployment():
    nodes, leases = seed_cluster()
    # ib-a already hosts a replica of sim and is the fuller fabric.
    view = view_of(
        nodes,
        leases,
        holding("sim-g1", ("node01", range(6)), ("node02", range(6)), fabric="ib-a", deployment="sim"),
    )
    assert place(Request("sim", 2, 2), view).fabric == "ib-b"


def test_scorers_stay_within_0_and_1():
    nodes, leases = seed_cluster()
    full_a = holding("sim-g1", ("node01", range(8)), ("node02", range(8)), fabric="ib-a", deployment="sim")
    view = view_of(nodes, leases, full_a)
    memo = PlacementCache()
    place(SEED_REQ, view, memo)  # builds the indexes
    for group, index in memo.indexes[True].items():
        for scorer in GROUP_SCORERS:
            assert 0.0 <= scorer.score(group, index, SEED_REQ, view) <= 1.0
    oracle = NodeBinPack()  # best_fit's test oracle, not a pipeline stage
    for node in view.nodes.values():
        assert 0.0 <= oracle.score(node, Request("d", 0, 1), view) <= 1.0


# --------------------------------------------------------------------------
# Placement's memo of a view (PlacementCache), kept beside it
# --------------------------------------------------------------------------


def index_buckets(view, memo, multi):
    """The memo's indexes of ``multi``'s shape, once it has followed the view."""
    return {g: {k: list(b) for k, b in idx.buckets.items()} for g, idx in _indexes(view, memo, multi).items()}


def test_commit_moves_nodes_in_the_indexes_as_a_fresh_build_would_place_them():
    nodes, leases = seed_cluster()
    view, memo = view_of(nodes, leases), PlacementCache()
    place(SEED_REQ, view, memo)  # builds the multi-node indexes
    place(Request("one", 4, 1), view, memo)  # and the single-node ones
    held = holding("sim-g1", ("node01", range(4), 20000, 20001), ("node02", range(4)), fabric="ib-a", deployment="sim")
    view.commit(held)
    assert view.changed == {"node01", "node02"}  # what the memo follows
    fresh, fresh_memo = view_of(nodes, leases, held), PlacementCache()
    place(SEED_REQ, fresh, fresh_memo)
    place(Request("one", 4, 1), fresh, fresh_memo)
    assert index_buckets(view, memo, True)["ib-a"] == {4: ["node01", "node02"]}
    assert not view.changed
    for multi in (False, True):
        assert index_buckets(view, memo, multi) == index_buckets(fresh, fresh_memo, multi)


def test_a_memo_follows_a_node_whose_view_was_replaced():
    """A node view replaced (its record changed: cordoned) is judged again, not by
    the verdict memoised for the one it replaced, and leaves the indexes."""
    nodes, leases = seed_cluster()
    view, memo = view_of(nodes, leases), PlacementCache()
    place(SEED_REQ, view, memo)
    assert "node01" in index_buckets(view, memo, True)["ib-a"][8]
    cordoned = view_of({**nodes, "node01": make_node("node01", "ib-a", admin="cordoned")}, leases).nodes["node01"]
    view.nodes["node01"] = cordoned
    view.changed.add("node01")
    assert "node01" not in index_buckets(view, memo, True)["ib-a"][8]
    assert check_node(cordoned, SEED_REQ, view, memo).reason == R.CORDONED


def test_a_refusal_is_reused_until_the_view_changes_then_recomputed():
    nodes, leases = seed_cluster(node02="lost", node03="lost", node04="lost")
    view, memo = view_of(nodes, leases, holding("a", ("node01", range(4), 20000, 20001))), PlacementCache()
    whole = Request("d", 8, 1)
    first = place(whole, view, memo)
    assert not first.placed and first.details["node01"].startswith("4 of 8 GPUs free")
    assert place(whole, view, memo) == first
    assert list(memo.refusals) == [(8, 1)] and memo.refusals_version == view.version
    view.commit(holding("b", ("node01", [4, 5], 20002, 20003)))
    again = place(whole, view, memo)
    assert again.details["node01"].startswith("2 of 8 GPUs free")  # not the refusal cached before the commit
    assert memo.refusals_version == view.version


# --------------------------------------------------------------------------
# Ports
# --------------------------------------------------------------------------


def test_ports_skip_those_held_on_the_node_and_are_distinct():
    nodes, leases = cluster(make_node("node01", None))
    view = view_of(nodes, leases, holding("x", ("node01", [0], 20000, 20002)))
    (leader,) = place(SINGLE_4, view).members
    assert (leader.rendezvous_port, leader.http_port) == (20001, 20003)


def test_ports_come_from_the_configured_range():
    nodes, leases = cluster(make_node("node01", None))
    (leader,) = place(SINGLE_4, view_of(nodes, leases, ports=PortRange(base=31000, count=10))).members
    assert (leader.rendezvous_port, leader.http_port) == (31000, 31001)


def test_nodes_of_one_host_never_get_a_port_another_node_holds():
    # llmgw up: every node is the same machine, and vLLM's rendezvous listens on *:port.
    nodes, leases = cluster(make_node("node01", None), make_node("node03", None))
    shared = PortRange(shared_by_nodes=True)
    full = holding("x", ("node01", list(range(8)), 20000, 20001))  # node01 is full: node03 it is
    view = view_of(nodes, leases, full, ports=shared)
    (leader,) = place(SINGLE_4, view).members
    assert (leader.node_id, leader.rendezvous_port, leader.http_port) == ("node03", 20002, 20003)
    # Apart (a real cluster), node03's own ports are all free.
    (apart,) = place(SINGLE_4, view_of(nodes, leases, full)).members
    assert (apart.node_id, apart.rendezvous_port, apart.http_port) == ("node03", 20000, 20001)


def test_nodes_of_one_host_take_their_own_free_ports_when_the_shared_pool_is_used_up():
    nodes, leases = cluster(make_node("node01", None), make_node("node03", None))
    view = view_of(nodes, leases, holding("x", ("node01", [0], 20000, 20001)), ports=PortRange(base=20000, count=3, shared_by_nodes=True))
    placed = place(SINGLE_4, view)
    assert placed.placed, placed.summary
    (leader,) = placed.members
    # One port of the host is left: the node's own two lowest, and the agent refuses what is held.
    assert leader.node_id in ("node01", "node03") and len({leader.rendezvous_port, leader.http_port}) == 2


@pytest.mark.parametrize(
    "base, count",
    [(20000, 1), (0, 10), (65530, 10)],
    ids=["too-small", "below-1", "past-65535"],
)
def test_bad_port_range_is_refused_with_a_message(base, count):
    with pytest.raises(ConfigError, match="port range"):
        PortRange(base=base, count=count)


# --------------------------------------------------------------------------
# explain
# --------------------------------------------------------------------------


def test_explain_says_node_by_node_why():
    nodes, leases = seed_cluster(node02="lost")
    nodes["node04"] = make_node("node04", "ib-b", admin="cordoned")
    view = view_of(nodes, leases)
    ex = explain(seed_deployment(), view)
    by_node = {n.node_id: (n.ok, n.reason) for n in ex.nodes}
    assert by_node == {
        "node01": (False, R.FABRIC_TOO_SMALL),
        "node02": (False, R.LEASE_NOT_READY),
        "node03": (False, R.FABRIC_TOO_SMALL),
        "node04": (False, R.CORDONED),
    }
    assert not ex.placeable and ex.fabric is None
    assert ex.fabrics == {"ib-a": 1, "ib-b": 1}
    assert "0/4 nodes fit" in ex.summary


def test_explain_when_placeable_names_fabric_and_leader():
    ex = explain(make_deployment("sim"), view_of(*seed_cluster()))
    assert ex.placeable and (ex.fabric, ex.leader) == ("ib-a", "node01")
    assert all(n.ok and n.reason == "" for n in ex.nodes)
    assert ex.nodes[0].free_gpus == 8 and ex.nodes[0].total_gpus == 8


def test_empty_cluster_says_so():
    result = place(SEED_REQ, view_of({}, {}))
    assert not result.placed and R.NO_NODES in result.summary
