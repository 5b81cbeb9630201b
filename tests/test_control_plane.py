"""Registry + health monitor + scheduler on a real nats-server, with real agents running real `sim` engines."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request

import pytest

from llmgw.services.devcluster import simcluster
from llmgw.shared.schemas import template_digest

from .cluster_helpers import MOVE, Cluster
from .cluster_helpers import crash as crash_service
from .cluster_helpers import sim_spec as spec

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


@pytest.fixture
async def cluster(nats_server, tmp_path):
    c = Cluster(nats_server, tmp_path / "cluster")
    yield c
    await c.close()


async def bring_up(cluster, connector, nodes=2, fabrics=1, schedulers=1, **scheduler):
    scheds = await cluster.start_control_plane(schedulers=schedulers, **scheduler)
    cluster.add_nodes(simcluster.layout(nodes, fabrics, 4))
    for n in cluster.nodes:
        cluster.start_agent(n)
    await cluster.operator(connector)
    await cluster.wait(lambda: len([lease for lease in cluster.leases.items.values() if lease.state == "ready"]) == nodes, timeout=45, what="all nodes ready")
    return scheds


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


async def test_launch_sequence_reaches_ready_and_serves(cluster, connector):
    await bring_up(cluster, connector)
    await cluster.apply(spec())
    (rep,) = await cluster.wait(lambda: cluster.ready("demo"), what="replica ready")
    assert rep.fabric == "ib-a" and [m.rank for m in rep.members] == [0, 1]
    assert rep.members[0].role == "leader" and rep.members[0].serves_http and not rep.members[1].serves_http
    assert all(m.pid and m.engine_state for m in rep.members)

    def health_status() -> int:
        with urllib.request.urlopen(rep.endpoint + "/health", timeout=5) as r:
            return r.status

    assert await asyncio.to_thread(health_status) == 200  # a blocking read: off the test's loop
    # the path it took, in order, from the event stream
    js = cluster.ops.jetstream()
    sub = await js.subscribe(f"llmgw.event.replica.{rep.id}.>", ordered_consumer=True)
    # The scheduler writes the record before it publishes the event: read until "ready"
    # arrives (not for a fixed while), then the path must be exactly this.
    seen = []
    while "ready" not in seen and len(seen) < 10:
        msg = await sub.next_msg(timeout=10)
        seen.append(msg.subject.rsplit(".", 1)[1])
    await sub.unsubscribe()
    assert seen == ["launching", "waiting-for-workers", "ready"]


async def test_member_exit_fails_and_reaps_then_rebuilds(cluster, connector):
    await bring_up(cluster, connector, **MOVE)  # restart in place: tests/test_spares_cluster.py
    await cluster.apply(spec())
    (first,) = await cluster.wait(lambda: cluster.ready("demo"), what="replica ready")
    leader_pid, worker_pid = first.members[0].pid, first.members[1].pid
    os.kill(worker_pid, signal.SIGKILL)  # the worker engine dies; its agent lives
    # The replacement's ready record and the old one's deletion are separate writes: wait for both.
    (second,) = await cluster.wait(
        lambda: first.id not in cluster.replicas.items and len(cluster.live("demo")) == 1 and [r for r in cluster.ready("demo") if r.id != first.id],
        what="old replica reaped and deleted, replacement ready, nothing else live",
    )
    assert second.generation > first.generation
    await cluster.wait(lambda: not alive(leader_pid), timeout=5, what="old leader stopped")


async def test_returning_node_has_its_stale_engines_stopped(cluster, connector):
    await bring_up(cluster, connector, nodes=2)
    await cluster.apply(spec())
    (first,) = await cluster.wait(lambda: cluster.ready("demo"), what="replica ready")
    worker = first.members[1]
    # node02's agent dies (the engines keep running, as on a real crash of the agent alone)…
    cluster.agents[worker.node_id].kill()
    await cluster.wait(lambda: cluster.leases.items[worker.node_id].state == "lost", what="node lost")
    await cluster.wait(lambda: first.id not in cluster.replicas.items, what="old replica reaped")
    assert alive(worker.pid), "the stale engine should still be running before its node returns"
    # …and comes back: it adopts the engine, reports it, and the scheduler fences it.
    cluster.start_agent(worker.node_id)
    await cluster.wait(lambda: not alive(worker.pid), timeout=15, what="stale engine stopped")


async def crash(svc):
    """Stop a service as a crash would: no resignation, no goodbye."""
    await crash_service(svc, [m for name in ("nodes", "leases", "deployments", "replicas") if (m := getattr(svc, name, None)) is not None])


async def test_standby_scheduler_finishes_a_rebuild_without_duplicates(cluster, connector):
    scheds = await bring_up(cluster, connector, nodes=4, fabrics=2, schedulers=2)
    await cluster.apply(spec(replicas=2, load="1s"))
    await cluster.wait(lambda: len(cluster.ready("demo")) == 2, what="two replicas ready")
    leader = next(s for s in scheds if s.leadership.is_leader)
    standby = next(s for s in scheds if s is not leader)
    victim = next(r for r in cluster.ready("demo") if r.fabric == "ib-a").members[1].node_id
    cluster.kill_node(victim)
    # mid-rebuild: the replacement has been placed and is launching / loading
    await cluster.wait(
        lambda: [r for r in cluster.live("demo") if r.generation > 2 and r.state in ("launching", "waiting-for-workers")], what="replacement launching"
    )
    await crash(leader)
    cluster.services.remove(leader)
    await cluster.wait(lambda: standby.leadership.is_leader, what="standby takes over")
    # Finished means two ready replicas, both whole on the fabric that can hold them, and nothing else live.
    shape = lambda: sorted((r.state, r.fabric) for r in cluster.live("demo"))  # noqa: E731
    await cluster.wait(shape, [("ready", "ib-b"), ("ready", "ib-b")], timeout=30, what="rebuild finished on ib-b")
    gens = [r.generation for r in cluster.live("demo")]
    assert len(set(gens)) == len(gens) == 2


def ctl(cfg, *args, check=True):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "llmgw.services", "ctl", *args, "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    if check:
        assert r.returncode == 0, f"ctl {args}: {r.stderr}"
    return r


async def test_ctl_reads_and_changes_the_cluster(cluster, connector, tmp_path):
    import json

    from llmgw.shared.config import write_config

    await bring_up(cluster, connector, nodes=2)
    tls = cluster.server.issue("admin", "operator")
    cluster.server.reload()
    cfg = tmp_path / "operator.yaml"
    write_config(cfg, {"server": cluster.server.url, "tls": {"ca": tls.ca, "cert": tls.cert, "key": tls.key}})
    deploy = tmp_path / "demo.yaml"
    deploy.write_text(
        "name: demo\nmodel: sim-7b\nengine: sim\nreplicas: 1\nnodes_per_replica: 2\ngpus_per_node: 2\nengine_args: [--load-time, 0.2s]\nstartup_timeout: 30s\n"
    )
    r = await asyncio.to_thread(ctl, cfg, "deploy", "apply", "-f", str(deploy))
    assert "deployment demo applied" in r.stdout
    (rep,) = await cluster.wait(lambda: cluster.ready("demo"), what="replica ready")

    nodes = json.loads((await asyncio.to_thread(ctl, cfg, "nodes", "-o", "json")).stdout)
    assert [(n["node_id"], n["fabrics"], n["gpus_total"], n["gpus_free"], n["state"], n["mgmt_addr"]) for n in nodes] == [
        ("node01", ["ib-a"], 4, 2, "ready", cluster.addr("node01")),
        ("node02", ["ib-a"], 4, 2, "ready", cluster.addr("node02")),
    ]
    reps = json.loads((await asyncio.to_thread(ctl, cfg, "replicas", "-o", "json")).stdout)
    assert [(r["id"], r["deployment"], r["generation"], r["fabric"], r["state"], r["endpoint"]) for r in reps] == [
        (rep.id, "demo", rep.generation, "ib-a", "ready", rep.endpoint)
    ]
    assert (reps[0]["model"], reps[0]["spec_digest"]) == ("sim-7b", template_digest(spec()))
    assert [(m["node"], m["rank"], m["role"], len(m["gpus"])) for m in reps[0]["members"]] == [("node01", 0, "leader", 2), ("node02", 1, "worker", 2)]
    table = (await asyncio.to_thread(ctl, cfg, "replicas")).stdout
    assert rep.id in table and "node01:0 node02:1" in table
    ex = json.loads((await asyncio.to_thread(ctl, cfg, "explain", "demo", "-o", "json")).stdout)
    assert {n["node_id"] for n in ex["nodes"]} == {"node01", "node02"}

    r = await asyncio.to_thread(ctl, cfg, "cordon", "node01")
    assert "node01 is now cordoned" in r.stdout
    nodes = json.loads((await asyncio.to_thread(ctl, cfg, "nodes", "-o", "json")).stdout)
    assert nodes[0]["admin"] == "cordoned"

    async def history():
        return [json.loads(line) for line in (await asyncio.to_thread(ctl, cfg, "events", "-o", "json")).stdout.splitlines()]

    async def seen(wanted):
        return {(e["kind"], e["subject"], e["what"]) for e in await history()} & wanted

    # The scheduler publishes "ready" just after it writes the record: wait for both events.
    wanted = {("node", "node01", "cordoned"), ("replica", rep.id, "ready")}
    await cluster.wait(lambda: seen(wanted), wanted, what="cordoned and ready in the history")
    assert {"time", "kind", "subject", "what", "detail"} <= set((await history())[0])

    # bad input: a clear one-line error, nothing applied
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: demo2\nmodel: m\nengine: sim\nreplicas: 1\ngpus_per_nod: 2\n")
    r = await asyncio.to_thread(ctl, cfg, "deploy", "apply", "-f", str(bad), check=False)
    assert r.returncode == 2 and "gpus_per_nod: unknown key" in r.stderr and "did you mean 'gpus_per_node'" in r.stderr
    r = await asyncio.to_thread(ctl, cfg, "cordon", "node99", check=False)
    assert r.returncode == 2 and "no node 'node99'" in r.stderr

    r = await asyncio.to_thread(ctl, cfg, "deploy", "delete", "demo")
    assert "deleted" in r.stdout
    await cluster.wait(lambda: not cluster.live("demo"), what="replicas reaped after delete")


async def test_services_expose_prometheus_metrics(nats_server):
    import urllib.request

    from llmgw.services.registry import Registry
    from llmgw.shared.natsserver import free_port

    from .conftest import service_config

    port = free_port()
    cfg = service_config(nats_server, "registry")
    import msgspec

    svc = Registry(msgspec.structs.replace(cfg, metrics_listen=f"127.0.0.1:{port}"))
    nats_server.reload()
    await svc.start()
    try:
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
        assert "llmgw_registry_inventories_total" in body and "llmgw_registry_nodes" in body
    finally:
        await svc.stop()


async def test_a_recreated_deployment_continues_its_generations(cluster, connector):
    """Ids never repeat: after delete and re-apply the new replicas are not -g1, -g2 again
    (a node away during the delete could still run the old -g1's engine)."""
    from llmgw.shared import subjects as S
    from llmgw.shared.schemas import NameRequest, encode

    await cluster.start_control_plane()
    await cluster.operator(connector)
    # No nodes: the replicas stay pending, which is enough to issue generations.
    await cluster.apply(spec(name="again", replicas=2))
    # Wait for the whole set: the scheduler writes the two records one after the other.
    await cluster.wait(lambda: cluster.ids("again"), ["again-g1", "again-g2"], what="both pending replicas")
    reply = await cluster.ops.request(S.api("scheduler", "delete"), encode(NameRequest(name="again")), timeout=5)
    assert not (reply.headers or {}).get("Nats-Service-Error-Code"), reply.data
    await cluster.wait(lambda: not cluster.live("again"), what="replicas of the deleted deployment gone")
    await cluster.apply(spec(name="again", replicas=2))
    await cluster.wait(lambda: cluster.ids("again"), ["again-g3", "again-g4"], what="both replicas of the re-created deployment")
    # A name never used before still starts at 1.
    await cluster.apply(spec(name="fresh", replicas=1))
    await cluster.wait(lambda: cluster.ids("fresh"), ["fresh-g1"], what="the fresh replica")


async def test_changed_engine_args_roll_the_replica_over_to_the_new_spec(cluster, connector):
    """A rolling update with real agents and engines: the new replica is up before the old one goes."""
    await bring_up(cluster, connector, nodes=4)
    await cluster.apply(spec())
    (old,) = await cluster.wait(lambda: cluster.ready("demo"), what="replica ready")
    old_pids = [m.pid for m in old.members]
    assert all(load_time(p) == b"0.2s" for p in old_pids)
    await cluster.apply(spec(load="0.3s"))  # engine args changed
    (new,) = await cluster.wait(lambda: [r for r in cluster.ready("demo") if r.id != old.id], what="replacement ready")
    # Placed beside the old one (surge), never on its GPUs.
    held = lambda r: {(m.node_id, g) for m in r.members for g in m.gpus}  # noqa: E731
    assert new.generation > old.generation and held(new).isdisjoint(held(old))
    # The old one was retired only once the new one was ready (the event history says so).
    from llmgw.shared.schemas import Event, decode

    sub = await cluster.ops.jetstream().subscribe("llmgw.event.replica.>", ordered_consumer=True)
    history = []
    while not any(e.subject == old.id and e.what == "reaping" for e in history):
        history.append(decode((await sub.next_msg(timeout=10)).data, Event))
    await sub.unsubscribe()
    when = {(e.subject, e.what): e.time for e in history}
    assert when[(new.id, "ready")] <= when[(old.id, "reaping")]
    assert "spec changed" in next(e.detail for e in history if e.subject == old.id and e.what == "reaping")
    await cluster.wait(lambda: old.id not in cluster.replicas.items, what="old replica reaped")
    await cluster.wait(lambda: not any(alive(p) for p in old_pids), timeout=10, what="old engines stopped")
    assert [r.id for r in cluster.live("demo")] == [new.id] and all(alive(m.pid) for m in new.members)
    assert all(load_time(m.pid) == b"0.3s" for m in new.members)


def load_time(pid: int) -> bytes:
    """The --load-time an engine process was started with (its argv, from the kernel)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    return argv[argv.index(b"--load-time") + 1] if b"--load-time" in argv else b""
