"""Standbys for every service (issue #13).

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

from llmgw.services import simcluster
from llmgw.shared import subjects as S

from .cluster_helpers import Cluster
from .test_control_plane import bring_up, spec

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
async def cluster(nats_server, tmp_path):
    c = Cluster(nats_server, tmp_path / "cluster")
    yield c
    await c.close()


async def die(svc):
    """The process dies: every task stops where it is, the connection drops."""
    for t in list(svc.tasks) + list(getattr(svc, "background", ())):
        t.cancel()
    await asyncio.gather(*svc.tasks, return_exceptions=True)
    for m in ("nodes", "leases", "deployments", "replicas"):
        await getattr(svc, m).stop()
    await svc.nc.close()


async def replica_events(ops, rid: str) -> list[str]:
    """What the stream holds for replica ``rid``, in order, read to the stream's end."""
    js = ops.jetstream()
    last = (await js.stream_info(S.EVENT_STREAM)).state.last_seq
    sub = await js.subscribe(f"llmgw.event.replica.{rid}.>", ordered_consumer=True)
    out = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=1)
            except Exception:
                break
            out.append(msg.subject.rsplit(".", 1)[1])
            if msg.metadata.num_pending == 0 or msg.metadata.sequence.stream >= last:
                break
    finally:
        await sub.unsubscribe()
    return out


@pytest.mark.parametrize("when", ["before-event", "after-event"])
async def test_scheduler_killed_between_record_and_event_loses_no_event(cluster, connector, when):
    scheds = await bring_up(cluster, connector, nodes=2, schedulers=2)
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
