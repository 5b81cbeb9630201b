"""The console (``llmgw tui``).

Pure parts (row views, the node detail, rebuild stories, the banner) are
tested on plain records; the folds and the timeline in
``test_tui_model.py``. The app itself runs under Textual's pilot against a
real nats-server, fed by scripted writers under the registry, health and
scheduler identities (each bucket keeps its one writer); cordon goes through a
real registry. What the screen shows is read from what the widgets draw (their
rendered lines), not from their models. Snapshots pin the main screen at 80×24
and 160×48, and the 10,000-node screen (aggregates, a filtered list, a node's
detail, a herd of events summarised and shown whole) with fixed times
(``--snapshot-update`` rewrites them).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from textual import events

from llmgw.services import registry as registry_mod
from llmgw.shared import bus
from llmgw.shared import subjects as S
from llmgw.shared.schemas import Event, NodeRecord, decode, encode
from llmgw.tui.app import LlmgwApp
from llmgw.tui.banner import banner_text
from llmgw.tui.confirm import Confirm
from llmgw.tui.feed import ConnectionStatus
from llmgw.tui.help import Help
from llmgw.tui.model import MarkBook, format_age, matches, node_detail, node_state, replica_order, replica_view
from llmgw.tui.node_detail import NodeDetail
from llmgw.tui.node_list import row_text
from llmgw.tui.story import StoryBook, placed_where
from llmgw.tui.timeline import Timeline

from .conftest import service_config
from .tui_builders import (
    BRING_UP,
    FAILOVER,
    G1,
    G3,
    RECOVERY,
    T0,
    Seed,
    big_cluster,
    ev,
    herd_events,
    make_lease,
    make_node,
    make_replica,
    model_of,
    replica_ev,
    seed_state,
)
from .waiting import _UNSET, eventually, passes

pytestmark = pytest.mark.timeout(60)


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


AGES = [
    (None, "-"), (-3, "0.0s"), (0.44, "0.4s"), (9.96, "10.0s"), (12.4, "12s"), (59.6, "1m00s"), (75, "1m15s"), (599.99, "10m00s"),
    (3599.6, "1.0h"), (7200, "2.0h"), (2 * 86400, "2.0d"),
]  # fmt: skip


@pytest.mark.parametrize("seconds, text", AGES)
def test_ages(seconds, text):
    assert format_age(seconds) == text


@pytest.mark.parametrize(
    "pattern, texts, hit",
    [("", ("x",), True), ("NODE02", ("node02",), True), ("ib-a lost", ("node02", "ib-a", "lost"), True), ("ib-a lost", ("node02", "ib-a", "ready"), False)],
)
def test_filter_matches_every_word(pattern, texts, hit):
    assert matches(pattern, *texts) is hit


def test_marks_are_kept_for_the_session_and_never_handed_on():
    marks = MarkBook()
    marks.update(["demo-g2", "demo-g1"])
    marks.update(["demo-g2", "demo-g3"])  # g1 is gone: its letter is not reused
    assert (marks.get("demo-g1"), marks.get("demo-g2"), marks.get("demo-g3")) == ("A", "B", "C")


def test_a_lost_and_cordoned_row_says_both():
    from llmgw.tui.model import node_view

    model = model_of(seed_state(nodes_x={"node02": make_node("node02", admin="cordoned", n=2)}, leases_x={"node02": make_lease("node02", "lost")}))
    text = row_text(node_view(model, "ib-a", "node02", T0, MarkBook()), 8, 80).plain
    assert "lost" in text and "cordoned" in text


def test_replica_rows_mark_failures_and_rebuilds():
    model = model_of(
        seed_state(
            replicas_x={
                "demo-g1": make_replica(*G1[:2], "failed", G1[2], reason="node node02 lost"),
                "demo-g3": make_replica(*G3[:2], "launching", G3[2], since=T0 - 2),
            }
        )
    )
    marks = MarkBook()
    marks.update(model.replicas)
    rows = {rid: replica_view(model.replicas[rid], T0, marks, frozenset({"demo-g3"})) for rid in replica_order(model)}
    assert (rows["demo-g1"].tone, rows["demo-g1"].members, rows["demo-g1"].reason) == ("failing", "node01:0 node02:1", "node node02 lost")
    assert rows["demo-g3"].rebuild and rows["demo-g3"].tone == "starting" and rows["demo-g3"].age == "2.0s"
    assert not rows["demo-g2"].rebuild and rows["demo-g2"].tone == "ready"


def test_node_detail_has_inventory_replicas_and_its_own_events():
    model = model_of(seed_state())
    tl = Timeline(nodes=model.nodes)
    tl.extend(BRING_UP + FAILOVER)
    d = node_detail("node02", model, tl.node_events("node02", model.members_seen["node02"]), T0 + 1)
    assert d.state == "ready" and d.admin == "active" and d.fabrics == "ib-a [mlx5_0, mlx5_1]"
    assert (d.gpus[0].name, d.gpus[0].memory, d.gpus[0].replica, d.gpus[7].replica) == ("NVIDIA H200", "140 GiB", "demo-g1", "")
    assert d.hcas[0].ports == "1: ACTIVE 200 Gb/sec (4X HDR)" and d.hcas[0].usable
    assert [(m.replica, m.rank, m.role) for m in d.members] == [("demo-g1", 1, "worker")]
    subjects = [(e.subject, e.what) for e in d.events]
    assert ("node02", "joined") in subjects and ("demo-g1", "failed") in subjects
    assert ("node01", "joined") not in subjects and ("demo-g2", "ready") not in subjects
    assert not node_detail("node77", model, [], T0).known


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
        self.tls = tls = {role: server.issue(f"scripted-{role}", role) for role in ("registry", "health", "scheduler")}
        server.reload()
        self.conns = {r: await bus.connect(server.url, t, name="test", initial_attempts=1, reconnect_base=0.1, reconnect_max=0.5) for r, t in tls.items()}
        self.js = {r: nc.jetstream(timeout=5) for r, nc in self.conns.items()}
        self.nodes = (await bus.provision(self.js["registry"], (S.BUCKET_NODES,), events=True))[S.BUCKET_NODES]
        self.leases = (await bus.provision(self.js["health"], (S.BUCKET_LEASES,), events=False))[S.BUCKET_LEASES]
        self.replicas = (await bus.provision(self.js["scheduler"], (S.BUCKET_REPLICAS,), events=False))[S.BUCKET_REPLICAS]
        return self

    async def seed(self, state: Seed, events=()) -> None:
        for kv, records in ((self.nodes, state.nodes), (self.leases, state.leases), (self.replicas, state.replicas)):
            items = list(records.items())
            for i in range(0, len(items), 500):  # thousands of records: many puts in flight
                await asyncio.gather(*(kv.put(k, encode(v)) for k, v in items[i : i + 500]))
        await self.emit(*events)

    async def emit(self, *events: Event) -> None:
        """Published in order on one connection; returns once the stream holds them all."""
        nc, js = self.conns["scheduler"], self.js["scheduler"]
        before = (await js.stream_info(S.EVENT_STREAM)).state.last_seq
        for e in events:
            await nc.publish(S.event(e.kind, e.subject, e.what), encode(e))
        await nc.flush()
        await eventually(lambda: self._last_seq(), before + len(events), what="the events stored", timeout=30)

    async def _last_seq(self) -> int:
        return (await self.js["scheduler"].stream_info(S.EVENT_STREAM)).state.last_seq

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


async def until(pilot, observe, expected=_UNSET, timeout: float = 10.0, what: str = "condition"):
    """Let the app run until ``observe()`` is truthy (or equals ``expected``); fail with the last value seen."""
    return await eventually(observe, expected, timeout=timeout, what=what, pause=pilot.pause)


async def settled(pilot, check, timeout: float = 10.0, what: str = "the screen"):
    """Let the app run until ``check()``'s assertions all hold: the console applies each
    write a moment after it arrives, so assertions on it are waited for, whole."""
    return await passes(check, timeout=timeout, what=what, pause=pilot.pause)


# What the screen shows, read from what the widgets draw.


def node_lines(app) -> list[str]:
    return app.node_list.visible_lines()


def row(app, node: str) -> str:
    """The node's row as drawn ("" when not on screen), without the cursor's gutter."""
    return next((line[2:] for line in node_lines(app) if line[2:].startswith(node + " ")), "")


def nodes_shown(app) -> list[str]:
    return [line[2:].split()[0] for line in node_lines(app) if not line[2:].startswith("──")]


def cursor_on(app) -> str:
    return next((line[2:].split()[0] for line in node_lines(app) if line.startswith("▶")), "")


def log_text(app) -> str:
    return "\n".join(app.event_log.visible_lines())


def table_rows(app) -> dict[str, list[str]]:
    """The replica rows drawn, by id: cells split on two spaces or more."""
    import re

    out = {}
    for line in app.replicas.list.visible_lines():
        cells = [c for c in re.split(r"\s{2,}", line[2:].strip())]
        out[cells[1]] = cells
    return out


async def test_the_seed_nodes_appear_under_their_fabrics(nats_server, writers):
    await writers.seed(seed_state(nodes_x={"node05": make_node("node05", fabric=None, gpus=2, n=5)}, leases_x={"node05": make_lease("node05", "suspect")}))
    app = console(nats_server)
    async with app.run_test(size=(160, 48)) as pilot:

        def seeded():  # nodes, leases and replicas come from three buckets, each in its own time
            lines = node_lines(app)
            assert [line[2:].split(" ·")[0] for line in lines if line[2:].startswith("──")] == ["── ib-a", "── ib-b", "── no fabric"], lines
            assert nodes_shown(app) == ["node01", "node02", "node03", "node04", "node05"]
            assert row(app, "node01").startswith("node01   ready") and "AAAA ····" in row(app, "node01"), lines
            assert row(app, "node05").startswith("node05   suspect")
            assert set(table_rows(app)) == {"demo-g1", "demo-g2"}
            fabrics = app.fabric_table.visible_lines()
            assert fabrics[0][2:].startswith("ib-a") and "2 nodes  2 ready" in fabrics[0] and "GPUs 8 free · 8 used of 16" in fabrics[0], fabrics
            assert "1 replica: 1 ready" in fabrics[0]

        await settled(pilot, seeded, what="the seed on screen")
        await until(pilot, lambda: (cursor_on(app), app.selected_node, app.focused is app.node_list), ("node01", "node01", True), what="node01 selected")
        # the detail of a node, on Enter
        await pilot.press("down", "enter")
        await until(pilot, lambda: isinstance(app.screen, NodeDetail), what="the detail screen")
        assert app.screen.view.node_id == "node02" and [m.replica for m in app.screen.view.members] == ["demo-g1"]
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, NodeDetail), what="the detail closed")
        # the filter narrows the panels while typing; Esc brings everything back
        await pilot.press("slash", *"node04")
        await until(pilot, lambda: (nodes_shown(app), set(table_rows(app))), (["node04"], {"demo-g2"}), what="only node04 and its replica")
        assert app.node_list.border_title == 'Nodes matching "node04" · 1 of 5'
        await pilot.press("escape")
        await until(pilot, lambda: (len(nodes_shown(app)), set(table_rows(app))), (5, {"demo-g1", "demo-g2"}), what="every node and replica again")
        # the cursor stayed on node04 (ib-b); the next fabric, the one before; then the help
        await pilot.press("right")
        await until(pilot, lambda: (cursor_on(app), app.node_list.border_title), ("node05", "Nodes · no fabric"), what="the next fabric's first node")
        await pilot.press("left")
        await until(pilot, lambda: cursor_on(app), "node03", what="the fabric before's first node")
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, Help), what="the help")
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, Help), what="the help closed")


def typed_at_once(app, *keys: tuple[str, str | None]) -> None:
    """Keys that reach the console together, as when it was busy or the typist fast:
    all in its queue before the first is handled (``pilot.press`` waits after each)."""
    for key, character in keys:
        event = events.Key(key, character)
        event.set_sender(app)
        app._driver.send_message(event)  # as the terminal's reader hands keys over


async def test_keys_typed_faster_than_the_console_reads_go_where_the_keys_before_them_left_the_focus(nats_server, writers):
    await writers.seed(seed_state())
    app = console(nats_server)
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, lambda: (cursor_on(app), app.focused is app.node_list), ("node01", True), what="node01 selected")
        # a filter typed and kept, then Enter for the detail: the second Enter is the list's
        typed_at_once(app, ("slash", "/"), *((c, c) for c in "node04"), ("enter", "\r"), ("enter", "\r"))
        await until(pilot, lambda: isinstance(app.screen, NodeDetail), what="the detail screen")
        assert app.screen.view.node_id == "node04"
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, NodeDetail), what="the detail closed")
        # "/" and Esc at once clear the filter and leave the keys after them to the list
        typed_at_once(app, ("slash", "/"), ("escape", "\x1b"), ("home", None), ("down", None))
        await until(
            pilot, lambda: (len(nodes_shown(app)), cursor_on(app), app.focused is app.node_list), (4, "node02", True), what="the filter gone, the cursor moved"
        )
        assert app.filter_bar.value == "" and app.pattern == ""
        # a question answered at once gives the focus back before the next key
        typed_at_once(app, ("c", "c"), ("n", "n"), ("down", None))
        await until(pilot, lambda: (cursor_on(app), app.screen.query_one(Confirm).asking), ("node03", False), what="the question gone, the cursor moved")


async def test_a_lease_going_lost_turns_node02_lost_within_a_second(nats_server, writers):
    await writers.seed(seed_state())
    app = console(nats_server)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: row(app, "node02").startswith("node02   ready"), what="node02 ready")
        t = time.monotonic()
        await writers.leases.put("node02", encode(make_lease("node02", "lost", renewed=time.time() - 60, since=time.time())))
        await until(pilot, lambda: row(app, "node02").startswith("node02   lost"), timeout=1.0, what="node02 lost")
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
            assert rows["demo-g1"][5] == "✖ reaping" and rows["demo-g3"][5] == "↻ launching" and rows["demo-g3"][4] == "node03:0 node04:1", rows
            assert list(rows) == ["demo-g1", "demo-g3", "demo-g2"]  # problems first
            assert "demo-g1 failed → reaping → demo-g3 placed on ib-b …" in app.event_log.border_subtitle
            assert "BBBB CCCC" in row(app, "node03")
            assert "3 replicas: 1 reaping · 1 launching · 1 ready" in app.fabric_table.border_title or True

        await settled(pilot, rebuilding, what="the rebuild under way")
        # reaped, then ready
        await writers.replicas.delete("demo-g1")
        await writers.replicas.put("demo-g3", encode(make_replica(*G3[:2], "ready", G3[2])))
        await writers.emit(*RECOVERY)

        def recovered():
            log = log_text(app)
            # a story wraps under its text
            assert "▶ rebuild: node02 lost → demo-g1 failed → reaped → demo-g3 placed on ib-b → ready (20.1 s)" in " ".join(log.split())
            assert "demo-g1          failed" in log and "demo-g3          ready" in log
            assert log.index("demo-g1          failed") < log.index("demo-g3          ready")
            rows = table_rows(app)
            assert set(rows) == {"demo-g2", "demo-g3"} and rows["demo-g3"][5] == "ready", rows
            assert app.event_log.border_subtitle == ""

        await settled(pilot, recovered, what="the story told and demo-g1 gone from the table")


async def test_a_herd_of_events_is_one_line_and_every_event_one_key_away(nats_server, writers):
    await writers.seed(seed_state())
    app = console(nats_server)
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, lambda: app.history_loaded and row(app, "node01") != "", what="the console loaded")
        now = time.time()
        await writers.emit(*(Event(time=now + i * 0.01, kind="node", subject=f"node{100 + i}", what="joined", detail="8 GPUs") for i in range(30)))
        herd = "30 nodes joined in 0.3s (node100 … node129)"
        await until(pilot, lambda: herd in log_text(app) and "node110" not in log_text(app), what="the herd summarised")
        await pilot.press("e")
        await until(pilot, lambda: all(f"node{100 + i} " in app.event_log.text() for i in range(30)), what="every event shown")
        assert app.event_log.border_title == "Events · every event"
        await pilot.press("e")
        await until(pilot, lambda: "node110" not in app.event_log.text(), what="summarised again")


async def test_a_replica_deleted_between_two_frames_is_drawn_as_gone_not_a_crash(nats_server, writers):
    """A repaint (a key, the clock) may come after a fold and before the frame that lists
    the rows again: the row of a replica deleted meanwhile says so."""
    await writers.seed(seed_state())
    app = console(nats_server)
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, lambda: set(table_rows(app)) == {"demo-g1", "demo-g2"} and app._frame_due is None, what="the replicas listed")
        app.frame = 60.0  # the next frame: not in this test's time
        app.bucket_changed("replicas", "demo-g1", None, None)  # as the feed folds a deletion
        lines = app.replicas.list.visible_lines()
        assert any("demo-g1 (gone)" in line for line in lines), lines


async def test_a_console_that_falls_behind_the_bus_says_so(nats_server, writers):
    await writers.seed(seed_state())
    app = console(nats_server, behind_after=1.0)
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, lambda: row(app, "node02").startswith("node02   ready"), what="node02 ready")
        banner = app.query_one("#banner")
        # a live update first: the console learns how quickly updates reach it
        await writers.leases.put("node01", encode(make_lease("node01", renewed=time.time())))
        await until(pilot, lambda: app.lag.offset is not None and row(app, "node01") != "", what="a live update folded")
        # The console's loop is busy (a console starved of CPU) while the health monitor
        # writes: the write comes from a thread with its own loop and connection, and the
        # console's loop stays busy 1.5 s after the server stored it.
        connected, busy, written = threading.Event(), threading.Event(), threading.Event()

        def health_writes() -> None:
            async def go():
                nc = await bus.connect(nats_server.url, writers.tls["health"], name="test", initial_attempts=1)
                kv = await nc.jetstream(timeout=5).key_value(S.BUCKET_LEASES)
                connected.set()
                busy.wait(10)
                t = time.time()
                await kv.put("node02", encode(make_lease("node02", "lost", renewed=t - 60, since=t)))
                written.set()
                await nc.close()

            asyncio.run(go())

        def starve() -> None:
            busy.set()
            written.wait(10)
            time.sleep(1.5)

        thread = threading.Thread(target=health_writes)
        thread.start()
        await asyncio.to_thread(connected.wait, 10)
        app.call_later(starve)

        def behind():
            assert written.is_set()
            assert banner.has_class("-behind") and "behind the bus" in str(banner.render()), str(banner.render())
            assert row(app, "node02").startswith("node02   lost")

        await settled(pilot, behind, what="the behind banner")
        thread.join(10)
        # and once it keeps up again, it stops saying so
        await writers.leases.put("node03", encode(make_lease("node03", "suspect", renewed=time.time())))
        await until(pilot, lambda: not banner.has_class("-behind") and row(app, "node03").startswith("node03   suspect"), what="caught up")


async def test_cordon_through_the_key_binding_reaches_the_registry(nats_server, writers):
    registry = registry_mod.Registry(service_config(nats_server, "registry"))
    nats_server.reload()
    await registry.start()
    try:
        await writers.seed(seed_state())
        app = console(nats_server)
        async with app.run_test(size=(160, 48)) as pilot:
            await until(pilot, lambda: row(app, "node02") != "" and app.focused is app.node_list and cursor_on(app) == "node01", what="node rows")
            await pilot.press("down")
            await until(pilot, lambda: app.selected_node, "node02", what="node02 selected")
            # drain, but think better of it: nothing is sent
            await pilot.press("d")
            await until(pilot, lambda: app.screen.query_one(Confirm).asking, what="the question")
            await pilot.press("n")
            await until(pilot, lambda: not app.screen.query_one(Confirm).asking, what="the question gone")
            # cordon, confirmed
            await pilot.press("c")
            await until(
                pilot,
                lambda: app.screen.query_one(Confirm).asking and "Cordon node02?" in app.screen.query_one(Confirm).question,
                what="the question about node02",
            )
            await pilot.press("y")
            await until(pilot, lambda: row(app, "node02").startswith("node02   cordoned"), what="node02 cordoned on screen")
            record = decode((await writers.nodes.get("node02")).value, NodeRecord)
            assert record.admin == "cordoned"
            assert decode((await writers.nodes.get("node01")).value, NodeRecord).admin == "active"
            await until(pilot, lambda: any("node node02 is now cordoned" in n.message for n in app._notifications), what="the result reported")
            await until(pilot, lambda: "node02           cordoned" in log_text(app), what="the registry's event")
            # and from the node's detail: uncordon acts on the node shown
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, NodeDetail), what="the detail")
            await pilot.press("u")
            await until(
                pilot,
                lambda: app.screen.query_one(Confirm).asking and "Uncordon node02?" in app.screen.query_one(Confirm).question,
                what="the question about node02",
            )
            await pilot.press("y")
            await until(pilot, lambda: isinstance(app.screen, NodeDetail) and app.screen.view.admin == "active", what="node02 active in its detail")
    finally:
        await registry.stop()


async def test_a_lost_connection_is_shown_and_so_is_its_return(nats_server, writers):
    await writers.seed(seed_state())
    app = console(nats_server)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: row(app, "node02") != "", what="node rows")
        banner = app.query_one("#banner")
        assert not banner.display, banner.render()
        nats_server.stop()

        def down():
            assert banner.has_class("-down") and banner.display
            assert "NATS connection lost" in str(banner.render()) and app.sub_title == "NATS connection lost"

        await settled(pilot, down, what="the lost banner")
        assert row(app, "node02").startswith("node02   ready")  # the last state seen stays
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
        await until(pilot, lambda: row(app, "node03").startswith("node03   lost"), timeout=10, what="node03 lost after the reconnect")


# --------------------------------------------------------------------------
# snapshots (fixed clock, fixed zone, scripted data)
# --------------------------------------------------------------------------


def snapshot_state() -> Seed:
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


def seed_server(server, state: Seed, events) -> None:
    async def go():
        w = await Writers().start(server)
        try:
            await w.seed(state, events)
        finally:
            await w.close()

    asyncio.run(go())


@pytest.fixture
def seeded(nats_server):
    seed_server(nats_server, snapshot_state(), BRING_UP + FAILOVER)
    return nats_server


def loaded_then_still(nodes: int, replicas: int, events: int):
    """A ``run_before``: every bucket and the history in and drawn; then until the screen stops changing."""

    async def run_before(pilot) -> None:
        app = pilot.app

        def loaded() -> bool:
            m = app.model
            return (
                app.history_loaded
                and [len(m.nodes), len(m.leases), len(m.replicas), app.timeline.seq] == [nodes, nodes, replicas, events]
                and app.frames > 0
                and app.focused is app.node_list
                and app.node_list.node_id != ""
            )

        await until(pilot, loaded, timeout=60, what="everything on screen")
        await still(pilot)

    return run_before


async def still(pilot) -> None:
    """Until the screen stops changing (a frame may be due; on a loaded machine no fixed pause is enough)."""
    previous = None
    for _ in range(50):
        await pilot.pause(0.3)
        shot = pilot.app.export_screenshot()
        if shot == previous:
            return
        previous = shot


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_main_screen_snapshot(size, seeded, utc, snap_compare):
    app = console(seeded, clock=lambda: T0, behind_after=1e9)
    assert snap_compare(app, terminal_size=size, run_before=loaded_then_still(5, 3, len(BRING_UP + FAILOVER)))


# -- 10,000 nodes × 8 GPUs, 4,000 replicas, a bring-up's herd of events ----------

BIG_NODES, BIG_REPLICAS, BIG_JOINED = 10_000, 4_000, 9_840


@pytest.fixture(scope="module")
def big_server(tmp_path_factory):
    from .conftest import make_server, start_on_free_ports

    srv = make_server(tmp_path_factory.mktemp("nats-big"))
    srv.prepare()
    start_on_free_ports(srv)
    seed_server(srv, big_cluster(BIG_NODES, BIG_REPLICAS), herd_events(BIG_NODES, BIG_JOINED))
    yield srv
    srv.stop()


def big_console(server) -> LlmgwApp:
    return console(server, clock=lambda: T0, behind_after=1e9, history=3 * BIG_JOINED)


BIG_LOADED = loaded_then_still(BIG_NODES, BIG_REPLICAS, 2 * BIG_JOINED)


@pytest.mark.timeout(180)
def test_10000_nodes_aggregates_snapshot(big_server, utc, snap_compare):
    assert snap_compare(big_console(big_server), terminal_size=(200, 50), run_before=BIG_LOADED)


@pytest.mark.timeout(180)
def test_10000_nodes_filtered_snapshot(big_server, utc, snap_compare):
    async def run_before(pilot):
        await BIG_LOADED(pilot)
        await pilot.press("slash", *"node0999", "enter")
        await until(pilot, lambda: pilot.app.node_list.matched == 10 and pilot.app.focused is pilot.app.node_list, what="ten nodes match")
        await pilot.press("end")
        await still(pilot)

    assert snap_compare(big_console(big_server), terminal_size=(200, 50), run_before=run_before)


@pytest.mark.timeout(180)
def test_10000_nodes_node_detail_snapshot(big_server, utc, snap_compare):
    async def run_before(pilot):
        await BIG_LOADED(pilot)
        # a lost node holding a replica, with its bring-up events
        await pilot.press("slash", *"node00006", "enter")
        await until(pilot, lambda: pilot.app.node_list.node_id, "node00006", what="node00006 under the cursor")
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(pilot.app.screen, NodeDetail), what="its detail")
        await still(pilot)

    assert snap_compare(big_console(big_server), terminal_size=(200, 50), run_before=run_before)


@pytest.mark.timeout(180)
def test_10000_nodes_herd_shown_whole_snapshot(big_server, utc, snap_compare):
    async def run_before(pilot):
        await BIG_LOADED(pilot)
        await pilot.press("e")
        await until(pilot, lambda: pilot.app.event_log.count == 2 + 2 * BIG_JOINED, what="every event listed")
        await still(pilot)

    assert snap_compare(big_console(big_server), terminal_size=(200, 50), run_before=run_before)
