"""The outage rule of the health monitor's pure core (issue #13): a bus outage
never counts against a node. Table-driven, clock injected."""

from __future__ import annotations

import pytest

from llmgw.services.leases import LeaseBook, Timings
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
        (
            [("hb", 0, 1, "b1"), ("down", 0.5), ("up", 40.5), ("hb", 55, 2, "b1"), ("tick", 60.4), ("tick", 60.5)],
            [FIRST, ("node01", "ready", "suspect")],
            "suspect",
        ),
        (
            [("hb", 0, 1, "b1"), ("down", 0.5), ("up", 40.5), ("hb", 45, 2, "b1"), ("tick", 60.5), ("tick", 61)],
            [FIRST, ("node01", "ready", "lost")],
            "lost",
        ),
    ],
    ids=["paused-while-down", "grace-after-reconnect", "slow-agent-heard-in-grace", "dead-node-lost-after-grace", "second-outage", "no-outage", "countdown-resumes-before", "countdown-resumes-after"],
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
    assert [(t.node_id, t.new) for t in book.expire(160.0)] == [("dead", "lost")]
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
    book, seen = run([("hb", 0, 1, "b1"), ("tick", 12)] + after_lost)
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
