"""The reconciler's gray-failure cases (8, 9, 10 and peer loss in 3), as tables.

Pure: plain values in, a Plan out, time injected. The world below applies a
plan the way the shell does — replica records, the deployment's generation
and backoff, the failure history, and the registry's cordon — so a test reads
as a sequence of facts and what the scheduler made of them.
"""

from __future__ import annotations

import datetime as dt

import msgspec
import pytest

from llmgw.services.scheduler.cycle import ReconcileConfig, remember_failures
from llmgw.services.scheduler.reconcile import reconcile
from llmgw.shared.schemas import ExplainReply, Replica, decode, encode, to_builtins
from llmgw.shared.states import ACTIVE_REPLICA, WANTED_REPLICA
from llmgw.shared.states import EngineState as E
from llmgw.shared.states import ReplicaState as RS

from .builders import apply_plan, cluster, make_deployment, make_lease, make_node, seed_cluster, seed_deployment

T0 = 1_000_000.0


class World:
    def __init__(self, nodes, leases, *deployments, config: ReconcileConfig | None = None):
        self.nodes, self.leases = dict(nodes), dict(leases)
        self.deployments = {d.name: d for d in deployments}
        self.replicas: dict[str, Replica] = {}
        self.config = config or ReconcileConfig()
        self.history: dict = {}
        self.now = T0
        self.plan = None
        self.launched_at: list[float] = []

    def step(self, dt_: float = 1.0):
        self.now += dt_
        plan = reconcile(self.deployments, self.replicas, self.nodes, self.leases, self.now, config=self.config, failures=self.history)
        self.plan = plan
        self.replicas, self.deployments = apply_plan(plan, self.replicas, self.deployments)
        for name, b in plan.backoffs.items():
            self.deployments[name] = msgspec.structs.replace(self.deployments[name], failures=b.failures, retry_at=b.retry_at, last_failure=b.last_failure)
        self.history = remember_failures(self.history, plan, self.now, self.config.auto_cordon_window)
        for c in plan.cordons:  # what the registry does when asked
            self.nodes[c.node_id] = msgspec.structs.replace(self.nodes[c.node_id], admin="cordoned", admin_by="auto", admin_reason=c.reason)
        if plan.launches:
            self.launched_at.append(self.now)
        return plan

    def member(self, rid: str, node: str, state: str, detail: str = ""):
        r = self.replicas[rid]
        members = [msgspec.structs.replace(m, engine_state=state, engine_detail=detail) if m.node_id == node else m for m in r.members]
        self.replicas[rid] = msgspec.structs.replace(r, members=members)

    def all_members(self, rid: str, state: str):
        for m in self.replicas[rid].members:
            self.member(rid, m.node_id, state)

    def state(self, rid: str) -> str:
        return self.replicas[rid].state

    def events(self, rid=None):
        return [(e.subject, e.what) for e in self.plan.events if rid is None or e.subject == rid]


def single_node_world(nodes: int = 1, replicas: int = 1, fabric="ib-a", config=None, **deployment) -> World:
    names = [f"node{i:02d}" for i in range(1, nodes + 1)]
    recs, leases = cluster(*(make_node(n, fabric, gpus=8) for n in names))
    dep = make_deployment("sim", replicas=replicas, nodes_per_replica=1, gpus_per_node=8, **deployment)
    return World(recs, leases, dep, config=config)


def ready_world(config=None) -> World:
    """The seed's deployment with one replica (node01 leader, node02 worker), ready."""
    w = World(*seed_cluster(), seed_deployment(replicas=1), config=config)
    w.step()
    w.all_members("sim-g1", E.READY)
    w.step()
    assert w.state("sim-g1") == RS.READY
    return w


def degraded_world(config=None) -> World:
    w = ready_world(config)
    w.member("sim-g1", "node01", E.STALLED, "canary sent 12:00:01 got no token in 3s")
    w.step()
    assert w.state("sim-g1") == RS.DEGRADED
    return w


# --------------------------------------------------------------------------
# Case 8: ready <-> degraded, and hang_timeout
# --------------------------------------------------------------------------


def test_stalled_leader_makes_a_ready_replica_degraded_with_the_agents_words():
    w = ready_world()
    w.member("sim-g1", "node01", E.STALLED, "3 requests in flight, no byte for 10s (gateway gw1)")
    plan = w.step()
    assert w.events() == [("sim-g1", RS.DEGRADED)]
    ev = plan.events[0]
    assert ev.detail == "3 requests in flight, no byte for 10s (gateway gw1)"
    assert ev.data["from"] == RS.READY
    r = w.replicas["sim-g1"]
    assert r.reason == "leader on node01 stalled: 3 requests in flight, no byte for 10s (gateway gw1)"
    assert r.endpoint  # kept: it comes back to ready on the same address
    assert plan.stops == [] and plan.launches == []  # no replacement while it may recover


def test_a_stalled_worker_alone_does_not_degrade():
    # Only the leader serves; the agent judges progress on the leader.
    w = ready_world()
    w.member("sim-g1", "node02", E.STALLED, "odd")
    w.step()
    assert w.state("sim-g1") == RS.READY


def test_degraded_returns_to_ready_when_the_leader_makes_progress():
    w = degraded_world()
    w.member("sim-g1", "node01", E.READY)
    plan = w.step()
    assert w.events() == [("sim-g1", RS.READY)]
    assert plan.events[0].data["from"] == RS.DEGRADED
    assert w.replicas["sim-g1"].endpoint


@pytest.mark.parametrize(
    "after, failed",
    [(29.0, False), (29.9, False), (30.0, True), (45.0, True)],
)
def test_degraded_fails_after_hang_timeout_and_not_before(after, failed):
    w = degraded_world(ReconcileConfig(hang_timeout=30.0))
    since = w.replicas["sim-g1"].since
    w.step(since + after - w.now)
    if not failed:
        assert w.state("sim-g1") == RS.DEGRADED and w.plan.stops == []
        return
    assert w.events("sim-g1")[:2] == [("sim-g1", RS.FAILED), ("sim-g1", RS.REAPING)]
    failed_ev = w.plan.events[0]
    assert failed_ev.detail.startswith("leader on node01 made no progress for ")
    assert failed_ev.detail.endswith(": canary sent 12:00:01 got no token in 3s")
    # Both engines still run: both are stopped; a replacement is placed at once
    # (it served, so no backoff), on GPUs the hung one does not hold.
    assert sorted(s.node_id for s in w.plan.stops) == ["node01", "node02"]
    assert w.state("sim-g2") == RS.LAUNCHING
    held = {(m.node_id, g) for m in w.replicas["sim-g1"].members for g in m.gpus}
    assert not held & {(m.node_id, g) for m in w.replicas["sim-g2"].members for g in m.gpus}


def test_startup_timeout_does_not_apply_to_a_degraded_replica():
    w = World(*seed_cluster(), seed_deployment(replicas=1, startup_timeout=10.0), config=ReconcileConfig(hang_timeout=100.0))
    w.step()
    w.all_members("sim-g1", E.READY)
    w.step()
    w.member("sim-g1", "node01", E.STALLED, "x")
    w.step()
    w.step(50.0)  # long past startup_timeout since launch, within hang_timeout
    assert w.state("sim-g1") == RS.DEGRADED


def test_a_leader_seen_first_stalled_makes_a_launching_replica_degraded():
    w = World(*seed_cluster(), seed_deployment(replicas=1))
    w.step()
    w.member("sim-g1", "node01", E.STALLED, "canary got no token")
    w.member("sim-g1", "node02", E.JOINED)
    w.step()
    r = w.replicas["sim-g1"]
    assert r.state == RS.DEGRADED and r.endpoint.endswith(":20001")
    w.member("sim-g1", "node01", E.READY)
    w.step()
    assert w.state("sim-g1") == RS.READY


def test_degraded_is_active_wanted_and_holds_its_gpus():
    assert RS.DEGRADED in ACTIVE_REPLICA and RS.DEGRADED in WANTED_REPLICA
    # One fabric of two nodes, all 16 GPUs held by the degraded replica.
    w = World(*cluster(make_node("node01", "ib-a"), make_node("node02", "ib-a")), make_deployment(replicas=1, gpus_per_node=8))
    w.step()
    w.all_members("sim-g1", E.READY)
    w.step()
    w.member("sim-g1", "node01", E.STALLED, "x")
    w.step()
    assert w.state("sim-g1") == RS.DEGRADED
    assert [r.id for r in w.replicas.values()] == ["sim-g1"]  # counted: no replacement
    # Scaling up finds no free GPU: the degraded replica still holds them.
    w.deployments["sim"] = msgspec.structs.replace(w.deployments["sim"], replicas=2)
    w.step()
    assert w.state("sim-g2") == RS.PENDING and "not_enough_free_gpus" in w.plan.pending["sim"]


# --------------------------------------------------------------------------
# Case 3: a member that lost a peer fails the replica at once
# --------------------------------------------------------------------------


def _launching():
    w = World(*seed_cluster(), seed_deployment(replicas=1))
    w.step()
    return w


def _waiting():
    w = _launching()
    w.all_members("sim-g1", E.STARTING)
    w.step()
    assert w.state("sim-g1") == RS.WAITING
    return w


# No grace for a late engine exit (restart in place, tests/test_spares_core.py): at once.
AT_ONCE = ReconcileConfig(peer_lost_grace=0)


@pytest.mark.parametrize(
    "start", [_launching, _waiting, lambda: ready_world(AT_ONCE), lambda: degraded_world(AT_ONCE)], ids=["launching", "waiting", "ready", "degraded"]
)
def test_peer_lost_fails_at_once_from_every_active_state(start):
    w = start()
    w.member("sim-g1", "node01", E.PEER_LOST, "log: rank 1 lost")
    plan = w.step(0.1)  # no timeout involved: at once
    assert w.events("sim-g1")[:2] == [("sim-g1", RS.FAILED), ("sim-g1", RS.REAPING)]
    assert plan.events[0].detail == "member rank 0 on node01 peer-lost: log: rank 1 lost"
    # The peer-lost engine still runs, so it gets a stop (and so does its peer).
    assert sorted(s.node_id for s in plan.stops) == ["node01", "node02"]
    # The suspect is the peer that went quiet, not the one that said so.
    assert [f.node_id for f in plan.implicated] == ["node02"]
    # Reaped once both report exited, then gone.
    w.all_members("sim-g1", E.EXITED)
    w.step()
    assert "sim-g1" not in w.replicas


def test_every_member_peer_lost_implicates_them_all():
    w = ready_world(AT_ONCE)
    w.all_members("sim-g1", E.PEER_LOST)
    plan = w.step()
    assert w.state("sim-g1") == RS.REAPING
    assert sorted(f.node_id for f in plan.implicated) == ["node01", "node02"]


# --------------------------------------------------------------------------
# Case 9: crash-loop backoff
# --------------------------------------------------------------------------


def crash_once(w: World) -> None:
    """The live replica's engine exits (before serving): it fails, is reaped and gone."""
    (rid,) = [r.id for r in w.replicas.values() if r.state == RS.LAUNCHING]
    w.all_members(rid, E.EXITED)
    w.step()
    assert rid not in w.replicas


def test_backoff_doubles_from_base_to_max_between_attempts():
    w = single_node_world(config=ReconcileConfig(backoff_base=5.0, backoff_max=40.0))
    w.step()
    waits = []
    for _ in range(6):
        crash_once(w)
        failed_at = w.now
        while not w.plan.launches:
            assert "sim" in w.plan.pending and w.plan.pending["sim"].startswith("backing off after ")
            w.step(0.5)
        waits.append(w.now - failed_at)
    # The launch happens on the first cycle at or after retry_at (cycles of 0.5 s).
    assert waits == [5.0, 10.0, 20.0, 40.0, 40.0, 40.0]
    assert w.deployments["sim"].failures == 6


def test_backoff_reason_names_failures_last_reason_and_next_attempt():
    w = single_node_world(config=ReconcileConfig(backoff_base=5.0))
    w.step()
    crash_once(w)
    d = w.deployments["sim"]
    at = dt.datetime.fromtimestamp(w.now + 5.0).strftime("%H:%M:%S")
    assert (d.failures, d.retry_at) == (1, w.now + 5.0)
    assert d.last_failure == "sim-g1: member rank 0 on node01 exited"
    expected = f"backing off after 1 failure before serving: sim-g1: member rank 0 on node01 exited; next attempt at {at}"
    assert w.plan.pending["sim"] == expected
    assert ("sim", "backoff") in w.events()
    # Nothing made while it waits: no pending replica record either.
    w.step(1.0)
    assert w.replicas == {} and w.plan.launches == [] and w.plan.pending["sim"] == expected


def test_backoff_resets_when_a_replica_becomes_ready():
    w = single_node_world(config=ReconcileConfig(backoff_base=5.0))
    w.step()
    crash_once(w)
    crash_once_after = w.now
    w.step(5.0)
    assert w.plan.launches
    (rid,) = list(w.replicas)
    w.all_members(rid, E.READY)
    plan = w.step()
    assert w.state(rid) == RS.READY
    assert plan.backoffs["sim"].failures == 0 and plan.backoffs["sim"].retry_at == 0.0
    assert ("sim", "recovered") in w.events()
    d = w.deployments["sim"]
    assert (d.failures, d.retry_at, d.last_failure) == (0, 0.0, "")
    assert crash_once_after < w.now


def test_failure_after_serving_is_not_a_crash_loop():
    w = single_node_world(nodes=2, config=ReconcileConfig(backoff_base=5.0))
    w.step()
    w.all_members("sim-g1", E.READY)
    w.step()
    w.leases["node01"] = make_lease("node01", "lost", since=w.now)
    plan = w.step()
    assert w.state("sim-g2") == RS.LAUNCHING  # replaced in the same cycle
    assert "sim" not in plan.backoffs and w.deployments["sim"].failures == 0


def test_backoff_base_zero_turns_it_off():
    w = single_node_world(config=ReconcileConfig(backoff_base=0.0, backoff_max=0.0))
    w.step()
    crash_once(w)
    assert w.plan.launches and "sim" not in w.plan.pending


def test_backoff_does_not_hold_back_scale_down_or_delete():
    w = single_node_world(nodes=2, replicas=2, config=ReconcileConfig(backoff_base=5.0))
    w.step()
    w.all_members("sim-g1", E.READY)
    w.step()
    crash_once(w)  # sim-g2 fails before serving
    assert w.deployments["sim"].failures == 1
    del w.deployments["sim"]
    w.step()
    assert w.state("sim-g1") == RS.REAPING


# --------------------------------------------------------------------------
# Case 10: auto-cordon, with its circuit breaker
# --------------------------------------------------------------------------


def cordon_config(**kw) -> ReconcileConfig:
    base = dict(backoff_base=0.0, backoff_max=0.0, auto_cordon_after=3, auto_cordon_window=600.0, auto_cordon_max_share=0.25)
    base.update(kw)
    return ReconcileConfig(**base)


def crash_on(w: World, node: str) -> None:
    """The replica on ``node`` exits before serving."""
    (rid,) = [r.id for r in w.replicas.values() if r.state == RS.LAUNCHING and r.members[0].node_id == node]
    w.all_members(rid, E.EXITED)
    w.step()


@pytest.mark.parametrize("crashes, cordoned", [(2, False), (3, True)])
def test_node_implicated_in_enough_failures_is_cordoned(crashes, cordoned):
    w = single_node_world(nodes=4, config=cordon_config())
    w.step()
    for _ in range(crashes - 1):
        crash_on(w, "node01")
        assert not w.plan.cordons
    crash_on(w, "node01")
    if not cordoned:
        assert w.plan.cordons == [] and w.nodes["node01"].admin == "active"
        return
    (c,) = w.plan.cordons
    assert c.node_id == "node01"
    assert c.reason.startswith("3 replica failures in 10m: sim-g3 member rank 0 on node01 exited")
    assert w.plan.settled == ["node01"] and "node01" not in w.history
    # It takes nothing new: the next replica goes elsewhere.
    w.step()
    assert all(r.members[0].node_id != "node01" for r in w.replicas.values() if r.state == RS.LAUNCHING)


def test_failures_older_than_the_window_do_not_count():
    w = single_node_world(nodes=4, config=cordon_config(auto_cordon_window=60.0))
    w.step()
    crash_on(w, "node01")
    crash_on(w, "node01")
    w.step(61.0)
    crash_on(w, "node01")
    assert w.plan.cordons == [] and len(w.history["node01"]) == 1


def test_breaker_withholds_beyond_the_share_of_a_fabric():
    # 4 nodes on ib-a, share 0.25: at most one auto-cordoned.
    w = single_node_world(nodes=4, replicas=1, config=cordon_config())
    w.step()
    for _ in range(3):
        crash_on(w, "node01")
    assert [c.node_id for c in w.plan.cordons] == ["node01"]
    w.step()
    for _ in range(3):
        crash_on(w, "node02")
    assert w.plan.cordons == [] and w.nodes["node02"].admin == "active"
    (ev,) = [e for e in w.plan.events if e.what == "auto-cordon-withheld"]
    assert (ev.kind, ev.subject) == ("node", "node02")
    assert ev.detail.startswith("auto-cordon withheld: fabric ib-a already has 1 of 4 nodes auto-cordoned")
    # The evidence is used up: one more failure does not withhold again.
    assert "node02" not in w.history
    crash_on(w, "node02")
    assert not [e for e in w.plan.events if e.what == "auto-cordon-withheld"]


def test_operator_cordons_do_not_count_against_the_share():
    w = single_node_world(nodes=4, config=cordon_config())
    w.nodes["node04"] = msgspec.structs.replace(w.nodes["node04"], admin="cordoned", admin_by="operator")
    w.step()
    for _ in range(3):
        crash_on(w, "node01")
    assert [c.node_id for c in w.plan.cordons] == ["node01"]


def test_breaker_on_a_small_fabric_never_cordons():
    w = single_node_world(nodes=2, config=cordon_config())  # floor(0.25 * 2) = 0
    w.step()
    for _ in range(3):
        crash_on(w, "node01")
    assert w.plan.cordons == []
    assert any("already has 0 of 2 nodes auto-cordoned (at most 0" in e.detail for e in w.plan.events)


def test_nodes_on_no_fabric_are_counted_against_the_cluster():
    w = single_node_world(nodes=8, fabric=None, config=cordon_config())  # at most 2 of 8
    w.step()
    withheld = []
    for node in ("node01", "node02", "node03"):
        for _ in range(3):
            crash_on(w, node)
            withheld += [e.detail for e in w.plan.events if e.what == "auto-cordon-withheld"]
    auto = sorted(n for n, r in w.nodes.items() if r.admin_by == "auto")
    assert auto == ["node01", "node02"]
    assert len(withheld) == 1 and withheld[0].startswith("auto-cordon withheld: the cluster already has 2 of 8 nodes")


def test_uncordon_starts_a_node_afresh():
    w = single_node_world(nodes=4, config=cordon_config())
    w.step()
    for _ in range(3):
        crash_on(w, "node01")
    assert w.nodes["node01"].admin == "cordoned"
    # The operator uncordons (the registry clears the reason and who).
    w.nodes["node01"] = msgspec.structs.replace(w.nodes["node01"], admin="active", admin_by="operator", admin_reason="")
    w.step()
    assert w.plan.cordons == []


def test_auto_cordon_share_zero_turns_it_off():
    w = single_node_world(nodes=4, config=cordon_config(auto_cordon_max_share=0.0))
    w.step()
    for _ in range(4):
        crash_on(w, "node01")
    assert w.plan.cordons == [] and not [e for e in w.plan.events if e.kind == "node"]


def test_a_node_cordoned_meanwhile_has_its_history_dropped():
    w = single_node_world(nodes=4, config=cordon_config())
    w.step()
    crash_on(w, "node01")
    assert "node01" in w.history
    w.nodes["node01"] = msgspec.structs.replace(w.nodes["node01"], admin="draining", admin_by="operator")
    w.step()
    assert "node01" in w.plan.settled and "node01" not in w.history


# --------------------------------------------------------------------------
# The operator's view: ctl and the console (pure parts)
# --------------------------------------------------------------------------


def test_ctl_deployments_shows_the_backoff_and_json_keeps_its_fields():
    from llmgw.services.ctl.ops import backoff_line, deployment_table

    w = single_node_world(config=ReconcileConfig(backoff_base=5.0))
    w.step()
    crash_once(w)
    table = deployment_table(w.deployments, w.replicas, now=w.now)
    assert table[0][-1] == "BACKOFF"
    at = dt.datetime.fromtimestamp(w.now + 5.0).strftime("%H:%M:%S")
    assert table[1][3:] == ("0/1", "1 node(s) × 8 GPU(s)", "-", "-", f"1×, next {at}")
    assert backoff_line(w.deployments["sim"], w.now).startswith(f"backing off after 1 failure before serving; next attempt at {at}")
    # Past retry_at it still says how many in a row, without a next time.
    assert deployment_table(w.deployments, w.replicas, now=w.now + 6.0)[1][-1] == "1×"


def test_ctl_nodes_json_adds_admin_reason_and_who():
    from llmgw.services.ctl.ops import admin_text, node_rows

    nodes, leases = cluster(make_node("node01"), make_node("node02"))
    nodes["node01"] = msgspec.structs.replace(nodes["node01"], admin="cordoned", admin_by="auto", admin_reason="3 replica failures in 10m: x")
    rows = {r["node_id"]: r for r in node_rows(nodes, leases, {})}
    assert (rows["node01"]["admin"], rows["node01"]["admin_by"], rows["node01"]["admin_reason"]) == ("cordoned", "auto", "3 replica failures in 10m: x")
    assert admin_text(rows["node01"]) == "cordoned (auto)" and admin_text(rows["node02"]) == "active"
    assert {"node_id", "fabrics", "gpus_total", "gpus_free", "state", "admin", "mgmt_addr", "lease_age"} <= rows["node02"].keys()


def test_ctl_explain_head_names_backoff_and_the_stalled_member():
    from llmgw.services.ctl.ops import explain_lines
    from llmgw.services.scheduler.service import explain_reply
    from llmgw.services.scheduler.view import ClusterView

    w = degraded_world()
    view = ClusterView.build(w.nodes, w.leases, w.replicas.values())
    spec = msgspec.structs.replace(w.deployments["sim"], failures=2, retry_at=w.now + 10, last_failure="sim-g0: member rank 0 on node01 exited")
    ex = explain_reply(spec, view, w.replicas.values(), w.now)  # as the scheduler answers it
    lines = explain_lines(ex)
    assert lines[0].startswith("deployment sim: ")
    assert lines[1].startswith("backing off after 2 failures before serving: sim-g0: member rank 0 on node01 exited; next attempt at ")
    assert lines[2] == "replica sim-g1 degraded: leader on node01 stalled: canary sent 12:00:01 got no token in 3s"
    assert lines[3] == "  rank 0 on node01: stalled: canary sent 12:00:01 got no token in 3s"
    # What `ctl explain -o json` prints (scripts read it): every key of the untyped
    # answer it replaced, in order, defaults included, and the wire loses nothing.
    wire = decode(encode(ex), ExplainReply)
    assert wire == ex
    assert list(to_builtins(wire)) == ["deployment", "request", "nodes", "fabrics", "placeable", "fabric", "leader", "summary", "backoff", "replicas"]
    # (scores: added after, placement's node scores; the keys before it keep their order)
    assert list(to_builtins(wire)["nodes"][0]) == ["node_id", "ok", "reason", "detail", "fabrics", "free_gpus", "total_gpus", "scores"]
    assert list(to_builtins(wire)["backoff"]) == ["failures", "last_failure", "retry_at", "active", "message"]
    assert list(to_builtins(wire)["replicas"][0]["members"][0]) == ["node", "rank", "engine_state", "engine_detail"]


def console_model(w, deployments=None):
    """The console's folded model of a world (as the console builds it from the buckets)."""
    from tui.cluster import DEPLOYMENTS, LEASES, NODES, REPLICAS, ClusterModel

    model = ClusterModel()
    for bucket, items in ((NODES, w.nodes), (LEASES, w.leases), (REPLICAS, w.replicas), (DEPLOYMENTS, deployments or {})):
        model.replace(bucket, items)
    return model


def test_console_marks_degraded_and_shows_a_deployment_backing_off():
    from tui.model import BACKOFF, MarkBook, backoff_views, replica_order, replica_summary, replica_tone, replica_view
    from tui.palette import GPU_CELL_STYLE, REPLICA_TONE_STYLE
    from tui.replicas import state_text

    w = degraded_world()
    backing = msgspec.structs.replace(
        make_deployment("other", replicas=1), failures=3, retry_at=w.now + 20, last_failure="other-g3: member rank 0 on node03 exited"
    )
    model = console_model(w, {"sim": w.deployments["sim"], "other": backing})
    (degraded,) = [replica_view(model.replicas[rid], w.now, MarkBook()) for rid in replica_order(model)]
    (waiting,) = backoff_views(model, w.now)
    assert (degraded.id, degraded.state, degraded.tone) == ("sim-g1", RS.DEGRADED, "degraded")
    assert "canary sent 12:00:01" in degraded.reason
    assert str(state_text(degraded)) == "⚠ degraded"
    assert (waiting.id, waiting.state, waiting.tone, waiting.age) == ("(other)", BACKOFF, "backoff", "in 20s")
    assert waiting.reason.startswith("backing off after 3 failures before serving; next attempt at ")
    assert replica_summary(model, frozenset(), 1) == "1 degraded · 1 backoff"
    # A colour of its own, on the row and on its GPU cells.
    assert replica_tone(RS.DEGRADED) == "degraded"
    assert REPLICA_TONE_STYLE["degraded"] not in (REPLICA_TONE_STYLE["ready"], REPLICA_TONE_STYLE["starting"], REPLICA_TONE_STYLE["failing"])
    assert GPU_CELL_STYLE["degraded"] not in (GPU_CELL_STYLE["ready"], GPU_CELL_STYLE["starting"], GPU_CELL_STYLE["failing"])
    # Once retry_at has passed, no backoff row.
    assert backoff_views(model, w.now + 21) == ()


def test_console_node_detail_shows_the_auto_cordon_reason_and_engine_detail():
    from tui.model import node_detail

    w = degraded_world()
    w.nodes["node01"] = msgspec.structs.replace(w.nodes["node01"], admin="cordoned", admin_by="auto", admin_reason="3 replica failures in 10m: x")
    v = node_detail("node01", console_model(w), [], w.now)
    assert v.admin_reason == "auto: 3 replica failures in 10m: x"
    (m,) = v.members
    assert (m.engine_state, m.engine_detail) == (E.STALLED, "canary sent 12:00:01 got no token in 3s")


def test_breaker_counts_cordons_decided_in_the_same_cycle():
    # node01 and node02 reach the threshold in one cycle: only one is cordoned.
    w = single_node_world(nodes=4, replicas=2, config=cordon_config())
    w.step()
    assert sorted(r.members[0].node_id for r in w.replicas.values()) == ["node01", "node02"]
    for _ in range(3):
        for rid in [r.id for r in w.replicas.values() if r.state == RS.LAUNCHING]:
            w.all_members(rid, E.EXITED)
        w.step()
        if w.plan.cordons:
            break
    assert [c.node_id for c in w.plan.cordons] == ["node01"]
    assert [e.subject for e in w.plan.events if e.what == "auto-cordon-withheld"] == ["node02"]


def test_console_story_of_a_hung_replica_starts_when_it_degraded():
    from tui.story import StoryBook

    w = ready_world(ReconcileConfig(hang_timeout=30.0))
    book = StoryBook()
    w.member("sim-g1", "node01", E.STALLED, "canary got no token in 3s")
    told = []
    for _ in range(40):
        w.step()
        for ev in w.plan.events:
            told.append(book.add(ev))
        for r in list(w.replicas.values()):
            if r.state == RS.REAPING:
                w.all_members(r.id, E.EXITED)
            elif r.id != "sim-g1" and r.state == RS.LAUNCHING:
                w.all_members(r.id, E.READY)
    (story,) = [s for s in told if s is not None]
    assert story.steps[:2] == ["sim-g1 degraded", "sim-g1 failed"]
    assert story.steps[-1] == "ready (31.0 s)"


# --------------------------------------------------------------------------
# Case 3, peer loss: the replacement keeps off the node a peer reported lost
# --------------------------------------------------------------------------


def test_the_replacement_keeps_off_the_node_a_peer_reported_lost_until_it_is_heard_from():
    """The seed's node kill: node01's leader says rank 1 (node02) is gone seconds before
    node02's lease can run out. The replacement goes to ib-b, not back onto node02."""
    w = ready_world()
    w.member("sim-g1", "node01", E.PEER_LOST, "log: rank 1 lost (127.0.1.2 closed the connection)")
    w.step()
    # every lease is still ready: a moment for node02's agent to report an exit (restart in place)
    assert w.state("sim-g1") == RS.DEGRADED and w.replicas["sim-g1"].reason.startswith("group broken")
    plan = w.step(0.5)  # none came: it moves
    assert w.state("sim-g1") == RS.REAPING
    (new,) = [r for r in w.replicas.values() if r.id != "sim-g1"]
    assert new.fabric == "ib-b" and {launch.node_id for launch in plan.launches} == {"node03", "node04"}
    # Still avoided while node02 says nothing (its old engine reaped, too)...
    w.all_members("sim-g1", E.EXITED)
    w.step()
    w.deployments["big"] = make_deployment("big", replicas=1, nodes_per_replica=2, gpus_per_node=8)
    w.step()
    (big,) = [r for r in w.replicas.values() if r.deployment == "big"]
    assert big.state == RS.PENDING and "peer_lost_suspect" in big.reason
    # ...and offered again once a heartbeat after the report renewed its lease.
    w.leases["node02"] = msgspec.structs.replace(w.leases["node02"], last_renew=w.now + 0.5)
    plan = w.step()
    assert w.replicas[big.id].state == RS.LAUNCHING
    assert {launch.node_id for launch in plan.launches} == {"node01", "node02"}


def test_a_replica_failed_by_a_lost_node_is_no_crash_loop_of_its_deployment():
    """A node that dies under a replica still starting says nothing about the deployment:
    the replacement is placed at once, with no backoff."""
    w = single_node_world(nodes=2, config=ReconcileConfig(backoff_base=5.0))
    w.step()
    (first,) = list(w.replicas.values())
    assert first.state == RS.LAUNCHING
    node = first.members[0].node_id
    w.leases[node] = msgspec.structs.replace(w.leases[node], state="lost")
    plan = w.step()
    assert not plan.backoffs and w.deployments["sim"].failures == 0
    (repl,) = [r for r in w.replicas.values() if r.id != first.id]
    assert repl.state == RS.LAUNCHING and repl.members[0].node_id != node
