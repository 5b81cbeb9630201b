"""``llmgw ctl`` commands that talk to a running cluster under the operator certificate.

Reads come straight from the KV buckets and the event stream (the operator may
read everything); changes go through the services' APIs, so every bucket keeps
its single writer.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import difflib
import json
import sys
from pathlib import Path

import msgspec
import yaml
from nats.js.api import DeliverPolicy
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NoKeysError, NotFoundError

from llmgw.shared import bus, subjects as S
from llmgw.shared.config import default_operator_config, load_service_config, read_yaml
from llmgw.shared.durations import parse_duration
from llmgw.shared.errors import BusError, ConfigError, LlmgwError, WireError
from llmgw.shared.schemas import (
    ApiError,
    DeploymentSpec,
    Event,
    Lease,
    NameRequest,
    NodeAddrRequest,
    NodeRecord,
    NodeRequest,
    Replica,
    decode,
    encode,
    template_digest,
    to_builtins,
)
from llmgw.shared.states import ENDING_REPLICA, ReplicaState


class ApiFailed(LlmgwError):
    code = "api"


class NotProvisioned(LlmgwError):
    """A bucket or the event stream does not exist yet: the service that creates it has not started."""

    code = "not_provisioned"


# Who creates each bucket (and the event stream) on its first start: named when one is missing.
_CREATOR = {S.BUCKET_NODES: "registry", S.BUCKET_LEASES: "health monitor", S.BUCKET_DEPLOYMENTS: "scheduler", S.BUCKET_REPLICAS: "scheduler"}


class Session:
    def __init__(self, args):
        path = getattr(args, "config", None) or default_operator_config()
        if not Path(path).exists():
            raise ConfigError(f"no operator configuration at {path}; pass --config, set LLMGW_CONFIG, or run 'llmgw up' (it writes .llmgw/operator.yaml)")
        self.cfg = load_service_config(path)
        self.nc = None

    async def __aenter__(self):
        import logging

        # A short-lived tool: connection chatter would bury the answer.
        quiet = logging.getLogger("llmgw.ctl.bus")
        quiet.setLevel(max(logging.WARNING, logging.getLogger().level))
        self.nc = await bus.connect(self.cfg.server, self.cfg.tls_files(), name="ctl", logger=quiet, initial_attempts=3, reconnect_base=0.2, reconnect_max=1.0, connect_timeout=3)
        self.js = self.nc.jetstream(timeout=5)
        return self

    async def __aexit__(self, *exc):
        try:
            await asyncio.wait_for(self.nc.close(), 3)
        except Exception:
            pass

    async def read_bucket(self, bucket: str, schema, *, missing: str = "") -> dict:
        """The bucket's records; a bucket not created yet reads as empty, unless it is
        the verb's own (``missing`` names what it lists): then one line says so."""
        try:
            kv = await self.js.key_value(bucket)
        except BucketNotFoundError:
            if missing:
                raise NotProvisioned(f"no {missing} yet: the bucket {bucket} does not exist (has the {_CREATOR.get(bucket, 'control plane')} started?)") from None
            return {}  # not created yet: nothing there
        keys: list[str] = []
        for attempt in range(4):
            try:
                keys = await kv.keys()
                break
            except NoKeysError:
                # nats-py's key listing can end early when it races its own
                # consumer; an empty answer from a bucket holding values is retried.
                info = await self.js.stream_info(S.kv_stream(bucket))
                if not info.state.messages:
                    return {}
                await asyncio.sleep(0.1 * (attempt + 1))
        else:
            raise BusError(f"could not list the keys of {bucket}; try again")
        out = {}
        for k in keys:
            try:
                out[k] = decode((await kv.get(k)).value, schema)
            except KeyNotFoundError:
                continue  # deleted between the listing and the read
            except WireError as e:
                print(f"llmgw: warning: {bucket}/{k} skipped: {e}", file=sys.stderr)
        return out

    async def call(self, service: str, verb: str, payload: bytes, timeout: float = 10.0) -> bytes:
        try:
            reply = await self.nc.request(S.api(service, verb), payload, timeout=timeout)
        except Exception as e:
            raise BusError(f"the {service} did not answer {verb} ({type(e).__name__}); is 'llmgw {service}' running?") from None
        if reply.headers and reply.headers.get("Nats-Service-Error-Code"):
            try:
                err = decode(reply.data, ApiError)
                raise ApiFailed(err.description)
            except WireError:
                raise ApiFailed(reply.headers.get("Nats-Service-Error", "request failed")) from None
        return reply.data


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
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip(), file=out)


def _json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def _age(t: float) -> str:
    if not t:
        return "-"
    s = max(0.0, dt.datetime.now().timestamp() - t)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


def gpus_in_use(replicas: dict[str, Replica]) -> dict[str, set[int]]:
    used: dict[str, set[int]] = {}
    for r in replicas.values():
        if r.state == ReplicaState.GONE:
            continue
        for m in r.members:
            used.setdefault(m.node_id, set()).update(m.gpus)
    return used


def node_rows(nodes: dict[str, NodeRecord], leases: dict[str, Lease], replicas: dict[str, Replica]) -> list[dict]:
    from llmgw.services.scheduler.view import gpu_blocks

    used = gpus_in_use(replicas)
    rows = []
    for nid in sorted(nodes):
        n = nodes[nid]
        lease = leases.get(nid)
        total = len(n.gpus)
        # Out of service (issue #14): unhealthy, or held by a process llmgw did not start.
        blocked = gpu_blocks(n)
        rows.append(
            {
                "node_id": nid,
                "fabrics": [f.name for f in n.fabrics],
                "unusable_fabrics": {f.name: f.problem for f in n.fabrics if not f.usable},
                "gpus_total": total,
                "gpus_free": total - len((used.get(nid, set()) | set(blocked)) & {g.index for g in n.gpus}),
                "gpus_out_of_service": {str(i): why for i, why in sorted(blocked.items())},
                "state": lease.state if lease else "unknown",
                "admin": n.admin,
                # why it is cordoned/draining, and who said so ("auto": the scheduler)
                "admin_reason": n.admin_reason,
                "admin_by": n.admin_by,
                "mgmt_addr": n.mgmt_addr,
                # recorded at onboarding (llmgw ctl node set-addr), or only the node's word
                "addr_verified": bool(n.recorded_addr),
                # two agents answer for the node (the health monitor's verdict), in words
                "quarantine": lease.quarantine if lease else "",
                "lease_age": (dt.datetime.now().timestamp() - lease.last_renew) if lease else None,
            }
        )
    return rows


def replica_rows(replicas: dict[str, Replica]) -> list[dict]:
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
                    {"node": m.node_id, "rank": m.rank, "role": m.role, "gpus": list(m.gpus), "engine_state": m.engine_state, "engine_detail": m.engine_detail, "pid": m.pid}
                    for m in r.members
                ],
                "endpoint": r.endpoint,
                "since": r.since,
                "reason": r.reason,
            }
        )
    return rows


# --------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------


def nodes(args) -> int:
    async def go():
        async with Session(args) as s:
            return node_rows(
                await s.read_bucket(S.BUCKET_NODES, NodeRecord, missing="nodes"),
                await s.read_bucket(S.BUCKET_LEASES, Lease),
                await s.read_bucket(S.BUCKET_REPLICAS, Replica),
            )

    rows = _run(go())
    if args.output == "json":
        _json(rows)
        return 0
    table = [("NODE", "STATE", "ADMIN", "FABRICS", "GPUS FREE/TOTAL", "MGMT ADDR", "LEASE AGE")]
    for r in rows:
        age = f"{r['lease_age']:.1f}s" if r["lease_age"] is not None else "-"
        state = f"{r['state']}, QUARANTINED" if r["quarantine"] else r["state"]
        addr = r["mgmt_addr"] if r["addr_verified"] or not r["mgmt_addr"] else f"{r['mgmt_addr']} (unverified)"
        table.append((r["node_id"], state, admin_text(r), ",".join(r["fabrics"]) or "(none)", f"{r['gpus_free']}/{r['gpus_total']}", addr, age))
    _table(table)
    if len(table) == 1:
        print("(no nodes registered yet)")
    # Reasons are long: under the table, one line per node that has one.
    for r in rows:
        if r["admin"] != "active" and r["admin_reason"]:
            print(f"{r['node_id']} {r['admin']}{' automatically' if r['admin_by'] == 'auto' else ''}: {r['admin_reason']}")
        if r["quarantine"]:
            print(f"{r['node_id']} QUARANTINED: {r['quarantine']}")
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
    return f"{row['admin']} (auto)" if row["admin"] != "active" and row.get("admin_by") == "auto" else row["admin"]


def replicas(args) -> int:
    async def go():
        async with Session(args) as s:
            return replica_rows(await s.read_bucket(S.BUCKET_REPLICAS, Replica, missing="replicas"))

    rows = _run(go())
    if getattr(args, "deployment", None):
        rows = [r for r in rows if r["deployment"] == args.deployment]
    if args.output == "json":
        _json(rows)
        return 0
    table = [("REPLICA", "DEPLOYMENT", "GEN", "FABRIC", "STATE", "MEMBERS", "ENDPOINT", "AGE")]
    for r in rows:
        members = " ".join(f"{m['node']}:{m['rank']}" for m in r["members"]) or "-"
        table.append((r["id"], r["deployment"], r["generation"], r["fabric"] or "-", r["state"], members, r["endpoint"] or "-", _age(r["since"])))
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
        async with Session(args) as s:
            return await s.read_bucket(S.BUCKET_DEPLOYMENTS, DeploymentSpec, missing="deployments"), await s.read_bucket(S.BUCKET_REPLICAS, Replica)

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


def backoff_line(d: DeploymentSpec, now: float | None = None) -> str:
    """A deployment's crash-loop backoff in words ("" when it has none)."""
    if not d.failures:
        return ""
    now = dt.datetime.now().timestamp() if now is None else now
    s = "s" if d.failures != 1 else ""
    if d.retry_at > now:
        at = dt.datetime.fromtimestamp(d.retry_at).strftime("%H:%M:%S")
        return f"backing off after {d.failures} failure{s} before serving; next attempt at {at}; last: {d.last_failure}"
    return f"{d.failures} failure{s} before serving in a row, retrying; last: {d.last_failure}"


def deployment_table(deps: dict[str, DeploymentSpec], reps: dict[str, Replica], now: float | None = None) -> list[tuple]:
    """``ctl deployments``: a header, then a row per deployment."""
    now = dt.datetime.now().timestamp() if now is None else now
    table = [("DEPLOYMENT", "MODEL", "ENGINE", "READY/WANTED", "SHAPE", "OUTDATED", "BACKOFF")]
    for d in sorted(deps.values(), key=lambda d: d.name):
        mine = [r for r in reps.values() if r.deployment == d.name]
        ready = sum(1 for r in mine if r.state == ReplicaState.READY)
        # Replicas of an older engine template still to be replaced by the rolling update.
        digest = template_digest(d)
        outdated = sum(1 for r in mine if r.spec_digest and r.spec_digest != digest and r.state not in ENDING_REPLICA | {ReplicaState.GONE})
        shape = f"{d.nodes_per_replica} node(s) × {d.gpus_per_node} GPU(s)"
        # Crash-loop backoff: failures in a row, and the next attempt while it waits.
        backoff = "-"
        if d.failures:
            backoff = f"{d.failures}×, next {dt.datetime.fromtimestamp(d.retry_at).strftime('%H:%M:%S')}" if d.retry_at > now else f"{d.failures}×"
        table.append((d.name, d.model, d.engine, f"{ready}/{d.replicas}", shape, str(outdated) if outdated else "-", backoff))
    return table


# What an operator writes; the rest is the scheduler's (generations, backoff).
_SPEC_KEYS = [f for f in DeploymentSpec.__struct_fields__ if f not in ("applied_at", "last_generation", "failures", "last_failure", "retry_at")]


def load_deployments(path: str) -> list[DeploymentSpec]:
    """Read a deployment file: one mapping, a list, or ``deployments: [...]``."""
    data = read_yaml(path) if path != "-" else yaml.safe_load(sys.stdin.read())
    items = data.get("deployments", data) if isinstance(data, dict) else data
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{path}: expected a deployment mapping, a list of them, or 'deployments: [...]'")
    specs = []
    for i, item in enumerate(items):
        where = f"{path}: deployments[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: expected a mapping")
        for key in item:
            if key not in _SPEC_KEYS:
                close = difflib.get_close_matches(str(key), _SPEC_KEYS, n=1)
                raise ConfigError(f"{where}: unknown key '{key}'" + (f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(_SPEC_KEYS)})"))
        item = dict(item)
        if "startup_timeout" in item:
            item["startup_timeout"] = parse_duration(item["startup_timeout"], f"{where}.startup_timeout")
        try:
            specs.append(msgspec.convert(item, DeploymentSpec))
        except msgspec.ValidationError as e:
            raise ConfigError(f"{where}: {e}") from None
    return specs


def deploy(args) -> int:
    if args.deploy_cmd == "apply":
        specs = load_deployments(args.file)
        from llmgw.services.scheduler.service import validate_spec

        for spec in specs:
            try:
                validate_spec(spec)
            except ConfigError as e:
                raise ConfigError(f"{args.file}: deployment {spec.name!r}: {e}") from None

        async def go():
            async with Session(args) as s:
                return [decode(await s.call("scheduler", "apply", encode(spec)), DeploymentSpec) for spec in specs]

        for d in _run(go()):
            print(f"deployment {d.name} applied: {d.replicas} × {d.nodes_per_replica} node(s) × {d.gpus_per_node} GPU(s) of {d.model} on {d.engine}")
        return 0

    async def go_delete():
        async with Session(args) as s:
            return decode(await s.call("scheduler", "delete", encode(NameRequest(name=args.name))), DeploymentSpec)

    d = _run(go_delete())
    print(f"deployment {d.name} deleted; its replicas are being stopped")
    return 0


def explain(args) -> int:
    async def go():
        async with Session(args) as s:
            return json.loads(await s.call("scheduler", "explain", encode(NameRequest(name=args.deployment))))

    ex = _run(go())
    if args.output == "json":
        _json(ex)
        return 0
    for line in explain_lines(ex):
        print(line)
    table = [("NODE", "FABRICS", "GPUS FREE/TOTAL", "VERDICT")]
    for n in ex["nodes"]:
        verdict = "ok" if n["ok"] else f"{n['reason']}: {n['detail']}"
        if n["ok"] and "; out of service: " in n["detail"]:  # a GPU it fits without (issue #14)
            verdict += " (out of service: " + n["detail"].split("; out of service: ", 1)[1] + ")"
        table.append((n["node_id"], ",".join(n["fabrics"]) or "(none)", f"{n['free_gpus']}/{n['total_gpus']}", verdict))
    _table(table)
    return 0


def explain_lines(ex: dict) -> list[str]:
    """The head of ``ctl explain``: the placement summary, the backoff, the replicas
    that are not serving and why (with their members' engine details)."""
    out = [f"deployment {ex['deployment']}: {ex['summary']}"]
    backoff = ex.get("backoff") or {}
    if backoff.get("active"):
        out.append(backoff["message"])
    elif backoff.get("failures"):
        out.append(f"{backoff['failures']} failure(s) before serving in a row (retrying now); last: {backoff['last_failure']}")
    for r in ex.get("replicas", []):
        if r["state"] == ReplicaState.READY:
            continue
        out.append(f"replica {r['id']} {r['state']}" + (f": {r['reason']}" if r["reason"] else ""))
        for m in r["members"]:
            if m.get("engine_detail"):
                out.append(f"  rank {m['rank']} on {m['node']}: {m['engine_state'] or 'unreported'}: {m['engine_detail']}")
    return out


def admin(args) -> int:
    verb = args.ctl_cmd

    async def go():
        async with Session(args) as s:
            # --reason, where the command line offers it, is kept on the record.
            req = NodeRequest(node_id=args.node, reason=getattr(args, "reason", None) or "")
            return decode(await s.call("registry", verb, encode(req)), NodeRecord)

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
            async with Session(args) as s:
                return decode(await s.call("registry", "set-addr", encode(NodeAddrRequest(node_id=args.node, addr=args.addr))), NodeRecord)

        rec = _run(go_addr())
        print(f"node {rec.node_id}: management address recorded as {rec.recorded_addr}; an inventory claiming another is refused")
        return 0

    async def go_release():
        async with Session(args) as s:
            for attempt in range(10):
                try:
                    return decode(await s.call("health", "release", encode(NodeRequest(node_id=args.node))), Lease)
                except ApiFailed as e:
                    # a standby monitor answered (the API is a queue group); the acting one will
                    if "standing by" not in str(e) or attempt == 9:
                        raise
                    await asyncio.sleep(0.2)

    lease = _run(go_release())
    print(f"node {lease.node_id} released from quarantine; boot {lease.boot_id[:8]} holds its lease (if two agents still answer, it is quarantined again)")
    return 0


def format_event(ev: Event) -> str:
    t = dt.datetime.fromtimestamp(ev.time).strftime("%H:%M:%S.%f")[:-3]
    return f"{t}  {ev.kind:<10} {ev.subject:<16} {ev.what:<20} {ev.detail}"


def events(args) -> int:
    async def go():
        async with Session(args) as s:
            try:
                sub = await s.js.subscribe(S.ALL_EVENTS, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
            except NotFoundError:  # no stream captures the event subjects yet
                raise NotProvisioned(f"no events yet: the event stream {S.EVENT_STREAM} does not exist (has the scheduler started?)") from None
            idle = None if args.follow else 0.5
            while True:
                try:
                    msg = await sub.next_msg(timeout=idle) if idle else await sub.next_msg(timeout=3600)
                except Exception:
                    if args.follow:
                        continue
                    break
                try:
                    ev = decode(msg.data, Event)
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
