"""``llmgw health``: the single writer of node leases (``llmgw_leases``).

Heartbeats come in on ``llmgw.node.*.heartbeat``; the pure ``LeaseBook`` turns
them and the passage of time into transitions; this shell stores leases and
publishes each transition as an event. The countdowns live in memory: a lease
is written on a transition at once, on a boot change at the next tick, and its renewals only as
a staggered checkpoint (``leases.py``, "What is written to KV"), so a quiet
cluster costs a few writes a second, not one per heartbeat.

Several monitors may run: one leads (``llmgw_leaders``), the others stand by,
keeping a live copy of the stored leases (``KvMirror``) and the latest
heartbeat of each node, and on taking over continue from both.

It also judges what heartbeats claim (``leases.py``): a sequence jump is
refused and counted, and two agents heartbeating for one identity quarantine
the node until an operator calls ``release`` (``llmgw ctl node release``).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import Counter as Tally

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from llmgw.shared import api
from llmgw.shared import buckets as B
from llmgw.shared import subjects as S
from llmgw.shared.errors import LlmgwError
from llmgw.shared.kvmirror import KvMirror
from llmgw.shared.names import is_valid_name
from llmgw.shared.schemas import Heartbeat, Lease, NodeRequest, encode
from llmgw.shared.states import EventKind, LeaseState

from ..runtime import ServiceRuntime, Turn, run_service
from .leases import WRITE_CAUSES, LeaseBook, Timings, Transition

HEARTBEATS = Counter("llmgw_health_heartbeats_total", "Heartbeats received, by result", ["result"])
LEASES = Gauge("llmgw_health_leases", "Node leases, by state", ["state"])
TRANSITIONS = Counter("llmgw_health_transitions_total", "Lease transitions", ["to"])
QUARANTINED = Gauge("llmgw_health_quarantined_nodes", "Nodes quarantined: two agents heartbeat for one identity")
WRITE_SECONDS = Histogram(
    "llmgw_health_lease_write_seconds", "Time to store leases: one transition's lease, or one flush of checkpoints, boot writes and retries"
)
WRITE_ERRORS = Counter(
    "llmgw_health_lease_write_errors_total", "Lease writes the KV refused or that timed out (the lease stays in memory and is written again)"
)
WRITES = Counter(
    "llmgw_health_lease_writes_total",
    "Lease writes the KV acknowledged, by cause: transition (a state change), boot (a new or settled boot id), checkpoint (renewals)",
    ["cause"],
)
for _cause in WRITE_CAUSES:
    WRITES.labels(_cause)  # every cause reads 0 before its first write, not absent
# The one label every heartbeat counts under, looked up once (labels() takes a lock
# and builds a key per call: 400 times a second at 2,000 nodes, 2,000 at 10,000).
ACCEPTED = HEARTBEATS.labels("accepted")
_ACTING: weakref.WeakSet[HealthMonitor] = weakref.WeakSet()  # monitors whose leases the scrape reads


class _LeaseAges:
    """``llmgw_health_lease_age_seconds{node}``, read from the acting monitor's book
    when scraped: one series per node (a few thousand nodes are a few thousand
    series, as node_exporter has per machine), so an alert can name the node."""

    def describe(self):
        return []

    def collect(self):
        # From memory: exact, although KV holds renewals only as checkpoints.
        ages = GaugeMetricFamily(
            "llmgw_health_lease_age_seconds", "Seconds since the node's lease was last renewed by a heartbeat (acting monitor only)", labels=["node"]
        )
        stamp = time.time()
        # One acts (one book, no duplicate series): the acting one still on the bus, not
        # one that crashed or stopped in this process (tests, a restart in place).
        for monitor in [m for m in list(_ACTING) if m.acting and getattr(m, "nc", None) is not None and m.nc.is_connected][:1]:
            for node, lease in sorted(monitor.book.leases.items()):
                ages.add_metric([node], max(0.0, stamp - lease.last_renew))
        yield ages


REGISTRY.register(_LeaseAges())


class NotActing(LlmgwError):
    code = "not_acting"


class NotQuarantined(LlmgwError):
    code = "not_quarantined"


class UnknownLease(LlmgwError):
    code = "unknown_lease"


# Lease writes in flight at once (their acks awaited together).
WRITES_AT_ONCE = 256


class HealthMonitor(ServiceRuntime):
    role = "health"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.io_coalesce = cfg.health.io_coalesce

    async def setup(self) -> None:
        h = self.cfg.health
        self.book = LeaseBook(Timings(h.heartbeat_interval, h.suspect_after_missed, h.node_lost_after, self.cfg.reconnect_grace), on_refuse=self._refused)
        # Set while lease writes fail (no quorum, or the bus away): countdowns pause.
        self.write_blocked = False
        self.leases_kv = self.kv[S.BUCKET_LEASES]
        # The stored leases, kept current while standing by, so taking over needs no
        # bulk read (and none of nats-py's key listing, which can come back empty
        # from a bucket holding values).
        self.stored_leases: KvMirror[Lease] = await KvMirror(self.leases_kv, B.LEASES).start()
        self.heard: dict[str, tuple[Heartbeat, float]] = {}
        # Transitions heartbeats made, for transition_writer.
        self._unwritten: list[Transition] = []
        self._unwritten_added = asyncio.Event()
        _ACTING.add(self)
        self.lead(h.leader_ttl)
        await self.nc.subscribe(S.ALL_HEARTBEATS, cb=self.on_heartbeat)
        await self.add_api({api.RELEASE: self.api_release, api.LEASE: self.api_lease})
        self.spawn(self.tick_loop())
        self.spawn(self.transition_writer())

    async def _load(self) -> None:
        leases = await self._stored()
        self.book.load(leases, time.time())
        self.log.info("continuing from %d stored leases", len(leases))

    async def _stored(self) -> dict[str, Lease]:
        """Every stored lease, as the bucket holds it now.

        The warm copy, when it has seen the bucket's last write (the monitor
        never deletes a lease, so the newest revision it holds is the stream's
        last sequence). Otherwise — its watch broken by a server restart and not
        yet re-read — a fresh copy, which ``KvMirror.start`` returns only once it
        has seen every message the bucket held. A value that does not decode is
        logged by the mirror and left out: that node starts afresh.
        """
        last = (await self.js.stream_info(S.kv_stream(S.BUCKET_LEASES))).state.last_seq
        seen = max(self.stored_leases.revisions.values(), default=0)
        if seen >= last:
            return dict(self.stored_leases.items)
        self.log.info("the copy of the stored leases is behind the bucket (sequence %d of %d); reading it afresh", seen, last)
        fresh = await KvMirror(self.leases_kv, B.LEASES).start()
        try:
            return dict(fresh.items)
        finally:
            await fresh.stop()

    async def _take_over(self) -> None:
        """Continue from the stored leases and the heartbeats heard while standing by."""
        await self._load()
        heard, self.heard = self.heard, {}
        # Acting before the heard heartbeats are applied (follow_leadership would set
        # it only after): one arriving meanwhile goes to the book, not to ``heard``.
        self.acting = True
        transitions = [tr for hb, at in heard.values() if (tr := self.book.heartbeat(hb, at))]
        try:
            await self._apply(transitions)
        except Exception:
            pass  # counted and logged by _store; those leases are written again

    async def on_bus_disconnect(self) -> None:
        self.book.disconnected(time.time())
        self.log.warning("lost the bus: no node goes suspect or lost until it is back and %.1fs have passed", self.book.grace())

    async def on_bus_reconnect(self) -> None:
        self.book.reconnected(time.time())
        self.log.info("bus back: every node has %.1fs (health.reconnect_grace) to be heard before anything expires", self.book.grace())

    async def on_heartbeat(self, msg) -> None:
        hb = self.node_message(msg, Heartbeat, HEARTBEATS, "heartbeat")
        if hb is None:
            return
        if not self.acting:
            # Standing by (or not yet leading): remember the latest, so taking
            # over starts from what was heard instead of waiting a whole
            # interval for every node's next heartbeat.
            self.heard[hb.node_id] = (hb, time.time())
            return
        tr = self.book.heartbeat(hb, time.time())
        if self._refusing:
            self._refusing = False
        else:
            ACCEPTED.inc()
        if tr:
            # Written by transition_writer, never here: nats-py runs this
            # subscription's callbacks one at a time, so a write awaited here (a KV
            # without quorum answers only at its timeout) would leave every later
            # heartbeat queued unheard — and 10,000 nodes' first heartbeats would be
            # written one round trip after another.
            self._unwritten.append(tr)
            self._unwritten_added.set()
        # A boot change or a settled boot (book.dirty) goes out with the next tick's flush.

    _refusing = False

    async def transition_writer(self) -> None:
        """Write the heartbeats' transitions as they come, every node's at once."""
        while True:
            await self._unwritten_added.wait()
            self._unwritten_added.clear()
            batch, self._unwritten = self._unwritten, []
            try:
                await self._apply(batch)
            except Exception:
                pass  # counted and logged by _store; those leases are written again

    def _refused(self, node: str, reason: str, detail: str) -> None:
        HEARTBEATS.labels(reason).inc()
        self._refusing = True
        self.log.warning("heartbeat from %s refused: %s", node, detail)

    async def api_release(self, req: NodeRequest) -> Lease:
        """An operator resolved a quarantined node (stopped the impostor, or
        re-issued the node's certificate): its lease holds its last boot id again."""
        if not is_valid_name(req.node_id):
            raise NotQuarantined(f"node_id: {req.node_id!r} is not a node name")
        if not self.acting:
            raise NotActing("this health monitor is standing by; ask again (another instance acts)")
        tr = self.book.release(req.node_id, time.time())
        if tr is None:
            lease = self.book.leases.get(req.node_id)
            raise NotQuarantined(f"node {req.node_id} is not quarantined" if lease else f"no lease for node {req.node_id!r}")
        await self._apply([tr])
        return tr.lease

    async def api_lease(self, req: NodeRequest) -> Lease:
        """A node's lease as the acting monitor holds it: ``last_renew`` exact, where
        the stored one is a checkpoint (up to ``checkpoint_interval`` old). For
        whoever must know whether a node was heard since a given moment."""
        if not is_valid_name(req.node_id):
            raise UnknownLease(f"node_id: {req.node_id!r} is not a node name")
        if not self.acting:
            raise NotActing("this health monitor is standing by; ask again (another instance acts)")
        lease = self.book.leases.get(req.node_id)
        if lease is None:
            raise UnknownLease(f"no lease for node {req.node_id!r}: never heard")
        return lease

    async def tick_loop(self) -> None:
        h = self.cfg.health
        # Check often enough that "lost" is declared within a fraction of a heartbeat.
        period = min(h.heartbeat_interval / 4, 1.0)
        while True:
            await asyncio.sleep(period)
            try:
                # The round it takes over in judges nothing: the next tick does.
                if await self.follow_leadership(self._take_over) != Turn.ACTING:
                    continue
            except Exception as e:
                self.log.warning("taking over failed (%s); trying again at the next tick", e or type(e).__name__)
                continue
            try:
                if self.write_blocked:
                    # Writes failed: judge nothing until one succeeds (the outage rule).
                    # One write probes; the rest follow once it is acknowledged.
                    due = self.book.due_writes(time.time())
                    if due:
                        await self._store(*due[0])
                    await self._flush()
                    if not self.book.dirty:
                        self.write_blocked = False
                        self.book.reconnected(time.time())
                        self.log.info("lease writes work again: every node has %.1fs to be heard before anything expires", self.book.grace())
                    continue
                if self.book.outage_since is not None and not self.write_blocked and self.nc.is_connected:
                    self.book.reconnected(time.time())
                await self._apply(self.book.expire(time.time()))
                await self._flush()
            except Exception as e:
                self.log.warning("lease tick failed: %s", e or type(e).__name__)
            finally:
                if self._gauge_stale:
                    self._gauge()

    async def _apply(self, transitions: list[Transition]) -> None:
        """Write each transition's lease, then announce it: a node's transitions in
        order, up to WRITES_AT_ONCE nodes at once (10,000 first heartbeats are not
        10,000 round trips one after another). On a failed write the transitions
        not yet written wait for the next flush (no write each, which would wait
        out a timeout each), and the first failure is raised once all settled."""
        chains: dict[str, list[Transition]] = {}
        for tr in transitions:
            chains.setdefault(tr.node_id, []).append(tr)
        queue = list(chains.values())
        for i in range(0, len(queue), WRITES_AT_ONCE):
            results = await asyncio.gather(*(self._apply_node(chain) for chain in queue[i : i + WRITES_AT_ONCE]), return_exceptions=True)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                for chain in queue[i + WRITES_AT_ONCE :]:
                    for tr in chain:
                        self.book.unstored(tr.node_id, "transition")
                raise failed

    async def _apply_node(self, chain: list[Transition]) -> None:
        for i, tr in enumerate(chain):
            try:
                with WRITE_SECONDS.time():
                    await self._store(tr.lease, "transition")
            except Exception:
                for rest in chain[i + 1 :]:
                    self.book.unstored(rest.node_id, "transition")
                raise
            TRANSITIONS.labels(tr.new).inc()
            # The registry announces "joined"; the lease says "ready".
            self.log.info("node %s %s → %s (%s)", tr.node_id, tr.old or "new", tr.new, tr.detail)
            await self.events.emit(EventKind.NODE, tr.node_id, tr.new, tr.detail, at=tr.lease.since, previous=tr.old or "none")
            # Counted once per tick, not per transition: 10,000 first heartbeats
            # would otherwise count 10,000 leases each.
            self._gauge_stale = True

    async def _store(self, lease: Lease, cause: str) -> None:
        try:
            await self.leases_kv.put(lease.node_id, encode(lease))
        except Exception as e:
            WRITE_ERRORS.inc()
            self.write_failed(f"lease {lease.node_id}", e)
            # Written again once the bus takes writes; meanwhile nothing expires:
            # a monitor that cannot record a verdict does not reach new ones.
            self.book.unstored(lease.node_id, cause)
            if not self.write_blocked:
                self.write_blocked = True
                self.book.disconnected(time.time())
            raise
        WRITES.labels(cause).inc()
        self.book.stored(lease, time.time())

    async def _flush(self) -> None:
        due = self.book.due_writes(time.time())
        if not due:
            return
        with WRITE_SECONDS.time():
            # Bounded concurrency: acks are awaited in parallel, not one round trip each.
            for i in range(0, len(due), WRITES_AT_ONCE):
                await asyncio.gather(*(self._store(lease, cause) for lease, cause in due[i : i + WRITES_AT_ONCE]))

    async def stop(self) -> None:
        if getattr(self, "stored_leases", None) is not None:
            await self.stored_leases.stop()
        await super().stop()

    _gauge_stale = False

    def _gauge(self) -> None:
        self._gauge_stale = False
        # One walk over the leases, not one per state.
        states = Tally(lease.state for lease in self.book.leases.values())
        for state in LeaseState:
            LEASES.labels(state).set(states[state])
        QUARANTINED.set(sum(1 for lease in self.book.leases.values() if lease.quarantine))


def main(args) -> int:
    return run_service(HealthMonitor, args)
