"""The console (``llmgw tui``).

Pure parts (views, rebuild stories) are tested on plain records. The app itself
runs under Textual's pilot against a real nats-server, fed by scripted writers
under the registry, health and scheduler identities (each bucket keeps its one
writer); cordon goes through a real registry. Snapshots pin the main screen at
80×24 and 160×48 with fixed times (``--snapshot-update`` rewrites them).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from llmgw.services import registry as registry_mod
from llmgw.shared import bus
from llmgw.shared import subjects as S
from llmgw.shared.schemas import (
    Event,
    FabricMembership,
    Gpu,
    Hca,
    HcaPort,
    Lease,
    NodeRecord,
    Replica,
    ReplicaMember,
    decode,
    encode,
)
from llmgw.tui.app import LlmgwApp
from llmgw.tui.banner import banner_text
from llmgw.tui.confirm import Confirm
from llmgw.tui.events import EventLog
from llmgw.tui.feed import ConnectionStatus
from llmgw.tui.help import Help
from llmgw.tui.model import (
    NO_FABRIC,
    ClusterState,
    MarkBook,
    fabric_views,
    format_age,
    gpu_holders,
    matches,
    node_detail,
    node_state,
    replica_views,
)
from llmgw.tui.node_detail import NodeDetail
from llmgw.tui.node_row import NodeRow, row_text
from llmgw.tui.replicas import ReplicasTable
from llmgw.tui.story import StoryBook, placed_where

from .conftest import service_config
from .waiting import _UNSET, eventually, passes

pytestmark = pytest.mark.timeout(60)

T0 = 1_700_000_000.0  # every scripted time counts from here
SEED = (("node01", "ib-a"), ("node02", "ib-a"), ("node03", "ib-b"), ("node04", "ib-b"))


# --------------------------------------------------------------------------
# builders
# --------------------------------------------------------------------------


def make_node(node: str, fabric: str | None = "ib-a", gpus: int = 8, admin: str = "active", n: int = 1) -> NodeRecord:
    return NodeRecord(
        node_id=node,
        identity=f"CN={node},OU=node",
        mgmt_addr=f"127.0.1.{n}",
        mgmt_interface="lo",
        gpus=[Gpu(index=i, uuid=f"GPU-{node}-{i}", name="NVIDIA H200", memory_mib=143771) for i in range(gpus)],
        fabrics=[FabricMembership(name=fabric, hcas=["mlx5_0", "mlx5_1"])] if fabric else [],
        hcas=[
            Hca(name=h, ports=[HcaPort(port=1, state="ACTIVE", phys_state="LinkUp", rate="200 Gb/sec (4X HDR)")], usable=True)
            for h in (["mlx5_0", "mlx5_1"] if fabric else [])
        ],
        admin=admin,
    )


def make_lease(node: str, state: str = "ready", renewed: float = T0, since: float = T0 - 60) -> Lease:
    return Lease(node_id=node, state=state, boot_id=f"boot-{node}-0123456789", last_renew=renewed, since=since)


def make_replica(rid: str, fabric: str | None, state: str, members: list[tuple[str, list[int]]], since: float = T0 - 30, reason: str = "") -> Replica:
    gen = int(rid.rsplit("-g", 1)[1])
    return Replica(
        id=rid,
        deployment=rid.rsplit("-g", 1)[0],
        model="sim-70b",
        engine="sim",
        generation=gen,
        state=state,
        fabric=fabric,
        members=[
            ReplicaMember(node_id=node, rank=i, role="leader" if i == 0 else "worker", gpus=gpus, engine_state="ready" if state == "ready" else "")
            for i, (node, gpus) in enumerate(members)
        ],
        since=since,
        reason=reason,
    )


def ev(t: float, kind: str, subject: str, what: str, detail: str = "", **data: str) -> Event:
    return Event(time=T0 + t, kind=kind, subject=subject, what=what, detail=detail, data=data)


def replica_ev(t: float, rid: str, what: str, detail: str, frm: str) -> Event:
    return ev(t, "replica", rid, what, detail, deployment=rid.rsplit("-g", 1)[0], generation=rid.rsplit("-g", 1)[1], **{"from": frm})


G1 = ("demo-g1", "ib-a", [("node01", [0, 1, 2, 3]), ("node02", [0, 1, 2, 3])])
G2 = ("demo-g2", "ib-b", [("node03", [0, 1, 2, 3]), ("node04", [0, 1, 2, 3])])
G3 = ("demo-g3", "ib-b", [("node03", [4, 5, 6, 7]), ("node04", [4, 5, 6, 7])])

# The seed's story, as the services tell it (times relative to T0).
BRING_UP = [
    ev(-60, "node", "node01", "joined", "8 GPUs, fabrics ib-a"),
    ev(-60, "node", "node02", "joined", "8 GPUs, fabrics ib-a"),
    ev(-60, "node", "node03", "joined", "8 GPUs, fabrics ib-b"),
    ev(-60, "node", "node04", "joined", "8 GPUs, fabrics ib-b"),
    ev(-59, "deployment", "demo", "applied", "2 × 2 node(s) × 4 GPU(s) of sim-70b on sim"),
    replica_ev(-59, "demo-g1", "launching", "placed on ib-a: node01 (leader), node02", ""),
    replica_ev(-59, "demo-g2", "launching", "placed on ib-b: node03 (leader), node04", ""),
    replica_ev(-57, "demo-g1", "ready", "leader on node01 serving", "waiting-for-workers"),
    replica_ev(-57, "demo-g2", "ready", "leader on node03 serving", "waiting-for-workers"),
]
FAILOVER = [
    ev(-6, "node", "node02", "lost", "no heartbeat for 60.1s", previous="suspect"),
    replica_ev(-6, "demo-g1", "failed", "node node02 lost", "ready"),
    replica_ev(-6, "demo-g1", "reaping", "stopping node01", "failed"),
    replica_ev(-6, "demo-g3", "launching", "placed on ib-b: node03 (leader), node04", ""),
]
RECOVERY = [
    replica_ev(-5, "demo-g1", "gone", "all members stopped", "reaping"),
    replica_ev(14.1, "demo-g3", "ready", "leader on node03 serving", "waiting-for-workers"),
]


def seed_state(**over) -> ClusterState:
    nodes = {n: make_node(n, f, n=i + 1) for i, (n, f) in enumerate(SEED)}
    leases = {n: make_lease(n) for n, _ in SEED}
    replicas = {rid: make_replica(rid, fab, "ready", m) for rid, fab, m in (G1, G2)}
    for k, v in over.items():
        {"nodes": nodes, "leases": leases, "replicas": replicas}[k.split("_")[0]].update(v)
    return ClusterState(nodes, leases, replicas)


# --------------------------------------------------------------------------
# pure: views
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lease_state, admin, word",
    [
        ("ready", "active", "ready"),
        ("suspect", "active", "suspect"),
        ("lost", "active", "lost"),
        ("ready", "cordoned", "cordoned"),
        ("ready", "draining", "draining"),
        ("lost", "cordoned", "lost"),  # health first: a lost node is lost, cordoned or not
        (None, "active", "unknown"),
    ],
)
def test_node_state_word(lease_state, admin, word):
    lease = make_lease("node01", lease_state) if lease_state else None
    assert node_state(make_node("node01", admin=admin), lease) == word


@pytest.mark.parametrize(
    "seconds, text",
    [(None, "-"), (-3, "0.0s"), (0.44, "0.4s"), (9.96, "10.0s"), (12.4, "12s"), (75, "1m15s"), (7200, "2.0h"), (2 * 86400, "2.0d")],
)
def test_ages(seconds, text):
    assert format_age(seconds) == text


@pytest.mark.parametrize(
    "pattern, texts, hit",
    [("", ("x",), True), ("NODE02", ("node02",), True), ("ib-a lost", ("node02", "ib-a", "lost"), True), ("ib-a lost", ("node02", "ib-a", "ready"), False)],
)
def test_filter_matches_every_word(pattern, texts, hit):
    assert matches(pattern, *texts) is hit


def test_fabric_panels_hold_their_nodes_and_each_gpu_names_its_holder():
    state = seed_state(nodes_extra={"node05": make_node("node05", fabric=None, gpus=2, n=5)})
    marks = MarkBook()
    marks.update(state.replicas)
    panels = fabric_views(state, T0 + 0.5, marks)
    assert [(p.name, [n.node_id for n in p.nodes]) for p in panels] == [
        ("ib-a", ["node01", "node02"]),
        ("ib-b", ["node03", "node04"]),
        (NO_FABRIC, ["node05"]),
    ]
    node01 = panels[0].nodes[0]
    assert [c.mark for c in node01.cells] == ["A"] * 4 + ["·"] * 4
    assert {c.replica for c in node01.cells[:4]} == {"demo-g1"} and node01.cells[0].tone == "ready"
    # a ready lease's renewal is a checkpoint: the node was heard at most that long ago
    assert node01.lease_age == "≤0.5s" and node01.gpus_free == 4
    assert panels[0].summary == "2 nodes · 8/16 GPUs free"
    # the filter narrows nodes and drops panels left empty
    assert [p.name for p in fabric_views(state, T0, marks, "node04")] == ["ib-b"]


def test_a_cordon_stays_visible_on_a_node_whose_health_word_wins():
    state = seed_state(
        nodes_x={"node02": make_node("node02", admin="cordoned", n=2), "node03": make_node("node03", "ib-b", admin="draining", n=3)},
        leases_x={"node02": make_lease("node02", "lost")},
    )
    views = {n.node_id: n for p in fabric_views(state, T0, MarkBook()) for n in p.nodes}
    assert (views["node02"].state, views["node02"].admin) == ("lost", "cordoned")
    assert (views["node03"].state, views["node03"].admin) == ("draining", "")
    assert "lost" in row_text(views["node02"], 8, 80).plain and "cordoned" in row_text(views["node02"], 8, 80).plain


def test_marks_are_kept_for_the_session_and_never_handed_on():
    marks = MarkBook()
    marks.update(["demo-g2", "demo-g1"])
    marks.update(["demo-g2", "demo-g3"])  # g1 is gone: its letter is not reused
    assert (marks.get("demo-g1"), marks.get("demo-g2"), marks.get("demo-g3")) == ("A", "B", "C")


def test_a_gpu_claimed_by_a_replica_being_reaped_and_its_replacement_shows_the_replacement():
    state = seed_state(
        replicas_x={"demo-g1": make_replica(*G1[:2], "reaping", G1[2]), "demo-g9": make_replica("demo-g9", "ib-a", "launching", [("node01", [0])])}
    )
    assert gpu_holders(state.replicas)["node01"][0].id == "demo-g9"
    assert gpu_holders(state.replicas)["node01"][1].id == "demo-g1"


def test_replica_rows_mark_failures_and_rebuilds():
    state = seed_state(
        replicas_x={
            "demo-g1": make_replica(*G1[:2], "failed", G1[2], reason="node node02 lost"),
            "demo-g3": make_replica(*G3[:2], "launching", G3[2], since=T0 - 2),
        }
    )
    marks = MarkBook()
    marks.update(state.replicas)
    rows = {r.id: r for r in replica_views(state, T0, marks, rebuilding=frozenset({"demo-g3"}))}
    assert (rows["demo-g1"].tone, rows["demo-g1"].members, rows["demo-g1"].reason) == ("failing", "node01:0 node02:1", "node node02 lost")
    assert rows["demo-g3"].rebuild and rows["demo-g3"].tone == "starting" and rows["demo-g3"].age == "2.0s"
    assert not rows["demo-g2"].rebuild and rows["demo-g2"].tone == "ready"


def test_node_detail_has_inventory_replicas_and_its_own_events():
    state = seed_state()
    seen = {"demo-g1": {"node01", "node02"}, "demo-g2": {"node03", "node04"}}
    d = node_detail("node02", state, BRING_UP + FAILOVER, seen, T0 + 1)
    assert d.state == "ready" and d.admin == "active" and d.fabrics == "ib-a [mlx5_0, mlx5_1]"
    assert (d.gpus[0].name, d.gpus[0].memory, d.gpus[0].replica, d.gpus[7].replica) == ("NVIDIA H200", "140 GiB", "demo-g1", "")
    assert d.hcas[0].ports == "1: ACTIVE 200 Gb/sec (4X HDR)" and d.hcas[0].usable
    assert [(m.replica, m.rank, m.role) for m in d.members] == [("demo-g1", 1, "worker")]
    subjects = [(e.subject, e.what) for e in d.events]
    assert ("node02", "joined") in subjects and ("demo-g1", "failed") in subjects
    assert ("node01", "joined") not in subjects and ("demo-g2", "ready") not in subjects
    assert not node_detail("node77", state, [], {}, T0).known


# --------------------------------------------------------------------------
# pure: rebuild stories
# --------------------------------------------------------------------------


def tell(events) -> tuple[StoryBook, list]:
    book = StoryBook()
    told = [s for e in events if (s := book.add(e)) is not None]
    return book, told


def test_the_seed_rebuild_reads_as_one_story():
    book, told = tell(BRING_UP + FAILOVER + RECOVERY)
    assert [s.text() for s in told] == ["node02 lost → demo-g1 failed → reaped → demo-g3 placed on ib-b → ready (20.1 s)"]
    assert book.current() == "" and book.rebuilding == frozenset()


def test_a_story_in_progress_and_a_reaping_that_outlasts_the_replacement():
    book, told = tell(BRING_UP + FAILOVER)
    assert told == [] and book.rebuilding == {"demo-g3"}
    assert book.current() == "node02 lost → demo-g1 failed → reaping → demo-g3 placed on ib-b …"
    _, told = tell(BRING_UP + FAILOVER + RECOVERY[1:])
    assert told[0].text().endswith("reaping → demo-g3 placed on ib-b → ready (20.1 s)")


@pytest.mark.parametrize(
    "events, story",
    [
        pytest.param(
            [
                replica_ev(0, "demo-g1", "failed", "engine on node01 exited with code 1", "ready"),
                replica_ev(0, "demo-g2", "pending", "no fabric has 2 nodes with 4 free GPUs", ""),
                replica_ev(30, "demo-g2", "launching", "placed on ib-a: node03 (leader), node04", "pending"),
                replica_ev(45, "demo-g2", "ready", "leader on node03 serving", "waiting-for-workers"),
            ],
            "demo-g1 failed (engine on node01 exited with code 1) → demo-g2 pending → demo-g2 placed on ib-a → ready (45.0 s)",
            id="no lost node: the failure's own reason; a replacement that waited",
        ),
        pytest.param(
            [
                ev(0, "node", "node09", "lost"),
                replica_ev(1, "demo-g1", "failed", "node node02 lost", "ready"),
                replica_ev(1, "solo-g4", "launching", "placed node05", ""),
                replica_ev(2, "demo-g2", "launching", "placed node05", ""),
                replica_ev(3, "demo-g2", "ready", "leader on node05 serving", "waiting-for-workers"),
            ],
            "demo-g1 failed (node node02 lost) → demo-g2 placed on node05 → ready (2.0 s)",
            id="an unrelated lost node is no cause; other deployments are not replacements",
        ),
        pytest.param(
            [
                ev(0, "node", "node02", "lost"),
                replica_ev(0, "demo-g1", "failed", "node node02 lost", "ready"),
                replica_ev(1, "demo-g2", "launching", "placed on ib-b: node03 (leader), node04", ""),
                replica_ev(5, "demo-g2", "failed", "startup timeout", "launching"),
                replica_ev(6, "demo-g3", "launching", "placed on ib-b: node03 (leader), node04", ""),
                replica_ev(9, "demo-g3", "ready", "", "waiting-for-workers"),
            ],
            "node02 lost → demo-g1 failed → demo-g2 placed on ib-b → demo-g2 failed → demo-g3 placed on ib-b → ready (9.0 s)",
            id="a replacement that fails continues the same story",
        ),
    ],
)
def test_story_cases(events, story):
    _, told = tell(events)
    assert [s.text() for s in told] == [story]


@pytest.mark.parametrize(
    "detail, where",
    [("placed on ib-b: node03 (leader), node04", "ib-b"), ("placed node05", "node05"), ("something else", "")],
)
def test_placed_where(detail, where):
    assert placed_where(detail) == where


@pytest.mark.parametrize(
    "status, now, cls, words",
    [
        (None, 0, "-info", "connecting"),
        (ConnectionStatus("connected", 100, "tls://x"), 101, "", ""),
        (ConnectionStatus("down", 100, "tls://x", down_since=100), 112, "-down", "lost"),
        (ConnectionStatus("connected", 110, "tls://x", down_since=100), 111, "-back", "back"),
        (ConnectionStatus("connected", 110, "tls://x", down_since=100), 120, "", ""),
        (ConnectionStatus("unreachable", 100, "tls://x", "refused; retrying in 1.0s"), 100, "-down", "retrying"),
    ],
)
def test_banner_says_lost_then_back_then_nothing(status, now, cls, words):
    got_cls, text = banner_text(status, "", now)
    assert got_cls == cls and words in text


# --------------------------------------------------------------------------
# against a real nats-server
# --------------------------------------------------------------------------


class Writers:
    """Scripted single writers: nodes as the registry, leases as the health monitor, replicas as the scheduler."""

    async def start(self, server) -> Writers:
        tls = {role: server.issue(f"scripted-{role}", role) for role in ("registry", "health", "scheduler")}
        server.reload()
        self.conns = {r: await bus.connect(server.url, t, name="test", initial_attempts=1, reconnect_base=0.1, reconnect_max=0.5) for r, t in tls.items()}
        self.js = {r: nc.jetstream(timeout=5) for r, nc in self.conns.items()}
        self.nodes = (await bus.provision(self.js["registry"], (S.BUCKET_NODES,), events=True))[S.BUCKET_NODES]
        self.leases = (await bus.provision(self.js["health"], (S.BUCKET_LEASES,), events=False))[S.BUCKET_LEASES]
        self.replicas = (await bus.provision(self.js["scheduler"], (S.BUCKET_REPLICAS,), events=False))[S.BUCKET_REPLICAS]
        return self

    async def seed(self, state: ClusterState, events=()) -> None:
        for n in state.nodes.values():
            await self.nodes.put(n.node_id, encode(n))
        for lease in state.leases.values():
            await self.leases.put(lease.node_id, encode(lease))
        for r in state.replicas.values():
            await self.replicas.put(r.id, encode(r))
        await self.emit(*events)

    async def emit(self, *events: Event) -> None:
        for e in events:
            await self.js["scheduler"].publish(S.event(e.kind, e.subject, e.what), encode(e))

    async def close(self) -> None:
        for nc in self.conns.values():
            try:
                await asyncio.wait_for(nc.close(), 2)
            except Exception:
                pass


@pytest.fixture
async def writers(nats_server):
    w = await Writers().start(nats_server)
    yield w
    await w.close()


def console(nats_server, **kw) -> LlmgwApp:
    cfg = service_config(nats_server, "operator", "ops")
    nats_server.reload()
    return LlmgwApp(cfg, **kw)


async def until(pilot, observe, expected=_UNSET, timeout: float = 5.0, what: str = "condition"):
    """Let the app run until ``observe()`` is truthy (or equals ``expected``); fail with the last value seen."""
    return await eventually(observe, expected, timeout=timeout, what=what, pause=pilot.pause)


async def settled(pilot, check, timeout: float = 5.0, what: str = "the screen"):
    """Let the app run until ``check()``'s assertions all hold: the console applies each
    write a moment after it arrives, so assertions on it are waited for, whole."""
    return await passes(check, timeout=timeout, what=what, pause=pilot.pause)


def row(app, node: str, fabric: str = "") -> NodeRow | None:
    for r in app.query(NodeRow):
        if r.node_id == node and (not fabric or r.view.fabric == fabric):
            return r
    return None


def log_text(app) -> str:
    return "\n".join(line.text for line in app.query_one(EventLog).lines)


def table_rows(app) -> dict[str, list[str]]:
    table = app.query_one(ReplicasTable)
    return {str(k.value): [str(c) for c in table.get_row(k)] for k in table.rows}


async def test_the_seed_nodes_appear_under_their_fabrics(nats_server, writers):
    await writers.seed(seed_state(nodes_x={"node05": make_node("node05", fabric=None, gpus=2, n=5)}, leases_x={"node05": make_lease("node05", "suspect")}))
    app = console(nats_server)
    async with app.run_test(size=(160, 48)) as pilot:

        def seeded():  # nodes, leases and replicas come from three buckets, each in its own time
            placed = {(r.view.fabric, r.node_id) for r in app.query(NodeRow)}
            assert placed == {("ib-a", "node01"), ("ib-a", "node02"), ("ib-b", "node03"), ("ib-b", "node04"), (NO_FABRIC, "node05")}
            text = row(app, "node01").render().plain
            assert text.startswith("node01   ready") and "AAAA ····" in text, text
            assert row(app, "node05").view.state == "suspect" and "suspect" in row(app, "node05").render().plain
            assert set(table_rows(app)) == {"demo-g1", "demo-g2"}

        await settled(pilot, seeded, what="the seed on screen")
        await until(pilot, lambda: app.focused is row(app, "node01") and app.selected_node == "node01", what="node01 selected")
        # the detail of a node, on Enter
        await pilot.press("down", "enter")
        await until(pilot, lambda: isinstance(app.screen, NodeDetail), what="the detail screen")
        assert app.screen.view.node_id == "node02" and [m.replica for m in app.screen.view.members] == ["demo-g1"]
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, NodeDetail), what="the detail closed")
        # the filter narrows the panels while typing; Esc brings everything back
        await pilot.press("slash", *"node04")
        await until(
            pilot, lambda: ([r.node_id for r in app.query(NodeRow)], set(table_rows(app))), (["node04"], {"demo-g2"}), what="only node04 and its replica"
        )
        await pilot.press("escape")
        await until(pilot, lambda: (len(app.query(NodeRow)), set(table_rows(app))), (5, {"demo-g1", "demo-g2"}), what="every node and replica again")
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, Help), what="the help")
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, Help), what="the help closed")


async def test_a_lease_going_lost_turns_node02_lost_within_a_second(nats_server, writers):
    await writers.seed(seed_state())
    app = console(nats_server)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: row(app, "node02") is not None and row(app, "node02").view.state == "ready", what="node02 ready")
        t = time.monotonic()
        await writers.leases.put("node02", encode(make_lease("node02", "lost", renewed=time.time() - 60, since=time.time())))
        await until(
            pilot, lambda: (row(app, "node02").view.state, " lost " in row(app, "node02").render().plain), ("lost", True), timeout=1.0, what="node02 lost"
        )
        assert time.monotonic() - t < 1.0


async def test_a_rebuild_shows_in_the_replicas_table_and_tells_its_story(nats_server, writers):
    await writers.seed(seed_state(), BRING_UP)
    app = console(nats_server)
    async with app.run_test(size=(160, 48)) as pilot:
        # history from before the console started is replayed
        await until(
            pilot,
            lambda: app.history_loaded and {"demo-g1", "demo-g2"} <= set(table_rows(app)) and "node04           joined" in log_text(app),
            what="history and replicas",
        )
        # node02 dies: its replica fails and is reaped while a replacement is placed on ib-b
        await writers.leases.put("node02", encode(make_lease("node02", "lost")))
        await writers.replicas.put("demo-g1", encode(make_replica(*G1[:2], "reaping", G1[2], reason="node node02 lost")))
        await writers.replicas.put("demo-g3", encode(make_replica(*G3[:2], "launching", G3[2])))
        await writers.emit(*FAILOVER)

        def rebuilding():  # three writes and the events: wait until every one has reached the screen
            rows = table_rows(app)
            assert "demo-g3" in rows, rows
            assert rows["demo-g1"][5] == "✖ reaping" and rows["demo-g3"][5] == "↻ launching" and rows["demo-g3"][4] == "node03:0 node04:1"
            assert "demo-g1 failed → reaping → demo-g3 placed on ib-b …" in app.query_one(EventLog).border_subtitle
            assert [c.mark for c in row(app, "node03").view.cells] == ["B"] * 4 + ["C"] * 4

        await settled(pilot, rebuilding, what="the rebuild under way")
        # reaped, then ready
        await writers.replicas.delete("demo-g1")
        await writers.replicas.put("demo-g3", encode(make_replica(*G3[:2], "ready", G3[2])))
        await writers.emit(*RECOVERY)

        def recovered():
            log = log_text(app)
            assert "▶ rebuild" in log and "node02 lost → demo-g1 failed → reaped → demo-g3 placed on ib-b → ready (20.1 s)" in log
            assert "demo-g1          failed" in log and "demo-g3          ready" in log
            assert log.index("demo-g1          failed") < log.index("demo-g3          ready")
            rows = table_rows(app)
            assert set(rows) == {"demo-g2", "demo-g3"} and rows["demo-g3"][5] == "ready", rows
            assert app.query_one(EventLog).border_subtitle == ""

        await settled(pilot, recovered, what="the story told and demo-g1 gone from the table")


async def test_cordon_through_the_key_binding_reaches_the_registry(nats_server, writers):
    registry = registry_mod.Registry(service_config(nats_server, "registry"))
    nats_server.reload()
    await registry.start()
    try:
        await writers.seed(seed_state())
        app = console(nats_server)
        async with app.run_test(size=(160, 48)) as pilot:
            await until(pilot, lambda: row(app, "node02") is not None and app.focused is row(app, "node01"), what="node rows")
            await pilot.press("down")
            await until(pilot, lambda: app.selected_node, "node02", what="node02 selected")
            # drain, but think better of it: nothing is sent
            await pilot.press("d")
            await until(pilot, lambda: isinstance(app.screen, Confirm), what="the question")
            await pilot.press("n")
            await until(pilot, lambda: not isinstance(app.screen, Confirm), what="the question gone")
            # cordon, confirmed
            await pilot.press("c")
            await until(pilot, lambda: isinstance(app.screen, Confirm) and "Cordon node02?" in str(app.screen.question), what="the question about node02")
            await pilot.press("y")
            await until(pilot, lambda: row(app, "node02").view.state == "cordoned", what="node02 cordoned on screen")
            record = decode((await writers.nodes.get("node02")).value, NodeRecord)
            assert record.admin == "cordoned"
            assert decode((await writers.nodes.get("node01")).value, NodeRecord).admin == "active"
            await until(pilot, lambda: any("node node02 is now cordoned" in n.message for n in app._notifications), what="the result reported")
            await until(pilot, lambda: "node02           cordoned" in log_text(app), what="the registry's event")
    finally:
        await registry.stop()


async def test_a_lost_connection_is_shown_and_so_is_its_return(nats_server, writers):
    await writers.seed(seed_state())
    app = console(nats_server)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: row(app, "node02") is not None, what="node rows")
        banner = app.query_one("#banner")
        assert not banner.display, banner.render()
        nats_server.stop()

        def down():
            assert banner.has_class("-down") and banner.display
            assert "NATS connection lost" in str(banner.render()) and app.sub_title == "NATS connection lost"

        await settled(pilot, down, what="the lost banner")
        assert row(app, "node02").view.state == "ready"  # the last state seen stays
        await pilot.press("down")  # the screen still answers
        await until(pilot, lambda: app.selected_node, "node02", what="node02 selected while disconnected")
        nats_server.start()
        await until(
            pilot,
            lambda: banner.has_class("-back") and "connection back" in str(banner.render()) and app.sub_title == "live",
            timeout=10,
            what="the back banner",
        )

        # and it is live again: a change after the restart reaches the screen. The scripted
        # writer reconnects on its own schedule: wait until the server takes its write.
        async def put_lost():
            await writers.leases.put("node03", encode(make_lease("node03", "lost")))
            return True

        await eventually(put_lost, timeout=10, what="the writer's put after the restart", ignore=(Exception,))
        await until(pilot, lambda: row(app, "node03").view.state == "lost", timeout=10, what="node03 lost after the reconnect")


# --------------------------------------------------------------------------
# snapshots (fixed clock, fixed zone, scripted data)
# --------------------------------------------------------------------------


def snapshot_state() -> ClusterState:
    return seed_state(
        nodes_x={"node05": make_node("node05", fabric=None, gpus=2, n=5)},
        leases_x={"node02": make_lease("node02", "lost", renewed=T0 - 66, since=T0 - 6), "node05": make_lease("node05", "suspect", renewed=T0 - 4)},
        replicas_x={
            "demo-g1": make_replica(*G1[:2], "reaping", G1[2], since=T0 - 6, reason="node node02 lost"),
            "demo-g3": make_replica(*G3[:2], "launching", G3[2], since=T0 - 6, reason="placed on ib-b: node03 (leader), node04"),
        },
    )


@pytest.fixture
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture
def seeded(nats_server):
    async def go():
        w = await Writers().start(nats_server)
        try:
            await w.seed(snapshot_state(), BRING_UP + FAILOVER)
        finally:
            await w.close()

    asyncio.run(go())
    return nats_server


async def _loaded(pilot) -> None:
    app = pilot.app
    # every bucket and the history in, rows drawn and focus placed; then a moment for the
    # table to size its columns (it does that when idle)

    def loaded() -> bool:
        return app.history_loaded and [len(app.state.nodes), len(app.state.leases), len(app.state.replicas)] == [5, 5, 3]

    await until(pilot, lambda: loaded() and len(app.query(NodeRow)) == 5 and len(table_rows(app)) == 3 and app.focused is not None, what="everything on screen")
    # Then until the screen stops changing: the table sizes its columns when idle, and on a
    # loaded machine that can take longer than any fixed pause.
    previous = None
    for _ in range(50):
        await pilot.pause(0.1)
        shot = app.export_screenshot()
        if shot == previous:
            break
        previous = shot


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_main_screen_snapshot(size, seeded, utc, snap_compare):
    app = console(seeded, clock=lambda: T0)
    assert snap_compare(app, terminal_size=size, run_before=_loaded)
