"""Standbys for every service.

* The event outbox: a scheduler that dies between writing a replica record and
  publishing its event loses no event, and doubles none, once a standby takes
  over. The death is modelled in-process (the services run in the test's loop,
  tests/cluster_helpers.py): at the crash point the acting scheduler's tasks
  are cancelled and its connection closed — no resignation, nothing more sent,
  as a SIGKILL would leave it — while it is blocked publishing the event.
* ``llmgw up --ha``: real service processes, SIGKILLed one after another.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from llmgw.shared import buckets as B
from llmgw.shared.tasks import cancel_and_wait

from .cluster_helpers import MOVE, Cluster, replica_event_records
from .test_control_plane import bring_up, spec

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
async def cluster(nats_server, tmp_path):
    c = Cluster(nats_server, tmp_path / "cluster")
    yield c
    await c.close()


async def die(svc):
    """The process dies: every task stops where it is, the connection drops."""
    stuck = await cancel_and_wait([*svc.tasks, *getattr(svc, "background", ())])
    assert not stuck, f"tasks that did not end when cancelled: {[t.get_name() for t in stuck]}"
    for m in ("nodes", "leases", "deployments", "replicas"):
        await getattr(svc, m).stop()
    await svc.nc.close()


async def replica_events(ops, rid: str) -> list[str]:
    """What the stream holds for replica ``rid``, in order, read to the stream's end: its words."""
    return [e.what for e in await replica_event_records(ops, rid)]


@pytest.mark.parametrize("when", ["before-event", "after-event"])
async def test_scheduler_killed_between_record_and_event_loses_no_event(cluster, connector, when):
    scheds = await bring_up(cluster, connector, nodes=2, schedulers=2, **MOVE)  # the worker's kill below fails the replica
    await cluster.apply(spec())
    (first,) = await cluster.wait(lambda: cluster.ready("demo"), what="replica ready")
    leader = next(s for s in scheds if s.leadership.is_leader)
    standby = next(s for s in scheds if s is not leader)
    publish = leader.events.publish
    crashed = asyncio.Event()

    async def crash_point(ev, msg_id=""):
        if ev.kind == "replica" and ev.subject == first.id and ev.what == "failed":
            if when == "after-event":
                await publish(ev, msg_id=msg_id)
            crashed.set()
            asyncio.get_running_loop().create_task(die(leader))
            await asyncio.Event().wait()  # cancelled by the death
        return await publish(ev, msg_id=msg_id)

    leader.events.publish = crash_point
    os.kill(first.members[1].pid, signal.SIGKILL)  # the worker engine dies: the replica fails
    await cluster.wait(lambda: crashed.is_set(), what="the leader reached the crash point")
    cluster.services.remove(leader)
    # The record says failed (written before the crash point) …
    await cluster.wait(lambda: (r := cluster.replicas.items.get(first.id)) is None or r.state != "ready", what="failed record stored")
    await cluster.wait(lambda: standby.leadership.is_leader, what="standby takes over")
    # … and the standby finishes the job: the old replica reaped, a new one ready.
    await cluster.wait(
        lambda: first.id not in cluster.replicas.items and [r for r in cluster.ready("demo") if r.id != first.id], timeout=30, what="rebuilt by the standby"
    )
    seen = await replica_events(cluster.ops, first.id)
    assert seen.count("failed") == 1, seen
    assert seen[-1] == "gone" or "reaping" in seen, seen


# --------------------------------------------------------------------------
# llmgw up --ha: real processes
# --------------------------------------------------------------------------

UP_ARGS = [
    "--nodes",
    "2",
    "--fabrics",
    "1",
    "--gpus-per-node",
    "8",
    "--heartbeat-interval",
    "0.5s",
    "--node-lost-after",
    "3s",
    "--engine-load-time",
    "0.5s",
    "--gateway-port",
    "0",
]


def _llmgw(*args, timeout=150):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "llmgw.services", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def ha_dir(tmp_path):
    d = tmp_path / "ha"
    yield d
    _llmgw("down", "--dir", str(d), timeout=60)


def _pids(d) -> dict:
    import json

    return json.loads((d / "pids.json").read_text())


def _proc_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _chat(url: str) -> str:
    import json
    import urllib.request

    body = json.dumps({"model": "sim-70b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


@pytest.mark.slow
async def test_up_ha_survives_killing_the_acting_scheduler_health_monitor_and_a_gateway(ha_dir):
    import json

    from llmgw.shared import bus
    from llmgw.shared.config import load_service_config
    from llmgw.shared.kvmirror import open_mirror

    from .waiting import eventually

    done = _llmgw("up", "--dir", str(ha_dir), "--ha", "--detach", *UP_ARGS)
    assert done.returncode == 0, done.stdout + done.stderr
    info = json.loads((ha_dir / "cluster.json").read_text())
    assert info["gateway_url"] == info["gateway_urls"][0] and len(info["gateway_urls"]) == 2
    assert {"health-b", "scheduler-b", "gateway-b", "supervisor"} <= set(_pids(ha_dir))
    cfg = load_service_config(ha_dir / "operator.yaml")
    nc = await bus.connect(cfg.server, cfg.tls_files(), name="test-ha", initial_attempts=5, reconnect_base=0.1, reconnect_max=0.5)
    js = nc.jetstream()
    leaders = await open_mirror(js, B.LEADERS, wait=10)
    replicas = await open_mirror(js, B.REPLICAS, wait=10)
    try:

        def ready() -> list[str]:
            return sorted(r.id for r in replicas.items.values() if r.state == "ready")

        before = await eventually(lambda: (ids := ready()) and len(ids) == 2 and ids, timeout=20, what="two replicas ready")

        def acting_pid(service):
            lease = leaders.items.get(service)
            return int(lease.holder.split(":")[-2]) if lease else None

        async def kill_the_acting(service: str) -> None:
            # A function per service, not a loop body: the waits' closures bind this call's victim.
            victim = await eventually(lambda: acting_pid(service), timeout=10, what=f"an acting {service}")
            name = next(n for n, p in _pids(ha_dir).items() if p["pid"] == victim)
            os.kill(victim, signal.SIGKILL)
            # The standby takes over (a live process other than the victim holds the lease) …
            heir = await eventually(
                lambda: (p := acting_pid(service)) not in (None, victim) and _proc_alive(p) and p, timeout=20, what=f"standby {service} takes over"
            )

            # … and the supervisor restarts the killed one, and says so (recorded, then said).
            def said() -> bool:
                return f"{name} (pid {victim}) exited; restarted as pid {_pids(ha_dir)[name]['pid']}" in (ha_dir / "logs" / "supervisor.log").read_text()

            await eventually(
                lambda: _pids(ha_dir)[name]["pid"] != victim and _proc_alive(_pids(ha_dir)[name]["pid"]) and said(),
                timeout=20,
                what=f"{name} restarted, and said so",
            )
            assert heir != victim

        for service in ("scheduler", "health"):
            await kill_the_acting(service)

        gw = _pids(ha_dir)["gateway"]["pid"]
        os.kill(gw, signal.SIGKILL)
        assert _chat(info["gateway_urls"][1])  # the other gateway answers at once
        await eventually(lambda: _pids(ha_dir)["gateway"]["pid"] != gw and _proc_alive(_pids(ha_dir)["gateway"]["pid"]), timeout=20, what="gateway restarted")
        # Nothing was rebuilt or doubled: the same two replicas, ready, and no others.
        assert ready() == before
        assert sorted(replicas.items) == before

        # The restarted gateway serves again (it reads the replicas anew).
        async def restarted_gateway_answers():
            try:
                return bool(await asyncio.to_thread(_chat, info["gateway_urls"][0]))
            except Exception:
                return False

        await eventually(restarted_gateway_answers, timeout=20, what="the restarted gateway answers")
    finally:
        await leaders.stop()
        await replicas.stop()
        await nc.close()
