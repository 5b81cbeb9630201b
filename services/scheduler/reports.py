"""The scheduler's fold of agents' status reports into replica records: pure.

``ReportBook`` holds what nodes said they run (``reported``), which full report
each node last sent and from which agent incarnation, the members whose launch
was refused (``absent``), and the scheduler's own recent replica writes
(``recent``). It does no I/O and reads no clock: the scheduler passes ``now``
(wall-clock seconds, the clock replica records' ``created_at`` is on) and does
the sending, logging and counting itself.

The race it covers: an agent's "starting" report can reach the scheduler
before the scheduler's own record of that replica comes back through the KV
watch. ``known_replicas`` therefore prefers what this instance wrote (for
``OWN_WRITE_WINDOW`` seconds) when it is at least as new as the mirror's copy;
without it fencing would stop an engine just launched.

What a node reports is bounded and attributed (a node is not trusted): per node, the
engines a replica record names plus at most ``max_unknown`` others (kept for
fencing; more are dropped and counted); a report is believed only from the
agent incarnation (boot id) holding the node's lease, never while the node is
quarantined; and a full report marks missing engines absent only once its boot
id has held the lease for ``settle_heartbeats`` heartbeats.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

import msgspec

from llmgw.shared.schemas import EngineFact, Lease, Replica, StatusReport
from llmgw.shared.states import EngineState, LeaseState

# How long our own write of a replica record (or delete) outranks the mirror's copy.
OWN_WRITE_WINDOW = 30.0
# How often the own-write table is pruned: once a second, not once a report.
PRUNE_INTERVAL = 1.0
ABSENT_DETAIL = "missing from its node's full report, or the launch was refused"


class ReportBook:
    """What agents reported, folded into replica records. Time is passed in."""

    def __init__(
        self,
        replicas: Mapping[str, Replica],
        leases: Mapping[str, Lease],
        *,
        max_unknown: int,
        settle_heartbeats: int,
        launch_grace: float,
    ):
        # The live records (the scheduler's mirrors): read, never written here.
        self.replicas = replicas
        self.leases = leases
        self.max_unknown = max_unknown
        self.settle_heartbeats = settle_heartbeats
        # A full report taken within this long of a replica's creation may predate its launch.
        self.launch_grace = launch_grace
        # node -> {(replica id, rank): fact}, from the agents' status reports
        self.reported: dict[str, dict[tuple[str, int], EngineFact]] = defaultdict(dict)
        self.full_report_at: dict[str, float] = {}
        # node -> boot id of the agent whose full report that was
        self.full_report_boot: dict[str, str] = {}
        # (replica id, rank) whose launch the agent refused
        self.absent: set[tuple[str, int]] = set()
        # replica id -> (when, record or None if deleted) for our own recent writes
        self.recent: dict[str, tuple[float, Replica | None]] = {}
        self._pruned_at = float("-inf")

    # -- believing a report ------------------------------------------------------
    def distrust(self, node: str, boot_id: str) -> str:
        """Why a report from ``boot_id`` on ``node`` is not believed, or "" if it is."""
        lease = self.leases.get(node)
        if lease is None:
            return ""  # not heard yet (or no health monitor): as before
        if lease.quarantine:
            return "quarantined"
        if lease.boot_id != boot_id and lease.state != LeaseState.LOST:
            # Not (yet) the incarnation holding the lease; asked again when it does. A lost
            # node's replicas are already failed: its returning agent is heard at once,
            # so its stale engines are fenced without waiting for a heartbeat.
            return "other_boot"
        return ""

    def take(self, report: StatusReport, now: float) -> tuple[list[EngineFact], int]:
        """Fold a believed report in. A full report replaces the node's entries; a
        partial one updates them. Returns the report's engines that were kept (the
        ones to fence: at most ``max_unknown`` unnamed ones) and how many were dropped."""
        node = report.node_id
        if report.full:
            kept, dropped = self._bounded(report.engines, {}, now)
            self.full_report_at[node] = now
            self.full_report_boot[node] = report.boot_id
        else:
            kept, dropped = self._bounded(report.engines, self.reported.get(node, {}), now)
        self.reported[node] = kept
        return [f for f in report.engines if kept.get((f.replica_id, f.rank)) is f], dropped

    def _bounded(self, engines: Iterable[EngineFact], base: dict, now: float) -> tuple[dict, int]:
        """``base`` updated with ``engines``, keeping only engines a replica record
        names plus ``max_unknown`` others; and how many were dropped."""
        engines = list(engines)
        known = self.known_replicas({f.replica_id for f in engines}, now)
        out = dict(base)
        unknown = sum(1 for (rid, _r) in out if rid not in self.replicas and rid not in self.recent)
        dropped = 0
        for f in engines:
            key = (f.replica_id, f.rank)
            if f.replica_id not in known and key not in out:
                if unknown >= self.max_unknown:
                    dropped += 1
                    continue
                unknown += 1
            out[key] = f
        return out, dropped

    def has(self, node: str, replica_id: str, rank: int) -> bool:
        """Whether ``node`` reported running rank ``rank`` of ``replica_id``."""
        return (replica_id, rank) in self.reported.get(node, {})

    # -- our own writes ------------------------------------------------------------
    def wrote(self, replica_id: str, record: Replica | None, now: float) -> None:
        """This instance wrote ``record`` (None: deleted it) at ``now``."""
        self.recent[replica_id] = (now, record)

    def forget(self, replica_id: str) -> None:
        """The record is deleted: its members' refusals go with it."""
        self.absent = {k for k in self.absent if k[0] != replica_id}

    def refused(self, replica_id: str, rank: int) -> None:
        """The agent refused this member's launch: it is absent until the record goes."""
        self.absent.add((replica_id, rank))

    def known_replicas(self, ids: set[str], now: float) -> dict[str, Replica]:
        """The records of ``ids`` (those a report names): the mirror's, or what this
        instance wrote and its watch has not echoed yet, whichever is newer.

        Without the second part an agent's "starting" report can beat our own
        record through the watch, and fencing would stop an engine we just launched.
        Only the named ids are looked up: a report per node per heartbeat must
        not copy the whole replica table.
        """
        if now - self._pruned_at > PRUNE_INTERVAL:
            self._pruned_at = now
            for rid in [r for r, (at, _) in self.recent.items() if at < now - OWN_WRITE_WINDOW]:
                del self.recent[rid]
        known = {}
        for rid in ids:
            rep = self.replicas.get(rid)
            if rid in self.recent:
                mine = self.recent[rid][1]
                if mine is None:
                    rep = None
                elif rep is None or rep.generation <= mine.generation:
                    rep = mine
            if rep is not None:
                known[rid] = rep
        return known

    # -- folding into records --------------------------------------------------------
    def missing(self, node: str, rep: Replica) -> bool:
        """A full report from ``node``, taken well after the launch, lacks this engine.

        The grace covers a launch still in flight when the report was taken.
        """
        at = self.full_report_at.get(node)
        if at is None or rep.created_at <= 0 or at <= rep.created_at + self.launch_grace:
            return False
        lease = self.leases.get(node)
        if lease is None:
            return True
        # Only the incarnation holding the lease, settled, and not quarantined may say an
        # engine is gone (a lease from before these fields, boot_since 0, counts as settled).
        settled = lease.boot_since == 0 or lease.boot_heartbeats >= self.settle_heartbeats
        return not lease.quarantine and self.full_report_boot.get(node) == lease.boot_id and settled

    def with_reports(self, replicas: Mapping[str, Replica]) -> dict[str, Replica]:
        """Replicas with members' engine states folded in from the latest reports
        (a record whose members did not change is returned as the same object)."""
        out = {}
        for rid, rep in replicas.items():
            members = []
            changed = False
            for m in rep.members:
                fact = self.reported.get(m.node_id, {}).get((rid, m.rank))
                state, detail, pid = m.engine_state, m.engine_detail, m.pid
                if fact is not None and fact.generation == rep.generation:
                    state, detail, pid = EngineState(fact.state), fact.detail, fact.pid
                elif (rid, m.rank) in self.absent or self.missing(m.node_id, rep):
                    state, detail = EngineState.ABSENT, ABSENT_DETAIL
                if (state, detail, pid) != (m.engine_state, m.engine_detail, m.pid):
                    changed = True
                    m = msgspec.structs.replace(m, engine_state=state, engine_detail=detail, pid=pid)
                members.append(m)
            out[rid] = msgspec.structs.replace(rep, members=members) if changed else rep
        return out


def report_moves(
    before: Mapping[tuple[str, int], EngineFact] | None,
    after: Mapping[tuple[str, int], EngineFact],
    held: Iterable[tuple[str, int, int]],
    *,
    full: bool,
) -> bool:
    """Whether folding a node's report in (``before`` -> ``after``, its entries in
    ``ReportBook.reported``) can change what ``with_reports`` gives.

    ``with_reports`` reads, of a node's report, each engine's generation, state,
    detail and pid, and — through ``missing`` — whether a full report lacks a
    member the node holds (``held``: replica id, rank and the record's
    generation of every member on the node). A report that changes neither (an
    agent reconnecting and saying again what it runs, ten thousand of them after
    a nats-server restart) needs no step of its own: the book keeps it, and the
    next step, at the latest the next tick, reads it.
    """
    if _engine_facts(before or {}) != _engine_facts(after):
        return True
    if full:
        for rid, rank, generation in held:
            fact = after.get((rid, rank))
            if fact is None or fact.generation != generation:
                return True
    return False


def _engine_facts(facts: Mapping[tuple[str, int], EngineFact]) -> dict:
    return {key: (f.generation, f.state, f.detail, f.pid) for key, f in facts.items()}
