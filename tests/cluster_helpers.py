"""A control plane in-process plus real agents (subprocesses) running real `sim` engines.

Services run in the test's event loop so a test can stop one abruptly; agents
and engines are real processes marked with ``LLMGW_SIM_NODE`` so a finalizer
can kill every one of them, even engines in their own sessions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from nats.errors import TimeoutError as NatsTimeout

from llmgw.services.devcluster import simcluster
from llmgw.services.health.service import HealthMonitor
from llmgw.services.registry import Registry
from llmgw.services.scheduler.service import Scheduler
from llmgw.shared import buckets as B
from llmgw.shared import subjects as S
from llmgw.shared.kvmirror import open_mirror
from llmgw.shared.natsserver import NatsServer
from llmgw.shared.schemas import DeploymentSpec, Event, Lease, NodeRequest, Replica, decode, encode
from llmgw.shared.tasks import cancel_and_wait

from .conftest import service_config
from .waiting import _UNSET, eventually

HB = 0.3
HEALTH = dict(heartbeat_interval=HB, suspect_after_missed=3, node_lost_after=1.5, leader_ttl=0.6)
SCHED = dict(reconcile_interval=0.3, leader_ttl=0.6, command_timeout=2.0)
# For tests that follow a replica moving after one of its engines is killed:
# restart in place (which would relaunch it where it was) off.
MOVE = dict(restart_in_place=0)
TIMINGS = simcluster.Timings(heartbeat_interval=HB, stop_timeout=1.0, health_interval=0.1, reconnect_base=0.1, reconnect_max=0.5)


# Marks this cluster's agents and (inherited) engines, so that killing "node02" kills this
# test's node02 and not a simulated node02 of another run on the same machine
# (simcluster.kill_node matches every process carrying LLMGW_SIM_NODE=node02).
CLUSTER_ENV = "LLMGW_TEST_CLUSTER"


class Cluster:
    def __init__(self, server: NatsServer, root: Path):
        self.server = server
        self.root = root
        self.marker = f"{CLUSTER_ENV}={uuid.uuid4().hex}".encode()
        self.services: list = []
        self.agents: dict[str, subprocess.Popen] = {}
        self.spawned: list[subprocess.Popen] = []
        self.nodes: dict[str, simcluster.SimNode] = {}
        # 127.A.B.0/24 of our own, never 127.0.x (the layout's and `llmgw up`'s)
        self.net = f"127.{random.randint(2, 254)}.{random.randint(0, 255)}"

    async def start_service(self, cls, role, name=None, **sections):
        svc = cls(service_config(self.server, role, name, **sections))
        self.server.reload()
        await svc.start()
        self.services.append(svc)
        return svc

    async def start_control_plane(self, schedulers: int = 1, **scheduler):
        """Registry, health monitor and ``schedulers`` schedulers (``scheduler``: settings over ``SCHED``)."""
        await self.start_service(Registry, "registry")
        await self.start_service(HealthMonitor, "health", health=HEALTH)
        scheds = [await self.start_service(Scheduler, "scheduler", f"scheduler-{i}", scheduler={**SCHED, **scheduler}) for i in range(schedulers)]
        return scheds

    def add_nodes(self, specs: list[simcluster.SimNodeSpec], timings: simcluster.Timings = TIMINGS) -> None:
        """Write the nodes' files, each node moved onto this cluster's own loopback
        network (``self.net``): the layout's 127.0.1.N and ports from 20000 are
        what every simulated cluster on the machine uses, and an engine of another
        run (or one still stopping from a previous test) on the same address and
        port would answer for ours, or hold the port ours needs."""
        for spec in specs:
            if spec.mgmt_addr.startswith("127.0.1."):  # the layout's; a test that chose its own keeps it
                spec = dataclasses.replace(spec, mgmt_addr=f"{self.net}.{spec.mgmt_addr.rsplit('.', 1)[1]}")
            self.nodes[spec.node_id] = simcluster.write_node(self.root, self.server.pki_dir, self.server.url, spec, timings)
        self.server.reload()

    def addr(self, node_id: str) -> str:
        """The management address a node of this cluster listens on."""
        return self.nodes[node_id].spec.mgmt_addr

    def start_agent(self, node_id: str, wrap: tuple[str, ...] = ()) -> subprocess.Popen:
        """Start the node's agent; ``wrap``: a command that execs the agent's argv after its own
        (a mount namespace with the node's own /etc/hosts, say)."""
        node = self.nodes[node_id]
        log = open(node.log, "ab")
        p = subprocess.Popen(
            [*wrap, sys.executable, "-m", "llmgw.services", "agent", "--config", str(node.config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, simcluster.SIM_ENV: node_id, CLUSTER_ENV: self.marker.split(b"=", 1)[1].decode()},
            start_new_session=True,
        )
        log.close()
        self.agents[node_id] = p
        self.spawned.append(p)  # every one is waited for, restarted agents' old processes too
        return p

    async def operator(self, connector):
        self.ops = await connector.as_new("ops", "operator")
        js = self.ops.jetstream()
        self.replicas = await open_mirror(js, B.REPLICAS, wait=10)
        self.leases = await open_mirror(js, B.LEASES, wait=10)
        return self.ops

    async def apply(self, spec: DeploymentSpec):
        reply = await self.ops.request(S.api("scheduler", "apply"), encode(spec), timeout=5)
        assert not (reply.headers or {}).get("Nats-Service-Error-Code"), reply.data
        return reply

    async def monitor_lease(self, node: str) -> Lease | None:
        """``node``'s lease as the acting health monitor holds it (exact ``last_renew``
        and ``last_seq``; the bucket's are checkpoints, written once per 40 heartbeat
        intervals), or None while no monitor acts or it has no lease for the node."""
        try:
            reply = await self.ops.request(S.api("health", "lease"), encode(NodeRequest(node_id=node)), timeout=2)
        except Exception:
            return None
        if reply.headers and reply.headers.get("Nats-Service-Error-Code"):
            return None
        return decode(reply.data, Lease)

    async def wait(self, observe, expected=_UNSET, *, timeout=20.0, what="condition"):
        """Wait until ``observe()`` is truthy (or equals ``expected``); fail with the last
        value seen and the replicas as this mirror has them."""
        try:
            return await eventually(observe, expected, timeout=timeout, what=what, interval=0.05)
        except AssertionError as e:
            replicas = [(r.id, r.state, r.reason) for r in self.replicas.items.values()] if hasattr(self, "replicas") else "no mirror yet"
            raise AssertionError(f"{e}; replicas: {replicas}{self.agents_report()}") from None

    def agents_report(self) -> str:
        """Each agent's state and the tail of its log: a wait that fails on a node
        says whether its agent died, and why, instead of only that it was not ready."""
        lines = []
        for node_id, p in sorted(self.agents.items()):
            rc = p.poll()
            lease = getattr(getattr(self, "leases", None), "items", {}).get(node_id)
            lines.append(f"\n  {node_id}: agent pid {p.pid} {'running' if rc is None else f'exited {rc}'}, lease {getattr(lease, 'state', 'none')}")
            try:
                tail = self.nodes[node_id].log.read_text(errors="replace").splitlines()[-6:]
            except OSError:
                tail = []
            lines += [f"\n    | {t[:200]}" for t in tail]
        return "".join(lines)

    def ids(self, deployment: str) -> list[str]:
        return sorted(r.id for r in self.live(deployment))

    def kill_node(self, node_id: str) -> list[int]:
        """SIGKILL this cluster's agent and engines of ``node_id`` at once, as a machine dies."""
        pids = []
        for pid in simcluster.processes_of(node_id):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if self.marker not in f.read().split(b"\0"):
                        continue
                os.kill(pid, signal.SIGKILL)
                pids.append(pid)
            except (OSError, ProcessLookupError):
                pass
        return pids

    def live(self, deployment: str) -> list[Replica]:
        return [r for r in self.replicas.items.values() if r.deployment == deployment and r.state != "gone"]

    def ready(self, deployment: str) -> list[Replica]:
        return [r for r in self.live(deployment) if r.state == "ready"]

    async def close(self):
        for m in ("replicas", "leases"):
            if hasattr(self, m):
                await getattr(self, m).stop()
        stuck = []
        for svc in reversed(self.services):
            try:
                await asyncio.wait_for(svc.stop(), 20)
            except TimeoutError:
                stuck.append(f"{svc.role}/{svc.identity}")
            except Exception:
                pass
        # Kill until none is left: an agent killed while it was spawning an engine's
        # wrapper can leave a process that did not exist at the first pass (a
        # leader engine outlived a run of the flake hunt that way).
        for _ in range(10):
            if not any([self.kill_node(node_id) for node_id in self.nodes]):
                break
            await asyncio.sleep(0.2)
        for p in self.spawned:
            try:
                p.wait(2)
            except subprocess.TimeoutExpired:
                pass
        # A service whose stop never ends is a bug of the service, not of the test's
        # cleanup: say which (its processes were still cleaned up above).
        assert not stuck, f"stop() of {', '.join(stuck)} did not return within 20s"


async def crash(svc, mirrors=()) -> None:
    """Stop a service as a crash would: its tasks end, its connection drops, it never
    resigns. Ended as ServiceRuntime.stop ends them (llmgw.shared.tasks): a task whose nats-py
    read completed with its cancel swallows it on Python 3.11, and a single cancel and an
    unbounded wait for it hung a test once in a hunt (90 s timeout)."""
    for t in await cancel_and_wait(svc.tasks, timeout=5):
        print(f"crash: task {t.get_name()} did not end within 5s of its cancel", file=sys.stderr)
    for mirror in mirrors:
        await asyncio.wait_for(mirror.stop(), 5)
    await asyncio.wait_for(svc.nc.close(), 5)


async def replica_event_records(ops, rid: str) -> list[Event]:
    """What the stream holds for replica ``rid``, in order, read to the stream's end."""
    js = ops.jetstream()
    last = (await js.stream_info(S.EVENT_STREAM)).state.last_seq
    sub = await js.subscribe(f"llmgw.event.replica.{rid}.>", ordered_consumer=True)
    out = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=1)
            except NatsTimeout:  # nothing more for this replica
                break
            out.append(decode(msg.data, Event))
            if msg.metadata.num_pending == 0 or msg.metadata.sequence.stream >= last:
                break
    finally:
        await sub.unsubscribe()
    return out


def sim_spec(name="demo", replicas=1, nodes=2, gpus=2, load="0.2s"):
    """A deployment of the sim engine, as the control-plane tests apply it."""
    return DeploymentSpec(
        name=name,
        model="sim-7b",
        engine="sim",
        replicas=replicas,
        nodes_per_replica=nodes,
        gpus_per_node=gpus,
        engine_args=["--load-time", load],
        startup_timeout=30,
    )
