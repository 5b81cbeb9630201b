"""The console's pure cores, table-tested: the cluster folded one update at a
time (``tui/cluster.py``), the events panel's timeline with its herds
(``tui/timeline.py``) and how far behind the bus the screen is (``tui/lag.py``).

The fold's answers are checked against the read model's own functions
(``shared/readmodel.py``) computed from scratch over the same records: the
console and ``llmgw ctl`` must never disagree.
"""

from __future__ import annotations

import random

import pytest

from llmgw.shared.readmodel import gpu_holders, gpus_in_use, node_gpu_counts, node_state
from llmgw.shared.schemas import Event
from llmgw.tui.cluster import DEPLOYMENTS, LEASES, NO_FABRIC, NODES, REPLICAS, ClusterModel, row_key
from llmgw.tui.lag import Lag
from llmgw.tui.model import MarkBook, fabric_rows, node_view, replica_order, replica_summary
from llmgw.tui.timeline import Herd, Single, Timeline, Told, event_lines

from .tui_builders import BRING_UP, FAILOVER, G1, G3, RECOVERY, T0, ev, make_lease, make_node, make_replica, model_of, seed_state

# --------------------------------------------------------------------------
# folding: one update at a time
# --------------------------------------------------------------------------


def counts(model: ClusterModel, fabric: str) -> tuple:
    t = model.totals[fabric]
    return (dict(t.nodes), t.gpus_free, t.gpus_used, t.gpus_out, dict(t.replicas))


@pytest.mark.parametrize(
    "updates, fabric, expected",
    [
        pytest.param([], "ib-a", ({"ready": 2}, 8, 8, 0, {"ready": 1}), id="the seed: ib-a"),
        pytest.param(
            [(LEASES, "node02", make_lease("node02", "lost"))],
            "ib-a",
            ({"ready": 1, "lost": 1}, 8, 8, 0, {"ready": 1}),
            id="a lease going lost moves one node, not its GPUs",
        ),
        pytest.param(
            [(REPLICAS, "demo-g1", make_replica(*G1[:2], "reaping", G1[2]))],
            "ib-a",
            ({"ready": 2}, 8, 8, 0, {"reaping": 1}),
            id="a replica being reaped still holds its GPUs",
        ),
        pytest.param(
            [(REPLICAS, "demo-g1", make_replica(*G1[:2], "gone", G1[2]))],
            "ib-a",
            ({"ready": 2}, 16, 0, 0, {"gone": 1}),
            id="a gone replica frees them",
        ),
        pytest.param([(REPLICAS, "demo-g1", None)], "ib-a", ({"ready": 2}, 16, 0, 0, {}), id="a deleted replica frees them"),
        pytest.param(
            [(REPLICAS, "demo-g3", make_replica(*G3[:2], "launching", G3[2]))],
            "ib-b",
            ({"ready": 2}, 0, 16, 0, {"ready": 1, "launching": 1}),
            id="a replacement placed on ib-b",
        ),
        pytest.param(
            [(NODES, "node01", make_node("node01", admin="cordoned")), (LEASES, "node02", make_lease("node02", "suspect"))],
            "ib-a",
            ({"cordoned": 1, "suspect": 1}, 8, 8, 0, {"ready": 1}),
            id="admin and health words",
        ),
        pytest.param([(NODES, "node02", make_node("node02", "ib-b", n=2))], "ib-b", ({"ready": 3}, 12, 12, 0, {"ready": 1}), id="a node moves fabric"),
        pytest.param([(LEASES, "node01", None)], "ib-a", ({"unknown": 1, "ready": 1}, 8, 8, 0, {"ready": 1}), id="no lease: unknown"),
    ],
)
def test_folding_one_update_moves_the_fabric_counts(updates, fabric, expected):
    model = model_of(seed_state())
    for bucket, key, value in updates:
        model.fold(bucket, key, value)
    assert counts(model, fabric) == expected


def test_a_node_leaving_leaves_no_row_no_count_and_no_empty_fabric():
    model = model_of(seed_state())
    model.fold(NODES, "node03", None)
    model.fold(NODES, "node04", None)
    assert [key[1:] for key in model.rows] == [("ib-a", "node01"), ("ib-a", "node02")]
    assert set(model.totals) == {"ib-a", "ib-b"}  # ib-b still has its replica
    model.fold(REPLICAS, "demo-g2", None)
    assert set(model.totals) == {"ib-a"} and model.all.node_count == 2


def test_rows_are_sorted_by_fabric_with_no_fabric_last_and_a_node_on_two_fabrics_in_both():
    model = ClusterModel()
    model.fold(NODES, "node09", make_node("node09", None, gpus=2))
    model.fold(NODES, "node02", make_node("node02", "ib-b"))
    two = make_node("node05", "ib-a")
    two = type(two)(**{**{f: getattr(two, f) for f in two.__struct_fields__}, "fabrics": [*two.fabrics, *make_node("x", "ib-b").fabrics]})
    model.fold(NODES, "node05", two)
    model.fold(NODES, "node01", make_node("node01", "ib-b"))
    assert [k[1:] for k in model.rows] == [("ib-a", "node05"), ("ib-b", "node01"), ("ib-b", "node02"), ("ib-b", "node05"), (NO_FABRIC, "node09")]
    assert model.all.node_count == 4 and model.totals["ib-b"].node_count == 3


def test_changes_say_what_a_frame_must_redraw():
    model = model_of(seed_state())
    model.fold(LEASES, "node01", make_lease("node01", renewed=T0 + 40))  # a checkpoint: the age only
    c = model.take_changes()
    assert (c.nodes, c.order, c.facts, c.totals, c.replicas) == ({"node01"}, False, False, False, False)
    model.fold(LEASES, "node01", make_lease("node01", "suspect"))
    c = model.take_changes()
    assert (c.nodes, c.order, c.facts, c.totals) == ({"node01"}, False, True, True)
    model.fold(NODES, "node07", make_node("node07", "ib-c"))
    c = model.take_changes()
    assert (c.nodes, c.order) == ({"node07"}, True)
    model.fold(REPLICAS, "demo-g3", make_replica(*G3[:2], "launching", G3[2]))
    c = model.take_changes()
    assert (c.nodes, c.replicas, c.totals) == ({"node03", "node04"}, True, True)
    assert not model.take_changes()


def test_replacing_a_bucket_folds_only_what_differs():
    seed = seed_state()
    model = model_of(seed)
    fresh = dict(seed.leases)
    fresh["node02"] = make_lease("node02", "lost")
    del fresh["node04"]
    model.replace(LEASES, fresh)
    c = model.take_changes()
    assert c.nodes == {"node02", "node04"}
    assert model.facts["node04"].state == "unknown" and model.facts["node02"].state == "lost"


def test_the_filter_searches_ids_states_addresses_holders_and_fabrics():
    model = model_of(seed_state(nodes_x={"node05": make_node("node05", None, gpus=2, n=5)}))
    assert [k[2] for k in model.matching_rows("demo-g1")] == ["node01", "node02"]
    assert [k[2] for k in model.matching_rows("IB-B")] == ["node03", "node04"]
    assert [k[2] for k in model.matching_rows("127.0.1.5")] == ["node05"]
    assert [k[2] for k in model.matching_rows("ready ib-a node02")] == ["node02"]
    assert model.matching_rows("nothing-like-it") == []
    assert model.matching_rows("") is model.rows


def test_a_cordon_stays_visible_on_a_node_whose_health_word_wins():
    model = model_of(
        seed_state(
            nodes_x={"node02": make_node("node02", admin="cordoned", n=2), "node03": make_node("node03", "ib-b", admin="draining", n=3)},
            leases_x={"node02": make_lease("node02", "lost")},
        )
    )
    two, three = node_view(model, "ib-a", "node02", T0, MarkBook()), node_view(model, "ib-b", "node03", T0, MarkBook())
    assert (two.state, two.admin) == ("lost", "cordoned")
    assert (three.state, three.admin) == ("draining", "")


def test_node_rows_name_each_gpus_holder_and_a_replacement_wins_over_the_reaped():
    model = model_of(
        seed_state(replicas_x={"demo-g1": make_replica(*G1[:2], "reaping", G1[2]), "demo-g9": make_replica("demo-g9", "ib-a", "launching", [("node01", [0])])})
    )
    marks = MarkBook()
    marks.update(model.replicas)
    view = node_view(model, "ib-a", "node01", T0 + 0.5, marks)
    assert [(c.mark, c.tone) for c in view.cells[:2]] == [("C", "starting"), ("A", "failing")]
    assert view.lease_age == "≤0.5s" and view.gpus_free == 4
    assert model.holder("node01", 0).id == gpu_holders(model.replicas)["node01"][0].id == "demo-g9"


@pytest.mark.parametrize("seed", range(5))
def test_folding_in_any_order_agrees_with_the_read_model_from_scratch(seed):
    """Random puts and deletes of nodes, leases and replicas (overlapping GPU claims
    included): the folded facts equal ``ctl``'s, computed over the final records."""
    rnd = random.Random(seed)
    nodes = [f"node{i:02d}" for i in range(12)]
    model = ClusterModel()
    for step in range(400):
        what = rnd.random()
        node = rnd.choice(nodes)
        if what < 0.2:
            model.fold(
                NODES, node, None if rnd.random() < 0.2 else make_node(node, rnd.choice(["ib-a", "ib-b", None]), admin=rnd.choice(["active", "cordoned"]))
            )
        elif what < 0.45:
            model.fold(LEASES, node, None if rnd.random() < 0.1 else make_lease(node, rnd.choice(["ready", "suspect", "lost"]), renewed=T0 + step))
        else:
            rid = f"d{rnd.randrange(3)}-g{rnd.randrange(1, 9)}"
            if rnd.random() < 0.2:
                model.fold(REPLICAS, rid, None)
            else:
                members = [(n, sorted(rnd.sample(range(8), rnd.randrange(1, 5)))) for n in rnd.sample(nodes, rnd.randrange(1, 3))]
                model.fold(
                    REPLICAS,
                    rid,
                    make_replica(rid, rnd.choice(["ib-a", "ib-b", None]), rnd.choice(["launching", "ready", "failed", "reaping", "gone"]), members),
                )
    in_use = gpus_in_use(model.replicas)
    holders = gpu_holders(model.replicas)
    for node, rec in model.nodes.items():
        facts = model.facts[node]
        assert facts.state == node_state(rec, model.leases.get(node))
        assert facts.gpus == node_gpu_counts(rec, in_use)
        assert {g: r.id for g, r in model.holders(node).items()} == {g: r.id for g, r in holders.get(node, {}).items()}
    assert set(model.facts) == set(model.nodes)
    assert model.rows == sorted(row_key(f.name if f else NO_FABRIC, n) for n, rec in model.nodes.items() for f in (rec.fabrics or [None]))
    # the aggregates are the sums of the facts
    scratch = ClusterModel()
    scratch.replace(NODES, model.nodes)
    scratch.replace(LEASES, model.leases)
    scratch.replace(REPLICAS, model.replicas)
    assert fabric_rows(scratch) == fabric_rows(model)
    assert (scratch.all.nodes, scratch.all.gpus_free, scratch.all.replicas) == (model.all.nodes, model.all.gpus_free, model.all.replicas)


def test_replicas_are_listed_problems_first():
    model = model_of(
        seed_state(
            replicas_x={
                "demo-g1": make_replica(*G1[:2], "failed", G1[2], reason="node node02 lost"),
                "demo-g3": make_replica(*G3[:2], "launching", G3[2]),
                "other-g1": make_replica("other-g1", "ib-a", "degraded", [("node01", [4])]),
            }
        )
    )
    assert replica_order(model) == ["demo-g1", "demo-g3", "other-g1", "demo-g2"]
    assert replica_order(model, "ib-a") == ["demo-g1", "other-g1"]
    assert replica_summary(model, frozenset({"demo-g3"}), 1) == "1 ready · 1 degraded · 1 rebuilding · 1 failed · 1 backoff"
    model.fold(DEPLOYMENTS, "demo", None)  # a bucket the console reads too: no error for a missing key
    # the whole order is kept between changes: a change of state re-sorts it, a letter does not
    everything = replica_order(model)
    everything.clear()  # a caller's copy, not the kept list
    assert replica_order(model) == ["demo-g1", "demo-g3", "other-g1", "demo-g2"]
    model.fold(REPLICAS, "demo-g1", make_replica(*G1[:2], "ready", G1[2]))
    assert replica_order(model) == ["demo-g3", "other-g1", "demo-g1", "demo-g2"]
    assert replica_order(model, "demo") == ["demo-g3", "demo-g1", "demo-g2"]
    assert replica_order(model, "demo-g", among=["demo-g3", "other-g1", "demo-g1"]) == ["demo-g3", "demo-g1"]


# --------------------------------------------------------------------------
# the timeline: herds, stories, bounds
# --------------------------------------------------------------------------


def kinds(tl: Timeline) -> list[str]:
    out = []
    for e in tl.entries:
        if isinstance(e, Single):
            out.append(f"{e.seen.event.subject} {e.seen.event.what}")
        elif isinstance(e, Herd):
            out.append(f"herd: {e.text()}")
        elif isinstance(e, Told):
            out.append(f"story: {e.story.text()}")
    return out


def joined(i: int, t: float) -> Event:
    return ev(t, "node", f"node{i:05d}", "joined", "8 GPUs")


@pytest.mark.parametrize(
    "events, expected",
    [
        pytest.param(
            [joined(i, i * 0.1) for i in range(1, 10)],
            [f"node{i:05d} joined" for i in range(1, 10)],
            id="nine close together: single lines, as in a small cluster",
        ),
        pytest.param(
            [joined(i, i * 0.1) for i in range(1, 11)],
            ["herd: 10 nodes joined in 0.9s (node00001 … node00010)"],
            id="the tenth makes a herd where the first was",
        ),
        pytest.param(
            [joined(1, 0), ev(0.5, "deployment", "demo", "applied"), *(joined(i, i * 0.1) for i in range(2, 13))],
            ["herd: 12 nodes joined in 1.2s (node00001 … node00012)", "demo applied"],
            id="other events stay in stream order after the herd",
        ),
        pytest.param(
            [*(joined(i, i * 0.1) for i in range(1, 6)), *(joined(i, 100 + i * 0.1) for i in range(6, 11))],
            [f"node{i:05d} joined" for i in range(1, 11)],
            id="a gap longer than HERD_GAP starts afresh",
        ),
        pytest.param(
            [e for i in range(1, 11) for e in (joined(i, i), ev(i + 0.2, "node", f"node{i:05d}", "ready", "first heartbeat"))],
            ["herd: 10 nodes joined in 9.0s (node00001 … node00010)", "herd: 10 nodes ready in 9.0s (node00001 … node00010)"],
            id="interleaved kinds make a herd each",
        ),
    ],
)
def test_herds(events, expected):
    tl = Timeline()
    tl.extend(events)
    assert kinds(tl) == expected


def test_a_herd_of_ten_thousand_is_one_line_and_counts_as_it_grows():
    tl = Timeline()
    tl.extend(joined(i, i * 0.006) for i in range(1, 9841))
    herd = tl.entries[0]
    assert len(tl.entries) == 1 and isinstance(herd, Herd)
    assert herd.text() == "9,840 nodes joined in 59s (node00001 … node09840)"
    tl.add(joined(9841, 59.1))
    assert herd.count == 9841 and len(tl.entries) == 1
    lines = event_lines(tl)
    assert [k for k, _ in lines] == ["herd"]
    # every event one key away: the panel's expanded lines
    expanded = event_lines(tl, expand=True)
    assert len(expanded) == 1 + 9841 and expanded[1][0] == "member"
    # and a filter finds one member
    assert [(k, s.event.subject) for k, s in event_lines(tl, "node09999 joined")] == []
    assert [(k, s.event.subject) for k, s in event_lines(tl, "node09840")] == [("event", "node09840")]


def test_the_timeline_is_bounded_and_a_trimmed_herd_keeps_its_count():
    tl = Timeline(keep=100)
    tl.extend(joined(i, i * 0.01) for i in range(1, 151))
    tl.add(ev(10, "deployment", "demo", "applied"))
    assert tl.held == 100
    herd = tl.entries[0]
    assert isinstance(herd, Herd) and herd.count == 150 and len(herd.members) == 99
    assert herd.text().endswith("the oldest 51 no longer held")
    tl.extend(ev(20 + i, "deployment", f"d{i}", "applied") for i in range(150))  # the herd goes whole
    assert tl.held == 100 and not any(isinstance(e, Herd) and e.kind == "node" for e in tl.entries)


def test_the_seed_story_is_told_between_the_events():
    tl = Timeline()
    told = tl.extend(BRING_UP + FAILOVER + RECOVERY)
    assert [s.text() for s in told] == ["node02 lost → demo-g1 failed → reaped → demo-g3 placed on ib-b → ready (20.1 s)"]
    assert kinds(tl)[-2:] == ["demo-g3 ready", "story: node02 lost → demo-g1 failed → reaped → demo-g3 placed on ib-b → ready (20.1 s)"]
    assert [k for k, _ in event_lines(tl, "rebuild")] == [] and [k for k, _ in event_lines(tl, "reaped")] == ["story"]


def test_a_promoted_spare_and_its_rebuild_are_one_story_and_a_restart_in_place_another():
    from .tui_builders import replica_ev

    tl = Timeline()
    told = tl.extend(
        [
            replica_ev(0.0, "demo-g1", "degraded", "group broken: member rank 0 on node01 peer-lost: rank 1 lost", "ready"),
            replica_ev(0.0, "demo-g3", "ready", "promoted from standby: 1 of 2 serving", "standby"),
            replica_ev(0.5, "demo-g1", "failed", "member rank 0 on node01 peer-lost; moved", "degraded"),
            replica_ev(0.5, "demo-g1", "reaping", "stopping node01", "failed"),
            replica_ev(0.5, "demo-g4", "launching", "placed on ib-b: node03 (leader), node04", ""),
            replica_ev(16.0, "demo-g4", "standby", "leader on node03 loaded; a warm spare (2 of 2 serving)", "waiting-for-workers"),
            replica_ev(20.0, "demo-g2", "restarting", "restart in place: member rank 0 on node03 exited", "ready"),
            replica_ev(21.0, "demo-g2", "launching", "restarted in place on node03, node04 as generation 5", "restarting"),
            replica_ev(35.0, "demo-g2", "standby", "leader on node03 loaded; a warm spare (2 of 2 serving)", "waiting-for-workers"),
        ]
    )
    assert [s.text() for s in told] == [
        "demo-g1 degraded → demo-g1 failed → demo-g3 promoted → reaping → demo-g4 placed on ib-b → standing by (16.0 s)",
        "demo-g2 restarting in place → standing by (15.0 s)",
    ]
    assert tl.rebuilding == frozenset()


def test_a_nodes_events_are_found_without_walking_the_log():
    model = model_of(seed_state())
    tl = Timeline(nodes=model.nodes)
    tl.extend(BRING_UP + FAILOVER)
    seen = {"demo-g1"}
    got = [(e.subject, e.what) for e in tl.node_events("node02", seen)]
    assert got == [
        ("node02", "joined"),
        ("demo-g1", "launching"),
        ("demo-g1", "ready"),
        ("node02", "lost"),
        ("demo-g1", "failed"),
        ("demo-g1", "reaping"),
    ]
    # named in a detail (the placement names node03 and node04), not a member seen
    assert ("demo-g3", "launching") in [(e.subject, e.what) for e in tl.node_events("node04")]


# --------------------------------------------------------------------------
# how far behind the bus
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arrivals, drawn_at, behind, shown",
    [
        pytest.param([(100.0, 100.01)], 100.2, 0.19, False, id="keeping up: within a frame"),
        pytest.param([(100.0, 100.01), (101.0, 105.0)], 105.1, 4.09, True, id="a backlog: drawn 4 s late"),
        pytest.param([(100.0, 103.01), (101.0, 104.0)], 104.1, 0.1, False, id="a console clock 3 s ahead of the server's is not behind"),
        pytest.param([], 100.0, 0.0, False, id="nothing arrived: nothing to be behind on"),
    ],
)
def test_lag(arrivals, drawn_at, behind, shown):
    lag = Lag()
    for stored, at in arrivals:
        lag.arrived(stored, at)
    assert lag.drawn(drawn_at) == pytest.approx(behind)
    assert lag.shown is shown
    assert ("behind the bus" in lag.text()) is shown


def test_lag_says_so_until_it_has_caught_up():
    lag = Lag(show_after=2.0, hide_below=1.0)
    lag.arrived(0.0, 0.0)
    lag.drawn(0.1)
    lag.arrived(10.0, 14.0)
    assert lag.drawn(14.0) == 4.0 and lag.text() == "display 4.0 s behind the bus: catching up"
    lag.arrived(20.0, 21.5)
    assert lag.drawn(21.5) == 1.5 and lag.shown  # still catching up
    lag.arrived(30.0, 30.2)
    assert lag.drawn(30.2) == pytest.approx(0.2) and not lag.shown
