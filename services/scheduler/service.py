"""``llmgw scheduler``: the impure shell around the pure reconcile core.

It mirrors four buckets (nodes, leases, deployments, replicas) through KV
watches, folds agents' status reports into the replicas' member engine states,
reconciles when something changed (or every ``reconcile_interval``, for
timeouts) — an incremental step (``incremental.Reconciler``: the plan
``reconcile`` would give, for the work of what changed), and a full one every
``scheduler.full_pass_interval`` as the safety net — and applies the plan in the order
``plan.py`` prescribes. Wakes coalesce: however many reports arrive during a
step, one step follows. A lease renewal that keeps the state wakes nothing. It keeps
the per-node failure history auto-cordon judges (in memory: a new leader
starts it afresh) and asks the registry to cordon. Only the
leader (``llmgw_leaders``) acts; a standby keeps its mirrors warm and takes
over where the records say the work stands, so a restart in the middle of a
rebuild neither duplicates nor loses a replica: every decision is re-derived
from the stored records, never from memory.

What a node reports is bounded and attributed (a node is not trusted); the fold itself is
pure (``reports.ReportBook``, time passed in). ``reported`` keeps,
per node, the engines a replica record names plus at most
``MAX_UNKNOWN_PER_NODE`` others (kept for fencing; more are dropped and
counted), so one node cannot grow the scheduler's memory. A report is believed
only from the agent incarnation (boot id) that holds the node's lease, and not
at all while the health monitor has the node quarantined (two agents answer
for it); and a full report marks missing engines ``absent`` only once its boot
id has held the lease for ``BOOT_SETTLED_HEARTBEATS`` heartbeats, so a clone's
empty report cannot tear down replicas in the moment before the alternation
is seen. When a lease changes hands (a new boot id) or a quarantine is
lifted, the scheduler asks the node for its full list again.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections import defaultdict
from collections.abc import Mapping

import msgspec
from nats.errors import NoRespondersError
from nats.js.errors import NoKeysError

from llmgw.shared import api
from llmgw.shared import buckets as B
from llmgw.shared import subjects as S
from llmgw.shared.bus import EVENT_MAX_AGE
from llmgw.shared.errors import BusError, LlmgwError, WireError
from llmgw.shared.events import event_id
from llmgw.shared.kvmirror import KvMirror, open_bucket
from llmgw.shared.schemas import (
    BackoffState,
    CommandAck,
    DeploymentSpec,
    ExplainedMember,
    ExplainedReplica,
    ExplainReply,
    Lease,
    NameRequest,
    NodeRecord,
    NodeRequest,
    PlacementShape,
    Replica,
    StatusReport,
    decode_reply,
    encode,
    now,
    template_digest,
)
from llmgw.shared.specs import is_outdated, validate_spec
from llmgw.shared.states import BOOT_SETTLED_HEARTBEATS, REPLICA_ORDER, AdminBy, AdminState, EngineState, EventKind, EventWhat, LeaseState, ReplicaState
from llmgw.shared.tasks import cancel_and_wait

from ..runtime import ServiceRuntime, Turn, run_service
from . import ReconcileConfig, explain, fence
from .cycle import backoff_text, launches_for, remember_failures
from .fullpass import FullPass, Snapshot
from .incremental import Reconciler
from .metrics import (
    ACTING,
    AUTO_CORDONS,
    BACKING_OFF,
    COMMANDS,
    FULL_PASS_SECONDS,
    FULL_PASSES,
    MEMBERS,
    RECONCILE_SECONDS,
    RECONCILE_WORK,
    RECONCILES,
    REPLICAS,
    STATUS,
    STATUS_UNMOVED,
    TRUNCATED,
    RebuildClock,
)
from .plan import Backoff, Cordon, Launch, NodeFailure, Plan, Stop
from .reports import ReportBook, report_moves
from .view import ClusterView

# The periodic safety net, a full step (the view rebuilt from every record, every
# replica and deployment looked at), runs every ``scheduler.full_pass_interval``
# (60 s); between them each wake and each reconcile_interval tick is an
# incremental step (``incremental.py``).
SLOW_FULL_PASS = 0.5  # seconds: a full pass this long is logged
# Replica records written at once while applying a plan (each launch follows its
# own record's write, so the first launches need not wait for the last write).
APPLY_CONCURRENCY = 512
# How long a cordon asked of the registry is assumed to be on its way (so the
# breaker counts it) before its record shows it.
CORDON_GRACE = 10.0
# How long our own write of a deployment record outranks the mirror's copy.
OWN_WRITE_GRACE = 5.0
# Engines no replica record names, kept per node (for fencing); more are dropped.
MAX_UNKNOWN_PER_NODE = 256


class UnknownDeployment(LlmgwError):
    code = "unknown_deployment"


class Scheduler(ServiceRuntime):
    role = "scheduler"

    async def setup(self) -> None:
        sc = self.cfg.scheduler
        self.rconfig = ReconcileConfig.from_section(sc)
        nodes_kv = await open_bucket(self.js, S.BUCKET_NODES, wait=3600, logger=self.log)
        leases_kv = await open_bucket(self.js, S.BUCKET_LEASES, wait=3600, logger=self.log)
        self.deployments_kv = self.kv[S.BUCKET_DEPLOYMENTS]
        self.replicas_kv = self.kv[S.BUCKET_REPLICAS]
        self.nodes = await KvMirror(nodes_kv, B.NODES).start()
        self.leases = await KvMirror(leases_kv, B.LEASES).start()
        self.deployments = await KvMirror(self.deployments_kv, B.DEPLOYMENTS).start()
        self.replicas = await KvMirror(self.replicas_kv, B.REPLICAS).start()
        # What agents reported, and our own recent writes (the pure fold: reports.py)
        self.book = ReportBook(
            self.replicas.items,
            self.leases.items,
            max_unknown=MAX_UNKNOWN_PER_NODE,
            settle_heartbeats=BOOT_SETTLED_HEARTBEATS,
            launch_grace=sc.command_timeout,
        )
        # node -> {(replica id, rank): fact}: the book's, mutated in place, never replaced
        self.reported = self.book.reported
        # node -> replica failures that implicated it (auto-cordon's evidence)
        self.node_failures: dict[str, list[NodeFailure]] = {}
        # node -> (when asked, the acting health monitor's lease or None): see _heard
        self.heard_asked: dict[str, tuple[float, Lease | None]] = {}
        # node -> (when asked, reason): cordons asked of the registry, not yet in its record
        self.cordoning: dict[str, tuple[float, str]] = {}
        # deployment -> (when, record) of our own writes the watch has not echoed yet
        self.spec_writes: dict[str, tuple[float, DeploymentSpec]] = {}
        # commands sent from handlers, which must never wait on a node
        self.background: set[asyncio.Task] = set()
        self.stops_in_flight: set[tuple[str, str, int]] = set()
        self.rebuilds = RebuildClock()  # the rebuild and apply-to-ready metrics
        self.reconciler = Reconciler(self.rconfig)
        self._full_at = float("-inf")  # monotonic time the last full pass started
        self.full_pass_interval = sc.full_pass_interval
        # The periodic full pass runs beside the loop (fullpass.py); ``epoch`` counts
        # the plans applied and takeovers, which outdate a pass's snapshot.
        self.full_pass = FullPass(self.rconfig, self.log)
        self.epoch = 0
        # replica ids whose records changed since their outbox was last looked at
        self.outbox_dirty: set[str] = set()
        # ids of outbox events (Replica.pending_events) known to be in the stream
        self.published: set[str] = set()
        ACTING.add(self)
        self.started_at = now()
        self.wake = asyncio.Event()
        for m in (self.nodes, self.deployments, self.replicas):
            m.listeners.append(lambda *_: self.wake.set())
        self.replicas.listeners.append(lambda key, _old, _new: self.outbox_dirty.add(key))
        # node -> ids of the replica records with a member on it: which members a
        # node's full report must name for it to move nothing (``report_moves``)
        self.members_on: dict[str, set[str]] = defaultdict(set)
        for rid, rep in self.replicas.items.items():
            self._index_members(rid, None, rep)
        self.replicas.listeners.append(self._index_members)
        # A lease is rewritten for checkpoints and boot changes too; only a change of
        # state (or of the agent's boot, or a quarantine) can change a placement, so
        # only that wakes us.
        self.leases.listeners.append(
            lambda _k, old, new: (
                self.wake.set()
                if (old is None or new is None or (old.state, old.boot_id, old.quarantine) != (new.state, new.boot_id, new.quarantine))
                else None
            )
        )
        self.leases.listeners.append(self._on_lease)
        # The nodes whose record or lease changed since the last step: the step compares
        # only those (``Reconciler.step``'s ``touched``). ``walk_all``: compare every node
        # instead, once, where the reconciler's last inputs were not the last step's.
        self.touched: set[str] = set()
        self.walk_all = True
        self.nodes.listeners.append(lambda key, _old, _new: self.touched.add(key))
        self.leases.listeners.append(lambda key, _old, _new: self.touched.add(key))
        await self.nc.subscribe(S.ALL_STATUS, cb=self.on_status)
        await self.add_api({api.APPLY: self.api_apply, api.DELETE: self.api_delete, api.EXPLAIN: self.api_explain})
        self.lead(sc.leader_ttl)
        self.spawn(self.loop())

    # -- agent status ------------------------------------------------------------
    def _on_lease(self, node: str, old: Lease | None, new: Lease | None) -> None:
        """A lease changed hands (new boot id), left quarantine or returned from lost
        (same boot id: a partition healed, or an agent slow to reconnect after a bus
        outage): ask the node what it runs, and fence it (``_take_report``)."""
        if new is None or new.quarantine or not (self.leadership and self.leadership.is_leader):
            return
        returned = old is not None and old.state == LeaseState.LOST and new.state != LeaseState.LOST
        if old is not None and old.boot_id == new.boot_id and not old.quarantine and not returned:
            return
        if old is None and self.book.full_report_boot.get(node) == new.boot_id:
            return
        self._background(self._ask_status(node))

    async def on_status(self, msg) -> None:
        report = self.node_message(msg, StatusReport, STATUS, "status")
        if report is None:
            return
        node = report.node_id
        why = self.book.distrust(node, report.boot_id)
        if why:
            STATUS.labels(why).inc()
            self.log.debug("status from %s (boot %s) ignored: %s", node, report.boot_id[:8], why)
            return
        STATUS.labels("accepted").inc()
        before = self.book.reported.get(node)  # replaced by the fold, never changed in place
        self._take_report(report)
        if report_moves(before, self.book.reported.get(node, {}), self._held(node) if report.full else (), full=report.full):
            self.wake.set()
        else:
            STATUS_UNMOVED.inc()

    def _held(self, node: str) -> list[tuple[str, int, int]]:
        """Every member on ``node`` of a replica record: (replica id, rank, generation)."""
        out: list[tuple[str, int, int]] = []
        for rid in self.members_on.get(node, ()):
            rep = self.replicas.items.get(rid)
            if rep is not None:
                out.extend((rid, m.rank, rep.generation) for m in rep.members if m.node_id == node)
        return out

    def _index_members(self, rid: str, old: Replica | None, new: Replica | None) -> None:
        for m in old.members if old is not None else ():
            held = self.members_on.get(m.node_id)
            if held is not None:
                held.discard(rid)
                if not held:
                    del self.members_on[m.node_id]
        for m in new.members if new is not None else ():
            self.members_on[m.node_id].add(rid)

    def _take_report(self, report: StatusReport) -> None:
        """Fold a believed report into ``reported`` and fence what it shows (leader only)."""
        node = report.node_id
        stamp = time.time()
        engines, dropped = self.book.take(report, stamp)
        if dropped:
            TRUNCATED.inc(dropped)
            self.log.warning("status from %s: %d engines no replica names dropped (at most %d kept per node)", node, dropped, MAX_UNKNOWN_PER_NODE)
        if self.leadership and self.leadership.is_leader:
            # Fence on every report, not only full ones: a node whose lease went
            # lost while its agent stayed connected keeps reporting its stale
            # engines, and those must stop too. Sent in the background: this
            # handler serves every node's reports and must not wait on one node.
            # Only what was kept is fenced: at most MAX_UNKNOWN_PER_NODE stops.
            stops = fence({node: engines}, self.book.known_replicas({f.replica_id for f in engines}, stamp))
            stops = [st for st in stops if (st.node_id, st.replica_id, st.generation) not in self.stops_in_flight]
            if stops:
                self.stops_in_flight.update((st.node_id, st.replica_id, st.generation) for st in stops)
                self._background(
                    self._send_stops(stops), done=lambda: self.stops_in_flight.difference_update((st.node_id, st.replica_id, st.generation) for st in stops)
                )

    def _background(self, coro, done=None) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.background.add(task)

        def finished(t: asyncio.Task) -> None:
            self.background.discard(t)
            if done is not None:
                done()

        task.add_done_callback(finished)
        return task

    # -- the loop ----------------------------------------------------------------
    async def loop(self) -> None:
        interval = self.cfg.scheduler.reconcile_interval
        while True:
            try:
                await asyncio.wait_for(self.wake.wait(), interval)
            except TimeoutError:
                pass
            self.wake.clear()
            if await self.follow_leadership(self.take_over) == Turn.STANDING_BY:
                continue
            try:
                with RECONCILE_SECONDS.time():
                    await self.reconcile_once()
            except Exception:
                self.walk_all = True  # the step may have taken the changes without keeping them
                self.log.exception("reconcile failed; retrying next cycle")

    async def take_over(self) -> None:
        """Become the acting scheduler: refresh what agents run, finish interrupted launches.

        Everything else is re-derived from the records by the next reconcile;
        only the commands a previous leader may not have sent need resending,
        and launches are idempotent on the agent, so resending is safe.
        """
        self.log.info("acting as the scheduler; asking %d nodes what they run", len(self.nodes.items))
        self.reconciler.reset()  # its first step as leader is a full one
        self.epoch += 1  # and a full pass left from an earlier term is dropped
        sent = await self.flush_outbox(everything=True)
        if sent:
            self.log.info("published %d events a previous leader wrote into replica records but did not publish", sent)
        await asyncio.gather(*(self._ask_status(n) for n in self.nodes.items))
        resend = []
        for rep in self.replicas.items.values():
            spec = self.deployments.items.get(rep.deployment)
            if rep.state not in (ReplicaState.LAUNCHING, ReplicaState.WAITING) or spec is None or not rep.members:
                continue
            if any(m.node_id not in self.nodes.items for m in rep.members):
                continue  # reconcile fails it
            if is_outdated(rep, template_digest(spec)):
                continue  # the spec changed since: reconcile retires it (case 7), and no member may start on the new one
            for launch in launches_for(spec, rep, self.nodes.items):
                if not self.book.has(launch.node_id, rep.id, launch.member.rank):
                    resend.append(launch)
        if resend:
            self.log.info("re-sending %d launches an earlier leader may not have sent", len(resend))
            await asyncio.gather(*(self._launch(launch) for launch in resend))

    async def _ask_status(self, node: str) -> None:
        try:
            reply = await self.nc.request(S.cmd_list(node), b"{}", timeout=self.cfg.scheduler.command_timeout)
        except Exception:
            return  # unreachable: its lease decides what happens to its replicas
        try:
            report = decode_reply(reply.data, StatusReport)
        except WireError as e:
            COMMANDS.labels("list", "malformed").inc()
            self.log.warning("%s answered the engine list with something unreadable: %s", node, e)
            return
        if isinstance(report, CommandAck):  # there, and said no: not "unreachable"
            COMMANDS.labels("list", report.code or "refused").inc()
            self.log.warning("%s refused to list its engines: %s %s", node, report.code, report.reason)
            return
        if report.node_id == node and report.full and not self.book.distrust(node, report.boot_id):
            self._take_report(report)  # fenced too: the agent's own connect-time report may have been another boot's
            self.wake.set()

    def _deployments(self) -> dict[str, DeploymentSpec]:
        """The mirror's deployments, with our own recent writes (backoff, generation)
        where the watch has not echoed them yet and the operator has not re-applied."""
        stamp = time.time()
        out = dict(self.deployments.items)
        for name, (at, mine) in list(self.spec_writes.items()):
            seen = out.get(name)
            if stamp - at > OWN_WRITE_GRACE or seen is None or seen == mine or seen.applied_at != mine.applied_at:
                del self.spec_writes[name]
            else:
                out[name] = mine
        return out

    def _nodes(self) -> dict[str, NodeRecord]:
        """Node records, with the cordons we asked for and the registry has not written yet."""
        stamp = time.time()
        out = self.nodes.items
        for node, (at, reason) in list(self.cordoning.items()):
            rec = out.get(node)
            if rec is None or rec.admin != AdminState.ACTIVE or stamp - at > CORDON_GRACE:
                del self.cordoning[node]
                continue
            if out is self.nodes.items:
                out = dict(out)
            out[node] = msgspec.structs.replace(rec, admin=AdminState.CORDONED, admin_by=AdminBy.AUTO, admin_reason=reason)
        return out

    async def _heard(self, leases: dict[str, Lease]) -> dict[str, Lease]:
        """``leases``, with the exact last renewal of each node a peer reported lost
        whose stored renewal predates the report.

        Placement avoids such a node until it is heard from again (the case-3
        suspicion, ``peer_lost_suspects``). The bucket holds a ready lease's
        renewals only as checkpoints (``services/health/leases.py``), minutes apart, so
        only the acting health monitor knows whether the node has heartbeated
        since: it is asked (``llmgw.api.health.lease``), at most once a heartbeat
        interval per node. Without an answer the stored lease stands and the node
        stays avoided — the safe side, until its next checkpoint.
        """
        due: dict[str, Lease] = {}
        for fs in self.node_failures.values():
            for f in fs:
                lease = leases.get(f.node_id)
                if f.kind == EngineState.PEER_LOST and lease is not None and lease.state == LeaseState.READY and lease.last_renew <= f.time:
                    due[f.node_id] = lease
        for node in [n for n in self.heard_asked if n not in due]:
            del self.heard_asked[node]
        if not due:
            return leases
        stamp = time.monotonic()
        ask = [n for n in due if stamp - self.heard_asked.get(n, (float("-inf"), None))[0] >= self.cfg.health.heartbeat_interval]
        for node, answer in zip(ask, await asyncio.gather(*(self._ask_lease(n) for n in ask)), strict=True):
            self.heard_asked[node] = (stamp, answer)
        out = leases
        for node, stored in due.items():
            answer = self.heard_asked.get(node, (0.0, None))[1]
            if answer is not None and answer.boot_id == stored.boot_id and answer.last_renew > stored.last_renew:
                if out is leases:
                    out = dict(leases)
                out[node] = msgspec.structs.replace(stored, last_renew=answer.last_renew)
        return out

    async def _ask_lease(self, node: str) -> Lease | None:
        try:
            return await api.call(self.nc, api.LEASE, NodeRequest(node_id=node), timeout=min(0.5, self.cfg.scheduler.command_timeout))
        except LlmgwError:
            return None  # no answer, a standby's refusal, or no lease: ask again next interval

    async def reconcile_once(self) -> Plan:
        if self.full_pass.ended:
            outcome = self.full_pass.collect(self.epoch)
            if outcome is None:
                FULL_PASSES.labels("dropped").inc()
                self._full_at = float("-inf")  # again, at once: it is still due
            else:
                # The full pass's plan is this cycle's; the next step (woken at once)
                # catches up with what changed since its snapshot.
                FULL_PASSES.labels("adopted").inc()
                self._slow_full_pass(outcome.took, len(outcome.snapshot.replicas), len(outcome.snapshot.nodes), "beside the loop")
                self.reconciler = outcome.reconciler
                self.walk_all = True  # it last saw the snapshot: changes since were taken by steps of the one it replaces
                self.wake.set()
                snap = outcome.snapshot
                return await self._conclude(outcome.plan, snap.base, snap.replicas, full=True)
        base = dict(self.replicas.items)
        current = self.book.with_reports(base)
        due = time.monotonic() - self._full_at >= self.full_pass_interval
        # On the loop: a reconciler with nothing to step from (takeover, a plan not
        # applied in full), or a pass dropped too often while the cluster kept changing.
        full = self.reconciler.fresh or (due and self.full_pass.must_run_on_loop)
        heard = await self._heard(self.leases.items)
        touched = self._take_touched()  # after the last await, before _nodes() drops ended cordons
        deployments, nodes = self._deployments(), self._nodes()
        if full:
            self._full_at = time.monotonic()
            self.full_pass.ran_on_loop()
            FULL_PASSES.labels("on_loop").inc()
        elif due and not self.full_pass.running:
            self._full_at = time.monotonic()
            snapshot = Snapshot.copy(deployments, base, current, nodes, heard, now(), self.node_failures)
            self.full_pass.start(snapshot, self.epoch, self.wake.set)
        started = time.monotonic()
        plan = self.reconciler.step(deployments, current, nodes, heard, now(), failures=self.node_failures, full=full, touched=touched)
        if full:
            self._slow_full_pass(time.monotonic() - started, len(current), len(nodes), "on the loop")
        return await self._conclude(plan, base, current, full=full)

    def _take_touched(self) -> set[str] | None:
        """The nodes to compare this step (None: all of them), and start collecting anew.
        A node with a cordon asked for is in it every step: ``_nodes`` gives it a new
        record each time until the registry's own arrives (or the ask ends)."""
        touched, self.touched = self.touched, set()
        if self.walk_all:
            self.walk_all = False
            return None
        touched.update(self.cordoning)
        return touched

    def _slow_full_pass(self, took: float, replicas: int, nodes: int, where: str) -> None:
        FULL_PASS_SECONDS.set(took)
        if took >= SLOW_FULL_PASS:
            # On the loop, nothing is heard while it runs: a lease going lost
            # meanwhile waits for it. Said, so a slow failover can be put down to it.
            self.log.info("full reconcile pass (the periodic safety net) took %.2fs %s: %d replicas, %d nodes", took, where, replicas, nodes)

    async def _conclude(self, plan: Plan, base: Mapping[str, Replica], current: Mapping[str, Replica], *, full: bool) -> Plan:
        """Apply a step's plan (the loop's, or an adopted full pass's) and do what follows it."""
        RECONCILES.labels("full" if full else "incremental").inc()
        RECONCILE_WORK.labels("replicas_advanced").inc(self.reconciler.advanced)
        RECONCILE_WORK.labels("deployments_converged").inc(self.reconciler.converged)
        # Engine-state changes that did not change a replica's state still go to KV,
        # so operators see pids and engine states.
        for rid, rep in current.items():
            if rep is not base[rid] and rid not in plan.writes and rid not in plan.deletes:
                plan.writes[rid] = rep
        if plan:
            # A full pass running beside the loop saw the records before this plan:
            # it is dropped when it ends (fullpass.py).
            self.epoch += 1
            try:
                await self.apply(plan)
            except BaseException:
                # Some of it may not have been written: what the reconciler keeps
                # assumed it was. Its next step starts from the records again.
                self.reconciler.reset()
                raise
            self.rebuilds.events(plan.events)
        await self.flush_outbox(everything=full)
        self.rebuilds.deployments(self.deployments.items, self.replicas.items.values(), self.started_at)
        if plan or full:  # engine states and replica states move only with a plan's writes
            self._gauge()
        if full:
            # Tens of thousands of records and the live view are long-lived: collect
            # once (frozen ones too), then keep what survived out of the collector's
            # scans until the next full pass. At 10,000 nodes the scans were a third
            # of the CPU of placing 4,000 replicas; this costs ~0.2 s a minute.
            gc.unfreeze()
            gc.collect()
            gc.freeze()
        return plan

    async def apply(self, plan: Plan) -> None:
        # 1. generations (and backoffs) first: a generation is never issued twice.
        await self._write_specs(plan)
        # 2. records, each carrying its transition's events (the outbox): a crash
        # between a record and its events loses none (``flush_outbox``). A deleted
        # record cannot carry them: its events go out before the delete (a later
        # leader re-derives the delete and re-publishes them under the same id).
        outbox: dict[str, list] = defaultdict(list)
        for ev in plan.events:
            if ev.kind == EventKind.REPLICA:
                outbox[ev.subject].append(ev)
        writes = {rid: msgspec.structs.replace(rep, pending_events=outbox.get(rid, [])) for rid, rep in plan.writes.items()}
        launched = await self._write_records(writes, plan.launches)
        published = await self._delete_records(plan.deletes, outbox)
        # 3b. the launches of records not written here (none today), and the stops,
        # concurrently: a rebuild should not wait on one slow agent.
        orphans = [launch for launch in plan.launches if launch.replica_id not in writes]
        await asyncio.gather(*launched, *(self._launch(launch) for launch in orphans), self._send_stops(plan.stops))
        # 4. history (a replica's events are in its record already), in order, a
        # window at a time: thousands of transitions need not take a round trip each.
        unpublished = [ev for ev in plan.events if id(ev) not in published]
        for i in range(0, len(unpublished), APPLY_CONCURRENCY):
            await asyncio.gather(*(self._publish(ev) for ev in unpublished[i : i + APPLY_CONCURRENCY]))
        for ev in plan.events:
            self.log.info("replica %s → %s %s", ev.subject, ev.what, ev.detail)
        for name, why in plan.pending.items():
            self.log.info("deployment %s: replica pending: %s", name, why)
        # 5. what auto-cordon judges next time, and the cordons it decided.
        self.node_failures = remember_failures(self.node_failures, plan, now(), self.rconfig.auto_cordon_window)
        for c in plan.cordons:
            self.cordoning[c.node_id] = (time.time(), c.reason)
            self._background(self._cordon(c))
        AUTO_CORDONS.labels("withheld").inc(sum(1 for e in plan.events if e.what == EventWhat.AUTO_CORDON_WITHHELD))

    async def _write_specs(self, plan: Plan) -> None:
        """Apply step 1: each deployment's new generation counter and backoff."""
        specs = self._deployments()
        for name in sorted(set(plan.generations) | set(plan.backoffs)):
            spec = specs.get(name)
            if spec is None:
                continue
            new = spec
            gen = plan.generations.get(name, 0)
            if spec.last_generation < gen:
                new = msgspec.structs.replace(new, last_generation=gen)
            b: Backoff | None = plan.backoffs.get(name)
            if b is not None:
                new = msgspec.structs.replace(new, failures=b.failures, retry_at=b.retry_at, last_failure=b.last_failure)
            if new != spec:
                await self.deployments_kv.put(name, encode(new))
                self.spec_writes[name] = (time.time(), new)

    async def _write_records(self, writes: dict[str, Replica], plan_launches: list[Launch]) -> list[asyncio.Task]:
        """Apply step 3a: each placed replica's launches follow its own record's write,
        not the last of thousands: no engine starts that no record accounts for, and
        the first launches go out while later records are still being written.
        Returns the launches under way; raises when a record could not be written
        (once the launches of those that were have been sent)."""
        launches: dict[str, list[Launch]] = defaultdict(list)
        for launch in plan_launches:
            launches[launch.replica_id].append(launch)
        room = asyncio.Semaphore(APPLY_CONCURRENCY)
        launched: list[asyncio.Task] = []

        async def write(rid: str, rep: Replica) -> None:
            async with room:
                await self.replicas_kv.put(rid, encode(rep))
            self.book.wrote(rid, rep, time.time())
            launched.extend(asyncio.create_task(self._launch(launch)) for launch in launches.get(rid, ()))

        results = await asyncio.gather(*(write(rid, rep) for rid, rep in writes.items()), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            await asyncio.gather(*launched)  # those whose records were written are launched
            self.write_failed("replica records", failed)
            raise failed
        return launched

    async def _delete_records(self, deletes: list[str], outbox: Mapping[str, list]) -> set[int]:
        """Publish the events of the records a plan deletes, then delete them;
        returns the ``id()`` of each event published."""
        stamp = time.time()
        published: set[int] = set()
        for rid in deletes:
            for ev in outbox.get(rid, []):
                await self._publish(ev)
                published.add(id(ev))
        for rid in deletes:
            self.book.wrote(rid, None, stamp)
            try:
                await self.replicas_kv.purge(rid)
            except Exception as e:
                self.log.warning("could not delete replica %s: %s", rid, e)
            self.book.forget(rid)
        return published

    async def _publish(self, ev) -> None:
        """Publish one event under its id; a replica's, once stored, leaves the outbox."""
        msg_id = event_id(ev)
        if await self.events.publish(ev, msg_id=msg_id) and ev.kind == EventKind.REPLICA:
            self.published.add(msg_id)

    async def flush_outbox(self, everything: bool = True) -> int:
        """Publish the events the replica records hold and the stream lacks: those of
        a previous leader that died between a record and its events, or of our own
        apply that failed half-way. Each is published once, under its id; one we
        do not know about is first looked up (the newest event on its subject).
        ``everything`` False: only the records changed since the last look (the
        others' events were looked at then). Returns how many were published."""
        if everything:
            ids = list(self.replicas.items)
        else:
            ids = [rid for rid in self.outbox_dirty if rid in self.replicas.items]
        self.outbox_dirty.clear()
        pending = {}
        for rid in ids:
            for ev in self.replicas.items[rid].pending_events:
                pending[event_id(ev)] = ev
        if everything:
            self.published &= set(pending)  # forget what no record holds any more
        horizon = now() - EVENT_MAX_AGE + 3600  # older ones may have aged out of the stream
        sent = 0
        for msg_id, ev in pending.items():
            if msg_id in self.published or ev.time < horizon:
                continue
            try:
                if await self.events.stored(ev, msg_id):
                    self.published.add(msg_id)
                    continue
            except Exception as e:
                self.write_failed(f"outbox look-up of {msg_id}", e)
                return sent  # the stream is away: next cycle
            await self._publish(ev)
            if msg_id in self.published:
                sent += 1
                self.log.info("outbox: event %s %s of replica %s published (its record was written, the event was not)", ev.what, ev.detail, ev.subject)
        return sent

    async def _cordon(self, c: Cordon) -> None:
        """Ask the registry (the single writer of node records) to cordon; it records and announces it."""
        try:
            await api.call(self.nc, api.CORDON, NodeRequest(node_id=c.node_id, reason=c.reason, auto=True), timeout=self.cfg.scheduler.command_timeout)
        except api.ApiFailed as e:
            AUTO_CORDONS.labels("refused").inc()
            self.cordoning.pop(c.node_id, None)
            self.log.warning("auto-cordon of %s refused by the registry: %s", c.node_id, e)
            return
        except LlmgwError as e:  # no answer, or one that is not a node record
            AUTO_CORDONS.labels("no_answer").inc()
            self.cordoning.pop(c.node_id, None)
            self.log.warning("auto-cordon of %s: the registry did not answer (%s); its failures start afresh", c.node_id, e)
            return
        AUTO_CORDONS.labels("cordoned").inc()
        self.log.warning("node %s auto-cordoned: %s", c.node_id, c.reason)

    async def _launch(self, launch: Launch) -> None:
        key = (launch.replica_id, launch.member.rank)
        try:
            reply = await self._request_launch(launch)
        except Exception as e:
            # No answer: the node may be dying. Its lease decides; the startup timeout backs it up.
            COMMANDS.labels("launch", "no_answer").inc()
            self.log.warning("launch of %s rank %d on %s: no answer (%s)", launch.replica_id, launch.member.rank, launch.node_id, e or type(e).__name__)
            return
        try:
            ack = decode_reply(reply.data, CommandAck)
        except WireError as e:
            # An answer, unreadable: whether the engine started, the agent's status
            # report says; the startup timeout backs it up, as for no answer.
            COMMANDS.labels("launch", "malformed").inc()
            self.log.warning("launch of %s rank %d on %s: the agent's answer is unreadable (%s)", launch.replica_id, launch.member.rank, launch.node_id, e)
            return
        if ack.ok:
            COMMANDS.labels("launch", "ok").inc()
        else:
            COMMANDS.labels("launch", ack.code or "refused").inc()
            self.log.warning("launch of %s on %s refused: %s %s", launch.replica_id, launch.node_id, ack.code, ack.reason)
            self.book.refused(*key)
            self.wake.set()

    async def _request_launch(self, launch: Launch):
        """The launch request, sent again on "no responders" (a few times, backing off).

        "No responders" is not "no answer": the agent's subscription is missing
        right now — it is reconnecting, or the server is re-registering
        subscriptions after a configuration reload (a node onboarded or revoked),
        which takes ~100 ms. A launch lost that way was never re-sent and left the
        replica launching until its startup timeout. Launches are idempotent on
        the agent, so re-sending is safe.
        """
        subject, data = S.cmd_launch(launch.node_id), encode(launch.command)
        for delay in (0.2, 0.5, 1.0):
            try:
                return await self.nc.request(subject, data, timeout=self.cfg.scheduler.command_timeout)
            except NoRespondersError:
                COMMANDS.labels("launch", "no_responders_retry").inc()
                await asyncio.sleep(delay)
        return await self.nc.request(subject, data, timeout=self.cfg.scheduler.command_timeout)

    async def _send_stops(self, stops: list[Stop]) -> None:
        async def one(stop: Stop):
            try:
                reply = await self.nc.request(S.cmd_stop(stop.node_id), encode(stop.command), timeout=self.cfg.scheduler.command_timeout)
            except Exception as e:
                COMMANDS.labels("stop", "no_answer").inc()
                self.log.warning("stop of %s on %s: no answer (%s)", stop.replica_id, stop.node_id, e or type(e).__name__)
                return
            try:
                ack = decode_reply(reply.data, CommandAck)
            except WireError as e:
                COMMANDS.labels("stop", "malformed").inc()
                self.log.warning("stop of %s on %s: the agent's answer is unreadable (%s)", stop.replica_id, stop.node_id, e)
                return
            COMMANDS.labels("stop", "ok" if ack.ok else ack.code or "refused").inc()
            self.log.info("stop %s on %s: %s", stop.replica_id, stop.node_id, stop.reason)

        await asyncio.gather(*(one(s) for s in stops))

    def _gauge(self) -> None:
        counts: dict[str, int] = defaultdict(int)
        engines: dict[str, int] = defaultdict(int)
        for rep in self.replicas.items.values():
            counts[rep.state] += 1
            for m in rep.members:
                engines[m.engine_state] += 1
        for state in REPLICA_ORDER:
            if state != ReplicaState.GONE:
                REPLICAS.labels(state).set(counts.get(state, 0))
        for engine_state in EngineState:
            MEMBERS.labels(engine_state.value or "unreported").set(engines.get(engine_state, 0))
        stamp = now()
        BACKING_OFF.set(sum(1 for d in self.deployments.items.values() if d.retry_at > stamp))

    # -- operator API ----------------------------------------------------------------
    async def api_apply(self, request: DeploymentSpec) -> DeploymentSpec:
        spec = validate_spec(request)
        old = self.deployments.items.get(spec.name)
        floor = old.last_generation if old else await self._deleted_generation(spec.name)
        # Applying again is also how an operator says "try now": the backoff is the scheduler's, and starts afresh.
        stored = msgspec.structs.replace(spec, applied_at=now(), last_generation=max(spec.last_generation, floor), failures=0, retry_at=0.0, last_failure="")
        await self.deployments_kv.put(spec.name, encode(stored))
        shape = f"{spec.replicas} × {spec.nodes_per_replica} node(s) × {spec.gpus_per_node} GPU(s) of {spec.model} on {spec.engine}"
        if spec.spares:
            shape += f", and {spec.spares} warm spare(s)"
        if old is not None and template_digest(old) != template_digest(stored):
            shape += "; the engine template changed: replicas are replaced as new ones become ready"
        await self.events.emit(EventKind.DEPLOYMENT, spec.name, EventWhat.APPLIED, shape)
        self.wake.set()
        return stored

    async def _deleted_generation(self, name: str) -> int:
        """The last generation a deleted deployment of this name issued, from the
        bucket's history (it keeps 5 revisions; the delete is the newest).

        Without it a re-created deployment would issue ``<name>-g1`` again, and a
        node that was away during the delete could still run the old ``-g1``'s
        engine: its report would match the new record's id and generation, and
        fencing would let the stale engine stand in for the new replica.
        """
        try:
            entries = await self.deployments_kv.history(name)
        except NoKeysError:
            return 0  # never existed
        except Exception as e:
            raise BusError(f"cannot read the history of deployment {name!r} to continue its generations ({e or type(e).__name__}); try again") from None
        last = 0
        for entry in entries:
            if entry.value:
                try:
                    last = max(last, B.DEPLOYMENTS.decode(entry.value).last_generation)
                except WireError:
                    continue  # a malformed old revision says nothing about generations
        return last

    async def api_delete(self, req: NameRequest) -> DeploymentSpec:
        spec = self.deployments.items.get(req.name)
        if spec is None:
            raise UnknownDeployment(f"no deployment named {req.name!r}")
        await self.deployments_kv.delete(req.name)
        await self.events.emit(EventKind.DEPLOYMENT, req.name, EventWhat.DELETED, "its replicas are stopped and reaped")
        self.wake.set()
        return spec

    async def api_explain(self, req: NameRequest) -> ExplainReply:
        spec = self.deployments.items.get(req.name)
        if spec is None:
            raise UnknownDeployment(f"no deployment named {req.name!r}")
        view = ClusterView.build(self.nodes.items, self.leases.items, self.replicas.items.values(), ports=self.rconfig.ports)
        return explain_reply(spec, view, self.replicas.items.values(), now())

    async def stop(self) -> None:
        await cancel_and_wait(list(getattr(self, "background", ())))
        if getattr(self, "full_pass", None) is not None:
            await self.full_pass.stop()
        for m in ("nodes", "leases", "deployments", "replicas"):
            mirror = getattr(self, m, None)
            if mirror is not None:
                await mirror.stop()
        await super().stop()


def explain_reply(spec: DeploymentSpec, view: ClusterView, replicas, at: float) -> ExplainReply:
    """``explain``: where the next replica would go, node by node, plus what an
    operator needs besides — the crash-loop backoff and the replicas as they
    stand (a degraded or failing one with its members' engine details)."""
    ex = explain(spec, view)
    backing_off = spec.retry_at > at
    return ExplainReply(
        deployment=ex.deployment,
        request=PlacementShape(deployment=ex.request.deployment, gpus_per_node=ex.request.gpus_per_node, nodes_per_replica=ex.request.nodes_per_replica),
        nodes=ex.nodes,
        fabrics=ex.fabrics,
        placeable=ex.placeable,
        fabric=ex.fabric,
        leader=ex.leader,
        summary=ex.summary,
        backoff=BackoffState(
            failures=spec.failures,
            last_failure=spec.last_failure,
            retry_at=spec.retry_at,
            active=backing_off,
            message=backoff_text(Backoff(spec.failures, spec.retry_at, spec.last_failure)) if backing_off else "",
        ),
        replicas=[
            ExplainedReplica(
                id=r.id,
                state=r.state,
                reason=r.reason,
                members=[ExplainedMember(node=m.node_id, rank=m.rank, engine_state=m.engine_state, engine_detail=m.engine_detail) for m in r.members],
            )
            for r in sorted(replicas, key=lambda r: r.generation)
            if r.deployment == spec.name
        ],
    )


def main(args) -> int:
    return run_service(Scheduler, args)
