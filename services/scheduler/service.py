"""``llmgw scheduler``: the impure shell around the pure reconcile core.

It mirrors four buckets (nodes, leases, deployments, replicas) through KV
watches, folds agents' status reports into the replicas' member engine states,
runs ``reconcile`` when something changed (or every ``reconcile_interval``, for
timeouts), and applies the plan in the order ``plan.py`` prescribes. Only the
leader (``llmgw_leaders``) acts; a standby keeps its mirrors warm and takes
over where the records say the work stands, so a restart in the middle of a
rebuild neither duplicates nor loses a replica: every decision is re-derived
from the stored records, never from memory.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import msgspec
from nats.js.errors import NoKeysError
from prometheus_client import Counter, Gauge, Histogram

from llmgw.shared import subjects as S
from llmgw.shared.errors import BusError, ConfigError, LlmgwError, WireError
from llmgw.shared.kvmirror import KvMirror, open_bucket
from llmgw.shared.names import check_name
from llmgw.shared.schemas import (
    CommandAck,
    DeploymentSpec,
    EngineFact,
    Lease,
    NameRequest,
    NodeRecord,
    Replica,
    StatusReport,
    decode,
    encode,
    now,
    template_digest,
    to_builtins,
)

from ..runtime import ServiceRuntime, run_service
from . import ReconcileConfig, explain, fence, reconcile
from .reconcile import launches_for
from .plan import Launch, Plan, Stop
from .view import ClusterView, PortRange

RECONCILE_SECONDS = Histogram("llmgw_scheduler_reconcile_seconds", "Time to compute and apply one plan")
REPLICAS = Gauge("llmgw_scheduler_replicas", "Replicas, by state", ["state"])
COMMANDS = Counter("llmgw_scheduler_commands_total", "Commands sent to agents", ["verb", "result"])
STATUS = Counter("llmgw_scheduler_status_reports_total", "Agent status reports", ["result"])


class UnknownDeployment(LlmgwError):
    code = "unknown_deployment"


def validate_spec(spec: DeploymentSpec) -> DeploymentSpec:
    """Refuse what could never run, with the field named."""
    check_name(spec.name, "deployment name")
    if not spec.model:
        raise ConfigError("model: must not be empty")
    if spec.replicas < 0:
        raise ConfigError(f"replicas: must be 0 or more, got {spec.replicas}")
    if spec.nodes_per_replica < 1:
        raise ConfigError(f"nodes_per_replica: must be at least 1, got {spec.nodes_per_replica}")
    if spec.gpus_per_node < 0:
        raise ConfigError(f"gpus_per_node: must be 0 or more, got {spec.gpus_per_node}")
    if spec.startup_timeout <= 0:
        raise ConfigError(f"startup_timeout: must be positive, got {spec.startup_timeout}")
    for k in spec.env:
        if not k or "=" in k or not k.replace("_", "a").isalnum():
            raise ConfigError(f"env: {k!r} is not a valid environment variable name")
    return spec


class Scheduler(ServiceRuntime):
    role = "scheduler"
    buckets = (S.BUCKET_DEPLOYMENTS, S.BUCKET_REPLICAS, S.BUCKET_LEADERS)

    async def setup(self) -> None:
        sc = self.cfg.scheduler
        self.rconfig = ReconcileConfig(ports=PortRange(base=sc.port_base, count=sc.port_count))
        nodes_kv = await open_bucket(self.js, S.BUCKET_NODES, wait=3600, logger=self.log)
        leases_kv = await open_bucket(self.js, S.BUCKET_LEASES, wait=3600, logger=self.log)
        self.deployments_kv = self.kv[S.BUCKET_DEPLOYMENTS]
        self.replicas_kv = self.kv[S.BUCKET_REPLICAS]
        self.nodes = await KvMirror(nodes_kv, NodeRecord).start()
        self.leases = await KvMirror(leases_kv, Lease).start()
        self.deployments = await KvMirror(self.deployments_kv, DeploymentSpec).start()
        self.replicas = await KvMirror(self.replicas_kv, Replica).start()
        # node -> {(replica id, rank): fact}, from the agents' status reports
        self.reported: dict[str, dict[tuple[str, int], EngineFact]] = defaultdict(dict)
        self.full_report_at: dict[str, float] = {}
        self.absent: set[tuple[str, int]] = set()
        # replica id -> (when, record or None if deleted) for our own recent writes
        self.recent: dict[str, tuple[float, Replica | None]] = {}
        self._pruned_at = 0.0
        self.wake = asyncio.Event()
        self.acting = False
        for m in (self.nodes, self.deployments, self.replicas):
            m.listeners.append(lambda *_: self.wake.set())
        # Leases are rewritten on every renewal; only a change of state (or of
        # the agent's boot) can change a placement, so only that wakes us.
        self.leases.listeners.append(lambda _k, old, new: self.wake.set() if (old is None or new is None or (old.state, old.boot_id) != (new.state, new.boot_id)) else None)
        await self.nc.subscribe(S.ALL_STATUS, cb=self.on_status)
        await self.add_api({"apply": self.api_apply, "delete": self.api_delete, "explain": self.api_explain})
        self.lead(sc.leader_ttl)
        self.spawn(self.loop())

    # -- agent status ------------------------------------------------------------
    async def on_status(self, msg) -> None:
        report = self.node_message(msg, StatusReport, STATUS, "status")
        if report is None:
            return
        node = report.node_id
        STATUS.labels("accepted").inc()
        facts = {(f.replica_id, f.rank): f for f in report.engines}
        if report.full:
            self.reported[node] = facts
            self.full_report_at[node] = time.time()
        else:
            self.reported[node].update(facts)
        if self.leadership and self.leadership.is_leader:
            # Fence on every report, not only full ones: a node whose lease went
            # lost while its agent stayed connected keeps reporting its stale
            # engines, and those must stop too.
            await self._send_stops(fence({node: report.engines}, self.known_replicas({f.replica_id for f in report.engines})))
        self.wake.set()

    def known_replicas(self, ids: set[str]) -> dict[str, Replica]:
        """The records of ``ids`` (those a report names): the mirror's, or what this
        instance wrote and its watch has not echoed yet, whichever is newer.

        Without the second part an agent's "starting" report can beat our own
        record through the watch, and fencing would stop an engine we just launched.
        Only the named ids are looked up: a report per node per heartbeat must
        not copy the whole replica table.
        """
        now_ = time.time()
        if now_ - self._pruned_at > 1.0:  # once a second, not once a report
            self._pruned_at = now_
            for rid in [r for r, (at, _) in self.recent.items() if at < now_ - 30]:
                del self.recent[rid]
        known = {}
        for rid in ids:
            rep = self.replicas.items.get(rid)
            if rid in self.recent:
                mine = self.recent[rid][1]
                if mine is None:
                    rep = None
                elif rep is None or rep.generation <= mine.generation:
                    rep = mine
            if rep is not None:
                known[rid] = rep
        return known

    def _missing(self, node: str, rep: Replica) -> bool:
        """A full report from ``node``, taken well after the launch, lacks this engine.

        The grace covers a launch still in flight when the report was taken.
        """
        at = self.full_report_at.get(node)
        return at is not None and rep.created_at > 0 and at > rep.created_at + self.cfg.scheduler.command_timeout

    def _with_reports(self, replicas: dict[str, Replica]) -> dict[str, Replica]:
        """Replicas with members' engine states folded in from the latest reports."""
        out = {}
        for rid, rep in replicas.items():
            members = []
            changed = False
            for m in rep.members:
                fact = self.reported.get(m.node_id, {}).get((rid, m.rank))
                state, pid = m.engine_state, m.pid
                if fact is not None and fact.generation == rep.generation:
                    state, pid = fact.state, fact.pid
                elif (rid, m.rank) in self.absent or self._missing(m.node_id, rep):
                    state = "absent"
                if (state, pid) != (m.engine_state, m.pid):
                    changed = True
                    m = msgspec.structs.replace(m, engine_state=state, pid=pid)
                members.append(m)
            out[rid] = msgspec.structs.replace(rep, members=members) if changed else rep
        return out

    # -- the loop ----------------------------------------------------------------
    async def loop(self) -> None:
        interval = self.cfg.scheduler.reconcile_interval
        while True:
            try:
                await asyncio.wait_for(self.wake.wait(), interval)
            except asyncio.TimeoutError:
                pass
            self.wake.clear()
            leading = bool(self.leadership and self.leadership.is_leader)
            if leading and not self.acting:
                await self.take_over()
            self.acting = leading
            if not leading:
                continue
            try:
                with RECONCILE_SECONDS.time():
                    await self.reconcile_once()
            except Exception:
                self.log.exception("reconcile failed; retrying next cycle")

    async def take_over(self) -> None:
        """Become the acting scheduler: refresh what agents run, finish interrupted launches.

        Everything else is re-derived from the records by the next reconcile;
        only the commands a previous leader may not have sent need resending,
        and launches are idempotent on the agent, so resending is safe.
        """
        self.log.info("acting as the scheduler; asking %d nodes what they run", len(self.nodes.items))
        await asyncio.gather(*(self._ask_status(n) for n in self.nodes.items))
        resend = []
        for rep in self.replicas.items.values():
            spec = self.deployments.items.get(rep.deployment)
            if rep.state not in ("launching", "waiting-for-workers") or spec is None or not rep.members:
                continue
            if any(m.node_id not in self.nodes.items for m in rep.members):
                continue  # reconcile fails it
            if rep.spec_digest and rep.spec_digest != template_digest(spec):
                continue  # the spec changed since: reconcile retires it (case 7), and no member may start on the new one
            for launch in launches_for(spec, rep, self.nodes.items):
                if (rep.id, launch.member.rank) not in self.reported.get(launch.node_id, {}):
                    resend.append(launch)
        if resend:
            self.log.info("re-sending %d launches an earlier leader may not have sent", len(resend))
            await asyncio.gather(*(self._launch(l) for l in resend))

    async def _ask_status(self, node: str) -> None:
        try:
            reply = await self.nc.request(S.cmd_list(node), b"{}", timeout=self.cfg.scheduler.command_timeout)
            report = decode(reply.data, StatusReport)
        except Exception:
            return  # unreachable: its lease decides what happens to its replicas
        if report.node_id == node:
            self.reported[node] = {(f.replica_id, f.rank): f for f in report.engines}
            self.full_report_at[node] = time.time()

    async def reconcile_once(self) -> Plan:
        base = dict(self.replicas.items)
        current = self._with_reports(base)
        plan = reconcile(self.deployments.items, current, self.nodes.items, self.leases.items, now(), config=self.rconfig)
        # Engine-state changes that did not change a replica's state still go to KV,
        # so operators see pids and engine states.
        for rid, rep in current.items():
            if rep is not base[rid] and rid not in plan.writes and rid not in plan.deletes:
                plan.writes[rid] = rep
        if plan:
            await self.apply(plan)
        self._gauge()
        return plan

    async def apply(self, plan: Plan) -> None:
        # 1. generations first: a generation is never issued twice.
        for name, gen in plan.generations.items():
            spec = self.deployments.items.get(name)
            if spec is not None and spec.last_generation < gen:
                await self.deployments_kv.put(name, encode(msgspec.structs.replace(spec, last_generation=gen)))
        # 2. records.
        await asyncio.gather(*(self.replicas_kv.put(rid, encode(rep)) for rid, rep in plan.writes.items()))
        stamp = time.time()
        for rid, rep in plan.writes.items():
            self.recent[rid] = (stamp, rep)
        for rid in plan.deletes:
            self.recent[rid] = (stamp, None)
            try:
                await self.replicas_kv.purge(rid)
            except Exception as e:
                self.log.warning("could not delete replica %s: %s", rid, e)
            self.absent = {k for k in self.absent if k[0] != rid}
        # 3. commands, concurrently: a rebuild should not wait on one slow agent.
        await asyncio.gather(*(self._launch(l) for l in plan.launches), self._send_stops(plan.stops))
        # 4. history.
        for ev in plan.events:
            await self.events.emit(ev.kind, ev.subject, ev.what, ev.detail, at=ev.time, **ev.data)
            self.log.info("replica %s → %s %s", ev.subject, ev.what, ev.detail)
        for name, why in plan.pending.items():
            self.log.info("deployment %s: replica pending: %s", name, why)

    async def _launch(self, launch: Launch) -> None:
        key = (launch.replica_id, launch.member.rank)
        try:
            reply = await self.nc.request(S.cmd_launch(launch.node_id), encode(launch.command), timeout=self.cfg.scheduler.command_timeout)
            ack = decode(reply.data, CommandAck)
        except Exception as e:
            # No answer: the node may be dying. Its lease decides; the startup timeout backs it up.
            COMMANDS.labels("launch", "no_answer").inc()
            self.log.warning("launch of %s rank %d on %s: no answer (%s)", launch.replica_id, launch.member.rank, launch.node_id, e or type(e).__name__)
            return
        if ack.ok:
            COMMANDS.labels("launch", "ok").inc()
        else:
            COMMANDS.labels("launch", ack.code or "refused").inc()
            self.log.warning("launch of %s on %s refused: %s %s", launch.replica_id, launch.node_id, ack.code, ack.reason)
            self.absent.add(key)
            self.wake.set()

    async def _send_stops(self, stops: list[Stop]) -> None:
        async def one(stop: Stop):
            try:
                reply = await self.nc.request(S.cmd_stop(stop.node_id), encode(stop.command), timeout=self.cfg.scheduler.command_timeout)
                ack = decode(reply.data, CommandAck)
                COMMANDS.labels("stop", "ok" if ack.ok else ack.code or "refused").inc()
                self.log.info("stop %s on %s: %s", stop.replica_id, stop.node_id, stop.reason)
            except Exception as e:
                COMMANDS.labels("stop", "no_answer").inc()
                self.log.warning("stop of %s on %s: no answer (%s)", stop.replica_id, stop.node_id, e or type(e).__name__)

        await asyncio.gather(*(one(s) for s in stops))

    def _gauge(self) -> None:
        counts: dict[str, int] = defaultdict(int)
        for rep in self.replicas.items.values():
            counts[rep.state] += 1
        for state in ("pending", "launching", "waiting-for-workers", "ready", "failed", "reaping"):
            REPLICAS.labels(state).set(counts.get(state, 0))

    # -- operator API ----------------------------------------------------------------
    async def api_apply(self, data: bytes) -> DeploymentSpec:
        spec = validate_spec(decode(data, DeploymentSpec))
        old = self.deployments.items.get(spec.name)
        floor = old.last_generation if old else await self._deleted_generation(spec.name)
        stored = msgspec.structs.replace(spec, applied_at=now(), last_generation=max(spec.last_generation, floor))
        await self.deployments_kv.put(spec.name, encode(stored))
        shape = f"{spec.replicas} × {spec.nodes_per_replica} node(s) × {spec.gpus_per_node} GPU(s) of {spec.model} on {spec.engine}"
        if old is not None and template_digest(old) != template_digest(stored):
            shape += "; the engine template changed: replicas are replaced as new ones become ready"
        await self.events.emit("deployment", spec.name, "applied", shape)
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
                    last = max(last, decode(entry.value, DeploymentSpec).last_generation)
                except WireError:
                    continue  # a malformed old revision says nothing about generations
        return last

    async def api_delete(self, data: bytes) -> DeploymentSpec:
        req = decode(data, NameRequest)
        spec = self.deployments.items.get(req.name)
        if spec is None:
            raise UnknownDeployment(f"no deployment named {req.name!r}")
        await self.deployments_kv.delete(req.name)
        await self.events.emit("deployment", req.name, "deleted", "its replicas are stopped and reaped")
        self.wake.set()
        return spec

    async def api_explain(self, data: bytes):
        req = decode(data, NameRequest)
        spec = self.deployments.items.get(req.name)
        if spec is None:
            raise UnknownDeployment(f"no deployment named {req.name!r}")
        view = ClusterView.build(self.nodes.items, self.leases.items, self.replicas.items.values(), ports=self.rconfig.ports)
        return to_builtins(explain(spec, view))

    async def stop(self) -> None:
        for m in ("nodes", "leases", "deployments", "replicas"):
            mirror = getattr(self, m, None)
            if mirror is not None:
                await mirror.stop()
        await super().stop()


def main(args) -> int:
    return run_service(Scheduler, args)
