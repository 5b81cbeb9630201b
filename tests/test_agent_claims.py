"""The agent's side: a node proves what it claims.

* "ready" means the engine this agent launched answered: a process squatting
  on a leader's port (found in the kernel's socket table, owned by nobody in
  the engine's process tree) gets the launch refused or the engine ended,
  naming the squatter — never a ``ready``;
* one agent per work dir (an exclusive lock; a second one exits 2 naming the
  holder);
* an agent that was frozen (SIGSTOP) past ``node_lost_after`` sends a full
  report as soon as it runs again, so the scheduler fences its stale engines
  without the agent being restarted.

Everything is real: squatters are real processes listening on real sockets,
engines are the real ``sim`` engine, the freeze is a real SIGSTOP.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import textwrap

import pytest

from llmgw.services.agent.config import SupervisorConfig
from llmgw.services.agent.supervisor import PORT_BUSY, Supervisor
from llmgw.services.devcluster import simcluster
from llmgw.shared import procnet
from llmgw.shared.natsserver import free_port
from llmgw.shared.schemas import DeploymentSpec

from .agent_helpers import Tap, eventually, kill_engines, make_launch, recorded_engines
from .cluster_helpers import Cluster
from .test_agent import NODE, Node
from .test_agent_config import certs  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(90)

NODE_GPUS = set(range(8))

# A stranger on a leader's port: answers /health 200 and even a completion,
# so neither the health check nor a canary could tell it from an engine.
SQUAT = textwrap.dedent(
    """
    import http.server, json, sys

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._answer({"status": "ok"})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self._answer({"choices": [{"text": "pong"}], "usage": {"completion_tokens": 1}})

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        allow_reuse_address = True  # SO_REUSEADDR: may share a port our engine holds bound, not listening

    Server((sys.argv[1], int(sys.argv[2])), Handler).serve_forever()
    """
)


class Recorder:
    def __init__(self):
        self.facts = []

    def __call__(self, fact) -> None:
        self.facts.append(fact)

    def states(self, replica_id: str) -> list[str]:
        return [f.state for f in self.facts if f.replica_id == replica_id]

    def last(self, replica_id: str):
        return next((f for f in reversed(self.facts) if f.replica_id == replica_id), None)


@pytest.fixture
def squatters(tmp_path):
    script = tmp_path / "squat.py"
    script.write_text(SQUAT)
    started: list[subprocess.Popen] = []

    async def start(host: str, port: int) -> subprocess.Popen:
        # fork+exec off the loop: the agent under test runs on this loop and must not stall behind it
        p = await asyncio.to_thread(subprocess.Popen, [sys.executable, str(script), host, str(port)], stdin=subprocess.DEVNULL)
        started.append(p)
        await eventually(lambda: (host, port) in procnet.listening_sockets(), f"squatter listening on {host}:{port}")
        return p

    yield start
    for p in started:
        p.kill()
        p.wait(5)


@pytest.fixture
async def supervisor(tmp_path):
    wd = tmp_path / "agent"
    cfg = SupervisorConfig(work_dir=str(wd), log_lines=20, stop_timeout=1.0, health_interval=0.1, probe_interval=1.0, probe_timeout=1.0)
    sup = Supervisor(cfg, mgmt_addr="127.0.0.1", mgmt_interface="lo", on_change=Recorder())
    await sup.adopt()
    sup.start()
    yield sup
    await sup.close()
    kill_engines(wd)


# --------------------------------------------------------------------------
# (a), (b) ready means the engine we launched answered
# --------------------------------------------------------------------------


async def test_a_launch_on_a_port_someone_listens_on_is_refused_naming_the_holder(supervisor, squatters):
    port = free_port()
    squatter = await squatters("127.0.0.1", port)
    ack = await supervisor.launch(make_launch("r1", http_port=port), NODE_GPUS)
    assert not ack.ok and ack.code == PORT_BUSY, ack
    assert f"HTTP port {port} on 127.0.0.1 is held by pid {squatter.pid} (" in ack.reason and "squat.py" in ack.reason, ack.reason
    # Nothing was started, so nothing can ever be reported ready.
    assert supervisor.facts() == [] and supervisor.on_change.facts == []
    assert recorded_engines(supervisor.root.parent) == {}


async def test_a_squatter_answering_while_our_engine_loads_is_never_taken_for_it(supervisor, squatters):
    port = free_port()
    # Our engine holds 127.0.0.1:port bound but not listening while it loads (3 s);
    # the squatter listens on the wildcard address meanwhile and answers /health 200.
    ack = await supervisor.launch(make_launch("r1", http_port=port, load_time="3s"), NODE_GPUS)
    assert ack.ok, ack
    engine_pid = ack.pid or supervisor.facts()[0].pid
    squatter = await squatters("0.0.0.0", port)
    rec = supervisor.on_change

    def ended():
        f = rec.last("r1")
        return f if f is not None and f.state == "exited" and f"held by pid {squatter.pid}" in f.detail else None

    fact = await eventually(ended, "our engine ended and reported exited, naming the squatter", timeout=20)
    assert f"port {port} on 0.0.0.0 is held by pid {squatter.pid} (" in fact.detail, fact.detail
    assert f"not by the engine we launched (pid {engine_pid})" in fact.detail, fact.detail
    assert "ready" not in rec.states("r1"), rec.states("r1")
    assert squatter.poll() is None, "the squatter is not ours to signal"


# --------------------------------------------------------------------------
# (c) one agent per work dir
# --------------------------------------------------------------------------


@pytest.fixture
def node(tmp_path, nats_server):
    n = Node(root=tmp_path, tls=nats_server.issue(NODE, "node"), nats_url=nats_server.url)
    n.configure(nats_server.url)
    yield n
    for a in n.agents:
        a.kill()
    kill_engines(n.work_dir)


async def test_a_second_agent_on_the_same_work_dir_refuses_to_start(node, connector, nats_server):
    ops = connector.identity("ops", "operator")
    tap = await Tap(NODE).start(await connector.connect(ops, label="operator/ops"))
    first = node.start_agent()
    await eventually(lambda: tap.heartbeats, "the first agent heartbeating")
    second = node.start_agent()
    assert second.proc.wait(30) == 2, second.log()
    expected = f"another llmgw agent (pid {first.proc.pid}) is running on work dir {node.work_dir}; refusing to start"
    assert expected in second.log(), second.log()
    # The first one carries on: still running, still heartbeating after the second left.
    seen = tap.heartbeats[-1].seq
    await eventually(lambda: any(h.seq > seen + 1 for h in tap.heartbeats), "the first agent still heartbeating")
    assert first.proc.poll() is None
    assert {h.boot_id for h in tap.heartbeats} == {tap.heartbeats[0].boot_id}, "only the first agent ever spoke"
    # The lock goes with its holder: once the first ends, an agent starts there.
    assert first.terminate() == 0
    third = node.start_agent()
    await eventually(lambda: len({h.boot_id for h in tap.heartbeats}) == 2, "a new agent heartbeating after the first ended")
    assert third.proc.poll() is None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


# --------------------------------------------------------------------------
# (d) a frozen agent's stale engines are fenced when it runs again
# --------------------------------------------------------------------------


@pytest.fixture
async def cluster(nats_server, tmp_path):
    c = Cluster(nats_server, tmp_path / "cluster")
    yield c
    await c.close()


async def test_a_thawed_agent_gets_its_stale_engines_fenced_without_a_restart(cluster, connector):
    await cluster.start_control_plane()
    # Node ids and loopback addresses of this test's own: other simulated
    # clusters on the machine use node01… on 127.0.1.N, and the agent would
    # rightly refuse ports their engines hold (and 'llmgw sim kill-node node01'
    # elsewhere would kill ours).
    net = f"127.{random.randrange(2, 250)}.{random.randrange(2, 250)}"
    cluster.add_nodes([simcluster.SimNodeSpec(f"claims{i}", "ib-a", 4, f"{net}.{i}") for i in (1, 2)])
    for n in cluster.nodes:
        cluster.start_agent(n)
    await cluster.operator(connector)
    await cluster.wait(lambda: len([lease for lease in cluster.leases.items.values() if lease.state == "ready"]) == 2, what="both nodes ready")
    demo = DeploymentSpec(
        name="demo", model="sim-7b", engine="sim", replicas=1, nodes_per_replica=1, gpus_per_node=2, engine_args=["--load-time", "0.2s"], startup_timeout=30
    )
    await cluster.apply(demo)
    (first,) = await cluster.wait(lambda: cluster.ready("demo"), what="replica ready")
    node, stale_pid = first.members[0].node_id, first.members[0].pid
    agent = cluster.agents[node]
    # The agent alone freezes (its engines run on, in sessions of their own),
    # as a node partitioned away would look to the control plane.
    agent.send_signal(signal.SIGSTOP)
    try:
        await cluster.wait(lambda: cluster.leases.items[node].state == "lost", what=f"{node} lost")
        await cluster.wait(
            lambda: first.id not in cluster.replicas.items and [r for r in cluster.ready("demo") if r.id != first.id],
            what="old replica deleted and its replacement ready",
        )
        assert alive(stale_pid), "the stale leader runs on while its agent is frozen"
    finally:
        agent.send_signal(signal.SIGCONT)
    # Same agent process, same NATS connection: nothing changed locally, yet the
    # control plane must hear about the stale engine and fence it.
    await cluster.wait(lambda: not alive(stale_pid), timeout=20, what="stale leader stopped by fencing")
    assert agent.poll() is None, "the agent was not restarted"
    (second,) = cluster.ready("demo")
    assert second.members[0].node_id != node


# --------------------------------------------------------------------------
# the kernel's word, two ways
# --------------------------------------------------------------------------


def test_sock_diag_and_proc_net_tcp_agree_on_who_listens():
    """The netlink dump the agent reads and the /proc tables it falls back to name the same sockets."""
    import os
    import socket

    socks = []
    try:
        for family, addr in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::"), (socket.AF_INET6, "::1")):
            s = socket.socket(family)
            socks.append(s)
            s.bind((addr, 0))
            s.listen()
        connected = socket.create_connection(socks[0].getsockname())  # an established one is no listener
        socks.append(connected)
        mine = {s.getsockname()[1]: (s.getsockname()[0], os.fstat(s.fileno()).st_ino) for s in socks[:4]}

        def view(found):
            return sorted((listener.addr, listener.port, listener.inode) for listener in found if listener.port in mine)

        expected = sorted((addr, port, inode) for port, (addr, inode) in mine.items())
        assert view(procnet._diag_listeners()) == expected
        assert view(procnet._proc_listeners()) == expected
        assert procnet.answering(procnet.listeners(), "127.0.0.1", socks[1].getsockname()[1])[0].addr == "0.0.0.0"
        assert procnet.answering(procnet.listeners(), "127.0.0.1", socks[2].getsockname()[1])[0].addr == "::"
        assert procnet.answering(procnet.listeners(), "127.0.0.2", socks[0].getsockname()[1]) == []
    finally:
        for s in socks:
            s.close()


# --------------------------------------------------------------------------
# configuration: full_report_interval
# --------------------------------------------------------------------------


def test_full_report_interval_is_a_duration_with_a_default(tmp_path, certs):
    from llmgw.services.agent.config import load_agent_config
    from llmgw.shared.errors import ConfigError

    from .test_agent_config import base, write

    data = base(certs)
    assert load_agent_config(write(tmp_path, data)).full_report_interval == 30.0
    data["full_report_interval"] = "10s"
    assert load_agent_config(write(tmp_path, data)).full_report_interval == 10.0
    data["full_report_interval"] = "soon"
    with pytest.raises(ConfigError, match="full_report_interval"):
        load_agent_config(write(tmp_path, data))
