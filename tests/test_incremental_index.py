"""The incremental reconciler against the full computation.

``Reconciler.step`` keeps a live cluster view and advances only what changed;
``reconcile`` builds everything afresh. Over random histories — nodes added,
forgotten, lost, recovered, suspect, cordoned, drained, their fabrics going
down; replicas placed, reported on, deleted behind the scheduler's back;
deployments rescaled, re-templated and deleted; plans applied, not yet visible,
or lost — the two give the same plan at every step (same placements, same
events in the same order), and the live view equals ``ClusterView.build`` of
the same state, index for index. A second reconciler is told which nodes
changed (``touched``, as the shell's mirrors tell it) instead of comparing
them all, and gives the same plans.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.services.scheduler.cycle import ReconcileConfig, remember_failures
from llmgw.services.scheduler.incremental import Inputs, Reconciler, changes
from llmgw.services.scheduler.placement import PlacementCache, _indexes
from llmgw.services.scheduler.reconcile import reconcile
from llmgw.services.scheduler.view import ClusterView, PortRange

from .builders import apply_plan, make_deployment, make_lease, make_node, with_engines
from .test_scheduler_properties import deployment_specs, nodes_and_leases, perturb, report_engines

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Auto-cordon after two failures, so random histories reach it (and its breaker).
CONFIG = ReconcileConfig(auto_cordon_after=2, auto_cordon_max_share=0.5, reap_timeout=600.0)
# The same, for nodes that are one host (``llmgw up``): a port goes to one node at a time.
ONE_HOST = dataclasses.replace(CONFIG, ports=PortRange(shared_by_nodes=True))


class Recorded(dict):
    """A dict that records the keys set or removed: what the shell's KV mirrors tell
    their listeners, for ``Reconciler.step``'s ``touched``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.changed: set = set()

    def __setitem__(self, key, value):
        self.changed.add(key)
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.changed.add(key)
        super().__delitem__(key)

    def pop(self, key, *default):
        self.changed.add(key)
        return super().pop(key, *default)

    def _unrecorded(self, *_args, **_kwargs):
        raise NotImplementedError("not recorded: use item assignment, del or pop")

    update = setdefault = popitem = clear = _unrecorded  # type: ignore[assignment]

    def take(self) -> set:
        out, self.changed = self.changed, set()
        return out


def view_facts(view: ClusterView, cache: PlacementCache) -> dict:
    """Everything placement reads from a view and its memo, in comparable form."""
    for multi in (False, True):
        _indexes(view, cache, multi)
    nodes = {
        nid: (
            n.record,
            n.lease,
            n.gpus,
            tuple(n.fabrics),
            n.usable_fabrics,
            frozenset(n.used_gpus),
            frozenset(n.used_ports),
            tuple(sorted(n.blocked.items())),
            n.unhealthy,
            n.quarantine,
            n.suspect,
        )
        for nid, n in view.nodes.items()
    }
    static = {k: verdict for k, (node, verdict) in cache.static.items() if view.nodes.get(k[0]) is node}
    indexes = {
        (multi, group): (tuple((k, tuple(b)) for k, b in sorted(idx.buckets.items())), idx.total_gpus, idx.used_gpus)
        for multi, by_group in cache.indexes.items()
        for group, idx in by_group.items()
        if idx.buckets
    }
    return {
        "nodes": nodes,
        "static": static,
        "indexes": indexes,
        "spread": +Counter(view.spread),
        "max_gpus": view.max_gpus,
        "host_ports": +Counter(view.host_ports),
    }


def assert_view_is_full(rec: Reconciler, nodes, leases, replicas, suspects):
    full = ClusterView.build(nodes, leases, replicas.values(), ports=rec.config.ports, suspects=suspects)
    live, want = view_facts(rec.view, rec.memo), view_facts(full, PlacementCache())
    for key in want:
        assert live[key] == want[key], f"live view's {key} differs from the full build's"


@SETTINGS
@given(cluster=nodes_and_leases(max_nodes=12), specs=deployment_specs, rounds=st.integers(1, 10), data=st.data())
def test_incremental_steps_equal_full_reconciles(cluster, specs, rounds, data):
    nodes, leases = Recorded(cluster[0]), Recorded(cluster[1])
    deployments = {
        f"d{i}": make_deployment(f"d{i}", replicas=r, gpus_per_node=g, nodes_per_replica=n, startup_timeout=t) for i, (r, g, n, t) in enumerate(specs)
    }
    config = ONE_HOST if data.draw(st.booleans()) else CONFIG
    rec = Reconciler(config)
    told = Reconciler(config)  # told which nodes changed, as the shell does
    replicas: dict = {}
    failures: dict = {}
    now = 1_000.0
    added = 0
    for _ in range(rounds):
        now += data.draw(st.sampled_from([0.5, 1.0, 30.0, 700.0]))
        perturb(data.draw, nodes, leases, now)
        if data.draw(st.integers(0, 5)) == 0:  # a node joins
            added += 1
            nid = f"new{added}"
            nodes[nid] = make_node(nid, data.draw(st.sampled_from(["ib-a", "ib-b", None])), gpus=8)
            leases[nid] = make_lease(nid, "ready", since=now)
        if leases and data.draw(st.integers(0, 5)) == 0:  # a lease goes (or is renewed: same state, new object)
            nid = data.draw(st.sampled_from(sorted(leases)))
            if data.draw(st.booleans()):
                del leases[nid]
            else:
                leases[nid] = msgspec.structs.replace(leases[nid], last_renew=now, last_seq=leases[nid].last_seq + 1)
        replicas = report_engines(data.draw, replicas)
        if replicas and data.draw(st.integers(0, 6)) == 0:  # a record deleted behind the scheduler's back
            del replicas[data.draw(st.sampled_from(sorted(replicas)))]
        if data.draw(st.integers(0, 4)) == 0:  # an operator rescales, re-templates, re-times or deletes a deployment
            name = data.draw(st.sampled_from(sorted(deployments)))
            what = data.draw(st.sampled_from(["scale", "template", "timeout", "delete", "spares"]))
            if what == "delete":
                deployments.pop(name)
                if not deployments:
                    deployments[name] = make_deployment(name, replicas=1, gpus_per_node=1, nodes_per_replica=1)
            elif what == "template":
                deployments[name] = msgspec.structs.replace(deployments[name], engine_args=[f"--rev={now}"])
            elif what == "spares":  # warm spares: placed after every serving replica, taken back first
                deployments[name] = msgspec.structs.replace(deployments[name], spares=data.draw(st.integers(0, 2)))
            elif what == "timeout":  # the one field of a spec advancing a replica reads
                deployments[name] = msgspec.structs.replace(deployments[name], startup_timeout=data.draw(st.sampled_from([1.0, 60.0, 900.0])))
            else:
                deployments[name] = msgspec.structs.replace(deployments[name], replicas=data.draw(st.integers(0, 4)))

        full = reconcile(deployments, replicas, nodes, leases, now, config=config, failures=failures)
        full_step = data.draw(st.integers(0, 9)) == 0
        plan = rec.step(deployments, replicas, nodes, leases, now, failures=failures, full=full_step)
        assert plan == full
        touched = nodes.take() | leases.take()
        assert told.step(deployments, replicas, nodes, leases, now, failures=failures, full=full_step, touched=touched) == full
        assert set(plan.deletes).isdisjoint(plan.writes)  # else applying it would drop a record it launched
        assert [e.subject for e in plan.events] == [e.subject for e in full.events]

        fate = data.draw(st.sampled_from(["applied"] * 6 + ["not yet visible", "lost"]))
        if fate == "lost":  # the shell could not write it: it says so, and the next step is a full one
            rec.reset()
            told.reset()
            continue
        if fate == "not yet visible":  # written, but the mirrors have not echoed it: the same input again
            continue
        failures = remember_failures(failures, plan, now, config.auto_cordon_window)
        after, deployments = apply_plan(plan, replicas, deployments)
        for c in plan.cordons:  # the registry records the cordon it was asked for
            nodes[c.node_id] = msgspec.structs.replace(nodes[c.node_id], admin="cordoned", admin_by="auto", admin_reason=c.reason)
        # The view the step left equals the full build of what it decided.
        assert_view_is_full(rec, nodes, leases, after, rec.suspects)
        assert_view_is_full(told, nodes, leases, after, told.suspects)
        replicas = after


# --------------------------------------------------------------------------
# What a step does when little changed (table tests)
# --------------------------------------------------------------------------


def big_cluster(n: int = 40):
    nodes = {f"node{i:02d}": make_node(f"node{i:02d}", "ib-a" if i < n // 2 else "ib-b") for i in range(n)}
    leases = {nid: make_lease(nid, "ready", since=1.0) for nid in nodes}
    return nodes, leases


def placed(rec, deployments, nodes, leases, now):
    plan = rec.step(deployments, {}, nodes, leases, now)
    replicas, deployments = apply_plan(plan, {}, deployments)
    ready = {rid: msgspec.structs.replace(with_engines(r, all="ready"), state="ready") for rid, r in replicas.items()}
    rec.step(deployments, replicas, nodes, leases, now + 1)  # the writes echoed
    rec.step(deployments, ready, nodes, leases, now + 2)  # every replica ready
    return ready, deployments


def test_nothing_changed_advances_nothing():
    nodes, leases = big_cluster()
    rec = Reconciler()
    replicas, deps = placed(rec, {"d": make_deployment("d", replicas=6)}, nodes, leases, 10.0)
    plan = rec.step(deps, replicas, nodes, leases, 20.0)
    assert not plan and (rec.advanced, rec.converged) == (0, 0)


def test_the_schedulers_own_write_of_a_spec_converges_its_deployment_and_advances_no_replica():
    nodes, leases = big_cluster()
    rec = Reconciler()
    replicas, deps = placed(rec, {"d": make_deployment("d", replicas=6)}, nodes, leases, 10.0)
    # A new generation counter and a backoff: what apply() writes back into a spec.
    written = {"d": msgspec.structs.replace(deps["d"], last_generation=deps["d"].last_generation + 3, failures=1, last_failure="x")}
    plan = rec.step(written, replicas, nodes, leases, 20.0)
    assert plan == reconcile(written, replicas, nodes, leases, 20.0)
    assert (rec.advanced, rec.converged) == (0, 1)
    # A new startup timeout is read by every replica's clock: all of them are looked at.
    retimed = {"d": msgspec.structs.replace(written["d"], startup_timeout=5.0)}
    plan = rec.step(retimed, replicas, nodes, leases, 21.0)
    assert plan == reconcile(retimed, replicas, nodes, leases, 21.0)
    assert (rec.advanced, rec.converged) == (6, 1)


def test_a_shorter_startup_timeout_fails_the_replicas_it_makes_late_at_once():
    nodes, leases = big_cluster()
    rec = Reconciler()
    deps = {"d": make_deployment("d", replicas=2, startup_timeout=900.0)}
    plan = rec.step(deps, {}, nodes, leases, 10.0)
    launching, deps = apply_plan(plan, {}, deps)
    rec.step(deps, launching, nodes, leases, 11.0)  # the writes echoed; no engine is up
    retimed = {"d": msgspec.structs.replace(deps["d"], startup_timeout=5.0)}
    plan = rec.step(retimed, launching, nodes, leases, 20.0)
    assert plan == reconcile(retimed, launching, nodes, leases, 20.0)
    assert {e.subject for e in plan.events if e.what == "failed"} == set(launching)


def test_a_renewal_that_keeps_the_state_advances_nothing():
    nodes, leases = big_cluster()
    rec = Reconciler()
    replicas, deps = placed(rec, {"d": make_deployment("d", replicas=6)}, nodes, leases, 10.0)
    node = next(iter(replicas.values())).members[0].node_id
    renewed = {**leases, node: msgspec.structs.replace(leases[node], last_renew=20.0, last_seq=9)}
    plan = rec.step(deps, replicas, nodes, renewed, 20.0)
    assert not plan and (rec.advanced, rec.converged) == (0, 0)


def test_a_lost_node_advances_only_its_replicas_and_replaces_them_as_the_full_pass_does():
    nodes, leases = big_cluster()
    rec = Reconciler()
    replicas, deps = placed(rec, {"d": make_deployment("d", replicas=6)}, nodes, leases, 10.0)
    victim = next(iter(replicas.values())).members[1].node_id
    hosted = {rid for rid, r in replicas.items() if any(m.node_id == victim for m in r.members)}
    lost = {**leases, victim: make_lease(victim, "lost", since=20.0)}
    plan = rec.step(deps, replicas, nodes, lost, 20.0)
    assert rec.advanced == len(hosted) and rec.converged == 1
    assert plan == reconcile(deps, replicas, nodes, lost, 20.0)
    assert {launch.node_id for launch in plan.launches}.isdisjoint({victim}) and len(plan.launches) == 2 * len(hosted)


@pytest.mark.parametrize("told", ["nothing", "the lost node", "None: compare all"])
def test_told_which_nodes_changed_the_step_compares_only_those(told):
    """``touched`` is trusted: a lost node not named is not looked at; named, it is,
    and the plan is the full computation's; with None every node is compared."""
    nodes, leases = big_cluster()
    rec = Reconciler()
    replicas, deps = placed(rec, {"d": make_deployment("d", replicas=6)}, nodes, leases, 10.0)
    victim = next(iter(replicas.values())).members[1].node_id
    lost = {**leases, victim: make_lease(victim, "lost", since=20.0)}
    touched = {"nothing": set(), "the lost node": {victim}, "None: compare all": None}[told]
    plan = rec.step(deps, replicas, nodes, lost, 20.0, touched=touched)
    if told == "nothing":
        assert not plan and (rec.advanced, rec.converged) == (0, 0)
    else:
        assert plan == reconcile(deps, replicas, nodes, lost, 20.0)
        assert any(e.what == "failed" for e in plan.events)


def test_a_node_named_but_unchanged_advances_nothing():
    nodes, leases = big_cluster()
    rec = Reconciler()
    replicas, deps = placed(rec, {"d": make_deployment("d", replicas=6)}, nodes, leases, 10.0)
    assert not rec.step(deps, replicas, nodes, leases, 20.0, touched=set(nodes) | {"node-gone"})
    assert (rec.advanced, rec.converged) == (0, 0)


def test_a_startup_timeout_fires_with_no_input_changing():
    nodes, leases = big_cluster(4)
    rec = Reconciler()
    deps = {"d": make_deployment("d", replicas=1, startup_timeout=100.0)}
    plan = rec.step(deps, {}, nodes, leases, 10.0)
    replicas, deps = apply_plan(plan, {}, deps)
    assert not rec.step(deps, replicas, nodes, leases, 50.0)  # launching, not late yet
    plan = rec.step(deps, replicas, nodes, leases, 111.0)  # nothing changed but the clock
    assert plan == reconcile(deps, replicas, nodes, leases, 111.0)
    assert [e.what for e in plan.events][:2] == ["failed", "reaping"]


def test_a_pending_deployment_is_placed_when_a_node_joins():
    nodes, leases = big_cluster(2)
    rec = Reconciler()
    deps = {"d": make_deployment("d", replicas=3, gpus_per_node=8, nodes_per_replica=1)}
    plan = rec.step(deps, {}, nodes, leases, 10.0)
    replicas, deps = apply_plan(plan, {}, deps)
    assert sorted(r.state for r in replicas.values()) == ["launching", "launching", "pending"]
    assert not rec.step(deps, replicas, nodes, leases, 11.0)  # still no room: the same reason, nothing written
    nodes = {**nodes, "node09": make_node("node09", "ib-a")}
    leases = {**leases, "node09": make_lease("node09", "ready", since=12.0)}
    plan = rec.step(deps, replicas, nodes, leases, 12.0)
    assert plan == reconcile(deps, replicas, nodes, leases, 12.0)
    assert [launch.node_id for launch in plan.launches] == ["node09"]


# --------------------------------------------------------------------------
# changes(previous, now): what is dirty, as a pure function (table tests)
# --------------------------------------------------------------------------


def _settled():
    """A reconciler that has placed a deployment of 6 and seen them all ready."""
    nodes, leases = big_cluster()
    rec = Reconciler()
    replicas, deps = placed(rec, {"d": make_deployment("d", replicas=6, startup_timeout=100.0)}, nodes, leases, 10.0)
    return rec, deps, replicas, nodes, leases


def _edit(case, deps, replicas, nodes, leases):
    """The inputs of the next step after ``case``; returns them and what must be dirty."""
    first = sorted(replicas)[0]
    node = replicas[first].members[0].node_id
    on_node = {rid for rid, r in replicas.items() if any(m.node_id == node for m in r.members)}
    if case == "nothing":
        return (deps, replicas, nodes, leases), (set(), set(), set())
    if case == "a replica record replaced":
        return (deps, {**replicas, first: msgspec.structs.replace(replicas[first], reason="x")}, nodes, leases), ({first}, {"d"}, set())
    if case == "a replica record gone":
        return (deps, {k: v for k, v in replicas.items() if k != first}, nodes, leases), ({first}, {"d"}, set())
    if case == "a lease renewed, same state":
        renewed = {**leases, node: msgspec.structs.replace(leases[node], last_renew=20.0, last_seq=9)}
        return (deps, replicas, nodes, renewed), (set(), set(), set())
    if case == "a lease gone lost":
        return (deps, replicas, nodes, {**leases, node: make_lease(node, "lost", since=20.0)}), (on_node, {"d"}, {node})
    if case == "a node record replaced":
        return (deps, replicas, {**nodes, node: make_node(node, "ib-a", admin="cordoned")}, leases), (on_node, {"d"}, {node})
    if case == "the scheduler's own write of a spec":
        written = {"d": msgspec.structs.replace(deps["d"], last_generation=deps["d"].last_generation + 1)}
        return (written, replicas, nodes, leases), (set(), {"d"}, set())
    if case == "a new startup timeout":
        return ({"d": msgspec.structs.replace(deps["d"], startup_timeout=5.0)}, replicas, nodes, leases), (set(replicas), {"d"}, set())
    if case == "a deployment deleted":
        return ({}, replicas, nodes, leases), (set(replicas), {"d"}, set())
    raise AssertionError(case)


CASES = [
    "nothing",
    "a replica record replaced",
    "a replica record gone",
    "a lease renewed, same state",
    "a lease gone lost",
    "a node record replaced",
    "the scheduler's own write of a spec",
    "a new startup timeout",
    "a deployment deleted",
]


@pytest.mark.parametrize("case", CASES)
def test_changes_names_what_is_dirty_and_touches_nothing(case):
    rec, deps, replicas, nodes, leases = _settled()
    (d, r, n, le), (want_replicas, want_deployments, want_nodes) = _edit(case, deps, replicas, nodes, leases)
    before = copy.deepcopy(rec.seen)
    dirty = changes(rec.seen, Inputs(d, r, n, le, 20.0))
    assert (dirty.replicas, dirty.deployments, dirty.nodes) == (want_replicas, want_deployments, want_nodes)
    assert rec.seen == before  # pure: what the previous step left is read, not changed
    told = changes(rec.seen, Inputs(d, r, n, le, 20.0, touched=set(nodes) | set(leases)))
    assert (told.replicas, told.deployments, told.nodes) == (want_replicas, want_deployments, want_nodes)


def test_changes_names_a_replica_whose_clock_is_due_and_leaves_the_clock_to_remember():
    nodes, leases = big_cluster(4)
    rec = Reconciler()
    deps = {"d": make_deployment("d", replicas=1, startup_timeout=100.0)}
    replicas, deps = apply_plan(rec.step(deps, {}, nodes, leases, 10.0), {}, deps)
    rec.step(deps, replicas, nodes, leases, 11.0)  # the write echoed: launching, its clock set
    (rid,) = replicas
    assert [rid for _, rid in rec.seen.deadlines] == [rid]
    assert changes(rec.seen, Inputs(deps, replicas, nodes, leases, 50.0)).replicas == set()
    due = changes(rec.seen, Inputs(deps, replicas, nodes, leases, 111.0))
    assert due.replicas == {rid} and due.deployments == {"d"} and [r for _, r in due.due] == [rid]
    assert [r for _, r in rec.seen.deadlines] == [rid]  # still there: ``remember`` retires it
