"""Properties of the scheduler over random clusters and random histories.

Whatever the fabrics, GPUs, leases, admin states, deployments and node losses:
no replica spans two fabrics, no GPU is given twice, no port is reused on a
node, every multi-node replica sits on a fabric usable on each of its nodes
when it was placed, and placement finds a place exactly when one exists.
"""

from __future__ import annotations

from collections import defaultdict

import msgspec
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llmgw.services.scheduler.placement import Request, check_node, place
from llmgw.services.scheduler.reconcile import reconcile
from llmgw.services.scheduler.scorers import NodeBinPack
from llmgw.services.scheduler.view import ClusterView, PortRange
from llmgw.shared.schemas import Replica, ReplicaMember
from llmgw.shared.states import HOLDING_REPLICA

from .builders import apply_plan, make_deployment, make_lease, make_node

# What ``CapacityIndex.best_fit`` (which chooses nodes in production) is held to.
BEST_FIT_ORACLE = NodeBinPack()
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def nodes_and_leases(draw, max_nodes: int = 10):
    count = draw(st.integers(0, max_nodes))
    nodes, leases = {}, {}
    for i in range(count):
        node_id = f"node{i:02d}"
        # Mostly one fabric of two, so multi-node replicas often fit; sometimes none, two, or a third.
        fabrics = draw(st.sampled_from([["ib-a"], ["ib-b"], ["ib-a"], ["ib-b"], [], ["ib-a", "ib-b"], ["ib-c"]]))
        if draw(st.integers(0, 9)) > 0:  # now and then a lease without a record
            nodes[node_id] = make_node(
                node_id,
                fabrics,
                gpus=draw(st.sampled_from([0, 2, 4, 8, 8, 8])),
                admin=draw(st.sampled_from(["active"] * 6 + ["cordoned", "draining"])),
                usable=draw(st.integers(0, 5)) > 0,
            )
        if draw(st.integers(0, 9)) > 0:  # now and then a record without a lease
            leases[node_id] = make_lease(node_id, draw(st.sampled_from(["ready"] * 6 + ["suspect", "lost"])))
    return nodes, leases


deployment_specs = st.lists(
    st.tuples(st.integers(0, 4), st.sampled_from([1, 2, 4, 8]), st.integers(1, 3), st.sampled_from([100.0, 600.0])),
    min_size=1,
    max_size=3,
)

PERTURBATIONS = ["lose", "recover", "suspect", "cordon", "drain", "activate", "forget", "hca-down", "hca-up"]
ENGINE_REPORTS = ["", "starting", "joined", "ready", "ready", "exited", "absent"]


def perturb(draw, nodes, leases, now):
    ids = sorted(set(nodes) | set(leases))
    if not ids:
        return
    for _ in range(draw(st.integers(0, 3))):
        node_id = draw(st.sampled_from(ids))
        kind = draw(st.sampled_from(PERTURBATIONS))
        record = nodes.get(node_id)
        if kind in ("lose", "recover", "suspect"):
            state = {"lose": "lost", "recover": "ready", "suspect": "suspect"}[kind]
            leases[node_id] = make_lease(node_id, state, since=now)
        elif kind == "forget":
            nodes.pop(node_id, None)
        elif record is not None and kind in ("cordon", "drain", "activate"):
            admin = {"cordon": "cordoned", "drain": "draining", "activate": "active"}[kind]
            nodes[node_id] = msgspec.structs.replace(record, admin=admin)
        elif record is not None:
            usable = kind == "hca-up"
            fabrics = [msgspec.structs.replace(f, usable=usable) for f in record.fabrics]
            nodes[node_id] = msgspec.structs.replace(record, fabrics=fabrics)


def report_engines(draw, replicas):
    """What agents might say; arbitrary, the reconciler must stay safe whatever it hears."""
    out = {}
    for rid, replica in replicas.items():
        if replica.members and draw(st.booleans()):
            members = [msgspec.structs.replace(m, engine_state=draw(st.sampled_from(ENGINE_REPORTS))) for m in replica.members]
            replica = msgspec.structs.replace(replica, members=members)
        out[rid] = replica
    return out


# --------------------------------------------------------------------------
# Invariants
# --------------------------------------------------------------------------


def assert_holdings_disjoint(replicas, ports: PortRange):
    gpus, used_ports = defaultdict(set), defaultdict(set)
    for r in replicas.values():
        assert r.state in HOLDING_REPLICA
        for m in r.members:
            assert not gpus[m.node_id] & set(m.gpus), f"GPU over-committed on {m.node_id}: {r.id}"
            gpus[m.node_id].update(m.gpus)
            assert len(set(m.gpus)) == len(m.gpus)
            mine = [p for p in (m.rendezvous_port, m.http_port) if p]
            assert len(set(mine)) == len(mine), f"rendezvous and http port equal in {r.id}"
            assert all(p in ports for p in mine)
            assert not used_ports[m.node_id] & set(mine), f"port reused on {m.node_id}: {r.id}"
            used_ports[m.node_id].update(mine)


def assert_shape(replica):
    if replica.state == "pending":
        assert replica.members == [] and replica.fabric is None
        return
    ms = replica.members
    assert ms, replica
    assert [m.rank for m in ms] == list(range(len(ms)))
    assert len({m.node_id for m in ms}) == len(ms), "two members on one node"
    leader, workers = ms[0], ms[1:]
    assert leader.role == "leader" and leader.serves_http and leader.http_port and leader.rendezvous_port
    assert all(w.role == "worker" and not w.serves_http and not w.http_port and not w.rendezvous_port for w in workers)
    if len(ms) > 1:
        assert replica.fabric is not None, "multi-node replica without a fabric"
    else:
        assert replica.fabric is None


def assert_placed_soundly(replica, spec, nodes, leases):
    """A replica placed this round: on nodes that could take it, all on one usable fabric."""
    assert len(replica.members) == spec.nodes_per_replica
    for m in replica.members:
        record = nodes[m.node_id]
        assert leases[m.node_id].state == "ready"
        assert record.admin == "active"
        assert len(m.gpus) == spec.gpus_per_node
        assert set(m.gpus) <= {g.index for g in record.gpus}
        if spec.nodes_per_replica > 1:
            usable = {f.name for f in record.fabrics if f.usable}
            assert replica.fabric in usable, f"{m.node_id} not usable on {replica.fabric}"


@SETTINGS
@given(cluster=nodes_and_leases(), specs=deployment_specs, rounds=st.integers(1, 6), data=st.data())
def test_random_histories_keep_the_invariants(cluster, specs, rounds, data):
    nodes, leases = cluster
    ports = PortRange()
    deployments = {
        f"d{i}": make_deployment(f"d{i}", replicas=r, gpus_per_node=g, nodes_per_replica=n, startup_timeout=t) for i, (r, g, n, t) in enumerate(specs)
    }
    replicas: dict = {}
    ids_ever: set[str] = set()
    last_gen: dict[str, int] = defaultdict(int)
    now = 1_000.0
    for _ in range(rounds):
        now += data.draw(st.sampled_from([1.0, 30.0, 700.0]))
        perturb(data.draw, nodes, leases, now)
        replicas = report_engines(data.draw, replicas)
        if data.draw(st.integers(0, 4)) == 0:  # an operator rescales one deployment, or asks for spares
            name = data.draw(st.sampled_from(sorted(deployments)))
            field = data.draw(st.sampled_from(["replicas", "spares"]))
            deployments[name] = msgspec.structs.replace(deployments[name], **{field: data.draw(st.integers(0, 4 if field == "replicas" else 2))})

        plan = reconcile(deployments, replicas, nodes, leases, now)

        for rid, r in plan.writes.items():
            if rid not in replicas:  # a new replica: a fresh id, a larger generation
                assert rid not in ids_ever and r.generation > last_gen[r.deployment]
                ids_ever.add(rid)
                last_gen[r.deployment] = r.generation
                assert rid == f"{r.deployment}-g{r.generation}"
            if r.state == "launching" and (rid not in replicas or replicas[rid].state == "pending"):
                assert_placed_soundly(r, deployments[r.deployment], nodes, leases)
            if r.state == "launching" and rid in replicas and r.generation != replicas[rid].generation:
                # restarted in place: the same members, GPUs and ports, a generation never issued before
                was = replicas[rid]
                assert was.state in ("ready", "degraded", "standby", "restarting")
                assert [(m.node_id, m.gpus, m.http_port, m.rendezvous_port) for m in r.members] == [
                    (m.node_id, m.gpus, m.http_port, m.rendezvous_port) for m in was.members
                ]
                assert r.generation > last_gen[r.deployment]
                last_gen[r.deployment] = r.generation
        launched = {(launch.node_id, launch.replica_id, launch.member.rank) for launch in plan.launches}
        expected = {
            (m.node_id, rid, m.rank)
            for rid, r in plan.writes.items()
            if r.state == "launching" and (rid not in replicas or replicas[rid].state == "pending" or replicas[rid].generation != r.generation)
            for m in r.members
        }
        assert launched == expected
        for launch in plan.launches:
            assert launch.node_id in nodes and leases[launch.node_id].state == "ready"
        for stop in plan.stops:  # nothing is sent to a node known to be gone
            assert stop.node_id in nodes and getattr(leases.get(stop.node_id), "state", "") != "lost"
        assert set(plan.deletes).isdisjoint(plan.writes)

        # Shown by --hypothesis-show-statistics: the histories do reach every case.
        for r in plan.writes.values():
            event(f"{r.state}{' multi-node' if len(r.members) > 1 else ''}")
        if plan.deletes:
            event("deleted")
        replicas, deployments = apply_plan(plan, replicas, deployments)
        assert_holdings_disjoint(replicas, ports)
        for r in replicas.values():
            assert_shape(r)
        for name, spec in deployments.items():
            draining = {nid for nid, rec in nodes.items() if rec.admin == "draining"}
            counted = [
                r
                for r in replicas.values()
                if r.deployment == name
                and r.state in ("pending", "launching", "waiting-for-workers", "ready", "standby", "restarting")
                and not any(m.node_id in draining for m in r.members)
            ]
            assert len(counted) <= spec.replicas + spec.spares
            # a spare is never routed in place of a serving replica, nor beside enough of them
            assert sum(1 for r in counted if r.state == "ready") <= spec.replicas
        for rid in plan.writes:
            assert replicas[rid].since == now or replicas[rid].state == "pending"


# --------------------------------------------------------------------------
# place() against brute force
# --------------------------------------------------------------------------


@st.composite
def views(draw):
    nodes, leases = draw(nodes_and_leases(max_nodes=8))
    held = []
    for node_id, record in nodes.items():
        taken = draw(st.integers(0, len(record.gpus)))
        if taken:
            held.append(
                Replica(
                    id=f"x-{node_id}",
                    deployment=draw(st.sampled_from(["d", "other"])),
                    model="m",
                    engine="sim",
                    generation=1,
                    state=draw(st.sampled_from(sorted(HOLDING_REPLICA))),
                    fabric=None,
                    members=[
                        ReplicaMember(node_id=node_id, rank=0, role="leader", gpus=list(range(taken)), rendezvous_port=20000, http_port=20001, serves_http=True)
                    ],
                )
            )
    ports = PortRange(20000, draw(st.sampled_from([2, 3, 100])))
    return ClusterView.build(nodes, leases, held, ports=ports)


@SETTINGS
@given(view=views(), gpus=st.sampled_from([0, 1, 2, 4, 8]), n=st.integers(1, 3))
def test_place_finds_a_place_exactly_when_one_exists(view, gpus, n):
    request = Request("d", gpus, n)
    fits = {nid for nid, node in view.nodes.items() if check_node(node, request, view).ok}
    if n == 1:
        possible = bool(fits)
    else:
        per_fabric = defaultdict(set)
        for nid in fits:
            for f in view.nodes[nid].usable_fabrics:
                per_fabric[f].add(nid)
        possible = any(len(s) >= n for s in per_fabric.values())
    result = place(request, view)
    assert result.placed is possible
    if not possible:
        assert result.members is None and set(result.reasons) == set(view.nodes)
        return
    chosen = [m.node_id for m in result.members]
    assert len(chosen) == n == len(set(chosen)) and set(chosen) <= fits
    if n > 1:
        assert all(result.fabric in view.nodes[c].usable_fabrics for c in chosen)
        pool = {nid for nid in fits if result.fabric in view.nodes[nid].usable_fabrics}
    else:
        home = view.nodes[chosen[0]].home
        pool = {nid for nid in fits if view.nodes[nid].home == home}
    # Bin-packing inside the group, by the oracle: no unchosen node there would be left fuller.
    worst_chosen = min(BEST_FIT_ORACLE.score(view.nodes[c], request, view) for c in chosen)
    assert all(BEST_FIT_ORACLE.score(view.nodes[u], request, view) <= worst_chosen for u in pool - set(chosen))
    for m in result.members:
        node = view.nodes[m.node_id]
        assert m.gpus == node.free_gpus()[:gpus]
        assert not {m.rendezvous_port, m.http_port} & node.used_ports or m.rank > 0
