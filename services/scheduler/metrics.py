"""The scheduler's Prometheus metrics (``llmgw_scheduler_*``), in the process-wide registry.

Counters and gauges the shell updates as it steps and applies; the capacity
collector (``llmgw_scheduler_nodes``, ``llmgw_scheduler_gpus``), which reads
the acting scheduler's live view when scraped rather than on every step; and
the rebuild clock, which times rebuilds and applies from a plan's events.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from llmgw.shared.schemas import now
from llmgw.shared.states import EngineState, EventKind, ReplicaState

from .cycle import SPEC_CHANGED
from .view import ClusterView

RECONCILE_SECONDS = Histogram("llmgw_scheduler_reconcile_seconds", "Time to compute and apply one plan")
RECONCILES = Counter("llmgw_scheduler_reconciles_total", "Reconcile steps, by kind (incremental: what changed; full: the periodic safety net)", ["kind"])
RECONCILE_WORK = Counter("llmgw_scheduler_reconcile_work_total", "Replicas advanced and deployments converged by reconcile steps", ["what"])
FULL_PASSES = Counter(
    "llmgw_scheduler_full_passes_total",
    "Full passes (the safety net), by outcome: adopted (computed beside the loop, nothing applied meanwhile), "
    "dropped (a plan was applied while it ran: it starts again), on_loop (at takeover, after a plan not applied in full, "
    "or after passes were dropped too often)",
    ["outcome"],
)
FULL_PASS_SECONDS = Gauge("llmgw_scheduler_full_pass_seconds", "Wall time of the last full pass (beside the loop: on its worker thread)")
REPLICAS = Gauge("llmgw_scheduler_replicas", "Replicas, by state", ["state"])
COMMANDS = Counter("llmgw_scheduler_commands_total", "Commands sent to agents", ["verb", "result"])
STATUS = Counter("llmgw_scheduler_status_reports_total", "Agent status reports", ["result"])
STATUS_UNMOVED = Counter(
    "llmgw_scheduler_status_reports_unmoved_total", "Accepted status reports that changed nothing a step reads: no step was woken for them"
)
MEMBERS = Gauge("llmgw_scheduler_member_engines", "Replica members, by the engine state their agent reported", ["engine_state"])
BACKING_OFF = Gauge("llmgw_scheduler_deployments_backing_off", "Deployments waiting out a crash-loop backoff")
AUTO_CORDONS = Counter("llmgw_scheduler_auto_cordons_total", "Auto-cordon decisions", ["result"])
TRUNCATED = Counter("llmgw_scheduler_status_facts_dropped_total", "Engine facts dropped from status reports: unknown engines over the per-node cap")
# Rebuilds. The reason label is one of REBUILD_REASONS, never free text.
REPLICA_FAILURES = Counter(
    "llmgw_scheduler_replica_failures_total",
    "Replicas failed or replaced, by deployment and why (a bounded word: see rebuild_reason)",
    ["deployment", "reason"],
)
REBUILD_BUCKETS = (1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600, 1200, 1800, 3600)
RESTARTS_IN_PLACE = Counter(
    "llmgw_scheduler_restarts_in_place_total",
    "Replicas relaunched on the same members after an engine exited on healthy nodes, by deployment",
    ["deployment"],
)
REBUILD_SECONDS = Histogram(
    "llmgw_scheduler_rebuild_seconds", "Time from a replica failing (or being replaced) to its replacement being ready", ["deployment"], buckets=REBUILD_BUCKETS
)
APPLY_TO_READY_SECONDS = Histogram(
    "llmgw_scheduler_apply_to_ready_seconds", "Time from a deployment's apply to all its replicas being ready", ["deployment"], buckets=REBUILD_BUCKETS
)
# The schedulers of this process that may be acting, read by the capacity collector when scraped.
ACTING: weakref.WeakSet[Any] = weakref.WeakSet()


class _Capacity:
    """``llmgw_scheduler_nodes{fabric, state, admin}`` and ``llmgw_scheduler_gpus{fabric, state}``
    (free, used, out_of_service), computed from the acting scheduler's copies when
    scraped, not on every reconcile. A node on no fabric counts under fabric=""."""

    def describe(self):
        return []

    def collect(self):
        nodes = GaugeMetricFamily(
            "llmgw_scheduler_nodes", "Nodes, by fabric, lease state (unknown: no lease) and admin state", labels=["fabric", "state", "admin"]
        )
        gpus = GaugeMetricFamily("llmgw_scheduler_gpus", "GPUs, by fabric and state (free, used, out_of_service)", labels=["fabric", "state"])
        # The acting one still on the bus: a scheduler that crashed or stopped in
        # this process (tests, a restart in place) must not answer for the live one.
        for sched in [s for s in list(ACTING) if s.acting and getattr(s, "nc", None) is not None and s.nc.is_connected][:1]:
            # The reconciler's live view, kept current by every step (a full build of
            # 10,000 nodes per scrape cost more than the steps themselves).
            live: ClusterView = sched.reconciler.view
            if sched.reconciler.fresh:
                live = ClusterView.build(sched.nodes.items, sched.leases.items, sched.replicas.items.values(), ports=sched.rconfig.ports)
            n: dict[tuple, int] = defaultdict(int)
            g: dict[tuple, int] = defaultdict(int)
            for v in list(live.nodes.values()):
                for fabric in list(v.fabrics) or [""]:
                    n[(fabric, v.lease or "unknown", v.admin)] += 1
                    free = v.free_gpu_count()
                    blocked = len(set(v.blocked) & set(v.gpus))
                    g[(fabric, "free")] += free
                    g[(fabric, "out_of_service")] += blocked
                    g[(fabric, "used")] += max(0, len(v.gpus) - free - blocked)
            for k, c in sorted(n.items()):
                nodes.add_metric(list(k), c)
            for k, c in sorted(g.items()):
                gpus.add_metric(list(k), c)
        yield nodes
        yield gpus


REGISTRY.register(_Capacity())
REBUILD_REASONS = ("node_lost", "hardware", "engine_exited", "peer_lost", "startup_timeout", "hang", "no_members", "spec_changed", "drained", "other")


def rebuild_reason(reason: str) -> str:
    """The bounded label for a replica's failure (or replacement) reason, from the
    fixed phrases the pure core (cycle.py) opens its reasons with."""
    first = reason.split("; ", 1)[0]
    if first.startswith("member rank "):  # "member rank 1 on node02 peer-lost: ..." / "... exited"
        return "peer_lost" if f" {EngineState.PEER_LOST}" in first.split(":", 1)[0] else "engine_exited"
    if first.startswith("not ready within "):
        return "startup_timeout"
    if first.startswith("leader on ") and " made no progress for " in first:
        return "hang"
    if first.startswith(("fabric ", "GPU ")):
        return "hardware"
    if first.startswith("node ") and first.endswith((" lost", " has no record")):
        return "node_lost"
    if first.startswith("node ") and first.endswith(" draining"):
        return "drained"
    if first == SPEC_CHANGED:
        return "spec_changed"
    if first == "no members recorded":
        return "no_members"
    return "other"


class RebuildClock:
    """Observes the rebuild metrics from a plan's events (the pure core's history):
    a failure (or a replacement: counted, not timed) opens a rebuild of its deployment, the next replica of
    that deployment to become ready from starting closes the oldest one. Kept by
    the acting scheduler in memory: a takeover starts with none open."""

    def __init__(self):
        self.open: dict[str, list[float]] = defaultdict(list)  # deployment -> when each rebuild began
        self.applied: dict[str, float] = {}  # deployment -> applied_at already observed ready

    def events(self, events) -> None:
        for ev in events:
            if ev.kind != EventKind.REPLICA:
                continue
            dep = ev.data.get("deployment", "")
            prior = ev.data.get("from", "")
            if ev.what == ReplicaState.FAILED or (ev.what == ReplicaState.REAPING and prior not in ("", ReplicaState.FAILED)):
                why = rebuild_reason(ev.detail)
                if ev.what == ReplicaState.REAPING and why not in ("spec_changed", "drained"):
                    continue  # deleted or scaled down: nothing is rebuilt
                REPLICA_FAILURES.labels(dep, why).inc()
                if ev.what == ReplicaState.FAILED:  # a replacement replica is rolled in first, not rebuilt after
                    self.open[dep] = (self.open[dep] + [ev.time])[-64:]
            elif ev.what == ReplicaState.RESTARTING:  # timed like a failure, to the next replica up
                RESTARTS_IN_PLACE.labels(dep).inc()
                self.open[dep] = (self.open[dep] + [ev.time])[-64:]
            elif ev.what in (ReplicaState.READY, ReplicaState.STANDBY) and prior != ReplicaState.DEGRADED and self.open.get(dep):
                # Ready, a spare promoted, or a rebuilt spare standing by: capacity is whole again.
                REBUILD_SECONDS.labels(dep).observe(max(0.0, ev.time - self.open[dep].pop(0)))

    def deployments(self, specs, replicas, since: float) -> None:
        """Apply to ready: a spec applied after ``since`` whose replicas are all ready now."""
        waiting = [n for n, spec in specs.items() if spec.applied_at >= since and spec.replicas > 0 and self.applied.get(n) != spec.applied_at]
        for name in [n for n in self.open if n not in specs]:
            del self.open[name]  # deleted: nothing will be rebuilt
        if not waiting:
            return  # every apply already observed: no need to count thousands of replicas
        ready: dict[str, int] = defaultdict(int)
        for rep in replicas:
            if rep.state == ReplicaState.READY:
                ready[rep.deployment] += 1
        stamp = now()
        for name, spec in specs.items():
            if spec.applied_at >= since and spec.replicas > 0 and self.applied.get(name) != spec.applied_at and ready[name] >= spec.replicas:
                self.applied[name] = spec.applied_at
                APPLY_TO_READY_SECONDS.labels(name).observe(max(0.0, stamp - spec.applied_at))
