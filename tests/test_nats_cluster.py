"""A real 3-server NATS cluster under llmgw's PKI: configs, routes, replicas, losing a server.

Three real nats-server processes, each on its own loopback address
(127.0.0.1-3) and random free ports, routes over mutual TLS with route
certificates from llmgw's authority (pinned). A server is lost the way a
machine dies: SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import pytest
from nats.js.errors import NoStreamResponseError

from llmgw.shared import bus, natsbin, pki
from llmgw.shared import subjects as S
from llmgw.shared.errors import ConfigError
from llmgw.shared.natsconf import Peer, cluster_options, parse_peer, render_cluster
from llmgw.shared.natsserver import NatsCluster, NatsServer, free_port

from . import spawning
from .waiting import eventually

pytestmark = pytest.mark.timeout(90)

HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]

# A KV try made while a server is dead is bounded by this (seconds), where the waits
# around it allow 30 s in all: a try that meets a stream still electing a leader
# times out, and the next follows at most this long after the election.
QUICK_TRY = 1.0


def nats_t(conf) -> subprocess.CompletedProcess:
    return subprocess.run([natsbin.find(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30)


def monitor(server: NatsServer, path: str) -> dict:
    with urllib.request.urlopen(f"{server.monitor_url}{path}", timeout=5) as r:
        return json.load(r)


@pytest.fixture
def cluster(tmp_path):
    c = NatsCluster(root=tmp_path / "nats", size=3, hosts=HOSTS)
    c.prepare()
    yield c
    c.stop()


async def connect(c, tls, label, urls=None):
    return await bus.connect(urls or c.urls, tls, name=label, initial_attempts=3, reconnect_base=0.05, reconnect_max=0.3, connect_timeout=2)


# --------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------


def test_rendered_cluster_configs_pass_nats_server_t(tmp_path):
    pdir = tmp_path / "pki"
    pki.init_ca(pdir)
    peers = [parse_peer(f"nats{i + 1}=10.0.0.{11 + i}") for i in range(3)]
    pki.issue_server(pdir, [p.host for p in peers])
    for p in peers:
        pki.issue_route(pdir, p.name, [p.host])
    pki.issue(pdir, "node01", "node", tmp_path / "out")
    pki.issue(pdir, "ops", "operator", tmp_path / "out")
    texts = render_cluster(pdir, cluster_options(peers, tmp_path / "js"))
    confs = {}
    for name, text in texts.items():
        path = tmp_path / f"{name}.conf"
        path.write_text(text)
        r = nats_t(path)
        assert r.returncode == 0, r.stdout + r.stderr
        confs[name] = json.loads(text[text.index("{") :])
    stores = {c["jetstream"]["store_dir"] for c in confs.values()}
    assert len(stores) == 3  # each server its own store
    assert {c["server_name"] for c in confs.values()} == {"nats1", "nats2", "nats3"}
    users = [c["authorization"] for c in confs.values()]
    assert users[0] == users[1] == users[2]  # same accounts and permissions everywhere
    assert "urn:llmgw:node:node01" in {u["user"] for u in users[0]["users"]}
    for c in confs.values():
        cl = c["cluster"]
        assert cl["tls"]["verify"] is True
        assert sorted(cl["routes"]) == [f"nats-route://10.0.0.{11 + i}:6222" for i in range(3)]
        # exactly the three route certificates are pinned: no node or service certificate opens a route
        assert sorted(cl["tls"]["pinned_certs"]) == sorted(e.spki_sha256 for e in pki.active_routes(pdir))
        assert len(cl["tls"]["pinned_certs"]) == 3


def llmgw(*args, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "llmgw.services", *args], capture_output=True, text=True, timeout=60)
    if check:
        assert r.returncode == 0, f"llmgw {' '.join(args)}: {r.stderr}"
    return r


def test_ctl_renders_each_servers_config_and_refuses_an_even_count(tmp_path):
    pdir = str(tmp_path / "pki")
    llmgw("ctl", "cert", "init-ca", "--dir", pdir)
    llmgw("ctl", "cert", "issue-server", *HOSTS, "--dir", pdir)
    for i, h in enumerate(HOSTS):
        out = llmgw("ctl", "cert", "issue-route", f"nats{i + 1}", h, "--dir", pdir).stdout
        assert f"CN=nats{i + 1},OU=route" in out
    servers = [a for i, h in enumerate(HOSTS) for a in ("--server", f"nats{i + 1}={h}")]
    r = llmgw("ctl", "nats-config", "--pki", pdir, *servers, "--out-dir", str(tmp_path / "conf"), "--store-dir", str(tmp_path / "js"))
    assert "kv_replicas: 3" in r.stderr
    for i in range(3):
        t = nats_t(tmp_path / "conf" / f"nats{i + 1}.conf")
        assert t.returncode == 0, t.stdout + t.stderr
    r = llmgw("ctl", "nats-config", "--pki", pdir, *servers[:4], check=False)
    assert r.returncode == 2 and "2 NATS servers: use 1, or an odd number of 3 or more" in r.stderr


@pytest.mark.parametrize("n", [2, 4])
def test_even_cluster_sizes_are_refused(tmp_path, n):
    peers = [Peer(name=f"nats{i + 1}", host=f"10.0.0.{i + 1}") for i in range(n)]
    with pytest.raises(ConfigError, match=f"{n} NATS servers: use 1, or an odd number"):
        cluster_options(peers, tmp_path)


def test_a_missing_route_certificate_is_named(tmp_path):
    pdir = tmp_path / "pki"
    pki.init_ca(pdir)
    pki.issue_server(pdir, ["10.0.0.1"])
    peers = [parse_peer(f"nats{i + 1}=10.0.0.{i + 1}") for i in range(3)]
    with pytest.raises(ConfigError, match=r"no route certificate for server nats1.*issue-route nats1 10\.0\.0\.1"):
        render_cluster(pdir, cluster_options(peers, tmp_path))


@pytest.mark.parametrize("spec", ["nats1", "=10.0.0.1", "nats1=10.0.0.1:x", "Nats1=h", "nats1=h:1:2:3:4"])
def test_malformed_server_specs_are_refused(spec):
    with pytest.raises(Exception, match="server"):
        parse_peer(spec)


# --------------------------------------------------------------------------
# a running cluster
# --------------------------------------------------------------------------


async def test_cluster_forms_over_mtls_routes_and_buckets_are_r3(cluster):
    sched = cluster.issue("scheduler", "scheduler")
    cluster.start()
    for m in cluster.members:
        routes = monitor(m, "/routez")["routes"]
        # (nats-server pools several connections per peer)
        assert {r.get("remote_name") for r in routes} == {x.name for x in cluster.members if x is not m}
        assert all(r.get("tls_required", True) for r in routes)
    nc = await connect(cluster, sched, "sched")
    try:
        js = nc.jetstream(timeout=5)
        changes: list[str] = []
        await bus.provision(js, (S.BUCKET_REPLICAS,), events=True, replicas=3, adjust=True, changes=changes)
        assert changes == []  # created at R3: nothing to change
        for st in (S.kv_stream(S.BUCKET_REPLICAS), S.EVENT_STREAM):
            info = await js.stream_info(st)
            assert info.config.num_replicas == 3
            assert len(info.cluster.replicas) == 2
    finally:
        await nc.close()


async def test_a_node_certificate_cannot_join_as_a_route(cluster, tmp_path):
    """Same authority, but not a pinned route certificate: the cluster refuses the route."""
    node = cluster.issue("node01", "node")
    cluster.start()
    first = cluster.members[0]
    rogue_host = "127.0.0.9"
    conf = {
        "server_name": "rogue",
        "host": rogue_host,
        "port": free_port(rogue_host),
        "cluster": {
            "name": "llmgw",
            "host": rogue_host,
            "port": free_port(rogue_host),
            "tls": {"cert_file": node.cert, "key_file": node.key, "ca_file": node.ca, "verify": True, "timeout": 5},
            "routes": [f"nats-route://{first.host}:{first.cluster_port}"],
        },
    }
    (tmp_path / "rogue.conf").write_text(json.dumps(conf))
    rogue = await spawning.start_logged([natsbin.find(), "-c", str(tmp_path / "rogue.conf")], tmp_path / "rogue.log")
    try:
        await eventually(
            lambda: "TLS route handshake error: certificate not pinned" in first.log_path.read_text(), what="nats1 refusing the node's route", timeout=15
        )
        assert "rogue" not in {r.get("remote_name") for r in monitor(first, "/routez")["routes"]}
    finally:
        rogue.kill()
        rogue.wait(5)


async def test_a_client_keeps_working_when_its_server_is_killed(cluster):
    sched_tls = cluster.issue("scheduler", "scheduler")
    node_tls = cluster.issue("node01", "node")
    cluster.start()
    sched = await connect(cluster, sched_tls, "sched")
    try:
        victim = next(i for i, m in enumerate(cluster.members) if m.url.endswith(sched.connected_url.netloc))
        # the agent stands on another server, so the request crosses the cluster
        others = [m.url for i, m in enumerate(cluster.members) if i != victim]
        node = await connect(cluster, node_tls, "node", urls=others)
        try:

            async def answer(msg):
                await msg.respond(b"listed")

            await node.subscribe(S.cmd_list("node01"), cb=answer)
            await node.flush()
            js = sched.jetstream(timeout=3)
            kv = (await bus.provision(js, (S.BUCKET_REPLICAS,), events=False, replicas=3))[S.BUCKET_REPLICAS]
            assert (await sched.request(S.cmd_list("node01"), b"", timeout=3)).data == b"listed"

            cluster.kill(victim)

            async def request_answered():
                try:
                    return (await sched.request(S.cmd_list("node01"), b"", timeout=1)).data
                except Exception:
                    return None

            assert await eventually(request_answered, what="a request answered after the kill", timeout=30) == b"listed"
            assert not sched.connected_url.netloc.endswith(cluster.members[victim].url.split("//")[1])

            async def put():
                try:
                    return await kv.put("r1", b"after-the-kill")
                except Exception:
                    return None

            rev = await eventually(put, what="a KV write acknowledged by the two survivors", timeout=30)
            assert (await kv.get("r1")).revision == rev
        finally:
            await node.close()
    finally:
        await sched.close()


@pytest.mark.slow
async def test_an_acknowledged_write_survives_a_kill_and_the_restarted_server_catches_up(cluster):
    sched_tls = cluster.issue("scheduler", "scheduler")
    cluster.start()
    sched = await connect(cluster, sched_tls, "sched")
    try:
        js = sched.jetstream(timeout=3)
        kv = (await bus.provision(js, (S.BUCKET_REPLICAS,), events=False, replicas=3))[S.BUCKET_REPLICAS]
        await kv.put("r1", b"v1")
        # tries while a server is dead: QUICK_TRY each, not the context's 3 s
        quick = await sched.jetstream(timeout=QUICK_TRY).key_value(S.BUCKET_REPLICAS)
        victim = 2
        cluster.kill(victim)

        async def put():
            try:
                return await quick.put("r1", b"v2")
            except Exception:
                return None

        rev = await eventually(put, what="v2 acknowledged while a server is down", timeout=30)
        await asyncio.to_thread(cluster.restart, victim)  # off the loop, which the test's clients run on
        back = cluster.members[victim]

        def own_copy():
            """The restarted server's own replica of the bucket, as its monitoring reports it."""
            for acc in monitor(back, "/jsz?accounts=true&streams=true").get("account_details", []):
                for st in acc.get("stream_detail") or []:
                    if st["name"] == S.kv_stream(S.BUCKET_REPLICAS):
                        return st["state"]["last_seq"]
            return None

        # Its own copy holds both writes (v2 was acknowledged while it was dead): its
        # monitoring reports its local replica, not the leader's view.
        # (its monitoring port may be slow to answer on a loaded machine: a timeout is "not yet")
        await eventually(own_copy, rev, what="the restarted server's copy at v2's sequence", timeout=30, ignore=(OSError,))
        # Another server goes: the restarted one is now half of the majority that answers.
        cluster.kill(0)

        async def read():
            try:
                return (await quick.get("r1")).value
            except Exception:
                return None

        assert await eventually(read, what="v2 read with the restarted server in the majority", timeout=30) == b"v2"
    finally:
        await sched.close()


async def test_raising_replicas_from_one_to_three_keeps_the_data_and_survives_its_first_host(cluster):
    """Buckets made at R1 (services started with kv_replicas: 1) are raised to R3 by the
    next provisioning with kv_replicas: 3: logged, data kept, and the server that held
    the only copy can then die.

    (A *standalone* server's store is not adopted when that server joins a cluster —
    nats-server treats its streams as orphans, nats-io/nats-server#5467 — so growing
    a single server means restoring its state into the cluster; docs/operations.md.)
    """
    sched_tls = cluster.issue("scheduler", "scheduler")
    cluster.start()
    nc = await connect(cluster, sched_tls, "sched")
    try:
        js = nc.jetstream(timeout=5)
        kv = (await bus.provision(js, (S.BUCKET_REPLICAS,), events=True, replicas=1))[S.BUCKET_REPLICAS]

        # A stream just made on one server of three is heard through the others only once
        # its subject interest has crossed the routes; a publish before that finds no
        # responders (seen once in CI), so the first write waits for the bucket to take it.
        await eventually(lambda: kv.put("r1", b"kept"), what="the new R1 bucket to take a write", timeout=30, ignore=(NoStreamResponseError,))
        info = await js.stream_info(S.kv_stream(S.BUCKET_REPLICAS))
        assert info.config.num_replicas == 1
        only_copy = next(i for i, m in enumerate(cluster.members) if m.name == info.cluster.leader)
        changes: list[str] = []
        await bus.provision(js, (S.BUCKET_REPLICAS,), events=True, replicas=3, adjust=True, changes=changes)
        assert changes == [f"stream {S.kv_stream(S.BUCKET_REPLICAS)}: replicas 1 -> 3", f"stream {S.EVENT_STREAM}: replicas 1 -> 3"]

        async def all_current():
            i = await js.stream_info(S.kv_stream(S.BUCKET_REPLICAS))
            peers = [i.cluster.leader] + [p.name for p in i.cluster.replicas or [] if p.current]
            return sorted(p for p in peers if p)

        await eventually(all_current, ["nats1", "nats2", "nats3"], what="three current replicas", timeout=30)
        again: list[str] = []
        await bus.provision(js, (S.BUCKET_REPLICAS,), events=True, replicas=3, adjust=True, changes=again)
        assert again == []  # idempotent
        # reads once its first host is dead: QUICK_TRY each, not the context's 5 s
        quick = await nc.jetstream(timeout=QUICK_TRY).key_value(S.BUCKET_REPLICAS)
        cluster.kill(only_copy)

        async def read():
            try:
                return (await quick.get("r1")).value
            except Exception:
                return None

        assert await eventually(read, what="the value read with its first host dead", timeout=30) == b"kept"
    finally:
        await nc.close()


# --------------------------------------------------------------------------
# llmgw up --nats-servers 3, sim kill-nats / start-nats
# --------------------------------------------------------------------------


def test_up_refuses_an_even_number_of_servers(tmp_path):
    r = llmgw("up", "--dir", str(tmp_path / "up"), "--nats-servers", "2", "--no-demo", "--detach", check=False)
    assert r.returncode == 2 and "2 NATS servers: use 1, or an odd number of 3 or more" in r.stderr
    assert not (tmp_path / "up").exists()


@pytest.mark.slow
async def test_up_runs_on_three_servers_and_survives_killing_one(tmp_path):
    d = str(tmp_path / "up")
    try:
        await asyncio.to_thread(
            llmgw, "up", "--dir", d, "--nats-servers", "3", "--nodes", "1", "--fabrics", "0", "--no-demo", "--detach",
            "--heartbeat-interval", "500ms", "--node-lost-after", "3s", "--gateway-port", "0",
        )  # fmt: skip
        info = json.loads((tmp_path / "up" / "cluster.json").read_text())
        assert [s["name"] for s in info["nats_servers"]] == ["nats1", "nats2", "nats3"]
        assert [s["url"].split("//")[1].split(":")[0] for s in info["nats_servers"]] == HOSTS
        cfg = str(tmp_path / "up" / "operator.yaml")
        r = await asyncio.to_thread(llmgw, "sim", "kill-nats", "1", "--dir", d)
        assert "killed NATS server 1 (nats1" in r.stdout

        def node_listed():
            r = llmgw("ctl", "nodes", "-o", "json", "--config", cfg, check=False)
            return r.returncode == 0 and [n["node_id"] for n in json.loads(r.stdout)]

        # a read through the two survivors (while server 1 is down, a leader election may first time out)
        assert await eventually(lambda: asyncio.to_thread(node_listed), what="ctl nodes with nats1 dead", timeout=30) == ["node01"]
        r = await asyncio.to_thread(llmgw, "sim", "start-nats", "1", "--dir", d)
        assert "caught up with the cluster" in r.stdout
        r = await asyncio.to_thread(llmgw, "sim", "start-nats", "1", "--dir", d, check=False)
        assert r.returncode == 2 and "already running" in r.stderr
    finally:
        await asyncio.to_thread(llmgw, "down", "--dir", d, check=False)
