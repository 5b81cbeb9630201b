"""The health monitor's pure core: table-driven, clock injected."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from llmgw.services.health.leases import CHECKPOINT_HEARTBEATS, LeaseBook, Timings
from llmgw.shared.schemas import Heartbeat, Lease
from llmgw.shared.states import BOOT_SETTLED_HEARTBEATS

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
        # lost ends when the same agent incarnation is heard again (a slow reconnect)…
        ([("hb", 0, 1, "b1"), ("tick", 10), ("hb", 11, 2, "b1")], [("", "ready"), ("ready", "lost"), ("lost", "ready")], "ready"),
        # …and when the agent restarts with a new boot id
        ([("hb", 0, 1, "b1"), ("tick", 10), ("hb", 11, 1, "b2")], [("", "ready"), ("ready", "lost"), ("lost", "ready")], "ready"),
        # a duplicate (old seq) heartbeat does not renew a suspect lease
        ([("hb", 0, 5, "b1"), ("tick", 3), ("hb", 3.5, 5, "b1")], [("", "ready"), ("ready", "suspect")], "suspect"),
    ],
    ids=[
        "first",
        "quiet-but-fine",
        "suspect",
        "suspect-recovers",
        "suspect-not-yet-lost",
        "lost",
        "coarse-tick",
        "rejoin-same-boot",
        "rejoin-new-boot",
        "stale-seq",
    ],
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
    # "alive" was known only from an old checkpoint: it returned, so the grace runs a grace
    # (two heartbeats here) past its return, and then the dead node's countdown, long over, ends
    assert book.expire(113.0) == []
    book.heartbeat(hb(11, "c", node="alive"), 113.0)
    trs = book.expire(114.0)
    assert [(t.node_id, t.new) for t in trs] == [("dead", "lost")]
    assert book.leases["alive"].state == "ready"


# --------------------------------------------------------------------------
# What is written to KV, and why (every write counts at 10,000 nodes)
# --------------------------------------------------------------------------

C = CHECKPOINT_HEARTBEATS * T.heartbeat_interval  # the checkpoint interval: 40 s here


def beats(first, last, *, node="node02", boot="b1", seq=1, every=1.0):
    """Heartbeats of ``node`` at first, first + every, … up to last."""
    return [(first + i * every, "hb", node, seq + i, boot) for i in range(round((last - first) / every) + 1)]


def ticks(first, last, every=1.0, offset=0.5):
    """The monitor's ticks, half a heartbeat after each heartbeat."""
    return [(first + i * every + offset, "tick") for i in range(round((last - first) / every))]


def simulate(timeline, book=None, store=None):
    """Replay a timeline as the shell does (services/health/service.py): a transition is
    written at once, and each tick writes what ``due_writes`` names (a boot change
    or a settled boot, which leave the lease dirty, and checkpoints).
    Returns the book and every write as (at, node, cause); ``store`` gets each
    written lease, as the bucket would."""
    book = book or LeaseBook(T)
    writes = []

    def write(lease, cause, at):
        writes.append((at, lease.node_id, cause))
        book.stored(lease, at)
        if store is not None:
            store[lease.node_id] = lease

    for at, kind, *args in sorted(timeline, key=lambda ev: ev[0]):
        if kind == "hb":
            node, seq, boot = args
            tr = book.heartbeat(Heartbeat(node_id=node, boot_id=boot, seq=seq), at)
            if tr:
                write(tr.lease, "transition", at)
        elif kind == "release":
            write(book.release(args[0], at).lease, "transition", at)
        else:
            for tr in book.expire(at):
                write(tr.lease, "transition", at)
            for lease, cause in book.due_writes(at):
                write(lease, cause, at)
    return book, writes


def test_a_nodes_checkpoint_phase_is_a_hash_of_its_id():
    book = LeaseBook(T)
    # crc32("node02") / 2**32 of the interval: the same in every monitor and after every restart
    assert book.checkpoint_phase("node02") == pytest.approx(18.37349, abs=1e-5)
    assert LeaseBook(T).checkpoint_phase("node02") == book.checkpoint_phase("node02")
    assert 0 <= book.checkpoint_phase("node01") < C


@pytest.mark.parametrize(
    "timeline, writes",
    [
        # heartbeats every second for a minute: the first, the settled boot, then one checkpoint per
        # interval, each at the first tick after node02's slot boundary (18.37 s + k × 40 s)
        (beats(0, 60) + ticks(0, 60), [(0, "transition"), (3.5, "boot"), (18.5, "checkpoint"), (58.5, "checkpoint")]),
        # heartbeats stop at 20: suspect and lost are written; the suspect write carried the last
        # renewal, so nothing is left to checkpoint at 58.5
        (beats(0, 20) + ticks(0, 60), [(0, "transition"), (3.5, "boot"), (18.5, "checkpoint"), (23.5, "transition"), (30.5, "transition")]),
        # suspect, and back at the next heartbeat: both transitions, nothing else
        (beats(0, 5) + beats(9, 12, seq=10) + ticks(0, 13), [(0, "transition"), (3.5, "boot"), (8.5, "transition"), (9, "transition")]),
        # the agent restarts (new boot id, lease still ready): written at the next tick, and again when settled
        (beats(0, 5) + beats(6, 12, boot="b2") + ticks(0, 13), [(0, "transition"), (3.5, "boot"), (6.5, "boot"), (9.5, "boot")]),
        # lost, then back with a new boot: the transition, then the settled boot (in the slot
        # that began at 18.37, so no checkpoint follows in it)
        (
            beats(0, 2) + beats(15, 20, boot="b2") + ticks(0, 21),
            [(0, "transition"), (5.5, "transition"), (12.5, "transition"), (15, "transition"), (18.5, "boot")],
        ),
        # a replayed heartbeat renews nothing and writes nothing; the silence is judged as ever
        ([(float(t), "hb", "node02", 1, "b1") for t in range(11)] + ticks(0, 11), [(0, "transition"), (3.5, "transition"), (10.5, "transition")]),
        # two agents, one identity: the first boot change is written; the alternation quarantines
        # (a transition); the operator's release is one, and the boot holding the lease settles again
        (
            [
                *beats(0, 3, boot="A"),
                (4.0, "hb", "node02", 1, "B"),
                (5.0, "hb", "node02", 5, "A"),
                (6.0, "hb", "node02", 2, "B"),
                (7.0, "hb", "node02", 6, "A"),
                (8.0, "release", "node02"),
                *beats(9, 12, boot="B", seq=3),
                *ticks(0, 13),
            ],
            [(0, "transition"), (3.5, "boot"), (4.5, "boot"), (7, "transition"), (8, "transition"), (12.5, "boot")],
        ),
    ],
    ids=["renewals-checkpointed", "silence", "suspect-and-back", "agent-restart", "lost-then-new-boot", "replayed-heartbeat", "clone-quarantine-release"],
)
def test_what_is_written_and_why(timeline, writes):
    _, seen = simulate(timeline)
    assert [(at, cause) for at, _node, cause in seen] == writes


def test_the_settled_write_comes_when_the_scheduler_starts_trusting_the_boot():
    """The scheduler trusts a new incarnation's full reports for teardown once its lease
    shows BOOT_SETTLED_HEARTBEATS heartbeats; the boot write at that count is what
    lets it see that without waiting for a checkpoint."""
    store: dict[str, Lease] = {}
    simulate(beats(0, 10) + ticks(0, 10), store=store)
    assert store["node02"].boot_heartbeats == BOOT_SETTLED_HEARTBEATS


def test_checkpoints_spread_over_the_interval_and_each_node_gets_one():
    """1,000 nodes that all started in the same second (a power event) checkpoint once
    each per interval, spread over it, not all in one tick; and what the bucket holds is
    never newer than the truth, nor older by more than the interval and a tick."""
    nodes = [f"node{i:04d}" for i in range(1000)]
    book, store, writes = LeaseBook(T), {}, []
    tick = 0.25
    for step in range(int(3 * C / tick) + 1):
        at = step * tick
        if step % 4 == 0:  # every node heartbeats once a second
            for seq, node in enumerate(nodes):
                book.heartbeat(Heartbeat(node_id=node, boot_id="b1", seq=step // 4 + 1), at + seq * 1e-4)
        for lease, cause in book.due_writes(at):
            writes.append((at, lease.node_id, cause))
            book.stored(lease, at)
            store[lease.node_id] = lease
        if at >= C:  # from one interval on, every node has been written at least once
            for node in nodes:
                lag = book.leases[node].last_renew - store[node].last_renew
                assert 0 <= lag <= C + tick + 1.0, (node, at, lag)
    window = [(at, node) for at, node, cause in writes if cause == "checkpoint" and C <= at < 2 * C]
    assert sorted(node for _, node in window) == nodes  # each node exactly once per interval
    per_second = Counter(math.floor(at) for at, _ in window)
    mean = len(nodes) / C  # 33 a second
    assert max(per_second.values()) <= 2 * mean, per_second.most_common(3)


def test_a_takeover_resumes_checkpoints_at_each_nodes_slot_not_at_once():
    """A new monitor has every lease to checkpoint (it renewed them all from the heartbeats
    it heard): each at its node's next slot, spread over one interval, not in its first tick."""
    stale = {n: Lease(node_id=n, state="ready", boot_id="b1", last_seq=5, last_renew=10.0, since=0.0) for n in (f"node{i:04d}" for i in range(1000))}
    book = LeaseBook(T)
    book.load(stale, at=100.0)
    for i, node in enumerate(stale):  # the heartbeats the standby heard
        book.heartbeat(Heartbeat(node_id=node, boot_id="b1", seq=6), 99.0 + i / 1000)
    written = []
    for step in range(1, int(C / 0.25) + 1):
        at = 100.0 + step * 0.25
        for lease, cause in book.due_writes(at):
            written.append((at, lease.node_id, cause))
            book.stored(lease, at)
    assert sorted(node for _, node, _ in written) == sorted(stale)  # each once within the interval
    assert {cause for _, _, cause in written} == {"checkpoint"}
    assert max(Counter(math.floor(at) for at, _, _ in written).values()) <= 2 * len(stale) / C


@pytest.mark.parametrize(
    "failed, then, cause",
    [
        ("checkpoint", None, "checkpoint"),  # a failed checkpoint is retried as one
        ("checkpoint", "boot", "boot"),
        ("boot", "checkpoint", "boot"),
        ("checkpoint", "transition", "transition"),  # counted as the most telling cause
        ("transition", "boot", "transition"),
    ],
)
def test_a_lease_waiting_to_be_written_keeps_its_most_telling_cause(failed, then, cause):
    book = LeaseBook(T)
    book.heartbeat(hb(1), 0.0)
    book.stored(book.leases["node01"], 0.0)
    book.unstored("node01", failed)
    if then:
        book.unstored("node01", then)
    assert [(lease.node_id, c) for lease, c in book.due_writes(0.5)] == [("node01", cause)]
    book.stored(book.leases["node01"], 0.5)
    assert book.due_writes(0.75) == []


def test_an_unknown_write_cause_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown lease write cause 'renewal'"):
        LeaseBook(T).unstored("node01", "renewal")


# --------------------------------------------------------------------------
# A takeover from checkpoints (docs/architecture.md, "What a takeover knows")
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dies_at, acting_until, takeover_at, standby_since, lost_at",
    [
        # dead silent long enough to be suspect: its stored renewal is exact (written with the
        # transition), so its countdown ends where it would have: 40 + 10
        (40, 45, 45, 45, 50.5),
        # died a second before the takeover, after its last checkpoint (37.5): a cold standby
        # declares it lost right after the grace (2 s): earlier than 54, never before the grace
        (44, 45, 45, 45, 47.5),
        # the same with a standby that heard it until 44: exactly its own countdown
        (44, 45, 45, 0, 54.5),
        # no monitor from 45 to 70 (a cold standby started then): the grace still comes first
        (44, 45, 70, 70, 72.5),
    ],
    ids=["suspect-exact", "cold-standby-stale-checkpoint", "warm-standby", "late-takeover"],
)
def test_a_takeover_never_loses_a_live_node_nor_keeps_a_dead_one(dies_at, acting_until, takeover_at, standby_since, lost_at):
    """``live`` heartbeats throughout; ``dead`` stops at dies_at. The acting monitor writes as
    the shell does until acting_until; the new one, standing by since standby_since, takes
    over at takeover_at: it loads what the bucket holds, applies the latest heartbeat it heard
    of each node, and judges on."""
    store: dict[str, Lease] = {}
    before = beats(0, takeover_at - 1, node="live") + beats(0, dies_at, node="dead")
    simulate([ev for ev in before if ev[0] < acting_until] + ticks(0, acting_until), store=store)
    assert store["live"].last_renew < acting_until - 1  # a checkpoint, older than the truth
    new = LeaseBook(T)
    new.load(dict(store), takeover_at)
    heard = {}
    for at, _kind, node, seq, boot in (ev for ev in before if standby_since <= ev[0] < takeover_at):
        heard[node] = (Heartbeat(node_id=node, boot_id=boot, seq=seq), at)
    assert all(new.heartbeat(h, at) is None for h, at in heard.values())
    later = beats(takeover_at, takeover_at + 40, node="live", seq=int(takeover_at) + 1) + ticks(takeover_at, takeover_at + 40)
    trs = []
    for at, kind, *args in sorted(later, key=lambda ev: ev[0]):
        if kind == "hb":
            trs += [tr] if (tr := new.heartbeat(Heartbeat(node_id=args[0], boot_id=args[2], seq=args[1]), at)) else []
        else:
            trs += new.expire(at)
    assert not [tr for tr in trs if tr.node_id == "live"]
    assert [(tr.node_id, tr.lease.since) for tr in trs if tr.new == "lost"] == [("dead", lost_at)]
    assert lost_at >= takeover_at + new.grace()
    assert lost_at <= max(takeover_at + new.grace(), dies_at + T.node_lost_after) + 1.0


def test_a_monitor_leading_again_keeps_the_renewals_it_heard_itself():
    """It stepped down (its leadership renewals failed: no quorum) and leads again: the bucket
    holds node02's checkpoint from 18.5, but this monitor heard node02 until 30 — a fact, whoever
    judged meanwhile. Counting from the checkpoint would call node02 lost right after the grace."""
    store: dict[str, Lease] = {}
    book, _ = simulate(beats(0, 30) + ticks(0, 30), store=store)
    assert store["node02"].last_renew == 18.0
    book.load(dict(store), at=31.0)
    assert book.leases["node02"].last_renew == 30.0
    assert [(t.node_id, t.new) for t in book.expire(35.0)] == [("node02", "suspect")]  # silent 5 s, not 17
    assert book.expire(39.9) == []
    # a fresh monitor has nothing of its own: the checkpoint it is
    fresh = LeaseBook(T)
    fresh.load(dict(store), at=31.0)
    assert fresh.leases["node02"].last_renew == 18.0


def every_due_write(book: LeaseBook, at: float) -> set[tuple[str, str]]:
    """What ``due_writes`` must name, by the definition: a walk over every lease
    (a dirty one with its cause; a checkpoint for a lease renewed since it was stored
    whose slot boundary passed since it was written). The book looks at fewer."""
    out = set()
    for node, lease in book.leases.items():
        if node in book.dirty:
            out.add((node, book.dirty[node]))
        elif lease.last_renew > book.stored_renew.get(node, -math.inf) and (
            node not in book.written_at or book._slot(node, at) != book._slot(node, book.written_at[node])
        ):
            out.add((node, "checkpoint"))
    return out


def every_expiry(book: LeaseBook, at: float) -> set[tuple[str, str]]:
    """What ``expire`` must do, by the definition: every lease silent for
    node_lost_after goes lost, every ready one silent for suspect_after goes suspect."""
    if at < book.not_before or book.outage_since is not None:
        return set()
    out = set()
    for node, lease in book.leases.items():
        silent = at - lease.last_renew
        if lease.state != "lost" and silent >= T.node_lost_after:
            out.add((node, "lost"))
        elif lease.state == "ready" and silent >= T.suspect_after:
            out.add((node, "suspect"))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_due_writes_names_what_a_walk_over_every_lease_names(seed):
    """Random histories — nodes appearing, heartbeating at random, falling silent and
    returning, agents restarting, writes failing, ticks at irregular gaps (some longer
    than a checkpoint interval), a takeover from what was stored: at every tick the
    incremental ``due_writes`` (it looks only at the nodes whose slot boundary passed
    since the last tick, and those still waiting for a renewal) names exactly what a
    walk over every lease names, and ``expire`` (one comparison for a node heard
    lately) expires exactly what the definition does."""
    import random

    rng = random.Random(seed)
    book, store = LeaseBook(T), {}
    nodes = [f"node{i:03d}" for i in range(60)]
    seq = dict.fromkeys(nodes, 0)
    boot = dict.fromkeys(nodes, "b1")
    silent: set[str] = set()
    at = 0.0
    for _ in range(1500):
        at += rng.choice([0.01, 0.1, 0.25, 0.5, 1.0, 3.0]) if rng.random() > 0.01 else C * rng.choice([0.99, 1.0, 1.5, 3.0])
        for node in rng.sample(nodes, rng.randint(0, 20)):
            if node in silent:
                continue
            if rng.random() < 0.01:
                boot[node] = f"b{rng.randint(2, 99)}"  # the agent restarted
            seq[node] += 1
            if (tr := book.heartbeat(Heartbeat(node_id=node, boot_id=boot[node], seq=seq[node]), at)) is not None:
                if rng.random() < 0.1:
                    book.unstored(node, "transition")  # the write failed: it waits as dirty
                else:
                    book.stored(tr.lease, at)
                    store[node] = tr.lease
        if rng.random() < 0.05:
            silent ^= {rng.choice(nodes)}  # one node falls silent, or speaks again
        expected = every_expiry(book, at)
        expired = book.expire(at)
        assert {(tr.node_id, tr.new) for tr in expired} == expected, at
        for tr in expired:
            assert book.leases[tr.node_id] == tr.lease
            book.stored(tr.lease, at)
            store[tr.node_id] = tr.lease
        want = every_due_write(book, at)
        got = book.due_writes(at)
        assert {(lease.node_id, cause) for lease, cause in got} == want, at
        assert len(got) == len(want)  # each once
        for lease, _cause in got:
            if rng.random() < 0.05:
                book.unstored(lease.node_id, "checkpoint")  # failed: retried as dirty
            else:
                book.stored(lease, at)
                store[lease.node_id] = lease
        if rng.random() < 0.003:
            taken = LeaseBook(T)  # a takeover: a new monitor continues from the bucket
            taken.load(dict(store), at)
            book = taken
