"""KvMirror keeps a true copy of its bucket through a nats-server restart.

Found by bench/failover.py: after the embedded nats-server restarted, nats-py's
ordered consumer behind the watch was gone for good, every service's copy froze,
and the scheduler failed one replica over and over from its stale copy (1,500
launches in 12 s). The server here is SIGKILLed and restarted on its own store,
as a machine dies and comes back; nothing is called directly.
"""

from __future__ import annotations

import time

from llmgw.shared import buckets as B
from llmgw.shared import subjects as S
from llmgw.shared.kvmirror import open_mirror
from llmgw.shared.schemas import Lease, encode

from .waiting import eventually


def lease(node: str, state: str) -> bytes:
    now = time.time()
    return encode(Lease(node_id=node, state=state, boot_id="b1", last_renew=now, since=now))


async def test_a_mirror_follows_its_bucket_across_a_server_restart(nats_server, connector):
    writer = await connector.as_new("health", "health")
    reader = await connector.as_new("scheduler", "scheduler")
    kv_w = await writer.jetstream(timeout=5).create_key_value(bucket=S.BUCKET_LEASES)
    await kv_w.put("node01", lease("node01", "ready"))
    await kv_w.put("node02", lease("node02", "ready"))
    mirror = await open_mirror(reader.jetstream(timeout=5), B.LEASES, check_interval=0.2)
    heard: list[tuple[str, str | None, str | None]] = []
    mirror.listeners.append(lambda k, old, new: heard.append((k, old and old.state, new and new.state)))
    try:
        assert {k: v.state for k, v in mirror.items.items()} == {"node01": "ready", "node02": "ready"}

        nats_server.proc.kill()  # SIGKILL: no goodbye to anyone
        nats_server.proc.wait(10)
        nats_server.start()
        # Both clients come back on their own (bus.connect's reconnect backoff).
        await eventually(lambda: writer.is_connected and reader.is_connected, what="clients reconnected")

        async def put_lost() -> bool:
            try:
                await kv_w.put("node01", lease("node01", "lost"))
                return True
            except Exception:
                return False  # JetStream may still be recovering its store

        await eventually(put_lost, what="a write accepted after the restart")
        await kv_w.delete("node02")
        await kv_w.put("node03", lease("node03", "ready"))

        # What a reader acts on: the bucket as it is now, not as it was.
        await eventually(
            lambda: {k: v.state for k, v in mirror.items.items()},
            expected={"node01": "lost", "node03": "ready"},
            what="the mirror's copy after the restart",
        )
        # Listeners heard each difference, the deletion as new=None.
        assert ("node01", "ready", "lost") in heard
        assert ("node02", "ready", None) in heard
        assert ("node03", None, "ready") in heard
        # And the watch keeps working afterwards.
        await kv_w.put("node03", lease("node03", "suspect"))
        await eventually(lambda: mirror.items["node03"].state, expected="suspect", what="a later write")
    finally:
        await mirror.stop()


async def test_a_re_read_tells_listeners_only_what_changed(nats_server, connector):
    """A re-read that finds the bucket as it was says nothing: the scheduler wakes on
    listeners, and a restart of the server must not look like a change of every record."""
    writer = await connector.as_new("health", "health")
    reader = await connector.as_new("scheduler", "scheduler")
    kv_w = await writer.jetstream(timeout=5).create_key_value(bucket=S.BUCKET_LEASES)
    for n in ("node01", "node02"):
        await kv_w.put(n, lease(n, "ready"))
    mirror = await open_mirror(reader.jetstream(timeout=5), B.LEASES, check_interval=0.2)
    heard: list[str] = []
    mirror.listeners.append(lambda k, old, new: heard.append(k))
    try:
        nats_server.proc.kill()
        nats_server.proc.wait(10)
        nats_server.start()
        await eventually(lambda: mirror.resyncs >= 1, what="the mirror re-read its bucket after the reconnect")
        assert heard == []
        assert {k: v.state for k, v in mirror.items.items()} == {"node01": "ready", "node02": "ready"}
    finally:
        await mirror.stop()
