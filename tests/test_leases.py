"""The health monitor's pure core: table-driven, clock injected."""

from __future__ import annotations

import pytest

from llmgw.services.leases import LeaseBook, Timings
from llmgw.shared.schemas import Heartbeat, Lease

T = Timings(heartbeat_interval=1.0, suspect_after_missed=3, node_lost_after=10.0)


def hb(seq, boot="b1", node="node01"):
    return Heartbeat(node_id=node, boot_id=boot, seq=seq)


def book_with(*events):
    """Replay ("hb", at, seq, boot) and ("tick", at) events; return the book and all transitions."""
    book = LeaseBook(T)
    seen = []
    for ev in events:
        if ev[0] == "hb":
            _, at, seq, boot = ev
            tr = book.heartbeat(hb(seq, boot), at)
            seen += [tr] if tr else []
        else:
            seen += book.expire(ev[1])
    return book, [(t.old, t.new) for t in seen]


@pytest.mark.parametrize(
    "events, transitions, final",
    [
        ([("hb", 0, 1, "b1")], [("", "ready")], "ready"),
        ([("hb", 0, 1, "b1"), ("tick", 2.9)], [("", "ready")], "ready"),
        ([("hb", 0, 1, "b1"), ("tick", 3.0)], [("", "ready"), ("ready", "suspect")], "suspect"),
        ([("hb", 0, 1, "b1"), ("tick", 3.0), ("hb", 3.5, 2, "b1")], [("", "ready"), ("ready", "suspect"), ("suspect", "ready")], "ready"),
        ([("hb", 0, 1, "b1"), ("tick", 3), ("tick", 9.9)], [("", "ready"), ("ready", "suspect")], "suspect"),
        ([("hb", 0, 1, "b1"), ("tick", 3), ("tick", 10)], [("", "ready"), ("ready", "suspect"), ("suspect", "lost")], "lost"),
        # one coarse tick past the deadline goes straight to lost
        ([("hb", 0, 1, "b1"), ("tick", 12)], [("", "ready"), ("ready", "lost")], "lost"),
        # lost ends when the same agent incarnation is heard again (issue #13: a slow reconnect)…
        ([("hb", 0, 1, "b1"), ("tick", 10), ("hb", 11, 2, "b1")], [("", "ready"), ("ready", "lost"), ("lost", "ready")], "ready"),
        # …and when the agent restarts with a new boot id
        ([("hb", 0, 1, "b1"), ("tick", 10), ("hb", 11, 1, "b2")], [("", "ready"), ("ready", "lost"), ("lost", "ready")], "ready"),
        # a duplicate (old seq) heartbeat does not renew a suspect lease
        ([("hb", 0, 5, "b1"), ("tick", 3), ("hb", 3.5, 5, "b1")], [("", "ready"), ("ready", "suspect")], "suspect"),
    ],
    ids=["first", "quiet-but-fine", "suspect", "suspect-recovers", "suspect-not-yet-lost", "lost", "coarse-tick", "rejoin-same-boot", "rejoin-new-boot", "stale-seq"],
)
def test_lease_transitions(events, transitions, final):
    book, seen = book_with(*events)
    assert seen == transitions
    assert book.leases["node01"].state == final


def test_since_marks_the_transition_and_renew_the_last_heartbeat():
    book, _ = book_with(("hb", 0, 1, "b1"), ("hb", 1, 2, "b1"), ("tick", 4.5))
    lease = book.leases["node01"]
    assert (lease.state, lease.since, lease.last_renew) == ("suspect", 4.5, 1)


def test_restart_continues_countdowns_after_a_grace():
    stored = {
        "dead": Lease(node_id="dead", state="ready", boot_id="b", last_seq=9, last_renew=100.0, since=50.0),
        "alive": Lease(node_id="alive", state="ready", boot_id="c", last_seq=9, last_renew=100.0, since=50.0),
    }
    book = LeaseBook(T)
    book.load(stored, at=111.0)  # the monitor was down 11 s: longer than node_lost_after
    assert book.expire(111.5) == []  # grace: live nodes get to be heard first
    book.heartbeat(hb(10, "c", node="alive"), 112.0)
    trs = book.expire(113.0)
    assert [(t.node_id, t.new) for t in trs] == [("dead", "lost")]
    assert book.leases["alive"].state == "ready"


def test_due_writes_lag_at_most_one_interval():
    book = LeaseBook(T)
    book.heartbeat(hb(1), 0.0)
    book.stored(book.leases["node01"])
    book.heartbeat(hb(2), 0.5)
    assert book.due_writes(0.5) == []
    book.heartbeat(hb(3), 1.0)
    assert [l.last_renew for l in book.due_writes(1.0)] == [1.0]
