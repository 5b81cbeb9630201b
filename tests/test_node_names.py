"""A node whose ``mgmt_addr`` is a DNS name, end to end.

Real nats-server, real services, real agents and ``sim`` engines. The kernel's
socket tables hold addresses, never names, so every check the agent makes
(the leader's listener is its engine's, a worker holds a connection to its
leader's rendezvous) must go through what the name resolves to; the compose
kit names its nodes ``node01`` … and broke exactly there.

A name is given to an agent the way a machine has one: the system resolver
reading ``/etc/hosts``. Each agent under test runs in a mount namespace of its
own (``unshare -m``) whose ``/etc/hosts`` is a file of the test's, bind-mounted,
so the name resolves for that agent and its engines only, and rewriting the
file changes what it resolves to, as a DNS change does. That needs root; where
it cannot be had the tests that need it are skipped, saying why. ``localhost``
needs no namespace.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import openai
import pytest

from llmgw.services.devcluster import simcluster
from llmgw.services.health.service import HealthMonitor
from llmgw.services.registry import Registry
from llmgw.services.scheduler import reasons as R
from llmgw.services.scheduler.service import Scheduler
from llmgw.shared import buckets as B
from llmgw.shared import procfs, procnet
from llmgw.shared import subjects as S
from llmgw.shared.kvmirror import open_mirror
from llmgw.shared.schemas import Event, NameRequest, NodeAddrRequest, NodeRecord, encode

from .cluster_helpers import HEALTH, SCHED, TIMINGS, Cluster, sim_spec
from .gateway_helpers import HOST, gateway_config, start_gateway

pytestmark = pytest.mark.timeout(120)

DISCOVERY = 0.3  # seconds: how soon an agent sees its name resolve differently
FOREIGN = "10.255.255.7"  # an address no machine of the test holds


def _namespace_problem() -> str:
    if os.geteuid() != 0:
        return "needs root: each agent gets its own /etc/hosts in a mount namespace"
    if not shutil.which("unshare"):
        return "needs unshare (util-linux) for a mount namespace"
    r = subprocess.run(["unshare", "-m", "--", "sh", "-c", "mount --bind /etc/hosts /etc/hosts"], capture_output=True, text=True)
    return "" if r.returncode == 0 else f"cannot bind-mount /etc/hosts in a mount namespace here: {r.stderr.strip() or r.returncode}"


NAMESPACE_PROBLEM = _namespace_problem()
needs_namespace = pytest.mark.skipif(bool(NAMESPACE_PROBLEM), reason=NAMESPACE_PROBLEM)


def write_hosts(path: Path, entries: list[tuple[str, str]]) -> Path:
    """An /etc/hosts of (address, name) lines. Written in place (same inode): the
    bind mount shows the agent the new contents, as a DNS change would."""
    text = "127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for addr, name in entries)
    with open(path, "a+") as f:
        f.seek(0)
        f.truncate()
        f.write(text)
    return path


def own_hosts(hosts: Path) -> tuple[str, ...]:
    """Run a command with ``hosts`` as its /etc/hosts (and its children's)."""
    return ("unshare", "-m", "--", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts))


class Names:
    """A control plane, nodes named by DNS, and what the test watches."""

    def __init__(self, cluster: Cluster, tmp_path: Path):
        self.cluster = cluster
        self.tmp = tmp_path
        self.net = f"127.{random.randint(100, 250)}.{random.randint(0, 250)}"
        self.events: list[Event] = []
        self.gateways: list = []

    async def start(self, connector, names: dict[str, str], *, record: dict[str, str], hosts: Path | None) -> None:
        c = self.cluster
        await c.start_service(Registry, "registry")
        # No node is lost here on purpose: a lenient lost-after keeps a loaded machine's
        # slow heartbeat from failing a replica these tests watch serve.
        await c.start_service(HealthMonitor, "health", health={**HEALTH, "suspect_after_missed": 10, "node_lost_after": 8.0})
        # Ports of our own: a node at 127.0.0.1 shares its address with everything on the machine.
        await c.start_service(Scheduler, "scheduler", scheduler={**SCHED, "port_base": random.randrange(30000, 58000, 100), "port_count": 100})
        specs = [dataclasses.replace(s, mgmt_addr=names[s.node_id]) for s in simcluster.layout(len(names), 1, 4)]
        c.add_nodes(specs, timings=dataclasses.replace(TIMINGS, discovery_interval=DISCOVERY))
        self.ops = ops = await c.operator(connector)

        async def on_event(msg) -> None:
            self.events.append(B.EVENTS.decode(msg.data))

        await ops.subscribe("llmgw.event.node.>", cb=on_event)
        for node, addr in record.items():
            reply = await ops.request(S.api("registry", "set-addr"), encode(NodeAddrRequest(node_id=node, addr=addr)), timeout=5)
            assert not (reply.headers or {}).get("Nats-Service-Error-Code"), reply.data
        self.records = await open_mirror(ops.jetstream(), B.NODES, wait=10)
        for node in names:
            c.start_agent(node, wrap=own_hosts(hosts) if hosts else ())

    def record(self, node: str) -> NodeRecord | None:
        return self.records.items.get(node)

    def event(self, node: str, what: str) -> Event | None:
        return next((e for e in self.events if e.subject == node and e.what == what), None)

    async def verdicts(self, deployment: str) -> tuple[bool, dict[str, tuple[bool, str, str]]] | None:
        """``ctl explain``'s answer: (placeable, node -> (ok, reason, detail)); None
        while the scheduler does not know the deployment yet."""
        reply = await self.ops.request(S.api("scheduler", "explain"), encode(NameRequest(name=deployment)), timeout=5)
        if (reply.headers or {}).get("Nats-Service-Error-Code"):
            return None
        why = json.loads(reply.data)
        return why["placeable"], {n["node_id"]: (n["ok"], n["reason"], n["detail"]) for n in why["nodes"]}

    async def close(self) -> None:
        for gw in self.gateways:
            await gw.stop()
        await self.records.stop()


@pytest.fixture
async def names(nats_server, tmp_path):
    c = Cluster(nats_server, tmp_path / "cluster")
    n = Names(c, tmp_path)
    yield n
    if hasattr(n, "records"):
        await n.close()
    await c.close()


def engine_listens(addr: str, port: int, pid: int) -> bool:
    """The kernel shows ``addr:port`` listening, held by ``pid``'s process tree."""
    there = procnet.answering(procnet.listeners(), addr, port)
    ours: set[int] = set()
    for p in procfs.tree(pid) | {pid}:
        ours |= procfs.socket_inodes(p)
    return bool(there) and all(s.inode in ours for s in there)


def leader_pid(cluster: Cluster, node: str, replica_id: str) -> int:
    (engine,) = [e for e in simcluster.running_engines(node, simcluster.node_work_dir(cluster.nodes[node].config)) if e.replica_id == replica_id]
    return engine.pid


async def test_a_leader_at_localhost_becomes_ready_and_serves_through_the_gateway(names, connector, nats_server):
    """A node named ``localhost`` (recorded so: the registry resolves it too): its
    leader binds 127.0.0.1, is proved by the kernel's table, and the gateway
    reaches it by the name in its endpoint."""
    c = names.cluster
    await names.start(connector, {"node01": "localhost"}, record={"node01": "localhost"}, hosts=None)
    await c.apply(sim_spec("solo", replicas=1, nodes=1, gpus=2))
    (rep,) = await c.wait(lambda: c.ready("solo"), what="the replica ready", timeout=45)
    port = rep.members[0].http_port
    assert rep.endpoint == f"http://localhost:{port}"
    rec = names.record("node01")
    assert rec is not None and rec.mgmt_ips == ["127.0.0.1"] and not rec.addr_problem
    assert engine_listens("127.0.0.1", port, leader_pid(c, "node01", rep.id))

    cfg = gateway_config(nats_server, "gw-names")
    nats_server.reload()  # the gateway's new certificate admitted
    gw = await start_gateway(cfg)
    names.gateways.append(gw)
    await c.wait(lambda: gw.router.models() == ["sim-7b"], what="the gateway routes the replica")
    client = openai.AsyncOpenAI(base_url=f"http://{HOST}:{gw.port}/v1", api_key="unused", max_retries=0, timeout=15)
    raw = await client.chat.completions.with_raw_response.create(model="sim-7b", messages=[{"role": "user", "content": "hello"}])
    assert raw.headers.get("x-llmgw-replica") == rep.id
    assert raw.parse().choices[0].message.content


@needs_namespace
async def test_a_two_node_replica_named_by_dns_joins_and_serves_on_the_first_address_of_this_machine(names, connector):
    """node01's name resolves to two addresses of the machine, node02's to one
    foreign address and one of the machine's; addresses were recorded at
    onboarding. The worker joins its leader by name, the leader listens on the
    first of its own addresses only, and each record says what its name means."""
    net = names.net
    hosts = write_hosts(
        names.tmp / "hosts",
        [(f"{net}.1", "node01.llmgw.test"), (f"{net}.9", "node01.llmgw.test"), (FOREIGN, "node02.llmgw.test"), (f"{net}.2", "node02.llmgw.test")],
    )
    c = names.cluster
    await names.start(
        connector,
        {"node01": "node01.llmgw.test", "node02": "node02.llmgw.test"},
        record={"node01": f"{net}.1", "node02": f"{net}.2"},
        hosts=hosts,
    )
    await c.wait(lambda: all((r := names.record(n)) is not None and r.boot_id for n in ("node01", "node02")), what="both inventories accepted", timeout=45)
    r1, r2 = names.record("node01"), names.record("node02")
    assert r1 is not None and r2 is not None
    assert sorted(r1.mgmt_ips) == [f"{net}.1", f"{net}.9"] and r2.mgmt_ips == [f"{net}.2"]
    assert r1.mgmt_ips[0] == f"{net}.1", "the recorded address is where the engines bind, or the registry refuses the claim"
    assert (r1.addr_problem, r2.addr_problem) == ("", "")
    assert not [e for e in names.events if e.what == "addr-refused"]

    await c.apply(sim_spec("pair", replicas=1, nodes=2, gpus=2))
    (rep,) = await c.wait(lambda: c.ready("pair"), what="the 2-node replica ready", timeout=45)
    leader, worker = sorted(rep.members, key=lambda m: m.rank)
    assert (leader.node_id, worker.node_id) == ("node01", "node02")
    await c.wait(lambda: [m.engine_state for m in c.replicas.items[rep.id].members if m.rank == 1], ["joined"], what="the worker joined")
    assert rep.endpoint == f"http://{net}.1:{leader.http_port}"
    pid = leader_pid(c, "node01", rep.id)
    assert engine_listens(f"{net}.1", leader.http_port, pid)
    assert f"{net}.9" not in {s.addr for s in procnet.listeners() if s.port == leader.http_port}, "engines bind one address, not the name"


@needs_namespace
async def test_a_name_that_stops_resolving_refuses_launches_and_keeps_what_runs(names, connector):
    """The name disappears from the node's resolver: the node says so (event,
    record, ``ctl explain``), nothing new is placed or started there, the leader
    already serving keeps serving; when the name resolves again the waiting
    replica is placed."""
    net = names.net
    hosts = write_hosts(names.tmp / "hosts", [(f"{net}.1", "node01.llmgw.test")])
    c = names.cluster
    await names.start(connector, {"node01": "node01.llmgw.test"}, record={"node01": f"{net}.1"}, hosts=hosts)
    await c.apply(sim_spec("first", replicas=1, nodes=1, gpus=2))
    (first,) = await c.wait(lambda: c.ready("first"), what="the first replica ready", timeout=45)
    pid = leader_pid(c, "node01", first.id)

    write_hosts(hosts, [])
    await c.wait(lambda: names.event("node01", "addr-problem"), what="an addr-problem event", timeout=30)
    rec = names.record("node01")
    assert rec is not None and rec.addr_problem == "mgmt_addr node01.llmgw.test does not resolve: Name or service not known"
    assert names.event("node01", "addr-problem").detail.startswith(rec.addr_problem)

    await c.apply(sim_spec("second", replicas=1, nodes=1, gpus=2))
    await c.wait(
        lambda: names.verdicts("second"),
        (False, {"node01": (False, R.ADDR_PROBLEM, rec.addr_problem)}),
        what="explain shows the node refused for its address",
    )
    assert all(r.state == "pending" for r in c.live("second"))
    assert not [e for e in simcluster.running_engines("node01", simcluster.node_work_dir(c.nodes["node01"].config)) if e.replica_id != first.id]
    # The running leader was left alone: same process, still ready, still its engine's port.
    assert c.ready("first") and leader_pid(c, "node01", first.id) == pid
    assert engine_listens(f"{net}.1", first.members[0].http_port, pid)

    write_hosts(hosts, [(f"{net}.1", "node01.llmgw.test")])
    await c.wait(lambda: names.event("node01", "addr-ok"), what="an addr-ok event", timeout=30)
    await c.wait(lambda: c.ready("second"), what="the waiting replica placed and ready", timeout=45)


@needs_namespace
async def test_a_name_that_resolves_elsewhere_is_refused_with_its_reason(names, connector):
    """node01's name resolves on the node to an address of its own, but not the
    one recorded at onboarding: the registry refuses its inventory. node02's
    name resolves only to another machine's address: the agent says so itself.
    Both reasons reach the event stream and ``ctl explain``; nothing is placed."""
    net = names.net
    hosts = write_hosts(names.tmp / "hosts", [(f"{net}.1", "node01.llmgw.test"), (FOREIGN, "node02.llmgw.test")])
    c = names.cluster
    await names.start(connector, {"node01": "node01.llmgw.test", "node02": "node02.llmgw.test"}, record={"node01": f"{net}.5"}, hosts=hosts)
    refused = await c.wait(lambda: names.event("node01", "addr-refused"), what="node01's claim refused", timeout=45)
    assert refused.detail == (
        f"node01's inventory claims mgmt_addr node01.llmgw.test, which resolves on the node to {net}.1 (its engines listen on {net}.1), "
        f"but its recorded address is {net}.5; refused"
    )
    problem = await c.wait(lambda: names.event("node02", "addr-problem"), what="node02's own address problem", timeout=45)
    said = f"mgmt_addr node02.llmgw.test resolves to {FOREIGN}, none of which is an address of this machine"
    assert problem.detail.startswith(said)

    await c.apply(sim_spec("nowhere", replicas=1, nodes=1, gpus=2))
    await c.wait(
        lambda: names.verdicts("nowhere"),
        (False, {"node01": (False, R.ADDR_PROBLEM, refused.detail), "node02": (False, R.ADDR_PROBLEM, said)}),
        what="explain with both nodes refused for their addresses",
    )
    assert not c.ready("nowhere")
    for node in ("node01", "node02"):
        assert not simcluster.running_engines(node, simcluster.node_work_dir(c.nodes[node].config))
