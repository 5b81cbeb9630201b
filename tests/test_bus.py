"""The bus helper against a real server: provisioning, reconnects, backoff."""

from __future__ import annotations

import asyncio
import logging
import random
import re

import pytest

from llmgw.shared import bus
from llmgw.shared import subjects as S
from llmgw.shared.errors import BusError, ConfigError
from llmgw.shared.tls import TlsFiles

from .waiting import eventually


async def test_provisioning_is_idempotent(connector):
    sched = await connector.as_new("scheduler", "scheduler")
    js = sched.jetstream()
    first = await bus.provision(js, (S.BUCKET_REPLICAS, S.BUCKET_DEPLOYMENTS))
    await first[S.BUCKET_REPLICAS].put("r-1", b"v")
    ops = await connector.as_new("ops", "operator")
    js = ops.jetstream()
    # again, by a reader (which may open but not create): nothing recreated, nothing lost
    second = await bus.provision(js, (S.BUCKET_REPLICAS, S.BUCKET_DEPLOYMENTS))
    assert set(second) == {S.BUCKET_REPLICAS, S.BUCKET_DEPLOYMENTS}
    assert (await second[S.BUCKET_REPLICAS].get("r-1")).value == b"v"
    info = await js.stream_info(S.EVENT_STREAM)
    assert info.config.subjects == [S.ALL_EVENTS]
    assert info.config.num_replicas == 1


async def test_services_provision_their_own_buckets_only(connector):
    reg = await connector.as_new("registry", "registry")
    kvs = await bus.provision(reg.jetstream(), (S.BUCKET_NODES,))
    assert list(kvs) == [S.BUCKET_NODES]
    gw = await connector.as_new("gateway", "gateway")
    with pytest.raises(BusError):
        await bus.provision(gw.jetstream(timeout=1), (S.BUCKET_REPLICAS,), events=False)


async def test_reconnects_after_server_restart_and_keeps_subscriptions(connector, caplog):
    caplog.set_level(logging.INFO, logger="llmgw.bus")
    srv = connector.server
    ops = await connector.as_new("ops", "operator")
    node = await connector.as_new("node01", "node")
    got = asyncio.Queue()

    async def cb(msg):
        await got.put(msg.data)

    await ops.subscribe(S.heartbeat("node01"), cb=cb)
    await ops.flush()
    srv.stop()
    # both clients notice the server is gone (a condition, not half a second)
    await eventually(lambda: (node.is_connected, ops.is_connected), (False, False), what="both clients disconnected", timeout=10)
    srv.start()
    await eventually(lambda: (node.is_connected, ops.is_connected), (True, True), what="both clients reconnected", timeout=15)
    await ops.flush()  # its re-sent subscription has reached the server before anything is published
    await node.publish(S.heartbeat("node01"), b"after-restart")
    assert await asyncio.wait_for(got.get(), 5) == b"after-restart"
    await eventually(lambda: "disconnected from NATS" in caplog.text and "reconnected to NATS" in caplog.text, what="both logged", timeout=5)


async def test_initial_connect_gives_up_with_a_clear_error(tmp_path, nats_server):
    tls = nats_server.issue("node01", "node")
    with pytest.raises(BusError, match=re.escape("cannot connect to NATS at tls://127.0.0.1:1")):
        await bus.connect("tls://127.0.0.1:1", tls, name="t", initial_attempts=2, reconnect_base=0.01)


def test_missing_tls_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"tls\.cert: file"):
        TlsFiles(ca=__file__, cert=str(tmp_path / "missing.pem"), key=__file__).context()


@pytest.mark.parametrize("attempt, expected", [(0, 1.0), (1, 2.0), (3, 8.0), (10, 30.0)])
def test_backoff_doubles_up_to_the_cap(attempt, expected):
    rng = random.Random(1)
    d = bus.backoff_delay(attempt, 1.0, 30.0, rng)
    assert expected * 0.8 <= d <= expected * 1.2
