"""The outage rule of the health monitor's pure core: a bus outage
never counts against a node. Table-driven, clock injected."""

from __future__ import annotations

import pytest

from llmgw.services.health.leases import LeaseBook, Timings
from llmgw.shared.schemas import Heartbeat, Lease

# heartbeats every 1 s, suspect after 3 s, lost after 10 s, agents reconnect within 20 s
T = Timings(heartbeat_interval=1.0, suspect_after_missed=3, node_lost_after=10.0, reconnect_grace=20.0)


def run(events, timings=T):
    """Replay ("hb", at, seq, boot[, node]), ("tick", at), ("down", at), ("up", at),
    ("load", at) events; return the book and every (node, old, new)."""
    book = LeaseBook(timings)
    seen = []
    for ev in events:
        kind, at = ev[0], ev[1]
        if kind == "hb":
            node = ev[4] if len(ev) > 4 else "node01"
            tr = book.heartbeat(Heartbeat(node_id=node, boot_id=ev[3], seq=ev[2]), at)
            seen += [tr] if tr else []
        elif kind == "tick":
            seen += book.expire(at)
        elif kind == "down":
            book.disconnected(at)
        elif kind == "up":
            book.reconnected(at)
        elif kind == "load":
            book.load(dict(book.leases), at)
    return book, [(t.node_id, t.old, t.new) for t in seen]


FIRST = ("node01", "", "ready")


@pytest.mark.parametrize(
    "events, transitions, final",
    [
        # the monitor is off the bus for 40 s: no tick judges anything meanwhile
        ([("hb", 0, 1, "b1"), ("down", 0.5), ("tick", 5), ("tick", 20), ("tick", 40.5)], [FIRST], "ready"),
        # back at 40.5: the grace (20 s) holds although the node is silent since 0
        ([("hb", 0, 1, "b1"), ("down", 0.5), ("up", 40.5), ("tick", 41), ("tick", 60.4)], [FIRST], "ready"),
        # the agent reconnects 19 s after the server returned: heard within the grace, stays ready
        ([("hb", 0, 1, "b1"), ("down", 0.5), ("up", 40.5), ("tick", 50), ("hb", 59.5, 2, "b1"), ("tick", 61), ("tick", 62)], [FIRST], "ready"),
        # a node that died during the outage goes lost right when the grace ends, its countdown not restarted
        ([("hb", 0, 1, "b1"), ("down", 0.5), ("up", 40.5), ("tick", 60.5)], [FIRST, ("node01", "ready", "lost")], "lost"),
        # a second outage during the grace: still nothing until the bus is back and a grace has passed again
        (
            [("hb", 0, 1, "b1"), ("down", 0.5), ("up", 40.5), ("down", 45), ("tick", 70), ("up", 75), ("tick", 94.9)],
            [FIRST],
            "ready",
        ),
        # without an outage nothing changes: suspect at 3 s, lost at 10 s
        ([("hb", 0, 1, "b1"), ("tick", 3), ("tick", 10)], [FIRST, ("node01", "ready", "suspect"), ("node01", "suspect", "lost")], "lost"),
        # after the grace the ordinary countdown runs again, from the last heartbeat
        # a node returning during the grace holds it open for a grace after its return (55 + 20) …
        ([("hb", 0, 1, "b1"), ("down", 0.5), ("up", 40.5), ("hb", 55, 2, "b1"), ("tick", 60.5), ("tick", 74.9)], [FIRST], "ready"),
        # … then the ordinary countdown runs from its last heartbeat: silent 20 s by then, lost
        (
            [("hb", 0, 1, "b1"), ("down", 0.5), ("up", 40.5), ("hb", 45, 2, "b1"), ("tick", 64.9), ("tick", 65)],
            [FIRST, ("node01", "ready", "lost")],
            "lost",
        ),
    ],
    ids=[
        "paused-while-down",
        "grace-after-reconnect",
        "slow-agent-heard-in-grace",
        "dead-node-lost-after-grace",
        "second-outage",
        "no-outage",
        "countdown-resumes-before",
        "countdown-resumes-after",
    ],
)
def test_outage_pauses_countdowns_and_grants_a_grace(events, transitions, final):
    book, seen = run(events)
    assert seen == transitions
    assert book.leases["node01"].state == final


def test_takeover_grants_the_reconnect_grace():
    stored = {
        "dead": Lease(node_id="dead", state="ready", boot_id="b", last_seq=9, last_renew=100.0, since=50.0),
        "slow": Lease(node_id="slow", state="ready", boot_id="c", last_seq=9, last_renew=100.0, since=50.0),
    }
    book = LeaseBook(T)
    book.load(stored, at=140.0)  # taking over after a 40 s outage
    assert book.expire(159.9) == []  # the agents' worst reconnect time (20 s), not two heartbeats
    book.heartbeat(Heartbeat(node_id="slow", boot_id="c", seq=10), 159.0)
    # known only from a checkpoint older than a suspect window, "slow" returned: the grace
    # runs on for a grace after it (159 + 20), and the dead node goes lost then
    book.heartbeat(Heartbeat(node_id="slow", boot_id="c", seq=11), 178.0)
    assert book.expire(178.9) == []
    assert [(t.node_id, t.new) for t in book.expire(179.0)] == [("dead", "lost")]
    assert book.leases["slow"].state == "ready"


def test_grace_is_at_least_two_heartbeats():
    book = LeaseBook(Timings(heartbeat_interval=1.0, suspect_after_missed=3, node_lost_after=10.0))
    assert book.grace() == 2.0
    assert LeaseBook(T).grace() == 20.0


@pytest.mark.parametrize(
    "after_lost, transitions, final",
    [
        # the same agent heard again (seq grows): ready, and the detail says its engines are fenced
        ([("hb", 14, 2, "b1")], [("lost", "ready")], "ready"),
        # a replayed old heartbeat (seq not newer) proves nothing: stays lost
        ([("hb", 14, 1, "b1")], [], "lost"),
        # an implausible seq jump is refused even from a lost node
        ([("hb", 14, 10**9, "b1")], [], "lost"),
        # a new boot as before
        ([("hb", 14, 1, "b2")], [("lost", "ready")], "ready"),
    ],
    ids=["same-boot-returns", "replayed-heartbeat", "seq-jump", "new-boot"],
)
def test_lost_node_returns(after_lost, transitions, final):
    book, seen = run([("hb", 0, 1, "b1"), ("tick", 12), *after_lost])
    assert seen[:2] == [FIRST, ("node01", "ready", "lost")]
    assert [(o, n) for _, o, n in seen[2:]] == transitions
    assert book.leases["node01"].state == final


def test_same_boot_return_says_what_happens_to_its_engines():
    book = LeaseBook(T)
    book.heartbeat(Heartbeat(node_id="n", boot_id="b1", seq=1), 0)
    book.expire(12)
    tr = book.heartbeat(Heartbeat(node_id="n", boot_id="b1", seq=2), 14)
    assert (tr.old, tr.new, tr.lease.boot_id, tr.lease.since) == ("lost", "ready", "b1", 14)
    assert "same agent" in tr.detail and "fenced" in tr.detail


def test_quarantined_lost_node_stays_quarantined_when_it_returns():
    stored = {"n": Lease(node_id="n", state="lost", boot_id="b1", last_seq=5, last_renew=0.0, since=10.0, quarantine="two agents")}
    book = LeaseBook(T)
    book.load(stored, at=20.0)
    tr = book.heartbeat(Heartbeat(node_id="n", boot_id="b1", seq=6), 21.0)
    assert (tr.new, tr.lease.quarantine) == ("ready", "two agents")


def herd(returns, until, dead=("node99",)):
    """Nodes node00.. heartbeat at 0 and die or return at the given times after a bus
    outage (down at 0.5, up at 10); ticks every 0.5 s until ``until``. Returns the
    book and when each node went lost."""
    nodes = [f"node{i:02d}" for i in range(len(returns))] + list(dead)
    events = [("hb", 0, 1, "b1", n) for n in nodes] + [("down", 0.5), ("up", 10.0)]
    # The dead nodes are the ones past the end of ``returns``: they never heartbeat again.
    events += [("hb", at + k, 2 + k, "b1", n) for n, at in zip(nodes, returns, strict=False) for k in range(int(until - at) + 1)]
    events += [("tick", 10.0 + k / 2) for k in range(int((until - 10.0) * 2) + 1)]
    events.sort(key=lambda e: (e[1], e[0] != "hb"))  # a heartbeat and a tick at one time: the heartbeat first
    book = LeaseBook(T)
    lost = {}
    for ev in events:
        kind, at = ev[0], ev[1]
        if kind == "hb":
            book.heartbeat(Heartbeat(node_id=ev[4], boot_id=ev[3], seq=ev[2]), at)
        elif kind == "down":
            book.disconnected(at)
        elif kind == "up":
            book.reconnected(at)
        else:
            for tr in book.expire(at):
                if tr.new == "lost":
                    lost.setdefault(tr.node_id, at)
    return book, lost


@pytest.mark.parametrize(
    "returns, until, lost_at",
    [
        # every agent back within the grace (20 s after up at 10): only the dead node goes lost,
        # one grace after the last return (29 + 20)
        ([12.0, 20.0, 29.0], 80.0, {"node99": 49.0}),
        # a herd slower than the grace: agents keep returning until 95 s, 85 s after the bus came
        # back; each return holds the grace open, so none of them is lost, and the dead one is
        # lost one grace after the last return
        ([12.0 + 6.0 * k for k in range(15)], 140.0, {"node99": 116.0}),
        # a gap longer than the grace between two returns ends it: the dead node and the late
        # agent (returning at 60 after the grace ended at 32) are both lost at 32 — the gap is
        # the agents' worst reconnect time, so a node still silent then is lost
        ([12.0, 60.0], 80.0, {"node99": 32.0, "node01": 32.0}),
    ],
    ids=["within-grace", "slow-herd", "gap-ends-it"],
)
def test_a_reconnecting_herd_holds_the_grace_open_until_it_stops_returning(returns, until, lost_at):
    book, lost = herd(returns, until)
    assert lost == lost_at
    assert book.recovery_since is None  # the window closed: ordinary countdowns again


def test_a_herd_extends_the_grace_once_per_node():
    # node00 heartbeats every second after returning: only its first heartbeat is a return,
    # so the grace ends 20 s after it and the dead node is lost then, not 20 s after node00's last
    events = [("hb", 0, 1, "b1", "node00"), ("hb", 0, 1, "b1", "node99"), ("down", 0.5), ("up", 10.0)]
    events += [("hb", 12.0 + k, 2 + k, "b1", "node00") for k in range(40)]
    events += [("tick", 10.0 + k / 2) for k in range(0, 82)]
    events.sort(key=lambda e: (e[1], e[0] != "hb"))
    book, seen = run(events)
    lost = [(n, new) for n, _old, new in seen if new == "lost"]
    assert lost == [("node99", "lost")]
    assert book.leases["node99"].since == 32.0 and book.leases["node00"].state == "ready"


def test_a_warm_takeover_is_not_a_herd():
    # the standby heard every live node within a suspect window of taking over: no node
    # returns, so the grace ends where it always did (load at 5 + 20)
    events = [("hb", 0, 1, "b1", "node99")] + [("hb", float(k), 1 + k, "b1", "node00") for k in range(6)]
    events += [("load", 5.5)] + [("hb", 5.5 + k, 10 + k, "b1", "node00") for k in range(1, 30)]
    events += [("tick", 5.5 + k / 2) for k in range(0, 60)]
    events.sort(key=lambda e: (e[1], {"hb": 0, "load": 1, "tick": 2}[e[0]]))
    book, seen = run(events)
    assert [(n, new) for n, _o, new in seen if new == "lost"] == [("node99", "lost")]
    assert book.leases["node99"].since == 25.5
