"""The operator's read model: every fact ``llmgw ctl`` and the console derive from the buckets.

Both read the same records (nodes, leases, replicas, deployments) and must
never disagree on what they mean: which GPUs are in use and which are free, a
node's state word, how many replicas of a deployment are ready or outdated,
how old a lease or a replica is. Each such fact is computed here, once, by a
pure function of the records and a clock passed in (``now``); ctl prints it,
the console draws it, and neither computes it again.

Nothing here imports a service: the scheduler's module registers Prometheus
metrics on import, and a read-only tool must not. The scheduler's own copies
(its capacity gauges, ``ClusterView``) read the same helpers where they can —
``gpu_blocks``, ``gpu_counts`` and ``states.HOLDING_REPLICA`` are written to be shared.

Lease ages are bounds, not measurements. The health monitor keeps leases in
memory and writes a ready lease's renewals to the bucket only as a checkpoint
now and then; a state change (suspect, lost, ready again) is written at once,
with the last heartbeat it knows. So a *ready* lease's ``last_renew`` is at
most how long ago the node was last heard ("≤12s"), while a suspect or lost
one's is exactly when it was last heard ("1m06s"). The exact figure lives in
the monitor's memory: ``llmgw_health_lease_age_seconds``.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .schemas import DeploymentSpec, Event, Lease, NodeRecord, Replica, template_digest
from .specs import is_outdated
from .states import ENDING_REPLICA, HOLDING_REPLICA, ROUTABLE_REPLICA, WANTED_REPLICA, AdminState, LeaseState, NodeState

# --------------------------------------------------------------------------
# GPUs: held, out of service, free
# --------------------------------------------------------------------------


def gpu_blocks(record: NodeRecord) -> dict[int, str]:
    """The GPUs of ``record`` placement must not offer, index -> why (docs/hardware.md):
    unhealthy (XID, ECC, fallen off the bus), or busy with a process llmgw did not start."""
    out: dict[int, str] = {}
    for g in record.gpus:
        if not g.healthy:
            out[g.index] = f"unhealthy: {g.problem or 'reported unhealthy by its agent'}"
        elif g.foreign_mib > 0 or g.foreign_pids:
            pids = ", ".join(str(p) for p in g.foreign_pids) or "unknown pids"
            out[g.index] = f"busy: {g.foreign_mib} MiB held by process(es) llmgw did not start (pid {pids})"
    return out


def holder_precedence(replica: Replica) -> tuple[bool, str]:
    """Of the replicas naming one GPU, the one with the smallest key holds it:
    a live replica before one being reaped (that is who will hold it once
    reaping ends), then the smaller id, so the answer never depends on the
    bucket's order. ``gpu_holders`` and the console's folded copy
    (``tui/cluster.py``) decide by this one key."""
    return (replica.state in ENDING_REPLICA, replica.id)


def gpu_holders(replicas: Mapping[str, Replica]) -> dict[str, dict[int, Replica]]:
    """node -> GPU index -> the replica holding it (every state but gone holds;
    of two naming one GPU, ``holder_precedence`` decides)."""
    held: dict[str, dict[int, Replica]] = {}
    for r in sorted(replicas.values(), key=holder_precedence, reverse=True):
        if r.state not in HOLDING_REPLICA:
            continue
        for m in r.members:
            for g in m.gpus:
                held.setdefault(m.node_id, {})[g] = r
    return held


def gpus_in_use(replicas: Mapping[str, Replica]) -> dict[str, set[int]]:
    """node -> the GPU indices some replica holds ("GPUs in use")."""
    return {node: set(gpus) for node, gpus in gpu_holders(replicas).items()}


@dataclass(frozen=True)
class GpuCounts:
    total: int
    free: int  # neither held nor out of service: what placement may offer
    used: int  # held by a replica, and not out of service
    out_of_service: int  # unhealthy or busy (gpu_blocks), held or not


def gpu_counts(gpus: Iterable[int], held: Iterable[int], blocked: Iterable[int]) -> GpuCounts:
    """One node's GPUs by what they are doing, from the indices its inventory
    lists, the ones replicas hold and the ones out of service. An out-of-service
    GPU a replica still holds counts as out of service, not used: it is why the
    replica is failing. Held indices the inventory does not list are not counted."""
    listed = list(gpus)
    held, blocked = set(held), set(blocked)
    free = sum(1 for i in listed if i not in held and i not in blocked)
    out = sum(1 for i in listed if i in blocked)
    return GpuCounts(total=len(listed), free=free, used=len(listed) - free - out, out_of_service=out)


def node_gpu_counts(record: NodeRecord, in_use: Mapping[str, set[int]]) -> GpuCounts:
    """``gpu_counts`` of one node record, ``in_use`` from ``gpus_in_use``."""
    return gpu_counts((g.index for g in record.gpus), in_use.get(record.node_id, ()), gpu_blocks(record))


# --------------------------------------------------------------------------
# node state
# --------------------------------------------------------------------------


def lease_state(lease: Lease | None) -> NodeState:
    """The lease's state (ready, suspect, lost), or ``unknown`` without one."""
    return NodeState(lease.state) if lease is not None else NodeState.UNKNOWN


def node_state(record: NodeRecord, lease: Lease | None) -> NodeState:
    """A node's one word (``states.NodeState``): the lease's when it is not ready,
    else the admin state when not active, else ready."""
    if lease is None:
        return NodeState.UNKNOWN
    if lease.state != LeaseState.READY:
        return NodeState(lease.state)
    if record.admin != AdminState.ACTIVE:
        return NodeState(record.admin)
    return NodeState.READY


# --------------------------------------------------------------------------
# ages
# --------------------------------------------------------------------------


def format_age(seconds: float | None) -> str:
    """A duration in at most six characters: 0.4s, 12s, 1m15s, 2.0h, 2.0d; "-" for none."""
    if seconds is None:
        return "-"
    s = max(0.0, seconds)
    if s < 10:
        return f"{s:.1f}s"
    if s < 59.5:
        return f"{s:.0f}s"
    if s < 3599.5:  # whole seconds first: 599.99 s is 10m00s, not 9m60s
        whole = round(s)
        return f"{whole // 60}m{whole % 60:02d}s"
    if s < 86400:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def age_since(t: float, now: float) -> str:
    """How long ago ``t`` was; "-" when it was never set (0)."""
    return format_age(now - t) if t else "-"


def lease_age(lease: Lease | None, now: float) -> float | None:
    """Seconds since the stored lease was renewed (None without a lease): for a
    ready lease an upper bound on the silence, for others exact (module docstring)."""
    return now - lease.last_renew if lease is not None else None


def lease_age_text(state: str, age: float | None) -> str:
    """A lease age in words that do not claim more than the record knows:
    ``≤12s`` for a ready lease (its renewal was checkpointed that long ago; the
    node was heard since, or it would not be ready), ``1m06s`` for a suspect or
    lost one (written when it changed, with the last heartbeat), ``-`` for none."""
    if age is None:
        return "-"
    return f"≤{format_age(age)}" if state == LeaseState.READY else format_age(age)


def lease_line(lease: Lease | None, now: float) -> str:
    """A node's lease in one line: "ready for 1m00s, renewed ≤0.4s ago, boot 72424447"."""
    if lease is None:
        return "no lease yet"
    renewed = lease_age_text(lease.state, lease_age(lease, now))
    return f"{lease.state} for {format_age(now - lease.since)}, renewed {renewed} ago, boot {lease.boot_id[:8]}"


# --------------------------------------------------------------------------
# deployments
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class DeploymentStatus:
    ready: int  # replicas the gateway may route to
    wanted: int  # the replica count the operator asked for
    # Replicas still on their way up or serving that run an older engine
    # template: the rolling update will replace them. One failed or being
    # reaped is on its way out already and is not counted.
    outdated: int


def deployment_status(spec: DeploymentSpec, replicas: Iterable[Replica]) -> DeploymentStatus:
    digest = template_digest(spec)
    mine = [r for r in replicas if r.deployment == spec.name]
    return DeploymentStatus(
        ready=sum(1 for r in mine if r.state in ROUTABLE_REPLICA),
        wanted=spec.replicas,
        outdated=sum(1 for r in mine if r.state in WANTED_REPLICA and is_outdated(r, digest)),
    )


def _clock(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%H:%M:%S")


def backing_off(spec: DeploymentSpec, now: float) -> bool:
    """Waiting out a crash-loop backoff: failures in a row, and the next attempt still ahead."""
    return bool(spec.failures) and spec.retry_at > now


def backoff_line(d: DeploymentSpec, now: float | None = None) -> str:
    """A deployment's crash-loop backoff in words ("" when it has none)."""
    if not d.failures:
        return ""
    now = time.time() if now is None else now
    s = "s" if d.failures != 1 else ""
    if d.retry_at > now:
        return f"backing off after {d.failures} failure{s} before serving; next attempt at {_clock(d.retry_at)}; last: {d.last_failure}"
    return f"{d.failures} failure{s} before serving in a row, retrying; last: {d.last_failure}"


def backoff_cell(d: DeploymentSpec, now: float) -> str:
    """The backoff in a table cell: "2×, next 12:00:05", "2×" once retrying, "-" for none."""
    if not d.failures:
        return "-"
    return f"{d.failures}×, next {_clock(d.retry_at)}" if d.retry_at > now else f"{d.failures}×"


# --------------------------------------------------------------------------
# rows: what ``ctl nodes -o json`` and ``ctl replicas -o json`` print
# --------------------------------------------------------------------------


def node_rows(nodes: Mapping[str, NodeRecord], leases: Mapping[str, Lease], replicas: Mapping[str, Replica], now: float | None = None) -> list[dict]:
    """One row per registered node, in node order. Field names and values are
    what operators script against (``ctl nodes -o json``): add, never rename."""
    now = time.time() if now is None else now
    in_use = gpus_in_use(replicas)
    rows = []
    for nid in sorted(nodes):
        n = nodes[nid]
        lease = leases.get(nid)
        blocked = gpu_blocks(n)
        rows.append(
            {
                "node_id": nid,
                "fabrics": [f.name for f in n.fabrics],
                "unusable_fabrics": {f.name: f.problem for f in n.fabrics if not f.usable},
                "gpus_total": len(n.gpus),
                "gpus_free": node_gpu_counts(n, in_use).free,
                # Out of service: unhealthy, or held by a process llmgw did not start.
                "gpus_out_of_service": {str(i): why for i, why in sorted(blocked.items())},
                "state": lease_state(lease),
                "admin": n.admin,
                # why it is cordoned/draining, and who said so ("auto": the scheduler)
                "admin_reason": n.admin_reason,
                "admin_by": n.admin_by,
                "mgmt_addr": n.mgmt_addr,
                # recorded at onboarding (llmgw ctl node set-addr), or only the node's word
                "addr_verified": bool(n.recorded_addr),
                # what mgmt_addr resolves to on the node, its own addresses (engines bind the first)
                "mgmt_ips": list(n.mgmt_ips),
                # why no replica is placed there: the address does not resolve, or not to the recorded one
                "addr_problem": n.addr_problem,
                # two agents answer for the node (the health monitor's verdict), in words
                "quarantine": lease.quarantine if lease else "",
                # seconds; for a ready lease an upper bound (lease_age_text)
                "lease_age": lease_age(lease, now),
            }
        )
    return rows


def replica_rows(replicas: Mapping[str, Replica]) -> list[dict]:
    """One row per replica, by deployment and generation (``ctl replicas -o json``)."""
    rows = []
    for r in sorted(replicas.values(), key=lambda r: (r.deployment, r.generation)):
        rows.append(
            {
                "id": r.id,
                "deployment": r.deployment,
                "model": r.model,
                "generation": r.generation,
                "spec_digest": r.spec_digest,  # the engine template it runs (ctl deployments: OUTDATED)
                "fabric": r.fabric,
                "state": r.state,
                "members": [
                    {
                        "node": m.node_id,
                        "rank": m.rank,
                        "role": m.role,
                        "gpus": list(m.gpus),
                        "engine_state": m.engine_state,
                        "engine_detail": m.engine_detail,
                        "pid": m.pid,
                    }
                    for m in r.members
                ],
                "endpoint": r.endpoint,
                "since": r.since,
                "reason": r.reason,
            }
        )
    return rows


# --------------------------------------------------------------------------
# events
# --------------------------------------------------------------------------


def format_event(ev: Event) -> str:
    """One event in one line (``ctl events``, the console's feed)."""
    t = dt.datetime.fromtimestamp(ev.time).strftime("%H:%M:%S.%f")[:-3]
    return f"{t}  {ev.kind:<10} {ev.subject:<16} {ev.what:<20} {ev.detail}"
