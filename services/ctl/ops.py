"""``llmgw ctl`` commands that talk to a running cluster under the operator certificate.

Reads come straight from the KV buckets and the event stream (the operator may
read everything); changes go through the services' APIs, so every bucket keeps
its single writer. What a record means — GPUs free, a replica outdated, a lease's
age — comes from the read model (``shared/readmodel.py``), which the console
reads too; this module only fetches and prints.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from llmgw.shared import api
from llmgw.shared import buckets as B
from llmgw.shared import subjects as S
from llmgw.shared.api import ApiFailed
from llmgw.shared.errors import BusError, ConfigError, WireError
from llmgw.shared.operator import OperatorSession, load_operator_config, not_provisioned
from llmgw.shared.readmodel import (
    age_since,
    backoff_cell,
    backoff_line,
    deployment_status,
    format_event,
    lease_age_text,
    node_rows,
    replica_rows,
)
from llmgw.shared.schemas import (
    DeploymentSpec,
    ExplainReply,
    NameRequest,
    NodeAddrRequest,
    NodeRequest,
    Replica,
    to_builtins,
)
from llmgw.shared.specs import load_deployments, validate_spec
from llmgw.shared.states import AdminBy, AdminState, ReplicaState


def _session(args) -> OperatorSession:
    """This command's session: the operator configuration it names (checked now,
    before anything connects), connected by ``async with``."""
    return OperatorSession(load_operator_config(getattr(args, "config", None)))


def _run(coro):
    import nats.errors
    import nats.js.errors

    try:
        return asyncio.run(coro)
    except (nats.errors.Error, nats.js.errors.Error) as e:  # in one line, never a traceback
        raise BusError(f"the NATS server answered {type(e).__name__}: {e}") from None


def _table(rows: list[tuple], out=sys.stdout) -> None:
    if not rows:
        return
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip(), file=out)  # every row has the header's columns


def _json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


# --------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------


def nodes(args) -> int:
    async def go():
        async with _session(args) as s:
            return node_rows(
                await s.read(B.NODES, missing="nodes"),
                await s.read(B.LEASES),
                await s.read(B.REPLICAS),
            )

    rows = _run(go())
    if args.output == "json":
        _json(rows)
        return 0
    table = [("NODE", "STATE", "ADMIN", "FABRICS", "GPUS FREE/TOTAL", "MGMT ADDR", "LEASE AGE")]
    for r in rows:
        age = lease_age_text(r["state"], r["lease_age"])
        state = f"{r['state']}, QUARANTINED" if r["quarantine"] else r["state"]
        addr = r["mgmt_addr"] if r["addr_verified"] or not r["mgmt_addr"] else f"{r['mgmt_addr']} (unverified)"
        if r["mgmt_ips"] and r["mgmt_ips"] != [r["mgmt_addr"]]:
            addr += f" → {r['mgmt_ips'][0]}"
        table.append((r["node_id"], state, admin_text(r), ",".join(r["fabrics"]) or "(none)", f"{r['gpus_free']}/{r['gpus_total']}", addr, age))
    _table(table)
    if len(table) == 1:
        print("(no nodes registered yet)")
    # Reasons are long: under the table, one line per node that has one.
    for r in rows:
        if r["admin"] != AdminState.ACTIVE and r["admin_reason"]:
            print(f"{r['node_id']} {r['admin']}{' automatically' if r['admin_by'] == AdminBy.AUTO else ''}: {r['admin_reason']}")
        if r["quarantine"]:
            print(f"{r['node_id']} QUARANTINED: {r['quarantine']}")
        if r["addr_problem"]:
            print(f"{r['node_id']} ADDRESS: {r['addr_problem']}")
        for fabric, problem in r["unusable_fabrics"].items():
            print(f"{r['node_id']} fabric {fabric} unusable: {problem}")
        for index, why in r["gpus_out_of_service"].items():
            print(f"{r['node_id']} GPU {index} {why}")
    unverified = [r["node_id"] for r in rows if r["mgmt_addr"] and not r["addr_verified"]]
    if unverified:
        print(f"unverified addresses are the nodes' own word; record them with 'llmgw ctl node set-addr NODE ADDR' ({', '.join(unverified)})")
    return 0


def admin_text(row: dict) -> str:
    """The ADMIN cell: "cordoned (auto)" for the scheduler's auto-cordon."""
    return f"{row['admin']} (auto)" if row["admin"] != AdminState.ACTIVE and row.get("admin_by") == AdminBy.AUTO else row["admin"]


def replicas(args) -> int:
    async def go():
        async with _session(args) as s:
            return replica_rows(await s.read(B.REPLICAS, missing="replicas"))

    rows = _run(go())
    now = time.time()
    if getattr(args, "deployment", None):
        rows = [r for r in rows if r["deployment"] == args.deployment]
    if args.output == "json":
        _json(rows)
        return 0
    table = [("REPLICA", "DEPLOYMENT", "GEN", "FABRIC", "STATE", "MEMBERS", "ENDPOINT", "AGE")]
    for r in rows:
        members = " ".join(f"{m['node']}:{m['rank']}" for m in r["members"]) or "-"
        table.append((r["id"], r["deployment"], r["generation"], r["fabric"] or "-", r["state"], members, r["endpoint"] or "-", age_since(r["since"], now)))
    _table(table)
    if len(table) == 1:
        print("(no replicas)")
    # A replica that is not serving says why, under the table (a stalled leader's canary, a lost peer).
    for r in rows:
        if r["state"] not in (ReplicaState.READY, ReplicaState.LAUNCHING, ReplicaState.WAITING) and r["reason"]:
            print(f"{r['id']} {r['state']}: {r['reason']}")
    return 0


def deployments(args) -> int:
    async def go():
        async with _session(args) as s:
            return await s.read(B.DEPLOYMENTS, missing="deployments"), await s.read(B.REPLICAS)

    deps, reps = _run(go())
    if args.output == "json":
        _json([to_builtins(d) for d in sorted(deps.values(), key=lambda d: d.name)])
        return 0
    table = deployment_table(deps, reps)
    _table(table)
    if len(table) == 1:
        print("(no deployments)")
    for d in sorted(deps.values(), key=lambda d: d.name):
        if d.failures:
            print(f"{d.name}: {backoff_line(d)}")
    return 0


def deployment_table(deps: dict[str, DeploymentSpec], reps: dict[str, Replica], now: float | None = None) -> list[tuple]:
    """``ctl deployments``: a header, then a row per deployment."""
    now = time.time() if now is None else now
    table = [("DEPLOYMENT", "MODEL", "ENGINE", "READY/WANTED", "SHAPE", "OUTDATED", "STANDBY/SPARES", "BACKOFF")]
    for d in sorted(deps.values(), key=lambda d: d.name):
        status = deployment_status(d, reps.values())
        shape = f"{d.nodes_per_replica} node(s) × {d.gpus_per_node} GPU(s)"
        outdated = str(status.outdated) if status.outdated else "-"
        spares = f"{sum(1 for r in reps.values() if r.deployment == d.name and r.state == ReplicaState.STANDBY)}/{d.spares}" if d.spares else "-"
        table.append((d.name, d.model, d.engine, f"{status.ready}/{status.wanted}", shape, outdated, spares, backoff_cell(d, now)))
    return table


def deploy(args) -> int:
    if args.deploy_cmd == "apply":
        specs = load_deployments(args.file)
        for spec in specs:
            try:
                validate_spec(spec)
            except ConfigError as e:
                raise ConfigError(f"{args.file}: deployment {spec.name!r}: {e}") from None

        async def go():
            async with _session(args) as s:
                return [await s.call(api.APPLY, spec) for spec in specs]

        for d in _run(go()):
            spares = f" and {d.spares} warm spare(s)" if d.spares else ""
            print(f"deployment {d.name} applied: {d.replicas} × {d.nodes_per_replica} node(s) × {d.gpus_per_node} GPU(s) of {d.model} on {d.engine}{spares}")
        return 0

    async def go_delete():
        async with _session(args) as s:
            return await s.call(api.DELETE, NameRequest(name=args.name))

    d = _run(go_delete())
    print(f"deployment {d.name} deleted; its replicas are being stopped")
    return 0


def explain(args) -> int:
    async def go():
        async with _session(args) as s:
            return await s.call(api.EXPLAIN, NameRequest(name=args.deployment))

    ex = _run(go())
    if args.output == "json":
        _json(to_builtins(ex))
        return 0
    for line in explain_lines(ex):
        print(line)
    table = [("NODE", "FABRICS", "GPUS FREE/TOTAL", "VERDICT")]
    for n in ex.nodes:
        verdict = "ok" if n.ok else f"{n.reason}: {n.detail}"
        if n.ok and "; out of service: " in n.detail:  # a GPU it fits without
            verdict += " (out of service: " + n.detail.split("; out of service: ", 1)[1] + ")"
        if n.ok and (cached := n.scores.get("weights_cached", 0.0)):  # placement prefers it
            verdict += "; weights cached here" if cached >= 1 else f"; weights being copied here (score {cached:g})"
        table.append((n.node_id, ",".join(n.fabrics) or "(none)", f"{n.free_gpus}/{n.total_gpus}", verdict))
    _table(table)
    return 0


def explain_lines(ex: ExplainReply) -> list[str]:
    """The head of ``ctl explain``: the placement summary, the backoff, the replicas
    that are not serving and why (with their members' engine details)."""
    out = [f"deployment {ex.deployment}: {ex.summary}"]
    backoff = ex.backoff
    if backoff.active:
        out.append(backoff.message)
    elif backoff.failures:
        out.append(f"{backoff.failures} failure(s) before serving in a row (retrying now); last: {backoff.last_failure}")
    for r in ex.replicas:
        if r.state == ReplicaState.READY:
            continue
        out.append(f"replica {r.id} {r.state}" + (f": {r.reason}" if r.reason else ""))
        for m in r.members:
            if m.engine_detail:
                out.append(f"  rank {m.rank} on {m.node}: {m.engine_state or 'unreported'}: {m.engine_detail}")
    return out


def admin(args) -> int:
    verb = args.ctl_cmd

    async def go():
        async with _session(args) as s:
            # --reason, where the command line offers it, is kept on the record.
            req = NodeRequest(node_id=args.node, reason=getattr(args, "reason", None) or "")
            return await s.call(api.ADMIN[verb], req)

    rec = _run(go())
    print(f"node {rec.node_id} is now {rec.admin}" + (f": {rec.admin_reason}" if rec.admin_reason else ""))
    return 0


def node(args) -> int:
    """``ctl node set-addr NODE ADDR`` (the registry) and ``ctl node release NODE`` (the health monitor)."""
    from llmgw.shared.names import check_host, check_name

    check_name(args.node)
    if args.node_cmd == "set-addr":
        check_host(args.addr, "address")

        async def go_addr():
            async with _session(args) as s:
                return await s.call(api.SET_ADDR, NodeAddrRequest(node_id=args.node, addr=args.addr))

        rec = _run(go_addr())
        print(f"node {rec.node_id}: management address recorded as {rec.recorded_addr}; an inventory claiming another is refused")
        if rec.addr_problem:
            print(f"warning: {rec.addr_problem}; no replica is placed there until its agent claims an address the recorded one reaches", file=sys.stderr)
        return 0

    async def go_release():
        async with _session(args) as s:
            for attempt in range(10):
                try:
                    return await s.call(api.RELEASE, NodeRequest(node_id=args.node))
                except ApiFailed as e:
                    # a standby monitor answered (the API is a queue group); the acting one will
                    if e.code != "not_acting" or attempt == 9:
                        raise
                    await asyncio.sleep(0.2)

    lease = _run(go_release())
    print(f"node {lease.node_id} released from quarantine; boot {lease.boot_id[:8]} holds its lease (if two agents still answer, it is quarantined again)")
    return 0


def events(args) -> int:
    async def go():
        async with _session(args) as s:
            try:
                sub = await s.jetstream.subscribe(S.ALL_EVENTS, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
            except NotFoundError:  # no stream captures the event subjects yet
                raise not_provisioned("events", B.EVENTS) from None
            idle = None if args.follow else 0.5
            while True:
                try:
                    msg = await sub.next_msg(timeout=idle) if idle else await sub.next_msg(timeout=3600)
                except Exception:
                    if args.follow:
                        continue
                    break
                try:
                    ev = B.EVENTS.decode(msg.data)
                except WireError:
                    continue
                if args.output == "json":
                    print(json.dumps({"time": ev.time, "kind": ev.kind, "subject": ev.subject, "what": ev.what, "detail": ev.detail}), flush=True)
                else:
                    print(format_event(ev), flush=True)

    try:
        _run(go())
    except KeyboardInterrupt:
        pass
    return 0
