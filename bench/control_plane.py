"""Control-plane benchmark: registry, health monitor and scheduler at cluster scale.

Not a test: it prints figures (and ``--json FILE`` writes them). Run from the
repository root with the project's virtual environment::

    python bench/control_plane.py                       # 2,000 nodes x 8 GPUs
    python bench/control_plane.py --nodes 10000 --replicas 4000   # 80,000 GPUs
    python bench/control_plane.py --nodes 20 --replicas 5 --steady 3s \\
        --node-lost-after 3s --heartbeat 0.5s           # smoke: well under a minute

Configurations and their targets (2 cores, 5 s heartbeats, lost
after 15 s, 20 fabrics, 8 GPUs per node):

* ``--nodes 2000 --replicas 1000`` (the default): every figure no worse than
  the one recorded in docs/performance.md.
* ``--nodes 10000 --replicas 4000`` (80,000 GPUs, past Kubernetes' 5,000-node
  limit): registry + health + scheduler together < 25 % of one core in steady
  state (nats-server's share reported beside it, not in the sum); apply ->
  last of 8,000 launches at agents < 2 s; lost -> last replacement launch
  < 200 ms; a nats-server restart under 10,000 connected agents: every lease
  renewed again within two heartbeats of the server's return, and no node
  declared lost. Needs about 4 GB of memory over the agent workers (0.37 MiB
  per simulated agent, measured at 2,000 and 3,000) and 10,000 + file
  descriptors in them and as many in nats-server: the bench raises its own
  ``RLIMIT_NOFILE`` soft limit (its workers and nats-server inherit it) and
  says so, or stops with the ``ulimit -Hn`` it needs. Bring-up takes minutes
  (10,000 TLS handshakes made on this machine's cores, beside nats-server's);
  do not run it on a busy machine.

What runs where:

* a real nats-server (``NatsServer`` in a temporary directory) whose ledger
  holds one certificate per simulated node, one per service and an operator;
* registry, health monitor and scheduler as separate processes, started the
  way ``llmgw up`` starts them (``up.Cluster``: same config files, same
  ``python -m llmgw.services ROLE --config FILE``, same teardown), so their CPU
  can be read from ``/proc/<pid>/stat``;
* the simulated agents in ``--agent-procs`` worker processes (this script
  with ``--agents-worker``; one per 2,500 nodes by default, at most one per
  core), each one asyncio loop, told what to do and telling what they saw
  over their stdin/stdout (one loop's handshakes alone would pace a herd of
  thousands: ~160/s here): one TLS connection per node under that node's own certificate (the server only lets
  ``urn:llmgw:node:nodeNNNN`` publish ``llmgw.node.nodeNNNN.>``). Each connects the
  way the real agent does (``shared/bus.py``: a first connect delayed by a draw
  in [0, reconnect_base), reconnects backing off with jitter, and on every
  reconnect its inventory, a full status report and a heartbeat), publishes a
  heartbeat every ``--heartbeat`` (+-10 % jitter), answers launch with an ok
  ``CommandAck`` followed by a ``StatusReport`` (leader ``ready``, worker
  ``starting``), and answers stop and list. The arrival time of every launch
  command is recorded.

Phases:

1. bring-up: every agent connects (``--connect-concurrency`` handshakes in
   flight); until every node is registered and its lease ready.
2. steady state: CPU of each process over ``--steady``; the target is on
   registry + health + scheduler; nats-server and the bench with its agent
   workers are reported beside it.
3. placement: ``--replicas`` replicas x 2 nodes x 4 GPUs applied as the
   operator; apply -> first/last launch command at the agents, -> all ready.
4. failover: one member node's heartbeats stop (its connection stays up);
   lost event -> the replacement launches. That node is then shut down for good.
5. nats-server restart (one server; ``--restart-signal``, SIGTERM by default):
   the server is stopped under full load and started again on the same port
   and JetStream store. The agents come back as nats-py retries, through
   ``shared/bus.py``'s backoff and jitter; their TCP + TLS steps wait for one
   of ``--reconnect-slots`` (64) over all workers first, outside the connect
   timeout, as each real agent's handshake runs on its own node's CPU
   (``--reconnect-slots 0``: unpaced, thousands in flight on one loop, which
   collapses under its own connect timeouts). Reported: the reconnect spread (first and last agent
   reconnected after the server's return, connections/s), the time until the
   health monitor has renewed every live node's lease again — read from its
   own ``llmgw_health_lease_age_seconds{node}`` (metrics_listen), a node
   counting once its age shows a heartbeat accepted after the return; the
   same from the last agent's return, apart (the control plane's own time:
   the herd before it is paced by the simulated agents' TLS handshakes, made
   on the same cores) — and
   the nodes declared lost meanwhile (lost events in ``LLMGW_EVENTS`` for live
   nodes, and the monitor's ``llmgw_health_transitions_total{to="lost"}``):
   the target is none. The monitor pauses its countdowns while it is away from
   the bus and grants ``health.reconnect_grace`` (derived from reconnect_max
   when 0) after it is back; a node whose agent needs longer than that to
   reconnect and heartbeat is declared lost — that is what this phase checks.
   With ``--nats-servers 3`` (three servers as a cluster on 127.0.0.1-3,
   services at ``kv_replicas: 3``, as ``llmgw up --nats-servers 3``) phase 5 is
   instead: the meta leader SIGKILLed while the operator applies a small
   deployment every 100 ms: how long control-plane writes are blocked (the gap
   between the last apply acknowledged before the kill and the first after).

``--floor`` runs no control plane: nats-server and the agents alone. Phase 1
connects the agents; phase 2 sends the placement's 2 x ``--replicas`` launches
as the scheduler sends them (one request each, all in flight at once, under the
scheduler's own certificate) and reports send -> last launch at the agents;
phase 3 (unless ``--no-restart``) restarts nats-server and reports when every
agent is back. Each is what any control plane's figure includes at least on
this machine: the placement target is measured from the apply to the last
launch, and no lease is renewed before its agent is back. With the CPU each
side spends per launch and per returning agent, this says whether a target can
be met on these cores with the agents simulated on them.

``--until PHASE`` stops after that phase (e.g. ``--until steady --steady 5m``
to attach a profiler to one service in steady state).

Everything started is stopped on exit, Ctrl-C or failure; if this process is
killed outright, ``llmgw down --dir DIR`` (the directory is printed first)
stops what is left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import random
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.services.devcluster.simcluster import GPU_MEMORY_MIB, GPU_NAME, HCAS_PER_NODE, fabric_name, gpu_uuid
from llmgw.services.devcluster.up import Cluster
from llmgw.shared import buckets as B
from llmgw.shared import bus, pki
from llmgw.shared import subjects as S
from llmgw.shared.buckets import Bucket
from llmgw.shared.durations import format_duration, parse_duration
from llmgw.shared.kvmirror import KvMirror, open_mirror
from llmgw.shared.natsserver import NatsCluster, NatsServer, free_port
from llmgw.shared.schemas import (
    CommandAck,
    DeploymentSpec,
    EngineFact,
    Event,
    FabricMembership,
    Gpu,
    Hca,
    HcaPort,
    Heartbeat,
    Inventory,
    LaunchCommand,
    StatusReport,
    StopCommand,
    decode,
    encode,
)
from llmgw.shared.tasks import cancel_and_wait
from llmgw.shared.tls import TlsFiles

# % of one core (registry + health + scheduler), s, s, heartbeat intervals
# The phases in order (--until names the last one to run).
PHASES = ("bring-up", "steady", "placement", "failover", "restart")
TARGETS = {"cpu": 25.0, "placement": 2.0, "failover": 0.2, "restart_heartbeats": 2.0}
# The simulated agents' bus timings (the services get the same in their configs).
AGENT_RECONNECT_BASE, AGENT_RECONNECT_MAX = 0.5, 5.0
# The real agent's connect timeout (bus.connect's default), which bounds each
# reconnect attempt too; the bench's first connects get longer (they queue
# for a handshake slot in their worker).
AGENT_CONNECT_TIMEOUT, BENCH_FIRST_CONNECT_TIMEOUT = 5.0, 20.0
# No agent connected or reported a failed attempt for this long while some still
# had not connected: longer than one first-connect attempt may take (bus.connect
# bounds it at ATTEMPT_TIMEOUTS connect timeouts; nats-py reports the failed steps
# inside it), so those left are stuck, not slow. The bench says which and where,
# and stops. (At 120 s this stopped two 10,000-node runs whose last agents were
# still inside a legitimate attempt on a loaded machine.)
CONNECT_STALL = bus.ATTEMPT_TIMEOUTS * BENCH_FIRST_CONNECT_TIMEOUT + 2 * AGENT_RECONNECT_BASE + AGENT_RECONNECT_MAX
# --floor: how long a launch waits for its acknowledgement (longer than the
# scheduler's 5 s command_timeout, so that a late answer is counted, not lost).
FLOOR_COMMAND_TIMEOUT = 60.0
# Thousands of agents losing the bus at once would print thousands of warnings;
# the phase reports what they did instead.
AGENT_LOG = logging.getLogger("llmgw.bench.agents")
AGENT_LOG.setLevel(logging.ERROR)
DEPLOYMENT = "bench"
CONTROL_PLANE = ("registry", "health", "scheduler")  # the processes the CPU target sums
CLK_TCK = os.sysconf("SC_CLK_TCK")
THIS_FILE = Path(__file__).resolve()  # agent workers are this script again (--agents-worker JOB)


def peak_mib(pid: int) -> float:
    """A process's peak resident memory (``VmHWM`` in ``/proc/<pid>/status``), MiB."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds (``/proc/<pid>/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# --------------------------------------------------------------------------
# The PKI, issued in bulk
# --------------------------------------------------------------------------


@contextlib.contextmanager
def one_ledger_write(pki_dir: Path):
    """Let ``pki.issue`` run thousands of times with one ledger read and one write.

    ``pki.issue`` re-reads and rewrites the whole ledger on every call, which is
    right for onboarding a node and quadratic for 2,000 of them (about a minute
    here). The certificates and ledger entries are the ones ``pki.issue``
    makes; only the ledger file's round trips are batched.
    """
    entries = pki._load_ledger(pki_dir)
    load, save = pki._load_ledger, pki._save_ledger
    pki._load_ledger = lambda _p: entries
    pki._save_ledger = lambda _p, _e: None
    try:
        yield
    finally:
        pki._load_ledger, pki._save_ledger = load, save
        save(pki_dir, entries)


# --------------------------------------------------------------------------
# Simulated agents
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchSeen:
    at: float  # wall clock, comparable with the services' event times
    node: str
    replica_id: str
    generation: int
    rank: int


@dataclass
class SimAgent:
    node_id: str
    fabric: str
    mgmt_addr: str
    gpus: int
    tls: TlsFiles
    board: Board
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    seq: int = 0
    last_beat: float = 0.0
    nc: object = None
    engines: dict = field(default_factory=dict)  # (replica id, rank) -> EngineFact
    beating: asyncio.Task | None = None
    heartbeat_interval: float = 0.0
    silent: bool = False  # heartbeats stopped for good (the failover's victim)
    emit: object = None  # in an agents worker: tells the bench what happened (a dict a line)
    handshake_slots: asyncio.Semaphore | None = None  # shared by a worker's agents: reconnect handshakes in flight

    def inventory(self) -> Inventory:
        return Inventory(
            node_id=self.node_id,
            boot_id=self.boot_id,
            hostname=self.node_id,
            agent_version="bench",
            mgmt_addr=self.mgmt_addr,
            mgmt_interface="eth0",
            gpus=[
                Gpu(index=i, uuid=gpu_uuid(self.node_id, i), name=GPU_NAME, memory_mib=GPU_MEMORY_MIB, pci_bus_id=f"00000000:{0x18 + i * 0x10:02X}:00.0")
                for i in range(self.gpus)
            ],
            fabrics=[FabricMembership(name=self.fabric, hcas=list(HCAS_PER_NODE), usable=True)],
            hcas=[
                Hca(name=h, ports=[HcaPort(port=1, state="ACTIVE", phys_state="LinkUp", rate="200 Gb/sec (4X HDR)", link_layer="InfiniBand")], usable=True)
                for h in HCAS_PER_NODE
            ],
            sent_at=time.time(),
        )

    async def connect(self, url: str) -> None:
        # As the real agent connects (services/agent/agent.py): the same backoff and
        # jitter from shared/bus.py, and on every reconnect what it announces.
        # (Its first-connect spread is drawn by the caller, before it queues for a
        # handshake slot.)
        self.nc = await bus.connect(
            url, self.tls, name="bench-agent", initial_attempts=5, reconnect_base=AGENT_RECONNECT_BASE, reconnect_max=AGENT_RECONNECT_MAX,
            connect_timeout=BENCH_FIRST_CONNECT_TIMEOUT, on_reconnect=self.on_reconnect, on_error=self.on_error, logger=AGENT_LOG,
        )  # fmt: skip
        self.nc.options["connect_timeout"] = AGENT_CONNECT_TIMEOUT  # reconnects: as the real agent
        if self.handshake_slots is not None:
            # A real agent makes its handshake on its own node's CPU, whatever the others
            # do; here thousands share one loop, which gives each a fair slice: with all
            # of them in flight each takes longer than the 5 s connect timeout and whole
            # waves fail together (congestion collapse of the load generator, not of the
            # cluster). So a reconnect's TCP + TLS step waits for a slot first, outside
            # its timeout; nats-py has no hook for that, hence the wrapped method.
            # --reconnect-slots 0 leaves the herd as nats-py makes it.
            slots, dial = self.handshake_slots, self.nc._connect_to_server

            async def paced(server) -> None:
                async with slots:
                    await dial(server)

            self.nc._connect_to_server = paced  # type: ignore[method-assign]
        await self.nc.subscribe(S.cmd_launch(self.node_id), cb=self.on_launch)
        await self.nc.subscribe(S.cmd_stop(self.node_id), cb=self.on_stop)
        await self.nc.subscribe(S.cmd_list(self.node_id), cb=self.on_list)
        await self.nc.flush()

    async def announce(self, heartbeat: float) -> None:
        """What a real agent sends on connect: inventory, a full status report, a heartbeat."""
        self.heartbeat_interval = heartbeat
        await self._announce()
        self.beating = asyncio.create_task(self.heartbeats(heartbeat))

    async def _announce(self) -> None:
        await self.publish_inventory()
        await self.nc.publish(S.status(self.node_id), encode(self.report(full=True)))
        await self.heartbeat()

    async def on_error(self, _e: Exception) -> None:
        # a failed reconnect attempt is one; the bench counts them (AgentView.errors)
        if self.emit:
            self.emit({"ev": "error", "node": self.node_id})

    async def on_reconnect(self) -> None:
        if self.emit:
            self.emit({"ev": "reconnected", "node": self.node_id, "at": time.time()})
        if self.silent:
            return  # a node whose heartbeats were stopped (phase 4) stays silent
        try:
            await self._announce()
        except Exception:
            pass

    async def publish_inventory(self) -> None:
        await self.nc.publish(S.inventory(self.node_id), encode(self.inventory()))

    async def heartbeat(self) -> None:
        self.seq += 1
        self.last_beat = time.time()
        await self.nc.publish(S.heartbeat(self.node_id), encode(Heartbeat(node_id=self.node_id, boot_id=self.boot_id, seq=self.seq, sent_at=self.last_beat)))

    async def heartbeats(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval * random.uniform(0.9, 1.1))
            if self.nc.is_connected:
                try:
                    await self.heartbeat()
                except Exception:
                    pass

    def stop_heartbeats(self) -> None:
        self.silent = True
        if self.beating:
            self.beating.cancel()

    async def resume_heartbeats(self) -> None:
        """Heartbeat again, at once and then every interval, after ``stop_heartbeats``
        (bench/console.py takes a node to suspect and back, to time the lease change
        on the console's screen)."""
        self.silent = False
        if self.beating is None or self.beating.done():
            self.beating = asyncio.create_task(self.heartbeats(self.heartbeat_interval))
        if self.nc is not None and self.nc.is_connected:
            await self.heartbeat()

    def report(self, *, full: bool, engines: list[EngineFact] | None = None) -> StatusReport:
        facts = list(self.engines.values()) if full else (engines or [])
        return StatusReport(node_id=self.node_id, boot_id=self.boot_id, full=full, engines=facts, sent_at=time.time())

    async def on_launch(self, msg) -> None:
        at = time.time()
        cmd = decode(msg.data, LaunchCommand)
        self.board.launched(LaunchSeen(at, self.node_id, cmd.replica_id, cmd.generation, cmd.rank))
        fact = EngineFact(
            replica_id=cmd.replica_id,
            generation=cmd.generation,
            deployment=cmd.deployment,
            rank=cmd.rank,
            serves_http=cmd.rank == 0,
            pid=self.board.next_pid(),
            state="ready" if cmd.rank == 0 else "starting",
            gpus=list(cmd.gpus),
            http_port=cmd.http_port,
            rendezvous_port=cmd.rendezvous_port,
            since=at,
        )
        old = self.engines.get((cmd.replica_id, cmd.rank))
        if old is not None and old.generation == cmd.generation:
            fact = old  # idempotent, like the real agent
        self.engines[(cmd.replica_id, cmd.rank)] = fact
        await msg.respond(encode(CommandAck(ok=True, pid=fact.pid)))
        await self.nc.publish(S.status(self.node_id), encode(self.report(full=False, engines=[fact])))

    async def on_stop(self, msg) -> None:
        cmd = decode(msg.data, StopCommand)
        ended = []
        for key, fact in list(self.engines.items()):
            if fact.replica_id == cmd.replica_id and (cmd.generation == 0 or fact.generation <= cmd.generation):
                del self.engines[key]
                ended.append(
                    EngineFact(
                        replica_id=fact.replica_id,
                        generation=fact.generation,
                        deployment=fact.deployment,
                        rank=fact.rank,
                        pid=fact.pid,
                        state="exited",
                        exit_code=0,
                        gpus=fact.gpus,
                        since=time.time(),
                    )
                )
        await msg.respond(encode(CommandAck(ok=True)))
        if ended:
            await self.nc.publish(S.status(self.node_id), encode(self.report(full=False, engines=ended)))

    async def on_list(self, msg) -> None:
        await msg.respond(encode(self.report(full=True)))


@dataclass
class Board:
    """What the agents saw, shared by all of them."""

    launches: list[LaunchSeen] = field(default_factory=list)
    pid: int = 100_000
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def launched(self, seen: LaunchSeen) -> None:
        self.launches.append(seen)
        self.changed.set()

    def next_pid(self) -> int:
        self.pid += 1
        return self.pid


# --------------------------------------------------------------------------
# Agent workers: the simulated agents spread over processes
# --------------------------------------------------------------------------
#
# One asyncio loop completes only so many TLS handshakes a second (~160 here),
# which paced the restart phase's herd at 2,000 nodes and would take a minute
# at 10,000: the figure would be this process's, not the control plane's. So the
# agents run in ``--agent-procs`` worker processes (``control_plane.py
# --agents-worker JOB``), each one loop of SimAgents exactly as before. The
# bench talks to them over their stdin/stdout, a JSON object a line:
#
#   bench -> worker   {"op": "connect"} | {"op": "inventory", "nodes": [...]}
#                     | {"op": "silence", "node": N} | {"op": "resume", "node": N} | {"op": "close"}
#   worker -> bench   {"ev": "connected", "node": N} | {"ev": "launch", ...}
#                     | {"ev": "reconnected", "node": N, "at": T} | {"ev": "error", "node": N}
#                     | {"ev": "silenced", "node": N, "last_beat": T} | {"ev": "resumed", "node": N, "at": T}
#                     | {"ev": "closed"}
#
# Times are the workers' wall clocks, stamped where the event happened (same
# machine, same clock as the services' event times); the pipe's delay is not in
# any figure.


WORKER_JOB_KEYS = frozenset({"urls", "heartbeat", "concurrency", "reconnect_slots", "pid_base", "agents"})  # what Fleet.start writes


class WorkerBoard(Board):
    """A worker's board: every launch is also told to the bench."""

    def __init__(self, emit, pid_base: int):
        super().__init__(pid=pid_base)
        self.emit = emit

    def launched(self, seen: LaunchSeen) -> None:
        super().launched(seen)
        self.emit({"ev": "launch", "at": seen.at, "node": seen.node, "replica_id": seen.replica_id, "generation": seen.generation, "rank": seen.rank})


async def agents_worker(job: dict) -> int:
    loop = asyncio.get_running_loop()
    out = sys.stdout

    pending: list[str] = []

    def flush() -> None:
        out.write("".join(pending))
        out.flush()
        pending.clear()

    def emit(event: dict) -> None:
        # One write per loop iteration, not per event: thousands of launches arrive
        # together, and a write and flush each was this load generator's CPU taken
        # from the cores it shares with the control plane. (Times are stamped where
        # events happen; the pipe's delay is in no figure.)
        if not pending:
            loop.call_soon(flush)
        pending.append(json.dumps(event) + "\n")

    board = WorkerBoard(emit, job["pid_base"])
    slots = asyncio.Semaphore(job["reconnect_slots"]) if job["reconnect_slots"] else None
    agents = {
        a["node_id"]: SimAgent(
            a["node_id"], a["fabric"], a["mgmt_addr"], a["gpus"], TlsFiles(a["ca"], a["cert"], a["key"]), board, emit=emit, handshake_slots=slots
        )
        for a in job["agents"]
    }
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    sem = asyncio.Semaphore(job["concurrency"])

    async def connect(agent: SimAgent) -> None:
        # The real agent's first-connect spread, before queueing for a handshake slot.
        await asyncio.sleep(bus.first_connect_delay(AGENT_RECONNECT_BASE))
        async with sem:
            try:
                await agent.connect(job["urls"])
                await agent.announce(job["heartbeat"])
            except Exception as e:
                emit({"ev": "failed", "error": f"{agent.node_id} could not connect: {type(e).__name__}: {e}"})
                return
        emit({"ev": "connected", "node": agent.node_id})

    running: set[asyncio.Task] = set()

    def dump_connecting() -> None:
        # SIGUSR1 (the bench sends it when connects stall): where each agent still
        # connecting waits, on stderr, which the bench's own output carries.
        stuck = [t for t in running if not t.done()]
        print(f"agents worker {os.getpid()}: {len(stuck)} agents still connecting", file=sys.stderr)
        for t in stuck[:20]:
            # A suspended task's stack is its outermost frame only: follow the awaits.
            where, coro = [], t.get_coro()
            while coro is not None and len(where) < 40:
                frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                if frame is not None:
                    where.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
                coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
            print(f"--- {t.get_name()}:\n    " + "\n    ".join(where) + f"\n    awaiting {coro!r}", file=sys.stderr)
        sys.stderr.flush()

    loop.add_signal_handler(signal.SIGUSR1, dump_connecting)
    while line := await reader.readline():
        try:
            cmd = json.loads(line)
            op = cmd["op"]
        except (ValueError, TypeError, KeyError):
            # the bench writes these lines; one it did not mean is said, not fatal
            emit({"ev": "failed", "error": f"agents worker: not a command: {line[:200]!r}"})
            continue
        if op == "connect":
            for agent in agents.values():
                t = asyncio.create_task(connect(agent), name=f"connect {agent.node_id}")
                running.add(t)
                t.add_done_callback(running.discard)
        elif op == "inventory":
            for node in cmd["nodes"]:
                with contextlib.suppress(Exception):
                    await agents[node].publish_inventory()
        elif op == "silence":
            agent = agents[cmd["node"]]
            agent.stop_heartbeats()
            emit({"ev": "silenced", "node": agent.node_id, "last_beat": agent.last_beat})
        elif op == "resume":
            agent = agents[cmd["node"]]
            with contextlib.suppress(Exception):
                await agent.resume_heartbeats()
            emit({"ev": "resumed", "node": agent.node_id, "at": agent.last_beat})
        elif op == "close":
            break
    # close, or the bench is gone (EOF): end every connection, then say so
    await cancel_and_wait(running)
    for agent in agents.values():
        agent.stop_heartbeats()

    async def close(nc):
        with contextlib.suppress(Exception):
            await nc.close()

    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.gather(*(close(ag.nc) for ag in agents.values() if ag.nc is not None)), 15)
    emit({"ev": "closed"})
    flush()  # now: the loop ends with this coroutine
    return 0


@dataclass
class AgentView:
    """The bench's view of one simulated agent living in a worker."""

    node_id: str
    fabric: str
    mgmt_addr: str
    tls: TlsFiles
    worker: int = 0
    silent: bool = False
    last_beat: float = 0.0
    reconnected_at: list = field(default_factory=list)  # wall clock of each reconnect, as its worker stamped it
    errors: int = 0  # connection errors nats-py reported (a failed reconnect attempt is one)


class Fleet:
    """The agent workers, and what their agents did as the bench sees it."""

    def __init__(self, board: Board):
        self.board = board
        self.views: dict[str, AgentView] = {}
        self.procs: list[asyncio.subprocess.Process] = []
        self.readers: list[asyncio.Task] = []
        self.connected = 0
        self.connected_nodes: set[str] = set()
        self.errors = 0  # failed connection attempts the agents reported, all of them
        self.failed = ""  # a worker that ended before it was told to
        self.silenced: dict[str, asyncio.Future] = {}
        self.resumed: dict[str, asyncio.Future] = {}

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    async def start(self, root: Path, views: list[AgentView], procs: int, job: dict) -> None:
        for k in range(procs):
            mine = views[k::procs]
            for v in mine:
                v.worker = k
                self.views[v.node_id] = v
            path = root / f"agents-worker-{k}.json"
            agents = [
                {"node_id": v.node_id, "fabric": v.fabric, "mgmt_addr": v.mgmt_addr, "gpus": job["gpus"], "ca": v.tls.ca, "cert": v.tls.cert, "key": v.tls.key}
                for v in mine
            ]
            path.write_text(json.dumps({**job, "agents": agents, "pid_base": 100_000 + k * 1_000_000}))
            p = await asyncio.create_subprocess_exec(
                sys.executable, str(THIS_FILE), "--agents-worker", str(path), stdin=subprocess.PIPE, stdout=subprocess.PIPE, limit=1 << 20
            )
            self.procs.append(p)
            self.readers.append(asyncio.create_task(self._read(k, p)))

    async def _read(self, k: int, p: asyncio.subprocess.Process) -> None:
        assert p.stdout is not None
        while line := await p.stdout.readline():
            ev = json.loads(line)
            kind = ev["ev"]
            if kind == "launch":
                self.board.launched(LaunchSeen(ev["at"], ev["node"], ev["replica_id"], ev["generation"], ev["rank"]))
            elif kind == "reconnected":
                self.views[ev["node"]].reconnected_at.append(ev["at"])
            elif kind == "error":
                self.views[ev["node"]].errors += 1
                self.errors += 1
            elif kind == "connected":
                self.connected += 1
                self.connected_nodes.add(ev["node"])
            elif kind == "silenced":
                view = self.views[ev["node"]]
                view.silent, view.last_beat = True, ev["last_beat"]
                fut = self.silenced.pop(view.node_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
            elif kind == "resumed":
                view = self.views[ev["node"]]
                view.silent = False
                fut = self.resumed.pop(view.node_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
            elif kind == "failed":
                self.failed = self.failed or ev["error"]
            elif kind == "closed":
                return
        self.failed = self.failed or f"agents worker {k} (pid {p.pid}) ended unasked, exit code {await p.wait()}"

    def check_alive(self) -> None:
        if self.failed:
            raise BenchError(self.failed)

    async def tell(self, k: int, cmd: dict) -> None:
        stdin = self.procs[k].stdin
        assert stdin is not None
        stdin.write((json.dumps(cmd) + "\n").encode())
        await stdin.drain()

    async def connect_all(self) -> None:
        for k in range(len(self.procs)):
            await self.tell(k, {"op": "connect"})

    async def publish_inventory(self, nodes: list[str]) -> None:
        for k in range(len(self.procs)):
            mine = [n for n in nodes if self.views[n].worker == k]
            if mine:
                await self.tell(k, {"op": "inventory", "nodes": mine})

    async def silence(self, node: str, timeout: float = 10.0) -> AgentView:
        """Stop one agent's heartbeats for good (its connection stays up); returns its view
        once the worker says so, with the time of its last heartbeat."""
        fut = self.silenced[node] = asyncio.get_running_loop().create_future()
        await self.tell(self.views[node].worker, {"op": "silence", "node": node})
        await asyncio.wait_for(fut, timeout)
        return self.views[node]

    async def resume(self, node: str, timeout: float = 10.0) -> AgentView:
        """Start a silenced agent's heartbeats again (one at once); returns once its worker says so."""
        fut = self.resumed[node] = asyncio.get_running_loop().create_future()
        await self.tell(self.views[node].worker, {"op": "resume", "node": node})
        await asyncio.wait_for(fut, timeout)
        return self.views[node]

    async def close(self, timeout: float = 30.0) -> None:
        """Every worker closes its connections and exits; one that does not is killed."""
        for k, p in enumerate(self.procs):
            if p.returncode is None:
                with contextlib.suppress(Exception):
                    await self.tell(k, {"op": "close"})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in self.procs)), timeout)
        for p in self.procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()
        await cancel_and_wait(self.readers)


# --------------------------------------------------------------------------
# The bench
# --------------------------------------------------------------------------


class BenchError(Exception):
    pass


@dataclass
class Figures:
    values: dict = field(default_factory=dict)

    def __setitem__(self, k, v):
        self.values[k] = v

    def __getitem__(self, k):
        return self.values[k]

    def get(self, k, default=None):
        return self.values.get(k, default)


class Bench:
    def __init__(self, args, root: Path):
        self.args = args
        self.root = root
        self.cluster = Cluster(dir=root, progress=lambda m: print(m, flush=True))
        self.t0 = time.monotonic()
        self.board = Board()
        self.agents: list[AgentView] = []
        self.fleet = Fleet(self.board)
        self.fig = Figures()
        self.nc = None
        self.js = None
        self.mirrors: list[KvMirror] = []
        self.metrics: dict[str, str] = {}

    # -- output ---------------------------------------------------------------
    def stop_extra(self) -> None:
        """What a bench built on this one started besides the cluster, stopped at the end."""

    def summaries(self) -> list[str]:
        """Summaries printed after this bench's own."""
        return []

    def json_extra(self) -> dict:
        """Figures written to --json beside this bench's own."""
        return {}

    def out(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", flush=True)

    def phase(self, n: int, name: str) -> None:
        print(f"\n== phase {n}: {name} ==", flush=True)

    # -- setup ----------------------------------------------------------------
    def node_ids(self) -> list[str]:
        width = max(2, len(str(self.args.nodes)))
        return [f"node{i:0{width}d}" for i in range(1, self.args.nodes + 1)]

    def prepare(self) -> None:
        a = self.args
        if a.nats_servers > 1:
            self.cluster.nats_cluster = NatsCluster(root=self.root, size=a.nats_servers, hosts=[f"127.0.0.{i + 1}" for i in range(a.nats_servers)])
            self.cluster.nats_cluster.prepare()
            nats = self.cluster.nats = self.cluster.nats_cluster.members[0]
        else:
            nats = self.cluster.nats = NatsServer(root=self.root)
            nats.prepare()
        ids = self.node_ids()
        per = -(-a.nodes // a.fabrics)
        t = time.monotonic()
        with one_ledger_write(nats.pki_dir):
            for i, node in enumerate(ids):
                tls = nats.issue(node, "node")
                self.agents.append(AgentView(node, fabric_name(i // per), f"10.{(i + 1) >> 16 & 255}.{(i + 1) >> 8 & 255}.{(i + 1) & 255}", tls))
        self.out(f"issued {len(ids)} node certificates in {time.monotonic() - t:.1f}s ({a.fabrics} fabrics of {per} nodes)")
        hb, lost = a.heartbeat, a.node_lost_after
        self.suspect_after = next(k for k in (3, 2, 1) if k * hb < lost)
        common = {"reconnect_base": format_duration(AGENT_RECONNECT_BASE), "reconnect_max": format_duration(AGENT_RECONNECT_MAX)}
        self.metrics = {role: f"127.0.0.1:{free_port()}" for role in ("registry", "health", "scheduler")}
        self.configs = {
            "registry": self.cluster._service_config("registry", {**common, "metrics_listen": self.metrics["registry"]}),
            "health": self.cluster._service_config(
                "health",
                {
                    **common,
                    "metrics_listen": self.metrics["health"],
                    "health": {
                        "heartbeat_interval": format_duration(hb),
                        "suspect_after_missed": self.suspect_after,
                        "node_lost_after": format_duration(lost),
                        **({"reconnect_grace": format_duration(a.reconnect_grace)} if a.reconnect_grace else {}),
                    },
                },
            ),
            "scheduler": self.cluster._service_config(
                "scheduler",
                {
                    **common,
                    "metrics_listen": self.metrics["scheduler"],
                    **({"scheduler": {"full_pass_interval": format_duration(a.full_pass_interval)}} if a.full_pass_interval else {}),
                },
            ),
        }
        self.cluster._service_config("operator", {})
        self.out(
            f"health: heartbeat {format_duration(hb)}, suspect after {self.suspect_after} missed, lost after {format_duration(lost)}; scheduler: "
            + (f"a full pass every {format_duration(a.full_pass_interval)}" if a.full_pass_interval else "defaults")
        )

    def start_processes(self) -> None:
        self.cluster.start_nats()
        for role in ("registry", "health", "scheduler"):
            self.cluster._spawn(role, self.cluster.llmgw(role, "--config", str(self.configs[role])))
        self.out(
            "started registry, health, scheduler (pids " + ", ".join(f"{r} {self.cluster.procs[r].pid}" for r in ("registry", "health", "scheduler")) + ")"
        )

    async def connect_operator(self) -> None:
        tls = self.cluster.nats.tls_for("operator", "operator")
        self.nc = await bus.connect(self.cluster.nats_urls, tls, name="bench", initial_attempts=20, reconnect_base=0.2, reconnect_max=1.0)
        self.js = self.nc.jetstream(timeout=10)

    async def wait_services(self, timeout: float = 60.0) -> None:
        """The registry's and scheduler's APIs answer: their subscriptions are in place."""
        deadline = time.monotonic() + timeout
        for svc in ("llmgw-registry", "llmgw-scheduler"):
            while True:
                self.check_alive()
                try:
                    await self.nc.request(f"$SRV.PING.{svc}", b"", timeout=1)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise BenchError(f"{svc} did not answer in {timeout:.0f}s; see {self.root / 'logs'}") from None
                    await asyncio.sleep(0.2)

    async def mirror(self, bucket: Bucket, wait: float = 60.0) -> KvMirror:
        m = await open_mirror(self.js, bucket, wait=wait, timeout=60)
        self.mirrors.append(m)
        return m

    async def unmirror(self, m: KvMirror) -> None:
        await m.stop()
        self.mirrors.remove(m)

    def scrape(self, role: str) -> dict[str, float]:
        """A service's Prometheus metrics, name{labels} -> value."""
        out = {}
        try:
            with urllib.request.urlopen(f"http://{self.metrics[role]}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return out
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[k] = float(v)
        return out

    def full_passes(self) -> dict[str, float]:
        """The scheduler's full passes so far, by outcome (adopted, dropped, on_loop)."""
        m = self.scrape("scheduler")
        return {k: m.get(f'llmgw_scheduler_full_passes_total{{outcome="{k}"}}', 0.0) for k in ("adopted", "dropped", "on_loop")}

    def pids(self) -> dict[str, int]:
        p = {r: self.cluster.procs[r].pid for r in CONTROL_PLANE if r in self.cluster.procs}  # none with --floor
        servers = [n for n in self.cluster.procs if n.startswith("nats-server")]
        p["nats-server"] = self.cluster.procs[servers[0]].pid  # the first (of a cluster: its CPU stands for each)
        return p

    def cpu_all(self) -> dict[str, float]:
        cpu = {name: cpu_seconds(pid) for name, pid in self.pids().items()}
        # this process and its agent workers, together: the load generator
        cpu["bench (agents)"] = sum(cpu_seconds(pid) for pid in (os.getpid(), *self.fleet.pids))
        return cpu

    def check_alive(self) -> None:
        self.cluster.check_alive()
        self.fleet.check_alive()

    async def connect_agents(self) -> dict[str, float]:
        """Start the agent workers and connect every simulated agent; returns the CPU
        readings taken just before the first connect."""
        a = self.args
        # Thousands of TLS handshakes: spread over the agent workers, bounded concurrency
        # in each, with progress.
        job = {
            "urls": self.cluster.nats_urls,
            "heartbeat": a.heartbeat,
            "gpus": a.gpus,
            "concurrency": max(1, -(-a.connect_concurrency // a.agent_procs)),
            "reconnect_slots": a.reconnect_slots and max(1, -(-a.reconnect_slots // a.agent_procs)),
        }
        await self.fleet.start(self.root, self.agents, a.agent_procs, job)
        self.out(
            f"{a.agent_procs} agent worker process(es) (pids {', '.join(map(str, self.fleet.pids))}), {-(-len(self.agents) // a.agent_procs)} agents each at most"
        )
        c0 = self.cpu_all()
        t = time.monotonic()
        await self.fleet.connect_all()
        last_print, last_done = t, -1
        progress_at, progress_n = time.monotonic(), 0
        while self.fleet.connected < len(self.agents):
            self.check_alive()
            await asyncio.sleep(0.05)
            done = self.fleet.connected
            # A failed step of an attempt is progress too: an agent retrying its first
            # connect under load is not stuck; one that neither connects nor fails is.
            moved = done + self.fleet.errors
            if moved != progress_n:
                progress_at, progress_n = time.monotonic(), moved
            elif time.monotonic() - progress_at > CONNECT_STALL:
                # Every agent either says it connected or why not; one that does
                # neither is stuck in a step with no bound. Ask the workers where.
                missing = sorted(ag.node_id for ag in self.agents if ag.node_id not in self.fleet.connected_nodes)
                for pid in self.fleet.pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGUSR1)
                await asyncio.sleep(1.0)
                raise BenchError(
                    f"{len(missing)} agents neither connected nor reported a failed attempt within {CONNECT_STALL:.0f}s of the last that did "
                    f"({', '.join(missing[:10])}{' …' if len(missing) > 10 else ''}); the agent workers printed where each waits"
                )
            if time.monotonic() - last_print >= 2 and done != last_done:
                last_print, last_done = time.monotonic(), done
                self.out(f"agents connected {done}/{len(self.agents)} ({done / max(1e-9, last_print - t):.0f}/s)")
        connect_s = time.monotonic() - t
        self.fig["connect_s"] = connect_s
        self.fig["connect_bench_cpu_pct"] = 100 * (self.cpu_all()["bench (agents)"] - c0["bench (agents)"]) / connect_s
        self.out(
            f"{len(self.agents)} TLS connections (one per node certificate) in {connect_s:.1f}s: {len(self.agents) / connect_s:.0f} handshakes/s; "
            f"the bench and its {a.agent_procs} agent worker(s) used {self.fig['connect_bench_cpu_pct']:.0f}% of a core meanwhile"
        )
        return c0

    # -- phase 1 ---------------------------------------------------------------
    async def bring_up(self) -> None:
        a = self.args
        self.phase(1, "bring-up")
        t_start = time.monotonic()
        self.prepare()
        self.start_processes()
        await self.connect_operator()
        await self.wait_services()
        self.out("services answer; connecting agents")
        nodes = await self.mirror(B.NODES)
        leases = await self.mirror(B.LEASES)
        c0 = await self.connect_agents()
        want = {ag.node_id for ag in self.agents}
        deadline = time.monotonic() + max(120.0, a.nodes * 0.1)
        last, republished = None, time.monotonic()
        while True:
            self.check_alive()
            registered = len(want & set(nodes.items))
            ready = len({k for k, lease in leases.items.items() if lease.state == "ready"} & want)
            if (registered, ready) != last:
                self.out(f"nodes registered {registered}/{len(want)}, leases ready {ready}/{len(want)}")
                last = (registered, ready)
            if registered == ready == len(want):
                break
            if time.monotonic() > deadline:
                raise BenchError(f"bring-up incomplete: {registered} registered, {ready} ready of {len(want)}")
            if registered < len(want) and time.monotonic() - republished > 15:
                # A real agent re-sends its inventory periodically; do so for the missing ones.
                missing = [ag.node_id for ag in self.agents if ag.node_id not in nodes.items]
                self.out(f"re-sending the inventory of {len(missing)} unregistered nodes")
                await self.fleet.publish_inventory(missing)
                republished = time.monotonic()
            await asyncio.sleep(0.2)
        self.fig["bringup_s"] = time.monotonic() - t_start
        c1 = self.cpu_all()
        self.fig["bringup_cpu_s"] = {k: c1[k] - c0[k] for k in c0}
        self.out(
            f"bring-up complete in {self.fig['bringup_s']:.1f}s; the agent workers hold {sum(map(peak_mib, self.fleet.pids)):.0f} MiB together at most so far"
        )
        self.out("CPU seconds from the first agent connect: " + ", ".join(f"{k} {v:.1f}" for k, v in self.fig["bringup_cpu_s"].items()))
        await self.unmirror(nodes)
        await self.unmirror(leases)

    # -- phase 2 ---------------------------------------------------------------
    async def steady(self) -> None:
        a = self.args
        self.phase(2, "steady state")
        settle = max(1.0, a.heartbeat * 2)
        self.out(f"settling for {format_duration(settle)}, then measuring CPU over {format_duration(a.steady)}")
        await asyncio.sleep(settle)
        hb_before = self.scrape("health").get('llmgw_health_heartbeats_total{result="accepted"}', 0.0)
        writes_before = (await self.js.stream_info(S.kv_stream(S.BUCKET_LEASES))).state.last_seq
        c0, w0 = self.cpu_all(), time.monotonic()
        step = min(a.steady, 10.0)
        while time.monotonic() - w0 < a.steady - 1e-3:
            await asyncio.sleep(min(step, a.steady - (time.monotonic() - w0)))
            self.check_alive()
            c = self.cpu_all()
            el = time.monotonic() - w0
            so_far = sum(c[k] - c0[k] for k in CONTROL_PLANE)
            self.out(f"  {el:5.1f}s: registry+health+scheduler {100 * so_far / el:5.1f}% of a core so far")
        c1, window = self.cpu_all(), time.monotonic() - w0
        pct = {k: 100.0 * (c1[k] - c0[k]) / window for k in c0}
        hb_after = self.scrape("health").get('llmgw_health_heartbeats_total{result="accepted"}', 0.0)
        writes_after = (await self.js.stream_info(S.kv_stream(S.BUCKET_LEASES))).state.last_seq
        self.fig["steady_window_s"] = window
        self.fig["steady_cpu_pct"] = pct
        self.fig["steady_cpu_rh"] = pct["registry"] + pct["health"]
        self.fig["steady_cpu_control_plane"] = sum(pct[k] for k in CONTROL_PLANE)
        self.fig["heartbeats_per_s"] = (hb_after - hb_before) / window
        self.fig["lease_writes_per_s"] = (writes_after - writes_before) / window
        for k, v in pct.items():
            self.out(f"  {k:15s} {v:6.1f}% of one core")
        self.out(
            f"registry + health + scheduler: {self.fig['steady_cpu_control_plane']:.1f}% of one core (registry + health {self.fig['steady_cpu_rh']:.1f}%, nats-server {pct['nats-server']:.1f}% beside it); health accepted {self.fig['heartbeats_per_s']:.0f} heartbeats/s and wrote {self.fig['lease_writes_per_s']:.0f} leases/s"
        )

    # -- phase 3 ---------------------------------------------------------------
    async def placement(self) -> None:
        a = self.args
        self.phase(3, "placement")
        replicas = await self.mirror(B.REPLICAS)
        want = a.replicas
        ready_at: dict[str, float] = {}
        recorded_at: dict[str, float] = {}

        def on_replica(key, old, new):
            if new is None or new.deployment != DEPLOYMENT:
                return
            recorded_at.setdefault(key, time.time())
            if new.state == "ready" and key not in ready_at:
                ready_at[key] = time.time()

        replicas.listeners.append(on_replica)
        spec = DeploymentSpec(name=DEPLOYMENT, model="bench-70b", engine="sim", replicas=want, nodes_per_replica=2, gpus_per_node=4, startup_timeout=600)
        sched0 = self.scrape("scheduler")
        c0 = self.cpu_all()
        n_launch0 = len(self.board.launches)
        t_apply = time.time()
        reply = await self.nc.request(S.api("scheduler", "apply"), encode(spec), timeout=30)
        if (reply.headers or {}).get("Nats-Service-Error-Code"):
            raise BenchError(f"apply refused: {reply.data.decode(errors='replace')}")
        self.out(f"applied {want} replicas x 2 nodes x 4 GPUs (reply after {1000 * (time.time() - t_apply):.0f} ms)")
        expected = 2 * want
        deadline = time.monotonic() + max(60.0, want * 0.2)
        last = -1
        while len(self.board.launches) - n_launch0 < expected:
            self.check_alive()
            got = len(self.board.launches) - n_launch0
            if got != last:
                self.out(f"launch commands at agents {got}/{expected}")
                last = got
            if time.monotonic() > deadline:
                raise BenchError(f"only {got} of {expected} launch commands arrived")
            self.board.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.board.changed.wait(), 0.5)
        mine = self.board.launches[n_launch0:]
        first, lastl = min(s.at for s in mine), max(s.at for s in mine)
        self.fig["place_first_launch_s"] = first - t_apply
        self.fig["place_last_launch_s"] = lastl - t_apply
        self.out(f"all {expected} launch commands arrived: first {1000 * (first - t_apply):.0f} ms, last {1000 * (lastl - t_apply):.0f} ms after the apply")
        last = -1
        while len(ready_at) < want:
            self.check_alive()
            if len(ready_at) != last:
                self.out(f"replicas ready {len(ready_at)}/{want}")
                last = len(ready_at)
            if time.monotonic() > deadline:
                raise BenchError(f"only {len(ready_at)} of {want} replicas ready")
            await asyncio.sleep(0.1)
        self.fig["place_ready_s"] = max(ready_at.values()) - t_apply
        self.fig["place_first_record_s"] = min(recorded_at.values()) - t_apply
        self.fig["place_last_record_s"] = max(recorded_at.values()) - t_apply
        self.out(
            f"replica records (as a reader sees them): first {1000 * self.fig['place_first_record_s']:.0f} ms, last {1000 * self.fig['place_last_record_s']:.0f} ms after the apply"
        )
        c1 = self.cpu_all()
        self.fig["place_cpu_s"] = {k: c1[k] - c0[k] for k in c0}
        sched1 = self.scrape("scheduler")
        k_sum, k_cnt = "llmgw_scheduler_reconcile_seconds_sum", "llmgw_scheduler_reconcile_seconds_count"
        self.fig["place_reconciles"] = sched1.get(k_cnt, 0) - sched0.get(k_cnt, 0)
        self.fig["place_reconcile_s"] = sched1.get(k_sum, 0) - sched0.get(k_sum, 0)
        self.out(
            f"all {want} replicas ready {self.fig['place_ready_s']:.2f}s after the apply ({self.fig['place_reconciles']:.0f} reconciles, {self.fig['place_reconcile_s']:.2f}s in them)"
        )
        self.out("CPU seconds meanwhile: " + ", ".join(f"{k} {v:.2f}" for k, v in self.fig["place_cpu_s"].items()))
        self.replicas = replicas
        # For context: steady state again, now with every replica placed.
        window = min(a.steady, 10.0)
        await asyncio.sleep(min(a.heartbeat, 5.0))
        c0, w0 = self.cpu_all(), time.monotonic()
        await asyncio.sleep(window)
        c1, el = self.cpu_all(), time.monotonic() - w0
        self.fig["placed_cpu_pct"] = {k: 100.0 * (c1[k] - c0[k]) / el for k in c0}
        self.out(f"steady state with {want} replicas placed, over {el:.0f}s: " + ", ".join(f"{k} {v:.1f}%" for k, v in self.fig["placed_cpu_pct"].items()))

    # -- phase 4 ---------------------------------------------------------------
    async def failover(self) -> None:
        a = self.args
        self.phase(4, "failover")
        live = sorted((r for r in self.replicas.items.values() if r.deployment == DEPLOYMENT and r.state == "ready"), key=lambda r: r.generation)
        victim_id = live[0].members[-1].node_id  # a worker of the oldest replica
        hosted = [r.id for r in live if any(m.node_id == victim_id for m in r.members)]
        max_gen = max(r.generation for r in live)
        lost_sub = await self.nc.subscribe(S.event("node", victim_id, "lost"))
        n_launch0 = len(self.board.launches)
        passes0 = await asyncio.to_thread(self.full_passes)
        victim = await self.fleet.silence(victim_id)
        self.out(f"stopped the heartbeats of {victim_id} (member of {', '.join(hosted)}); its connection stays up")
        try:
            msg = await lost_sub.next_msg(timeout=a.node_lost_after + 30)
        except Exception:
            raise BenchError(f"no lost event for {victim_id} within {a.node_lost_after + 30:.0f}s") from None
        seen_lost = time.time()
        await lost_sub.unsubscribe()
        expected = 2 * len(hosted)
        deadline = time.monotonic() + 60
        while True:
            new = [s for s in self.board.launches[n_launch0:] if s.generation > max_gen]
            if len(new) >= expected:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"only {len(new)} of {expected} replacement launches arrived")
            self.board.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.board.changed.wait(), 0.5)
        # The lost event's time, as the health monitor stamped it, from the stream.
        stored = await self.js.get_last_msg(S.EVENT_STREAM, S.event("node", victim_id, "lost"))
        ev = decode(stored.data, Event)
        if abs(ev.time - B.EVENTS.decode(msg.data).time) > 1e-6:
            raise BenchError("the lost event in the stream differs from the one published")
        first, lastl = min(s.at for s in new), max(s.at for s in new)
        passes1 = await asyncio.to_thread(self.full_passes)
        # The scheduler's full passes from the silence to the last launch: one that
        # ran across the lost event ran beside the loop (dropped: the rebuild's plan
        # outdated it) unless it had to run on it.
        self.fig["failover_full_passes"] = {k: passes1.get(k, 0) - passes0.get(k, 0) for k in ("adopted", "dropped", "on_loop")}
        self.fig["lost_after_beat_s"] = ev.time - victim.last_beat
        self.fig["failover_first_s"] = first - ev.time
        self.fig["failover_last_s"] = lastl - ev.time
        self.fig["failover_replicas"] = len(hosted)
        self.fig["failover_event_seen_s"] = seen_lost - ev.time
        self.out(
            f"{victim_id} declared lost {ev.time - victim.last_beat:.2f}s after its last heartbeat (event time from {S.EVENT_STREAM}; lost after {format_duration(a.node_lost_after)}, checked every {format_duration(min(a.heartbeat / 4, 1.0))})"
        )
        self.out(
            f"replacement launch commands ({len(new)} for {len(hosted)} replicas) arrived {1000 * (first - ev.time):.0f} .. {1000 * (lastl - ev.time):.0f} ms after the lost event"
        )
        fp = self.fig["failover_full_passes"]
        self.out(
            f"the scheduler's full passes from the silence to the last launch: {fp['adopted']:.0f} adopted, {fp['dropped']:.0f} dropped (outdated by a plan "
            f"applied while they ran), {fp['on_loop']:.0f} on its loop (the last one took {self.scrape('scheduler').get('llmgw_scheduler_full_pass_seconds', 0.0):.2f}s)"
        )
        new_ids = {s.replica_id for s in new}
        t_wait = time.monotonic()
        while not all(self.replicas.items.get(r) is not None and self.replicas.items[r].state == "ready" for r in new_ids):
            if time.monotonic() - t_wait > 30:
                self.out("replacements not ready within 30s (not a target; continuing)")
                break
            await asyncio.sleep(0.05)
        else:
            self.fig["failover_ready_s"] = time.time() - ev.time
            self.out(f"replacements ready {self.fig['failover_ready_s']:.2f}s after the lost event (observed through the replicas bucket)")

    # -- teardown ----------------------------------------------------------------
    async def close(self) -> None:
        for m in list(self.mirrors):
            with contextlib.suppress(Exception):
                await m.stop()
        await self.fleet.close()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), 15)

    # -- phase 5 (one server) --------------------------------------------------
    def lease_ages(self) -> tuple[float, dict[str, float]]:
        """(wall clock when asked, node -> ``llmgw_health_lease_age_seconds``) from the
        health monitor's own metrics: how long ago *it* last accepted each node's heartbeat."""
        prefix = 'llmgw_health_lease_age_seconds{node="'
        asked = time.time()
        return asked, {k[len(prefix) : -2]: v for k, v in self.scrape("health").items() if k.startswith(prefix)}

    async def lost_events(self) -> dict[str, int]:
        """node -> how many lost events ``LLMGW_EVENTS`` holds for it."""
        info = await self.js.stream_info(S.EVENT_STREAM, subjects_filter=S.event("node", "*", "lost"))
        return {subject.split(".")[-2]: n for subject, n in (info.state.subjects or {}).items()}

    async def restart_nats(self) -> tuple[float, float, float]:
        """Stop nats-server (--restart-signal), keep it down --restart-down, start it
        again on the same port and JetStream store; wall clock of the stop, the new
        process's start and its readiness."""
        a, nats, proc = self.args, self.cluster.nats, self.cluster.procs["nats-server"]
        t_kill = time.time()
        os.killpg(proc.pid, getattr(signal, f"SIG{a.restart_signal}"))
        await asyncio.to_thread(proc.wait, 120)
        self.out(f"nats-server (pid {proc.pid}) stopped by SIG{a.restart_signal} in {time.time() - t_kill:.2f}s; every connection lost the bus")
        if a.restart_down > 0:
            await asyncio.sleep(a.restart_down)  # the outage itself is the scenario
        t_start = time.time()
        self.cluster._spawn("nats-server", self.cluster.llmgw("nats", "--config", str(nats.conf_path)))
        nats.proc = self.cluster.procs["nats-server"]
        # In a thread: this loop keeps running the agents' reconnects meanwhile.
        await asyncio.to_thread(nats.wait_ready, 120)
        return t_kill, t_start, time.time()

    async def nats_restart(self) -> None:
        """Stop nats-server under full load and start it again on the same port and store.

        Measured from the new server process's start (the earliest an agent can
        reconnect, so no renewal can precede it): the agents' reconnect spread, and
        when the health monitor had accepted a heartbeat of every live node again.
        Then: which live nodes were declared lost meanwhile (none may be)."""
        a = self.args
        self.phase(5, "nats-server restart")
        live = [ag for ag in self.agents if not ag.silent]
        live_ids = {ag.node_id for ag in live}
        hb = a.heartbeat
        grace = a.reconnect_grace or max(2 * hb, AGENT_RECONNECT_MAX * 1.2 + hb)
        self.out(
            f"{len(live)} live agents; the health monitor pauses its countdowns while it is away from the bus and then grants "
            f"{format_duration(grace)} ({'--reconnect-grace' if a.reconnect_grace else 'health.reconnect_grace derived: reconnect_max x 1.2 + a heartbeat'}) "
            f"before anything may expire; lost after {format_duration(a.node_lost_after)} of silence"
        )  # fmt: skip
        lost0 = await self.lost_events()
        trans0 = self.scrape("health").get('llmgw_health_transitions_total{to="lost"}', 0.0)
        for ag in self.agents:
            ag.reconnected_at.clear()
            ag.errors = 0
        nats = self.cluster.nats
        c0 = {k: v for k, v in self.cpu_all().items() if k != "nats-server"}
        t_kill, t_start, t_ready = await self.restart_nats()
        self.fig["restart_down_s"] = t_start - t_kill
        self.fig["restart_ready_s"] = t_ready - t_start
        self.out(
            f"nats-server started again (pid {nats.proc.pid}, same port and JetStream store) {t_start - t_kill:.2f}s after the stop; healthy {t_ready - t_start:.2f}s after its start"
        )
        renewed: dict[str, float] = {}  # node -> when the monitor first accepted its heartbeat after the start
        deadline = time.time() + max(120.0, a.nodes * 0.05)
        poll = 0.2 if a.nodes <= 2000 else 0.5  # a scrape of 10,000 series costs the monitor too
        last_print = 0.0
        while True:
            asked, ages = await asyncio.to_thread(self.lease_ages)
            for node in live_ids - renewed.keys():
                age = ages.get(node)
                # The monitor stamped ages no earlier than ``asked``: so this proves a
                # heartbeat accepted after the server's start.
                if age is not None and age <= asked - t_start:
                    renewed[node] = asked - age
            back = sum(1 for ag in live if ag.reconnected_at)
            if time.time() - last_print >= 2 or (len(renewed) == len(live_ids) and back == len(live)):
                last_print = time.time()
                self.out(
                    f"  {time.time() - t_start:5.1f}s after the start: agents reconnected {back}/{len(live)}, leases renewed by the monitor {len(renewed)}/{len(live_ids)}"
                )
            if len(renewed) == len(live_ids) and back == len(live):
                break
            if time.time() > deadline:
                raise BenchError(
                    f"after the restart only {back} of {len(live)} agents reconnected and {len(renewed)} of {len(live_ids)} leases were renewed within {deadline - t_start:.0f}s"
                )
            await asyncio.sleep(poll)
        c1 = {k: v for k, v in self.cpu_all().items() if k != "nats-server"}
        server_cpu = cpu_seconds(nats.proc.pid)
        span = time.time() - t_kill
        self.fig["restart_cpu_pct"] = {
            **{k: 100.0 * (c1[k] - c0[k]) / span for k in c0},
            "nats-server (new)": 100.0 * server_cpu / (time.time() - t_start),
        }
        # What one agent's return cost each side, upper bounds (start-up, JetStream's
        # recovery and the heartbeats meanwhile are in them too): on this machine both
        # sides share the same cores, in a real cluster the agents' side is on their nodes.
        self.fig["restart_server_ms_per_agent"] = 1000.0 * server_cpu / len(live)
        self.fig["restart_agents_ms_per_agent"] = 1000.0 * (c1["bench (agents)"] - c0["bench (agents)"]) / len(live)
        firsts = sorted(ag.reconnected_at[0] for ag in live)
        self.fig["reconnect_first_s"] = firsts[0] - t_start
        self.fig["reconnect_last_s"] = firsts[-1] - t_start
        spread = firsts[-1] - firsts[0]
        self.fig["reconnect_per_s"] = len(firsts) / spread if spread > 0 else float(len(firsts))
        self.fig["reconnect_repeats"] = sum(len(ag.reconnected_at) - 1 for ag in live)
        self.fig["reconnect_errors"] = sum(ag.errors for ag in live)
        self.fig["restart_renewed_s"] = max(renewed.values()) - t_start
        # The target counts from the server's return: healthy, taking connections.
        self.fig["restart_renewed_after_ready_s"] = max(renewed.values()) - t_ready
        self.fig["restart_renewed_heartbeats"] = self.fig["restart_renewed_after_ready_s"] / hb
        # The control plane's own share: from the last agent's return (the herd is paced by
        # the agent workers' TLS handshakes on the same cores, not by the monitor).
        # Clamped at 0: a renewal's time is estimated from the monitor's gauge (asked - age)
        # and an agent's return is stamped when nats-py runs its reconnected callback, which
        # can be after the monitor already accepted that agent's first heartbeat: a negative
        # difference means "at once".
        self.fig["restart_renewed_after_last_agent_s"] = max(0.0, max(renewed.values()) - firsts[-1])
        self.out(
            f"agents reconnected {self.fig['reconnect_first_s']:.2f} .. {self.fig['reconnect_last_s']:.2f}s after the server's start "
            f"({self.fig['reconnect_per_s']:.0f} connections/s; {self.fig['reconnect_repeats']} dropped and reconnected again; "
            f"{self.fig['reconnect_errors']} connection errors on the way, failed attempts among them)"
        )
        self.out(
            f"every live lease renewed by the monitor {self.fig['restart_renewed_s']:.2f}s after the server's start, "
            f"{self.fig['restart_renewed_after_ready_s']:.2f}s after it was healthy ({self.fig['restart_renewed_heartbeats']:.1f} heartbeats), "
            f"{self.fig['restart_renewed_after_last_agent_s']:.2f}s after the last agent was back (the control plane's own time: the herd "
            "before it is paced by the simulated agents' TLS handshakes on these same cores)"
        )
        # Lost declarations would have come before those renewals; give the events
        # in flight a heartbeat to be stored, then count.
        await asyncio.sleep(hb)
        lost1 = await self.lost_events()
        wrongly = sorted(n for n in live_ids if lost1.get(n, 0) > lost0.get(n, 0))
        trans = self.scrape("health").get('llmgw_health_transitions_total{to="lost"}', 0.0) - trans0
        leases = await self.mirror(B.LEASES)
        not_ready = sorted(n for n in live_ids if (lease := leases.items.get(n)) is None or lease.state != "ready")
        await self.unmirror(leases)
        self.fig["restart_wrongly_lost"] = len(wrongly)
        self.fig["restart_lost_transitions"] = trans
        self.fig["restart_not_ready_after"] = len(not_ready)
        self.out(
            f"live nodes declared lost during the restart: {len(wrongly)}{' (' + ', '.join(wrongly[:10]) + (' …' if len(wrongly) > 10 else '') + ')' if wrongly else ''}; "
            f"the monitor's transitions to lost: {trans:.0f}; live leases not ready in {S.BUCKET_LEASES} afterwards: {len(not_ready)}"
        )
        self.out(
            "CPU meanwhile (% of one core, from the stop; nats-server from its new start): "
            + ", ".join(f"{k} {v:.0f}%" for k, v in self.fig["restart_cpu_pct"].items())
        )
        if self.fig["reconnect_first_s"] - self.fig["restart_ready_s"] > 2 * AGENT_RECONNECT_MAX:
            self.out(
                "note: no agent was back within two reconnect_max of a healthy server. Every simulated agent's TLS handshake is made "
                f"by the bench's {self.args.agent_procs} agent worker(s) on this machine's cores: when thousands are in flight at once "
                "each takes longer than the 5 s connect timeout (and the server's TLS timeout), so whole waves fail and back off together "
                "(congestion collapse). The figures then say how the herd behaves against the workers' handshake capacity, not against nats-server's."
            )  # fmt: skip

    # -- phase 5 ---------------------------------------------------------------
    async def meta_leader_kill(self) -> None:
        """SIGKILL the JetStream meta leader while the operator applies a deployment
        (a scheduler KV write and an event) every 100 ms: the longest gap between
        acknowledged applies around the kill is how long control-plane writes are blocked."""
        nc = self.cluster.nats_cluster
        self.phase(5, "meta leader killed")

        def meta_leader() -> str | None:
            for m in nc.members:
                with contextlib.suppress(OSError, ValueError):
                    with urllib.request.urlopen(f"{m.monitor_url}/jsz", timeout=3) as r:
                        leader = (json.load(r).get("meta_cluster") or {}).get("leader")
                    if leader:
                        return leader
            return None

        meta = await asyncio.to_thread(meta_leader)  # a blocking read: off the agents' loop
        victim = next((i for i, m in enumerate(nc.members) if m.name == meta), None)
        if victim is None:
            raise BenchError(f"cannot tell the meta leader from the servers' monitoring (saw {meta!r})")
        dep_leader = (await self.js.stream_info(S.kv_stream(S.BUCKET_DEPLOYMENTS))).cluster.leader
        spec = DeploymentSpec(name="bench-probe", model="sim-7b", engine="sim", replicas=0, nodes_per_replica=1, gpus_per_node=0)
        acked: list[float] = []
        stop = asyncio.Event()
        acked_after_kill = asyncio.Event()
        t_kill = math.inf

        async def writer():
            while not stop.is_set():
                t = time.monotonic()
                with contextlib.suppress(Exception):
                    reply = await self.nc.request(S.api("scheduler", "apply"), encode(spec), timeout=2)
                    if not (reply.headers or {}).get("Nats-Service-Error-Code"):
                        acked.append(time.monotonic())
                        if acked[-1] > t_kill:
                            acked_after_kill.set()
                await asyncio.sleep(max(0.0, 0.1 - (time.monotonic() - t)))

        task = asyncio.create_task(writer())
        try:
            await asyncio.sleep(2.0)
            if not acked:
                raise BenchError("no apply acknowledged before the kill")
            name = f"nats-server-{meta}"
            t_kill = time.monotonic()
            proc = self.cluster.procs.get(name)
            if proc is not None:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                nc.kill(victim)
            self.out(
                f"SIGKILLed {meta}, the meta leader ({'also' if dep_leader == meta else 'not'} the leader of {S.kv_stream(S.BUCKET_DEPLOYMENTS)}: {dep_leader})"
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(acked_after_kill.wait(), 60)
            await asyncio.sleep(2.0)
        finally:
            stop.set()
            await task
        after = [t for t in acked if t > t_kill]
        if not after:
            raise BenchError("no apply acknowledged within 60s of killing the meta leader")
        before = max(t for t in acked if t <= t_kill)
        gaps = [b - a for a, b in itertools.pairwise(acked) if b > t_kill]
        self.fig["meta_kill_blocked_s"] = after[0] - before
        self.fig["meta_kill_first_ack_s"] = after[0] - t_kill
        self.fig["meta_kill_max_gap_s"] = max(gaps) if gaps else 0.0
        self.fig["meta_kill_victim_led_deployments"] = dep_leader == meta
        self.out(
            f"control-plane writes blocked {self.fig['meta_kill_blocked_s']:.2f}s (last ack before the kill -> first after; "
            f"first ack {self.fig['meta_kill_first_ack_s']:.2f}s after the kill; the longest gap after it {self.fig['meta_kill_max_gap_s']:.2f}s)"
        )

    # -- --floor ----------------------------------------------------------------
    async def floor(self) -> None:
        """The placement's launches with no control plane: nats-server and the simulated
        agents alone, the launches sent as the scheduler sends them (one request each,
        all in flight at once, under the scheduler's own certificate). What this
        takes is what any control plane's placement takes at least on this machine."""
        a = self.args
        self.phase(1, "bring-up: nats-server and the agents alone (--floor)")
        self.prepare()
        self.cluster.start_nats()
        sender = await bus.connect(
            self.cluster.nats_urls, self.cluster.nats.tls_for("scheduler", "scheduler"), name="bench-floor", initial_attempts=20, reconnect_base=0.2, reconnect_max=1.0
        )  # fmt: skip
        try:
            await self.connect_agents()
            # What the agents' heartbeats alone cost, for context: the floor's steady state.
            await asyncio.sleep(min(a.heartbeat, 5.0))
            window = min(a.steady, 10.0)
            c0, w0 = self.floor_cpu(), time.monotonic()
            await asyncio.sleep(window)
            c1, el = self.floor_cpu(), time.monotonic() - w0
            self.fig["floor_steady_cpu_pct"] = {k: 100.0 * (c1[k] - c0[k]) / el for k in c0}
            self.out(f"steady state, heartbeats only, over {el:.0f}s: " + ", ".join(f"{k} {v:.1f}%" for k, v in self.fig["floor_steady_cpu_pct"].items()))

            self.phase(2, f"the launch floor: {2 * a.replicas} launches, no control plane")
            nodes = self.node_ids()
            addr = {ag.node_id: ag.mgmt_addr for ag in self.agents}
            commands = []
            for r in range(a.replicas):
                pair = [nodes[(2 * r) % len(nodes)], nodes[(2 * r + 1) % len(nodes)]]
                rid = f"{DEPLOYMENT}-floor-{r:05d}"
                for rank, node in enumerate(pair):
                    cmd = LaunchCommand(
                        replica_id=rid, generation=r + 1, deployment=DEPLOYMENT, model="bench-70b", engine="sim", nnodes=2, rank=rank,
                        leader_addr=addr[pair[0]], rendezvous_port=29500,
                        http_port=8000, gpus=[0, 1, 2, 3], fabric=fabric_name(0), hcas=list(HCAS_PER_NODE),
                    )  # fmt: skip
                    commands.append((S.cmd_launch(node), encode(cmd)))
            acks: list[float] = []
            errors: dict[str, int] = {}

            async def one(subject: str, data: bytes) -> None:
                try:
                    reply = await sender.request(subject, data, timeout=FLOOR_COMMAND_TIMEOUT)
                    decode(reply.data, CommandAck)
                    acks.append(time.time())
                except Exception as e:
                    errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1

            n0 = len(self.board.launches)
            c0 = self.floor_cpu()
            t0 = time.time()
            await asyncio.gather(*(one(subject, data) for subject, data in commands))
            sent_s = time.time() - t0
            deadline = time.monotonic() + 30.0
            while len(self.board.launches) - n0 < len(acks) and time.monotonic() < deadline:
                # the workers' lines for the last launches are on their way
                self.board.changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.board.changed.wait(), 0.5)
            c1 = self.floor_cpu()
            seen = self.board.launches[n0:]
            if not seen:
                raise BenchError(f"no launch arrived at an agent ({errors})")
            self.fig["floor_first_launch_s"] = min(x.at for x in seen) - t0
            self.fig["floor_last_launch_s"] = max(x.at for x in seen) - t0
            self.fig["floor_last_ack_s"] = (max(acks) - t0) if acks else sent_s
            self.fig["floor_launches"] = len(seen)
            self.fig["floor_errors"] = errors
            self.fig["floor_cpu_s"] = {k: c1[k] - c0[k] for k in c0}
            self.out(
                f"{len(seen)} of {len(commands)} launches arrived: first {1000 * self.fig['floor_first_launch_s']:.0f} ms, "
                f"last {1000 * self.fig['floor_last_launch_s']:.0f} ms after the first was sent; {len(acks)} acknowledged, "
                f"the last after {1000 * self.fig['floor_last_ack_s']:.0f} ms" + (f"; not acknowledged: {errors}" if errors else "")
            )
            self.out("CPU seconds meanwhile: " + ", ".join(f"{k} {v:.2f}" for k, v in self.fig["floor_cpu_s"].items()))
            self.out("per launch: " + ", ".join(f"{k} {1000 * v / len(commands):.2f} ms" for k, v in self.fig["floor_cpu_s"].items()))
            await sender.close()
            if a.restart:
                await self.floor_restart()
        finally:
            with contextlib.suppress(Exception):
                await sender.close()

    async def floor_restart(self) -> None:
        """--floor, then: nats-server restarted under the agents alone. A lease cannot be
        renewed before its agent is back and has sent a heartbeat (it sends one as it
        reconnects): the last agent's return bounds phase 5's figure from below."""
        a = self.args
        self.phase(3, "the restart floor: nats-server restarted under the agents alone")
        for ag in self.agents:
            ag.reconnected_at.clear()
            ag.errors = 0
        nats = self.cluster.nats
        c0 = {k: v for k, v in self.floor_cpu().items() if k != "nats-server"}
        t_kill, t_start, t_ready = await self.restart_nats()
        self.out(f"nats-server started again {t_start - t_kill:.2f}s after the stop; healthy {t_ready - t_start:.2f}s after its start")
        deadline = time.time() + max(120.0, a.nodes * 0.05)
        last_print = 0.0
        while (back := sum(1 for ag in self.agents if ag.reconnected_at)) < len(self.agents):
            self.fleet.check_alive()
            if time.time() - last_print >= 2:
                last_print = time.time()
                self.out(f"  {time.time() - t_start:5.1f}s after the start: agents reconnected {back}/{len(self.agents)}")
            if time.time() > deadline:
                raise BenchError(f"after the restart only {back} of {len(self.agents)} agents reconnected within {deadline - t_start:.0f}s")
            await asyncio.sleep(0.2)
        server_cpu = cpu_seconds(nats.proc.pid)
        c1 = {k: v for k, v in self.floor_cpu().items() if k != "nats-server"}
        firsts = sorted(ag.reconnected_at[0] for ag in self.agents)
        self.fig["floor_reconnect_last_s"] = firsts[-1] - t_start
        self.fig["floor_reconnect_after_ready_s"] = firsts[-1] - t_ready
        self.fig["floor_restart_server_ms_per_agent"] = 1000.0 * server_cpu / len(self.agents)
        self.fig["floor_restart_agents_ms_per_agent"] = 1000.0 * (c1["agent workers"] - c0["agent workers"]) / len(self.agents)
        self.fig["floor_reconnect_errors"] = sum(ag.errors for ag in self.agents)
        self.out(
            f"every agent back {self.fig['floor_reconnect_last_s']:.2f}s after the server's start, {self.fig['floor_reconnect_after_ready_s']:.2f}s after it was healthy "
            f"({self.fig['floor_reconnect_errors']} connection errors on the way); CPU per returning agent: nats-server "
            f"{self.fig['floor_restart_server_ms_per_agent']:.2f} ms (from its start), agent workers {self.fig['floor_restart_agents_ms_per_agent']:.2f} ms"
        )

    def floor_cpu(self) -> dict[str, float]:
        return {
            "nats-server": cpu_seconds(self.pids()["nats-server"]),
            "agent workers": sum(cpu_seconds(pid) for pid in self.fleet.pids),
            "sender (the bench)": cpu_seconds(os.getpid()),
        }

    async def run(self) -> None:
        if self.args.floor:
            try:
                await self.floor()
            finally:
                await self.close()
            return
        until = PHASES.index(self.args.until)
        try:
            await self.bring_up()
            for i, phase in enumerate((self.steady, self.placement, self.failover), start=1):
                if i > until:
                    return
                await phase()
            if until < PHASES.index("restart"):
                return
            if self.cluster.nats_cluster is not None:
                await self.meta_leader_kill()
            elif self.args.restart:
                await self.nats_restart()
        finally:
            t = time.monotonic()
            await self.close()
            self.out(f"closed {len(self.agents)} agent connections in {time.monotonic() - t:.1f}s")


# --------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------


def summary(args, fig: Figures, argv: list[str]) -> str:
    def row(phase, what, value, target="", ok=None):
        mark = "" if ok is None else ("ok" if ok else "MISSED")
        return f"| {phase:10s} | {what:44s} | {value:>14s} | {target:>8s} | {mark:6s} |"

    v = fig.values
    lines = [
        "",
        "== SUMMARY ==",
        f"command:  {' '.join(shlex.quote(x) for x in argv)}",
        f"machine:  {os.cpu_count()} cores ({_cpu_model()}), python {sys.version.split()[0]}",
        f"cluster:  {args.nodes} nodes x {args.gpus} GPUs, {args.fabrics} fabrics, heartbeat {format_duration(args.heartbeat)}, lost after {format_duration(args.node_lost_after)}, {args.nats_servers} NATS server(s)",
        "",
        f"| {'phase':10s} | {'figure':44s} | {'value':>14s} | {'target':>8s} | {'check':6s} |",
        "|" + "-" * 12 + "|" + "-" * 46 + "|" + "-" * 16 + "|" + "-" * 10 + "|" + "-" * 8 + "|",
    ]
    if "bringup_s" in v:
        lines.append(row("bring-up", f"{args.nodes} agent TLS connections ({args.nodes / v['connect_s']:.0f}/s)", f"{v['connect_s']:.1f} s"))
        lines.append(row("bring-up", "all nodes registered, leases ready", f"{v['bringup_s']:.1f} s"))
    if "steady_cpu_rh" in v:
        p = v["steady_cpu_pct"]
        cp = v["steady_cpu_control_plane"]
        lines.append(
            row("steady", f"registry + health + scheduler CPU ({v['steady_window_s']:.0f} s)", f"{cp:.1f} %", f"< {TARGETS['cpu']:.0f} %", cp < TARGETS["cpu"])
        )
        lines.append(row("steady", "  registry + health", f"{v['steady_cpu_rh']:.1f} %"))
        for k in ("registry", "health", "scheduler", "nats-server", "bench (agents)"):
            lines.append(row("steady", f"  {k}", f"{p[k]:.1f} %"))
        lines.append(row("steady", "  heartbeats accepted by health", f"{v['heartbeats_per_s']:.0f} /s"))
        lines.append(row("steady", "  lease writes by health", f"{v['lease_writes_per_s']:.0f} /s"))
    if "place_last_launch_s" in v:
        if "place_first_record_s" in v:
            lines.append(row("placement", "apply -> first replica record visible", f"{v['place_first_record_s']:.2f} s"))
            lines.append(row("placement", f"apply -> last of {args.replicas} records visible", f"{v['place_last_record_s']:.2f} s"))
        lines.append(row("placement", "apply -> first launch at an agent", f"{v['place_first_launch_s']:.2f} s"))
        lines.append(
            row(
                "placement",
                f"apply -> last of {2 * args.replicas} launches at agents",
                f"{v['place_last_launch_s']:.2f} s",
                f"< {TARGETS['placement']:.0f} s",
                v["place_last_launch_s"] < TARGETS["placement"],
            )
        )
    if "place_ready_s" in v:
        lines.append(row("placement", f"apply -> all {args.replicas} replicas ready", f"{v['place_ready_s']:.2f} s"))
    if "placed_cpu_pct" in v:
        p = v["placed_cpu_pct"]
        lines.append(row("placement", "then steady: registry + health + scheduler", f"{sum(p[k] for k in CONTROL_PLANE):.1f} %"))
        lines.append(row("placement", "  registry + health", f"{p['registry'] + p['health']:.1f} %"))
        lines.append(row("placement", "  scheduler", f"{p['scheduler']:.1f} %"))
        lines.append(row("placement", "  nats-server", f"{p['nats-server']:.1f} %"))
    if "failover_last_s" in v:
        lines.append(row("failover", "last heartbeat -> lost event", f"{v['lost_after_beat_s']:.2f} s"))
        lines.append(row("failover", "lost -> first replacement launch", f"{1000 * v['failover_first_s']:.0f} ms"))
        lines.append(
            row(
                "failover",
                f"lost -> last replacement launch ({v['failover_replicas']} repl.)",
                f"{1000 * v['failover_last_s']:.0f} ms",
                f"< {1000 * TARGETS['failover']:.0f} ms",
                v["failover_last_s"] < TARGETS["failover"],
            )
        )
        if "failover_ready_s" in v:
            lines.append(row("failover", "lost -> replacements ready", f"{1000 * v['failover_ready_s']:.0f} ms"))
        if "failover_full_passes" in v:
            fp = v["failover_full_passes"]
            lines.append(row("failover", "  full passes beside the loop meanwhile", f"{fp['adopted'] + fp['dropped']:.0f} passes"))
            lines.append(row("failover", "  full passes on the loop meanwhile", f"{fp['on_loop']:.0f} passes"))
    if "meta_kill_blocked_s" in v:
        led = " (it led the deployments stream)" if v.get("meta_kill_victim_led_deployments") else ""
        lines.append(row("meta kill", f"writes blocked, meta leader SIGKILLed{led}"[:44], f"{v['meta_kill_blocked_s']:.2f} s"))
        lines.append(row("meta kill", "kill -> first acknowledged write", f"{v['meta_kill_first_ack_s']:.2f} s"))
    if "restart_renewed_s" in v:
        n_live = args.nodes - 1
        lines.append(row("restart", f"stopped (SIG{args.restart_signal}) -> started again", f"{v['restart_down_s']:.2f} s"))
        lines.append(row("restart", "started -> healthy (/healthz)", f"{v['restart_ready_s']:.2f} s"))
        lines.append(row("restart", "started -> first agent reconnected", f"{v['reconnect_first_s']:.2f} s"))
        lines.append(row("restart", f"started -> last of {n_live} agents reconnected", f"{v['reconnect_last_s']:.2f} s"))
        lines.append(row("restart", "  reconnect rate (first to last)", f"{v['reconnect_per_s']:.0f} /s"))
        lines.append(row("restart", "  agents' connection errors meanwhile", f"{v['reconnect_errors']:.0f} errors"))
        within = TARGETS["restart_heartbeats"] * args.heartbeat
        lines.append(row("restart", "started -> every lease renewed by health", f"{v['restart_renewed_s']:.2f} s"))
        lines.append(
            row(
                "restart",
                "healthy -> every lease renewed by health",
                f"{v['restart_renewed_after_ready_s']:.2f} s",
                f"< {within:g} s",
                v["restart_renewed_after_ready_s"] < within,
            )
        )
        # The control plane's own share, apart: the herd before it is paced by the
        # simulated agents' TLS handshakes on these same cores, not by the monitor.
        if "restart_renewed_after_last_agent_s" in v:
            lines.append(row("restart", "  last agent back -> every lease renewed", f"{v['restart_renewed_after_last_agent_s']:.2f} s"))
        lines.append(row("restart", "live nodes declared lost", f"{v['restart_wrongly_lost']:.0f} nodes", "0", v["restart_wrongly_lost"] == 0))
        for k, pct in v["restart_cpu_pct"].items():
            lines.append(row("restart", f"  CPU {k}", f"{pct:.1f} %"))
        if "restart_server_ms_per_agent" in v:
            lines.append(row("restart", "  nats-server CPU per returning agent", f"{v['restart_server_ms_per_agent']:.2f} ms"))
            lines.append(row("restart", "  bench + workers CPU per returning agent", f"{v['restart_agents_ms_per_agent']:.2f} ms"))
    if "floor_last_launch_s" in v:
        n = 2 * args.replicas
        for k, pct in v["floor_steady_cpu_pct"].items():
            lines.append(row("floor", f"steady, heartbeats only: {k}", f"{pct:.1f} %"))
        lines.append(row("floor", "send -> first launch at an agent", f"{v['floor_first_launch_s']:.2f} s"))
        lines.append(row("floor", f"send -> last of {n} launches at agents", f"{v['floor_last_launch_s']:.2f} s"))
        lines.append(row("floor", f"send -> last of {n} acks", f"{v['floor_last_ack_s']:.2f} s"))
        for k, cpu in v["floor_cpu_s"].items():
            lines.append(row("floor", f"  CPU per launch: {k}", f"{1000 * cpu / n:.2f} ms"))
        if v["floor_errors"]:
            lines.append(row("floor", "  not acknowledged", f"{sum(v['floor_errors'].values())} launches"))
    if "floor_reconnect_last_s" in v:
        lines.append(row("floor", "restart: started -> every agent back", f"{v['floor_reconnect_last_s']:.2f} s"))
        lines.append(row("floor", "restart: healthy -> every agent back", f"{v['floor_reconnect_after_ready_s']:.2f} s"))
        lines.append(row("floor", "  nats-server CPU per returning agent", f"{v['floor_restart_server_ms_per_agent']:.2f} ms"))
        lines.append(row("floor", "  agent workers CPU per returning agent", f"{v['floor_restart_agents_ms_per_agent']:.2f} ms"))
    if args.floor:
        lines.append("")
        done = [k for k in ("floor_last_launch_s", "floor_reconnect_last_s") if k in v]
        lines.append(f"phases completed: {len(done)}/{2 if args.restart else 1}")
        return "\n".join(lines)
    wanted = (("bring-up", "bringup_s"), ("steady", "steady_cpu_rh"), ("placement", "place_ready_s"), ("failover", "failover_last_s"))
    if args.nats_servers > 1:
        wanted += (("meta kill", "meta_kill_blocked_s"),)
    elif args.restart:
        wanted += (("restart", "restart_renewed_s"),)
    # Those after --until were not asked for ("meta kill" stands in phase 5's place).
    wanted = tuple((p, k) for p, k in wanted if PHASES.index(p if p in PHASES else "restart") <= PHASES.index(args.until))
    phases = [p for p, k in wanted if k in v]
    lines.append("")
    lines.append(f"phases completed: {', '.join(phases) or 'none'} ({len(phases)}/{len(wanted)})")
    return "\n".join(lines)


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return re.sub(r"\s+", " ", line.split(":", 1)[1].strip())
    return "unknown CPU"


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def stop_processes(cluster: Cluster) -> None:
    """Services first, then nats-server; each reaped as soon as it exits.

    ``up.stop_recorded`` does the same from the pids file, but it cannot reap
    children it did not start and so waits out its full grace period on their
    zombies; here they are our children, so wait on them directly, then let it
    clean up whatever is left (and the pids file).
    """
    for group in ([r for r in ("scheduler", "health", "registry") if r in cluster.procs], [n for n in cluster.procs if n.startswith("nats-server")]):
        procs = [cluster.procs[r] for r in group if cluster.procs[r].poll() is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
    cluster.stop_all()


def raise_fd_limit(nodes: int) -> str:
    """Raise this process's RLIMIT_NOFILE soft limit to what ``nodes`` TLS
    connections need (the agent workers and nats-server, started by this process,
    inherit it: nats-server holds the other end of each). Returns what was done, for the log; raises BenchError
    when the hard limit is too low for it."""
    # Per process: this one holds one socket per agent, nats-server the other end of
    # each (its own table, same limit), plus JetStream files, services, margin.
    need = nodes + 2048
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return f"open files: {soft} allowed, {need} needed"
    if hard != resource.RLIM_INFINITY and hard < need:
        raise BenchError(f"{nodes} nodes need {need} open files (one connection per agent here and in nats-server); the hard limit is {hard}: raise it (ulimit -Hn {need}, or LimitNOFILE=) and run again")  # fmt: skip
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return f"open files: soft limit raised from {soft} to {need} (hard {hard}), inherited by nats-server"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\nWhat runs where:")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2000)
    p.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    p.add_argument("--fabrics", type=int, default=None, help="default: 20, fewer when that would leave a fabric under 10 nodes")
    p.add_argument("--replicas", type=int, default=1000, help="replicas of 2 nodes x 4 GPUs to place")
    p.add_argument("--heartbeat", default="5s")
    p.add_argument("--node-lost-after", default="15s")
    p.add_argument("--steady", default="30s", help="CPU measuring window")
    p.add_argument("--connect-concurrency", type=int, default=64, help="TLS handshakes in flight at once, over all agent workers")
    p.add_argument(
        "--reconnect-slots", type=int, default=64,
        help="reconnect handshakes in flight at once, over all agent workers (default 64; 0: unpaced, every agent at once as nats-py retries)",
    )  # fmt: skip
    p.add_argument(
        "--agent-procs", type=int, default=None,
        help="processes the simulated agents run in (default: one per 2,500 nodes, at most one per core): one loop's TLS handshakes would pace a herd of thousands",
    )  # fmt: skip
    p.add_argument("--dir", help="work directory, kept (default: a fresh temporary one, removed after a successful run)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, configs)")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--nats-servers", type=int, default=1, help="1 (default), or 3, 5…: a cluster on 127.0.0.1-N; phase 5 is then the meta leader killed")
    p.add_argument("--no-restart", dest="restart", action="store_false", help="skip phase 5 (the nats-server restart under full load)")
    p.add_argument(
        "--until", choices=PHASES, default=PHASES[-1],
        help="stop after this phase (default: all five); e.g. --until steady --steady 5m leaves time to attach a profiler to one service",
    )  # fmt: skip
    p.add_argument(
        "--full-pass-interval", default="0s",
        help="scheduler.full_pass_interval (default 0s: the scheduler's own, 60s); e.g. 3s keeps a full pass running through the failover phase",
    )  # fmt: skip
    p.add_argument(
        "--floor", action="store_true",
        help="no control plane: nats-server and the agents alone, the placement's 2 x --replicas launches sent as the scheduler sends them; "
        "what any placement costs at least on this machine",
    )  # fmt: skip
    p.add_argument("--restart-signal", choices=("TERM", "KILL"), default="TERM", help="how phase 5 stops nats-server (default TERM; KILL as a crash)")
    p.add_argument("--restart-down", default="0s", help="how long nats-server stays down in phase 5 (default 0s: started again at once)")
    p.add_argument(
        "--reconnect-grace", default="0s",
        help="health.reconnect_grace for the monitor (default 0s: derived from reconnect_max, as a service does)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.nats_servers < 1 or (args.nats_servers > 1 and args.nats_servers % 2 == 0):
        p.error(f"--nats-servers {args.nats_servers}: use 1, or an odd number of 3 or more")
    for name in ("heartbeat", "node_lost_after", "steady", "restart_down", "reconnect_grace", "full_pass_interval"):
        setattr(args, name, parse_duration(getattr(args, name), "--" + name.replace("_", "-")))
    if args.fabrics is None:
        args.fabrics = max(1, min(20, args.nodes // 10))
    if args.nodes < 4 or args.fabrics < 1 or args.fabrics > args.nodes // 2:
        p.error("need at least 4 nodes and 1 to nodes/2 fabrics")
    if args.gpus < 4:
        p.error("--gpus: replicas take 4 GPUs per node")
    if args.node_lost_after <= args.heartbeat:
        p.error("--node-lost-after must exceed --heartbeat")
    capacity = args.nodes * (args.gpus // 4)  # members of 4 GPUs
    if 2 * args.replicas + 2 * (args.gpus // 4) * 2 > capacity:
        p.error(f"{args.replicas} replicas x 2 nodes x 4 GPUs (and room for a rebuild) do not fit {args.nodes} nodes x {args.gpus} GPUs")
    if args.replicas < 1:
        p.error("--replicas: at least 1")
    if args.agent_procs is None:
        args.agent_procs = max(1, min(os.cpu_count() or 1, -(-args.nodes // 2500)))
    if 0 < args.full_pass_interval < 1.0:
        p.error(f"--full-pass-interval {args.full_pass_interval:g}s: 0 (the scheduler's own) or at least its reconcile_interval, 1s")
    if args.floor and args.nats_servers > 1:
        p.error("--floor runs one nats-server (its restart phase restarts that one); leave out --nats-servers")
    if args.floor and args.until != PHASES[-1]:
        p.error("--until names the full bench's phases; --floor has its own two (add --no-restart to stop after the launches)")
    if args.reconnect_slots < 0:
        p.error("--reconnect-slots: 0 (unpaced) or more")
    if not 1 <= args.agent_procs <= args.nodes:
        p.error(f"--agent-procs {args.agent_procs}: between 1 and --nodes")
    return args


def main(argv: list[str] | None = None) -> int:
    argv_full = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    if argv_full[1:2] == ["--agents-worker"]:  # a process of simulated agents, started by the bench
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s[agents]: %(message)s", datefmt="%H:%M:%S")
        logging.getLogger("asyncio").setLevel(logging.ERROR)
        try:
            job = json.loads(Path(argv_full[2]).read_text()) if len(argv_full) > 2 else None
        except (OSError, ValueError) as e:
            job, why = None, f"{type(e).__name__}: {e}"
        else:
            why = "usage: control_plane.py --agents-worker JOB.json (started by the bench, not by hand)"
        missing = sorted(WORKER_JOB_KEYS - job.keys()) if isinstance(job, dict) else []
        if not isinstance(job, dict) or missing:
            why = f"missing {', '.join(missing)}" if missing else why
            print(f"agents worker: cannot read its job: {why}", file=sys.stderr)
            return 2
        return asyncio.run(agents_worker(job))
    args = parse_args(argv_full[1:])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="llmgw-cpbench-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"llmgw control-plane bench: work dir {root} (if this process is killed: llmgw down --dir {root})", flush=True)
    try:
        print(raise_fd_limit(args.nodes), flush=True)
    except BenchError as e:
        print(f"FAILED: {e}", flush=True)
        return 1
    return run_bench(Bench(args, root), argv_full)


def run_bench(bench: Bench, argv_full: list[str]) -> int:
    """Run ``bench`` to its end, stop everything it started (also on Ctrl-C, SIGTERM or
    failure), print its summary and write ``--json``; the exit code. bench/console.py
    runs its own Bench through this too (``stop_extra``, ``summaries``, ``json_extra``)."""
    args, root = bench.args, bench.root
    rc = 0

    async def go():
        task = asyncio.current_task()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        await bench.run()

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        bench.out("interrupted")
        rc = 130
    except asyncio.CancelledError:
        bench.out("terminated")
        rc = 143
    except BenchError as e:
        bench.out(f"FAILED: {e}")
        rc = 1
    except Exception as e:
        bench.out(f"FAILED: {type(e).__name__}: {e}")
        import traceback

        traceback.print_exc()
        rc = 1
    finally:
        # Ignore further Ctrl-C while cleaning up, so nothing is left running.
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            bench.stop_extra()
            t = time.monotonic()
            stop_processes(bench.cluster)
            bench.out(f"stopped the services and nats-server in {time.monotonic() - t:.1f}s")
        finally:
            signal.signal(signal.SIGINT, old)
        if args.keep or args.dir or rc == 1:
            print(f"work dir kept: {root} (logs in {root / 'logs'})")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(summary(args, bench.fig, argv_full), flush=True)
    for text in bench.summaries():
        print(text, flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": {k: v for k, v in vars(args).items()}, "cores": os.cpu_count(), "rc": rc, **bench.fig.values, **bench.json_extra()},
                indent=2,
                default=str,
            )
            + "\n"
        )
    return rc


if __name__ == "__main__":
    sys.exit(main())
