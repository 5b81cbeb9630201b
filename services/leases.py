"""The health monitor's pure core: heartbeats in, lease transitions out.

Times are the monitor's own clock, passed in; the agents' clocks never matter.

    ready ──(no heartbeat for suspect_after_missed × interval)──▶ suspect
    suspect ──(heartbeat)──▶ ready
    ready/suspect ──(no heartbeat for node_lost_after)──▶ lost
    lost ──(heartbeat with a NEW boot id: the agent restarted)──▶ ready

A lost node is sticky: heartbeats from the same agent incarnation (a healed
partition) do not bring it back, because the scheduler has already failed and
replaced its replicas; it rejoins when its agent restarts, which also fences
(stops) whatever stale engines it still runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from llmgw.shared.schemas import Heartbeat, Lease


@dataclass(frozen=True)
class Timings:
    heartbeat_interval: float
    suspect_after_missed: int
    node_lost_after: float

    @property
    def suspect_after(self) -> float:
        return self.heartbeat_interval * self.suspect_after_missed


@dataclass(frozen=True)
class Transition:
    node_id: str
    old: str  # "" for a node seen for the first time
    new: str
    lease: Lease
    detail: str


@dataclass
class LeaseBook:
    timings: Timings
    leases: dict[str, Lease] = field(default_factory=dict)
    # When each lease was last written to KV, to bound write traffic (see ``due_writes``).
    stored_renew: dict[str, float] = field(default_factory=dict)
    # No lease expires before this time (see ``load``).
    not_before: float = 0.0

    def load(self, leases: dict[str, Lease], at: float) -> None:
        """Continue from stored leases after a restart: countdowns resume where they were.

        Heartbeats sent while no monitor listened are gone, so live nodes get
        two heartbeat intervals to be heard again before anything expires; a
        node that died meanwhile is declared lost right after that grace, its
        countdown not restarted.
        """
        self.leases = dict(leases)
        self.stored_renew = {n: l.last_renew for n, l in leases.items()}
        self.not_before = at + 2 * self.timings.heartbeat_interval

    def heartbeat(self, hb: Heartbeat, at: float) -> Transition | None:
        old = self.leases.get(hb.node_id)
        if old is None:
            lease = Lease(node_id=hb.node_id, state="ready", boot_id=hb.boot_id, last_seq=hb.seq, last_renew=at, since=at)
            self.leases[hb.node_id] = lease
            return Transition(hb.node_id, "", "ready", lease, f"first heartbeat (boot {hb.boot_id[:8]})")
        if old.state == "lost":
            if hb.boot_id == old.boot_id:
                return None  # sticky: see the module docstring
            lease = Lease(node_id=hb.node_id, state="ready", boot_id=hb.boot_id, last_seq=hb.seq, last_renew=at, since=at)
            self.leases[hb.node_id] = lease
            return Transition(hb.node_id, "lost", "ready", lease, f"agent restarted (boot {hb.boot_id[:8]})")
        if hb.boot_id == old.boot_id and hb.seq <= old.last_seq:
            return None  # duplicate or reordered heartbeat: it proves nothing newer
        state_changes = old.state != "ready"
        detail = ""
        if hb.boot_id != old.boot_id:
            detail = f"agent restarted (boot {hb.boot_id[:8]})"
        lease = msgspec.structs.replace(
            old,
            state="ready",
            boot_id=hb.boot_id,
            last_seq=hb.seq,
            last_renew=at,
            since=at if state_changes else old.since,
        )
        self.leases[hb.node_id] = lease
        if state_changes:
            return Transition(hb.node_id, old.state, "ready", lease, detail or "heartbeats resumed")
        return None

    def expire(self, at: float) -> list[Transition]:
        """Leases whose heartbeats stopped: ready → suspect → lost."""
        out: list[Transition] = []
        if at < self.not_before:
            return out
        t = self.timings
        for node, lease in list(self.leases.items()):
            if lease.state == "lost":
                continue
            silent = at - lease.last_renew
            if silent >= t.node_lost_after:
                new = msgspec.structs.replace(lease, state="lost", since=at)
                self.leases[node] = new
                out.append(Transition(node, lease.state, "lost", new, f"no heartbeat for {silent:.1f}s"))
            elif silent >= t.suspect_after and lease.state == "ready":
                new = msgspec.structs.replace(lease, state="suspect", since=at)
                self.leases[node] = new
                out.append(Transition(node, "ready", "suspect", new, f"{int(silent / t.heartbeat_interval)} heartbeats missed"))
        return out

    def due_writes(self, at: float) -> list[Lease]:
        """Leases whose stored renew time lags by a heartbeat interval or more.

        Writing every heartbeat of every node would cost 400 KV writes/s at
        2,000 nodes; writing when the stored time lags by one interval keeps a
        restarted monitor's countdowns within one heartbeat of the truth and
        skips the writes of heartbeats that come early. Measured at 2,000 nodes
        (bench/control_plane.py): about two writes for three heartbeats, since
        a heartbeat that comes a little late lags by a full interval at once.
        """
        out = []
        for node, lease in self.leases.items():
            if lease.state != "lost" and lease.last_renew - self.stored_renew.get(node, 0.0) >= self.timings.heartbeat_interval:
                out.append(lease)
        return out

    def stored(self, lease: Lease) -> None:
        self.stored_renew[lease.node_id] = lease.last_renew
