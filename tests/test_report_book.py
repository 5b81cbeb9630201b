"""The scheduler's fold of agents' status reports (``ReportBook``), case by case.

Pure: plain records in, time passed in. The shell around it (the scheduler's
``on_status``) is exercised with real agents in test_node_claims.py and
test_control_plane.py.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.services.scheduler.fence import fence
from llmgw.services.scheduler.reports import OWN_WRITE_WINDOW, ReportBook, report_moves
from llmgw.shared.schemas import EngineFact, Lease, Replica, ReplicaMember, StatusReport
from llmgw.shared.states import EngineState, ReplicaState

T0 = 10_000.0
GRACE = 5.0  # the launch grace (the scheduler's command_timeout)


def replica(rid: str = "r1", *, generation: int = 1, node: str = "node01", created_at: float = T0) -> Replica:
    member = ReplicaMember(node_id=node, rank=0, role="leader", gpus=[0])
    return Replica(
        id=rid, deployment="sim", model="m", engine="sim", generation=generation, state=ReplicaState.LAUNCHING, members=[member], created_at=created_at
    )


def fact(rid: str = "r1", *, generation: int = 1, state: str = "starting", pid: int = 100, rank: int = 0) -> EngineFact:
    return EngineFact(replica_id=rid, generation=generation, rank=rank, state=state, pid=pid)


def report(*engines: EngineFact, node: str = "node01", boot: str = "boot-a", full: bool = False) -> StatusReport:
    return StatusReport(node_id=node, boot_id=boot, full=full, engines=list(engines))


def lease(node: str = "node01", *, boot: str = "boot-a", state: str = "ready", quarantine: str = "", heartbeats: int = 10, since: float = 1.0) -> Lease:
    return Lease(node_id=node, state=state, boot_id=boot, last_renew=T0, since=T0, boot_since=since, boot_heartbeats=heartbeats, quarantine=quarantine)


def book(replicas=None, leases=None, *, max_unknown: int = 4, settle: int = 3) -> ReportBook:
    return ReportBook(
        replicas if replicas is not None else {}, leases if leases is not None else {}, max_unknown=max_unknown, settle_heartbeats=settle, launch_grace=GRACE
    )


# -- whose report is believed ----------------------------------------------------------
@pytest.mark.parametrize(
    "held, why",
    [
        (None, ""),  # no lease yet (or no health monitor): believed
        (lease(boot="boot-a"), ""),  # the incarnation holding the lease
        (lease(boot="boot-b"), "other_boot"),  # a clone, or a new boot not yet holding the lease
        (lease(boot="boot-b", state="suspect"), "other_boot"),
        (lease(boot="boot-b", state="lost"), ""),  # a lost node's returning agent is heard at once, to be fenced
        (lease(boot="boot-a", quarantine="two boots"), "quarantined"),
        (lease(boot="boot-b", state="lost", quarantine="two boots"), "quarantined"),
    ],
)
def test_distrust_names_why_a_report_is_not_believed(held, why):
    b = book(leases={} if held is None else {"node01": held})
    assert b.distrust("node01", "boot-a") == why


# -- the race: the agent's report beats our own record through the watch ----------------
def test_a_report_before_our_own_record_is_known_and_not_fenced():
    mirror: dict[str, Replica] = {}  # the watch has not echoed the write yet
    b = book(mirror)
    rec = replica()
    b.wrote("r1", rec, T0)
    engines, dropped = b.take(report(fact()), T0 + 0.1)
    assert (engines, dropped) == ([fact()], 0)
    known = b.known_replicas({"r1"}, T0 + 0.1)
    assert known == {"r1": rec}
    assert fence({"node01": engines}, known) == []
    # Without our own write the same engine names no replica: fencing stops it.
    assert fence({"node01": engines}, book(mirror).known_replicas({"r1"}, T0 + 0.1)) != []


@pytest.mark.parametrize(
    "mirror_gen, mine_gen, after, expected",
    [
        (None, 2, 1.0, 2),  # only ours: ours
        (1, 2, 1.0, 2),  # ours is newer than the mirror's: ours
        (2, 2, 1.0, 2),  # the same generation: ours (it may carry newer state)
        (3, 2, 1.0, 3),  # the mirror moved past ours: the mirror's
        (1, 2, OWN_WRITE_WINDOW + 2.0, 1),  # ours is too old to outrank the mirror
        (None, 2, OWN_WRITE_WINDOW + 2.0, None),  # ...and forgotten
        (1, None, 1.0, None),  # we deleted it: gone, whatever the mirror still says
    ],
)
def test_known_replicas_prefers_our_recent_write_while_it_is_newest(mirror_gen, mine_gen, after, expected):
    mirror = {} if mirror_gen is None else {"r1": replica(generation=mirror_gen)}
    b = book(mirror)
    b.wrote("r1", None if mine_gen is None else replica(generation=mine_gen), T0)
    known = b.known_replicas({"r1"}, T0 + after)
    assert (known["r1"].generation if "r1" in known else None) == expected


def test_known_replicas_looks_up_only_the_named_ids():
    b = book({"r1": replica("r1"), "r2": replica("r2")})
    assert set(b.known_replicas({"r2", "r9"}, T0)) == {"r2"}


# -- what a report does to a node's entries ---------------------------------------------------
def test_a_full_report_replaces_the_nodes_entries_and_a_partial_one_updates_them():
    b = book({"r1": replica("r1"), "r2": replica("r2"), "r3": replica("r3")})
    b.take(report(fact("r1"), fact("r2"), full=True), T0)
    b.take(report(fact("r2", state="ready")), T0 + 1)
    assert {k: f.state for k, f in b.reported["node01"].items()} == {("r1", 0): "starting", ("r2", 0): "ready"}
    b.take(report(fact("r3"), full=True, boot="boot-b"), T0 + 2)
    assert list(b.reported["node01"]) == [("r3", 0)]
    assert (b.full_report_at["node01"], b.full_report_boot["node01"]) == (T0 + 2, "boot-b")
    assert b.has("node01", "r3", 0) and not b.has("node01", "r1", 0) and not b.has("node02", "r3", 0)


def test_a_partial_report_does_not_move_the_full_reports_time():
    b = book({"r1": replica()})
    b.take(report(fact(), full=True), T0)
    b.take(report(fact(state="ready")), T0 + 50)
    assert b.full_report_at["node01"] == T0


@pytest.mark.parametrize(
    "named, held, reported, kept, dropped",
    [
        # engines no record names: at most max_unknown (4) kept per node, the rest dropped
        ([], [], ["u1", "u2"], ["u1", "u2"], 0),
        ([], [], ["u1", "u2", "u3", "u4", "u5", "u6"], ["u1", "u2", "u3", "u4"], 2),
        # engines a record names never count against the cap
        (["r1", "r2"], [], ["u1", "u2", "u3", "u4", "r1", "r2"], ["u1", "u2", "u3", "u4", "r1", "r2"], 0),
        # unknown ones already held count; an update of one already held is kept at the cap
        ([], ["u1", "u2", "u3", "u4"], ["u1", "u5"], ["u1"], 1),
        # ...but a held one a record now names does not count
        (["u1"], ["u1", "u2", "u3", "u4"], ["u5"], ["u5"], 0),
    ],
)
def test_engines_no_replica_names_are_bounded_per_node(named, held, reported, kept, dropped):
    b = book({rid: replica(rid) for rid in named}, max_unknown=4)
    b.reported["node01"] = {(rid, 0): fact(rid) for rid in held}
    engines, n = b.take(report(*(fact(rid, pid=7) for rid in reported)), T0)
    assert [f.replica_id for f in engines] == kept
    assert n == dropped
    assert all(b.reported["node01"][(f.replica_id, 0)] is f for f in engines)


def test_the_bound_is_per_node():
    b = book(max_unknown=2)
    b.take(report(fact("u1"), fact("u2"), node="node01"), T0)
    engines, dropped = b.take(report(fact("u3"), fact("u4"), node="node02"), T0)
    assert ([f.replica_id for f in engines], dropped) == (["u3", "u4"], 0)


def test_a_report_naming_an_unknown_replica_is_kept_for_fencing():
    b = book({"r1": replica("r1")})
    engines, dropped = b.take(report(fact("ghost")), T0)
    assert ([f.replica_id for f in engines], dropped) == (["ghost"], 0)
    stops = fence({"node01": engines}, b.known_replicas({"ghost"}, T0))
    assert [s.replica_id for s in stops] == ["ghost"]
    # and it changes no record
    assert b.with_reports({"r1": replica("r1")})["r1"].members[0].engine_state == EngineState.UNREPORTED


# -- folding into the records ---------------------------------------------------------------
def test_a_fact_of_the_records_generation_is_folded_in():
    rec = replica(generation=2)
    b = book({"r1": rec})
    b.take(report(fact(generation=2, state="ready", pid=42)), T0)
    m = b.with_reports({"r1": rec})["r1"].members[0]
    assert (m.engine_state, m.pid) == (EngineState.READY, 42)


def test_a_stale_generations_fact_is_not_folded_in():
    rec = replica(generation=2)
    b = book({"r1": rec})
    b.take(report(fact(generation=1, state="ready", pid=42)), T0)
    assert b.with_reports({"r1": rec})["r1"] is rec  # unchanged: the same object
    # and fencing stops the old generation's engine
    stops = fence({"node01": list(b.reported["node01"].values())}, b.known_replicas({"r1"}, T0))
    assert [(s.replica_id, s.generation) for s in stops] == [("r1", 1)]


@pytest.mark.parametrize(
    "full_at, held, absent",
    [
        (T0 + GRACE + 1, lease(), True),  # a settled incarnation's full report, after the launch: gone
        (T0 + GRACE, lease(), False),  # within the launch grace: the launch may still be in flight
        (T0 + GRACE + 1, None, True),  # no lease to doubt it by
        (T0 + GRACE + 1, lease(boot="boot-b"), False),  # not the incarnation holding the lease
        (T0 + GRACE + 1, lease(heartbeats=2), False),  # its boot has not settled yet (a clone may be alternating)
        (T0 + GRACE + 1, lease(heartbeats=2, since=0.0), True),  # a lease from before boot counting: settled
        (T0 + GRACE + 1, lease(quarantine="two boots"), False),
    ],
)
def test_a_full_report_lacking_an_engine_marks_it_absent_only_when_believed(full_at, held, absent):
    rec = replica()
    b = book({"r1": rec}, {} if held is None else {"node01": held}, settle=3)
    b.take(report(fact("other"), full=True), full_at)
    m = b.with_reports({"r1": rec})["r1"].members[0]
    assert (m.engine_state == EngineState.ABSENT) is absent


def test_a_report_from_a_distrusted_boot_marks_nothing_absent_once_the_lease_moves():
    # A clone's empty full report was taken while its boot held the lease; the
    # lease then shows the other boot: the clone's report no longer says anything is gone.
    rec = replica()
    leases = {"node01": lease(boot="clone")}
    b = book({"r1": rec}, leases)
    b.take(report(full=True, boot="clone"), T0 + GRACE + 1)
    assert b.with_reports({"r1": rec})["r1"].members[0].engine_state == EngineState.ABSENT
    leases["node01"] = lease(boot="boot-a")
    assert b.distrust("node01", "clone") == "other_boot"
    assert b.with_reports({"r1": rec})["r1"] is rec


def test_a_refused_launch_is_absent_until_its_record_is_forgotten():
    rec = replica()
    b = book({"r1": rec})
    b.refused("r1", 0)
    assert b.with_reports({"r1": rec})["r1"].members[0].engine_state == EngineState.ABSENT
    b.take(report(fact(state="starting")), T0)  # a fact of its generation outranks the refusal
    assert b.with_reports({"r1": rec})["r1"].members[0].engine_state == EngineState.STARTING
    b.reported["node01"].clear()
    b.forget("r1")
    assert b.with_reports({"r1": rec})["r1"] is rec


# -- which reports need a step (report_moves) ------------------------------------------------
def held_on(replicas: dict, node: str = "node01") -> list[tuple[str, int, int]]:
    return [(rid, m.rank, r.generation) for rid, r in replicas.items() for m in r.members if m.node_id == node]


def fold_twice(replicas: dict, first: StatusReport, second: StatusReport, *, leases=None):
    """Fold ``first`` then ``second``; what with_reports gave after each, and whether the
    second moved anything by report_moves."""
    b = book(replicas, leases if leases is not None else {"node01": lease()})
    b.take(first, T0 + 10)
    seen = b.with_reports(replicas)
    before = b.reported.get("node01")
    b.take(second, T0 + 20)
    moved = report_moves(before, b.reported.get("node01", {}), held_on(replicas), full=second.full)
    return seen, b.with_reports(replicas), moved


@pytest.mark.parametrize(
    "first, second, moves",
    [
        (report(fact(), full=True), report(fact(), full=True), False),  # said again: an agent reconnecting
        (report(fact(), full=True), report(fact(), full=False), False),
        (report(fact(state="starting"), full=True), report(fact(state="ready"), full=False), True),  # the engine moved
        (report(fact(pid=100), full=True), report(fact(pid=101), full=True), True),  # restarted: a new pid
        (report(fact(), full=True), report(full=True), True),  # a full report lacking a member the node holds
        (report(fact(), full=True), report(full=False), False),  # a partial one lacking it says nothing of it
        (report(fact(generation=0), full=True), report(fact(generation=0), full=True), True),  # only an older generation's engine
        (report(full=True), report(fact("stray", generation=9), full=True), True),  # an engine appeared (to fence, and to fold)
    ],
)
def test_a_report_moves_a_step_only_when_it_changes_what_the_fold_gives(first, second, moves):
    replicas = {"r1": replica("r1", created_at=T0 - 100)}
    seen, now_gives, moved = fold_twice(replicas, first, second)
    assert moved is moves
    if not moved:
        assert now_gives == seen


def test_an_empty_nodes_reports_move_nothing():
    b = book({}, {"node01": lease()})
    before = b.reported.get("node01")
    b.take(report(full=True), T0)
    assert report_moves(before, b.reported.get("node01", {}), [], full=True) is False


FACT_STATES = ["starting", "joined", "ready", "stalled", "exited"]


@settings(max_examples=300, deadline=None)
@given(
    gens=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    created=st.lists(st.sampled_from([T0 - 100, T0 + 12, T0 + 30]), min_size=3, max_size=3),
    reports=st.lists(
        st.tuples(
            st.booleans(),
            st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.sampled_from(FACT_STATES), st.integers(100, 101)), max_size=4),
        ),
        min_size=2,
        max_size=2,
    ),
    heartbeats=st.sampled_from([0, 10]),
)
def test_a_report_that_moves_nothing_leaves_the_fold_as_it_was(gens, created, reports, heartbeats):
    """Whatever two reports a node sends, when report_moves says the second moved nothing,
    with_reports gives exactly what it gave before it: no step was owed."""
    replicas = {}
    for i, g in enumerate(gens):
        rep = replica(f"r{i}", generation=g, created_at=created[i])
        if i == 1:  # a second member, on another node, to be left alone
            rep = msgspec.structs.replace(rep, members=[*rep.members, ReplicaMember(node_id="node02", rank=1, role="worker", gpus=[0])])
        replicas[rep.id] = rep

    def as_report(full, engines):
        facts = {(f"r{i}", 0): fact(f"r{i}", generation=g, state=s, pid=pid) for i, g, s, pid in engines}
        return report(*facts.values(), full=full)

    first, second = (as_report(full, engines) for full, engines in reports)
    seen, now_gives, moved = fold_twice(replicas, first, second, leases={"node01": lease(heartbeats=heartbeats)})
    if not moved:
        assert now_gives == seen
