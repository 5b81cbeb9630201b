"""The health monitor's pure core: heartbeats in, lease transitions out.

Times are the monitor's own clock, passed in; the agents' clocks never matter.

    ready ──(no heartbeat for suspect_after_missed × interval)──▶ suspect
    suspect ──(heartbeat)──▶ ready
    ready/suspect ──(no heartbeat for node_lost_after)──▶ lost
    lost ──(a newer heartbeat, same or new boot id)──▶ ready

A lost node returns when it is heard again: with a new boot id (its agent
restarted) or with the same one (a healed partition, or an agent that took
longer than the grace to reconnect after a bus outage). Its replicas were
failed and replaced while it was lost; the scheduler asks a node whose lease
returns for its full engine list and fences (stops) the stale engines it still
runs, so the node comes back empty.

The bus outage rule (a bus outage never counts against a node). The monitor judges silence only while it
can hear: while it is disconnected from the bus (``disconnected``) nothing
expires, and when it reconnects (``reconnected``) or takes over (``load``)
every node gets ``Timings.reconnect_grace`` — the agents' worst reconnect
time — before anything can go suspect or lost. A node still silent after the
grace goes lost then (its countdown is not restarted, so a node that died
during the outage is not given a second full ``node_lost_after``). While
nodes are still coming back — each heard for the first time since the
outage began, or since a suspect window before a takeover — the grace runs on
until a whole grace passes with none returning (``_recovering``): thousands of
agents reconnecting at once queue for TLS handshakes far longer than their
backoff, and a fixed grace would declare most of them lost.

What a heartbeat may claim (a node is not trusted beyond its certificate). A node's certificate says who sends,
not that the sender is sane or alone:

* *Sequence jumps.* Within one boot id the sequence grows by one per
  heartbeat. A heartbeat more than ``1000 + 10 × elapsed/interval`` ahead of
  the last accepted one is refused and counted (``refused``), and the lease's
  ``last_seq`` is untouched, so the node's real heartbeats keep renewing it. A
  sequence that goes back within one boot id is a duplicate or reordered
  heartbeat, ignored as before (the agent draws a new boot id every start, so a
  restarted agent never reuses one).
* *Clones.* A legitimate restart changes the boot id once and never goes
  back. Two live agents with one identity make the boot id alternate (A, B, A,
  B …). A heartbeat from a boot id the lease already left (heard within
  ``CLONE_WINDOW`` heartbeat intervals) does not take the lease back: it is
  refused and counted (``superseded_boot``) — one such heartbeat is the old
  agent's last one arriving late. When that happens ``CLONE_RETURNS`` times
  within the window, two agents are alive, and the lease is quarantined
  (``Lease.quarantine`` says why): it stays renewed by either agent's
  heartbeats (so nothing is torn down for a lost node) and keeps its boot id,
  until an operator releases it (``release``). The scheduler launches nothing
  on a quarantined node and ignores its status reports.
* A boot change is written at the next tick (not at the next checkpoint), with
  ``boot_since``, so the scheduler can tell which agent incarnation holds the
  lease and for how long.

What is written to KV, and when (at 10,000 nodes every write counts). The countdowns live in memory;
a lease costs a write only when something a reader decides on changes:

* *transition* — every state change (first heartbeat, ready/suspect/lost,
  quarantine, release), written by the shell at once with its event;
* *boot* — a new boot id without a state change, and the heartbeat at which a
  boot id has held the lease ``BOOT_SETTLED_HEARTBEATS`` times (the scheduler
  trusts a new incarnation's full reports for teardown from then on), written
  at the next tick (``dirty``);
* *checkpoint* — renewals, once per ``Timings.checkpoint_interval``
  (``CHECKPOINT_HEARTBEATS`` heartbeat intervals: 200 s with the defaults, a
  write for 2.5 % of the heartbeats — 50 writes/s at 10,000 nodes), at a
  phase of its own per node (a hash of the node id), so checkpoints spread
  evenly over the interval even when every node started in the same second. Nothing is checkpointed for a lease whose
  heartbeats stopped: its last renewal was written with its suspect
  transition.

So a stored ``last_renew`` is never newer than the truth and lags it by at
most ``checkpoint_interval`` + one tick for a ready node, and not at all for
a suspect or lost one. What that means for a takeover is in ``load``.
"""

from __future__ import annotations

import bisect
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from llmgw.shared.schemas import Heartbeat, Lease
from llmgw.shared.states import BOOT_SETTLED_HEARTBEATS, EventWhat, LeaseState


@dataclass(frozen=True)
class Timings:
    heartbeat_interval: float
    suspect_after_missed: int
    node_lost_after: float
    # After the monitor reconnects to the bus or takes over, no lease expires for this
    # long: the agents' worst reconnect time (health.reconnect_grace).
    reconnect_grace: float = 0.0

    @property
    def suspect_after(self) -> float:
        return self.heartbeat_interval * self.suspect_after_missed

    @property
    def checkpoint_interval(self) -> float:
        """How often a ready lease's renewals are written (see the module docstring).

        Derived rather than configured (health has no key for it), from the
        heartbeat interval: the write traffic is then a fixed share of the
        heartbeat traffic the monitor takes anyway (1 / CHECKPOINT_HEARTBEATS),
        whatever node_lost_after is (the bench runs 15 s, the default is 60 s).
        Its staleness never changes a takeover's verdict (``load``); it bounds
        how old the renewal is that KV readers see.
        """
        return CHECKPOINT_HEARTBEATS * self.heartbeat_interval


@dataclass(frozen=True)
class Transition:
    node_id: str
    # What the node's events say: a lease state, or quarantined/released.
    old: EventWhat | Literal[""]  # "" for a node seen for the first time
    new: EventWhat
    lease: Lease
    detail: str


# A heartbeat may run ahead of the last accepted one by this much, plus
# SEQ_SLACK_PER_INTERVAL per heartbeat interval elapsed since (agents never skip).
SEQ_SLACK = 1000
SEQ_SLACK_PER_INTERVAL = 10
# Boot ids returning this many times within this many heartbeat intervals: two agents.
CLONE_RETURNS = 2
CLONE_WINDOW = 10
MAX_COUNTED = 1_000_000
# Renewals reach KV once per this many heartbeat intervals (Timings.checkpoint_interval):
# 40 × 5 s by default, 50 lease writes/s at 10,000 nodes instead of ~1,300.
CHECKPOINT_HEARTBEATS = 40
# The heartbeat count at which a boot id's lease is written again is
# states.BOOT_SETTLED_HEARTBEATS: the scheduler trusts a new incarnation's full
# reports for teardown from then on.
# Why a lease is written (llmgw_health_lease_writes_total{cause}). A lease waiting
# to be written for several reasons is counted under the first of these.
WRITE_CAUSES = ("transition", "boot", "checkpoint")


@dataclass
class LeaseBook:
    timings: Timings
    leases: dict[str, Lease] = field(default_factory=dict)
    # The last_renew of each lease as last written to KV: a checkpoint is due only
    # when there is a newer renewal to save (see ``due_writes``).
    stored_renew: dict[str, float] = field(default_factory=dict)
    # When each lease was last written (the monitor's clock): one checkpoint per slot.
    written_at: dict[str, float] = field(default_factory=dict)
    # No lease expires before this time (see ``load``).
    not_before: float = 0.0
    # node -> {boot id: last heard} for boot ids heard within CLONE_WINDOW intervals
    boots: dict[str, dict[str, float]] = field(default_factory=dict)
    # node -> when a superseded boot id came back (within the window)
    returns: dict[str, list[float]] = field(default_factory=dict)
    # Leases to write at the next flush, with the cause (one of WRITE_CAUSES): a new
    # boot id or a settled one, and any write that failed (written again).
    dirty: dict[str, str] = field(default_factory=dict)
    # Called with (node, reason, detail) for every refused heartbeat, e.g. ("seq_jump", …).
    on_refuse: Callable[[str, str, str], None] | None = None
    # When the monitor lost the bus (None while connected): nothing expires meanwhile.
    outage_since: float | None = None
    # When the current recovery (a reconnect or a takeover) began, while its grace is
    # open (None otherwise): a node heard for the first time since then extends it.
    recovery_since: float | None = None
    # node -> its checkpoint phase in [0, checkpoint_interval) (a hash of the node id)
    _phases: dict[str, float] = field(default_factory=dict)
    # Every phase in ``_phases``, sorted, with its node at the same index: a tick finds
    # the nodes whose slot boundary it passed by bisection, not by a walk over all nodes.
    _phase_order: list[float] = field(default_factory=list)
    _phase_nodes: list[str] = field(default_factory=list)
    # Up to when slot boundaries have been looked at (None: never, or since a load).
    _scanned_to: float | None = None
    # Nodes whose slot boundary passed before they had a renewal to checkpoint (a ready
    # lease written just before its boundary): looked at again each tick until written.
    _pending: set[str] = field(default_factory=set)

    def grace(self) -> float:
        """How long nothing expires after a reconnect or takeover."""
        return max(2 * self.timings.heartbeat_interval, self.timings.reconnect_grace)

    def disconnected(self, at: float) -> None:
        """The monitor lost the bus: the silence it cannot hear is not the nodes'."""
        if self.outage_since is None:
            self.outage_since = at

    def reconnected(self, at: float) -> None:
        """The bus is back: every node gets the grace to reconnect and be heard."""
        # A node last heard before the monitor lost the bus is one that returns.
        self.recovery_since = self.outage_since if self.outage_since is not None else at
        self.outage_since = None
        self.not_before = max(self.not_before, at + self.grace())

    def _recovering(self, old: Lease | None, at: float, since: float) -> None:
        """A heartbeat during a recovery's grace: if its node had not been heard
        since the recovery began, the agents are still coming back, so the grace
        runs on until ``grace()`` passes with no node returning.

        The grace alone assumes agents are limited by their reconnect backoff.
        Thousands reconnecting at once after a server restart are limited by
        TLS handshakes instead (one server, or one bench process, completes a
        few hundred a second), and a herd can take far longer than the backoff:
        a fixed grace then ends with most of the cluster still queued for a
        handshake and declares it lost. Each node extends the grace at most
        once per recovery, so a dead node never extends it, and the extension
        lasts as long as the herd, plus one grace.
        """
        if at >= self.not_before:
            self.recovery_since = None  # the grace ended: the ordinary countdowns run
        elif old is None or old.last_renew < since:
            self.not_before = max(self.not_before, at + self.grace())

    def load(self, leases: dict[str, Lease], at: float) -> None:
        """Continue from stored leases after a restart: countdowns resume where they were.

        A stored lease is a checkpoint: its ``last_renew`` is never newer than
        the node's last heartbeat, and older by at most ``checkpoint_interval``
        plus a tick for a ready node (exact for a suspect or lost one, written
        with its transition). The shell then applies the latest heartbeat it
        heard of each node while standing by, which makes those exact.

        Heartbeats sent while no monitor listened are gone, and a takeover may
        follow a bus outage the agents are still reconnecting from, so live
        nodes get the grace (``grace()``: at least two heartbeat intervals and
        the agents' worst reconnect time) to be heard again before anything
        expires: a live node heartbeats within it, whatever its stored age, so
        no live node is declared lost. A node that died meanwhile is declared
        lost right after that grace, its countdown not restarted, and never
        later than its true countdown would end (a stored renewal is never
        newer than the true one).
        """
        self.stored_renew = {n: lease.last_renew for n, lease in leases.items()}
        merged = dict(leases)
        # A monitor that acted before (it stepped down when it could not renew its
        # leadership, and leads again) heard renewals the checkpoints do not have yet:
        # they are facts whoever judged meanwhile, so they are kept, as a heard heartbeat is.
        for node, mine in self.leases.items():
            st = merged.get(node)
            if (
                st is not None
                and st.state == LeaseState.READY
                and st.boot_id == mine.boot_id
                and mine.last_seq > st.last_seq
                and mine.last_renew > st.last_renew
            ):
                merged[node] = msgspec.structs.replace(
                    st, last_seq=mine.last_seq, last_renew=mine.last_renew, boot_heartbeats=max(st.boot_heartbeats, mine.boot_heartbeats)
                )
        self.leases = merged
        # Checkpoints resume at each node's next slot, not all at once.
        self.written_at = {n: at for n in leases}
        self._scanned_to, self._pending = None, set()
        self.dirty = {}
        self.not_before = at + self.grace()
        # A node the monitor (or its standby self) heard within a suspect window of
        # the takeover is present; one known only from an older checkpoint returns.
        self.recovery_since = at - self.timings.suspect_after

    def _refuse(self, node: str, reason: str, detail: str) -> None:
        if self.on_refuse is not None:
            self.on_refuse(node, reason, detail)

    def _boot_change(self, node: str, old: Lease, boot: str, at: float) -> str:
        """A heartbeat from ``boot`` while the lease holds ``old.boot_id``: "new" (an
        agent restart), "return" (a boot id the lease already left) or "clone"
        (returns ``CLONE_RETURNS`` times within the window: two agents)."""
        horizon = at - CLONE_WINDOW * self.timings.heartbeat_interval
        heard = {b: t for b, t in self.boots.get(node, {}).items() if t >= horizon}
        heard[old.boot_id] = max(heard.get(old.boot_id, 0.0), old.last_renew)
        returns = [t for t in self.returns.get(node, []) if t >= horizon]
        kind = "new"
        if boot in heard:
            returns.append(at)
            kind = "clone" if len(returns) >= CLONE_RETURNS else "return"
        heard[boot] = at
        self.boots[node], self.returns[node] = heard, returns
        return kind

    def heartbeat(self, hb: Heartbeat, at: float) -> Transition | None:
        node = hb.node_id
        old = self.leases.get(node)
        if self.recovery_since is not None:
            self._recovering(old, at, self.recovery_since)
        if old is None:
            self.boots[node], self.returns[node] = {hb.boot_id: at}, []
            self.checkpoint_phase(node)  # in the phase order from now on
            self._pending.add(node)  # never written: due at once (see due_writes)
            lease = Lease(node_id=node, state=LeaseState.READY, boot_id=hb.boot_id, last_seq=hb.seq, last_renew=at, since=at, boot_since=at, boot_heartbeats=1)
            self.leases[node] = lease
            return Transition(node, "", EventWhat.READY, lease, f"first heartbeat (boot {hb.boot_id[:8]})")
        if old.quarantine and old.state != LeaseState.LOST:
            # Either agent keeps the node's lease alive (nothing is torn down for
            # a lost node); which one is real is the operator's call.
            lease = msgspec.structs.replace(old, state=LeaseState.READY, last_renew=at, since=at if old.state != LeaseState.READY else old.since)
            self.leases[node] = lease
            if old.state != LeaseState.READY:
                return Transition(node, EventWhat(old.state), EventWhat.READY, lease, "heartbeats resumed (still quarantined)")
            return None
        if old.state == LeaseState.LOST and hb.boot_id != old.boot_id:
            self._boot_change(node, old, hb.boot_id, at)
            lease = Lease(
                node_id=node,
                state=LeaseState.READY,
                boot_id=hb.boot_id,
                last_seq=hb.seq,
                last_renew=at,
                since=at,
                boot_since=at,
                boot_heartbeats=1,
                quarantine=old.quarantine,
            )
            self.leases[node] = lease
            return Transition(node, EventWhat.LOST, EventWhat.READY, lease, f"agent restarted (boot {hb.boot_id[:8]})")
        if hb.boot_id == old.boot_id:
            if hb.seq <= old.last_seq:
                return None  # duplicate or reordered heartbeat: it proves nothing newer
            limit = old.last_seq + SEQ_SLACK + int(max(0.0, at - old.last_renew) / self.timings.heartbeat_interval * SEQ_SLACK_PER_INTERVAL)
            if hb.seq > limit:
                self._refuse(node, "seq_jump", f"heartbeat seq {hb.seq} jumps from {old.last_seq} (at most {limit} plausible); refused")
                return None
        state_changes = old.state != LeaseState.READY
        detail = ""
        if hb.boot_id != old.boot_id:
            detail = f"agent restarted (boot {hb.boot_id[:8]})"
            kind = self._boot_change(node, old, hb.boot_id, at)
            if kind == "return":
                self._refuse(node, "superseded_boot", f"heartbeat from boot {hb.boot_id[:8]}, which the lease already left for {old.boot_id[:8]}; ignored")
                return None
            if kind == "clone":
                boots = sorted({old.boot_id, hb.boot_id})
                why = (
                    f"{node}: two agents with one identity — boot ids {' and '.join(b[:8] for b in boots)} heartbeat in alternation; "
                    f"quarantined until an operator resolves it (llmgw ctl node release {node})"
                )
                lease = msgspec.structs.replace(old, state=LeaseState.READY, last_renew=at, quarantine=why, since=at if state_changes else old.since)
                self.leases[node] = lease
                return Transition(node, EventWhat(old.state), EventWhat.QUARANTINED, lease, why)
            self.unstored(node, "boot")
        lease = msgspec.structs.replace(
            old,
            state=LeaseState.READY,
            boot_id=hb.boot_id,
            last_seq=hb.seq,
            last_renew=at,
            since=at if state_changes else old.since,
            boot_since=at if hb.boot_id != old.boot_id else old.boot_since,
            boot_heartbeats=1 if hb.boot_id != old.boot_id else min(old.boot_heartbeats + 1, MAX_COUNTED),
        )
        self.leases[node] = lease
        if lease.boot_heartbeats == BOOT_SETTLED_HEARTBEATS and not state_changes:
            self.unstored(node, "boot")  # the scheduler may trust this incarnation's reports now
        if state_changes:
            if not detail and old.state == LeaseState.LOST:
                detail = f"heartbeats resumed (same agent, boot {hb.boot_id[:8]}); its stale engines are fenced"
            return Transition(node, EventWhat(old.state), EventWhat.READY, lease, detail or "heartbeats resumed")
        return None

    def release(self, node: str, at: float) -> Transition | None:
        """An operator resolved a quarantine: the node's agents start afresh.

        The boot id the lease holds keeps it; if two agents still answer, the
        alternation is seen again and the node is quarantined again.
        """
        old = self.leases.get(node)
        if old is None or not old.quarantine:
            return None
        self.boots[node], self.returns[node] = {old.boot_id: at}, []
        lease = msgspec.structs.replace(old, quarantine="", boot_since=at, boot_heartbeats=0)
        self.leases[node] = lease
        return Transition(node, EventWhat.QUARANTINED, EventWhat.RELEASED, lease, f"quarantine lifted by an operator (boot {old.boot_id[:8]} holds the lease)")

    def expire(self, at: float) -> list[Transition]:
        """Leases whose heartbeats stopped: ready → suspect → lost."""
        out: list[Transition] = []
        if at < self.not_before or self.outage_since is not None:
            return out  # a grace, or the monitor cannot hear: see the module docstring
        self.recovery_since = None
        t = self.timings
        # Every tick walks every lease: kept to one comparison for a node heard lately
        # (nearly all of them), the changes applied after the walk. The microsecond keeps
        # float rounding from skipping a node the exact test below would judge.
        heard_since = at - t.suspect_after + 1e-6
        for node, lease in self.leases.items():
            if lease.last_renew > heard_since or lease.state == LeaseState.LOST:
                continue
            silent = at - lease.last_renew
            if silent >= t.node_lost_after:
                new = msgspec.structs.replace(lease, state=LeaseState.LOST, since=at)
                out.append(Transition(node, EventWhat(lease.state), EventWhat.LOST, new, f"no heartbeat for {silent:.1f}s"))
            elif silent >= t.suspect_after and lease.state == LeaseState.READY:
                new = msgspec.structs.replace(lease, state=LeaseState.SUSPECT, since=at)
                out.append(Transition(node, EventWhat.READY, EventWhat.SUSPECT, new, f"{int(silent / t.heartbeat_interval)} heartbeats missed"))
        for tr in out:
            self.leases[tr.node_id] = tr.lease
        return out

    def checkpoint_phase(self, node: str) -> float:
        """Where in each checkpoint interval ``node``'s checkpoint falls: a hash of
        its id, so the same node keeps its phase across monitors and restarts, and
        a cluster's checkpoints spread evenly however its nodes started."""
        phase = self._phases.get(node)
        if phase is None:
            phase = self._phases[node] = zlib.crc32(node.encode()) / 2**32 * self.timings.checkpoint_interval
            i = bisect.bisect_right(self._phase_order, phase)
            self._phase_order.insert(i, phase)
            self._phase_nodes.insert(i, node)
        return phase

    def _slot(self, node: str, at: float) -> int:
        return math.floor((at - self.checkpoint_phase(node)) / self.timings.checkpoint_interval)

    def due_writes(self, at: float) -> list[tuple[Lease, str]]:
        """Leases to write now, each with its cause: the ones marked ``dirty``
        (a boot write, or a write that failed), and checkpoints.

        A lease is checkpointed when its node's slot boundary (its phase plus a
        multiple of ``checkpoint_interval``) has passed since it was last
        written and it was renewed since: one write per node per interval
        instead of one per heartbeat (at 10,000 nodes and 5 s heartbeats, 50
        writes/s instead of the 1,314/s that writing whenever the stored renewal
        lagged by an interval cost). A suspect or lost lease renews nothing and
        is not checkpointed.

        Only the nodes that can be due are looked at (``_checkpoint_candidates``):
        those whose boundary fell since the last call, and those still waiting
        for a renewal after theirs. A tick used to walk every node, twice a slot
        computation each: at 2,000 nodes that was a tenth of the monitor's CPU
        in steady state, and it grows with the cluster, not with what is due.
        """
        out = [(self.leases[node], cause) for node, cause in self.dirty.items() if node in self.leases]
        for node in self._checkpoint_candidates(at):
            lease = self.leases.get(node)
            if lease is None or node in self.dirty:
                self._pending.discard(node)
                continue
            written = self.written_at.get(node)
            if written is not None and self._slot(node, at) == self._slot(node, written):
                self._pending.discard(node)  # written in this slot already
            elif lease.last_renew > self.stored_renew.get(node, -math.inf):
                self._pending.discard(node)
                out.append((lease, "checkpoint"))
            elif lease.state == LeaseState.READY:
                self._pending.add(node)  # its boundary passed before a renewal: the next one is due
            else:
                # Suspect or lost: its next renewal makes it ready, a transition written
                # at once, in this slot — nothing is left for a checkpoint.
                self._pending.discard(node)
        return out

    def _checkpoint_candidates(self, at: float) -> list[str]:
        """The pending nodes, and every node whose slot boundary lies in
        (the last call's ``at``, ``at``] — all nodes on the first call after
        construction or a ``load``, or when more than an interval passed. A
        superset of the nodes a checkpoint can be due for: ``due_writes``
        decides each by its slot, exactly as a walk over all of them would."""
        since, self._scanned_to = self._scanned_to, at if self._scanned_to is None else max(self._scanned_to, at)
        interval = self.timings.checkpoint_interval
        # Widened by a hair at both ends so that float rounding never drops a node (an
        # extra candidate is decided by its slot like any other).
        eps = 1e-6 * interval
        if since is None or at - since + 2 * eps >= interval:
            for node in self.leases:
                self.checkpoint_phase(node)  # leases given to the constructor are in the order too
            return list(self._phase_nodes)  # each once (the order holds each node once)
        if at <= since:
            return list(self._pending)
        # Boundaries p + k × interval in (since, at]: the phases on the arc of the
        # interval from ``since`` (modulo the interval) as long as the time passed.
        lo = since % interval - eps
        hi = lo + (at - since) + 2 * eps
        order, nodes = self._phase_order, self._phase_nodes
        found = nodes[bisect.bisect_left(order, lo) : bisect.bisect_right(order, hi)]
        if lo < 0:  # the arc begins before the interval's start: its end wraps to it
            found += nodes[bisect.bisect_left(order, lo + interval) :]
        if hi >= interval:  # the arc runs past the interval's end: the rest is at its start
            found += nodes[: bisect.bisect_right(order, hi - interval)]
        return list(dict.fromkeys([*self._pending, *found]))  # once each: a node is written once

    def unstored(self, node: str, cause: str) -> None:
        """``node``'s lease must be written at the next flush, for ``cause`` (a
        failed write keeps its cause; of several, the first in WRITE_CAUSES)."""
        if cause not in WRITE_CAUSES:
            raise ValueError(f"unknown lease write cause {cause!r} (one of {', '.join(WRITE_CAUSES)})")
        old = self.dirty.get(node)
        if old is None or WRITE_CAUSES.index(cause) < WRITE_CAUSES.index(old):
            self.dirty[node] = cause

    def stored(self, lease: Lease, at: float) -> None:
        """``lease`` was written to KV at ``at`` (the monitor's clock)."""
        self.stored_renew[lease.node_id] = lease.last_renew
        self.written_at[lease.node_id] = at
        if self.leases.get(lease.node_id) == lease:
            self.dirty.pop(lease.node_id, None)
