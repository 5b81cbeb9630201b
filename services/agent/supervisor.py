"""The engine supervisor: launch, watch, stop and adopt the engine processes of one node.

No NATS here: the agent turns commands into calls and state changes into
status reports; this module knows processes, files and HTTP health checks.

Engines outlive the agent (invariant 5). Each runs, through the wrapper
(``wrapper.py``), in a session of its own, so neither an agent restart nor
systemd's ``KillMode=process`` reaches it, and everything the supervisor knows
about it is in its directory (``enginedir.py``), from which a restarted agent
adopts it as it is: nothing killed, nothing restarted.

Engine states, as reported in ``EngineFact.state`` (``shared/states.py``)::

    launch / adopt ──> starting ──(leader: GET /health == 200)──> ready
                          └──(worker: holds a connection to its leader's rendezvous)──> joined
                                                                  │  ^
        (leader: a canary gets no token in probe_timeout,         v  │ (a canary gets a token,
         or a gateway's requests in flight get no byte for     stalled  or a gateway's completed
         stall_after, or /health fails twice running)                    count grows)
    any running ──(its own log says a peer of its group is gone)──> peer-lost
    any ──(process gone; exit_code from the wrapper)──> exited ──(stop)──> forgotten

Every change goes out at once as a status delta, with ``EngineFact.detail``
saying in words what was seen ("canary sent 12:00:01 got no token in 3s").

Progress probes. ``/health`` answers while a multi-node engine's collective
hangs, so a ready leader is also asked for a token: every ``probe_interval`` a
one-token completion (the canary) — unless real requests completed on it in
that interval, which the gateways report (``TrafficReport``, merged per
gateway, a gateway's entry forgotten after a few intervals without news).
A gateway's report of requests in flight that got no byte for ``stall_after``
is evidence of a stall too, without waiting for the next canary.

Peer loss. A multi-node engine whose peer went away says so in its own log
(the sim: "rank 1 lost (...)", "lost the leader (...)"; NCCL, Gloo and torch
print their own lines, see ``PEER_LOST_PATTERNS`` and docs/engines.md). Such a
group is broken for good, so the line is reported as ``peer-lost`` with the
line as detail, within ``LOG_SCAN_INTERVAL``.

Ready means the engine we launched answered. An answer on the leader's port
proves only that *something* listens there: another cluster's engine, a stale
one, a dummy. So before a leader is called ready, and at every health check,
the kernel's socket table (``shared/procnet.py``) must show the listener on
``mgmt_addr:http_port`` (or a wildcard address covering it) held by the
engine's own process tree (the socket's inode among ``/proc/<pid>/fd`` of the
engine, its descendants and its process group). A listener held by anyone else
ends the launch: our engine is stopped and reported ``exited`` with the holder
named in ``detail`` ("port 20001 on 127.0.1.1 is held by pid 4242 (python3
squat.py), not by the engine we launched (pid 4100)"), so the scheduler fails
the replica and rebuilds it. A launch whose leader ports are already held is
refused before anything starts (``port_busy``, the holder named).

Workers never listen (invariant 3), so they are watched as processes (and
logs) only and stay ``starting`` while alive. An exited engine is kept, with
its exit code and log tail, until a stop for it arrives, so the control plane
always sees the exit, even across a reconnect or an agent restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from llmgw.shared import addresses, procfs, procnet
from llmgw.shared.durations import format_duration
from llmgw.shared.errors import LlmgwError, WireError
from llmgw.shared.schemas import CommandAck, EngineFact, LaunchCommand, TrafficReport, weights_source
from llmgw.shared.states import EngineState
from llmgw.shared.tasks import cancel_and_wait

from . import adapters
from .config import SupervisorConfig
from .enginedir import EngineDir, EngineSpec, PidRecord, StopRequest, atomic_write, check_replica_id, dir_name

__all__ = ["Engine", "Supervisor"]

log = logging.getLogger("llmgw.agent.supervisor")

# Refusal codes of a launch (CommandAck.code).
STALE_GENERATION = "stale_generation"
UNKNOWN_GPU = "unknown_gpu"
GPU_BUSY = "gpu_busy"
BAD_LAUNCH = "bad_launch"
LAUNCH_CONFLICT = "launch_conflict"
SPAWN_FAILED = "spawn_failed"
PORT_BUSY = "port_busy"
ADDR_UNUSABLE = "addr_unusable"  # mgmt_addr or the leader's address does not resolve (to an address of this machine)

# How long the wrapper may take to start the engine and write its pid. Past it
# the launch is acked without a pid and the watch loop picks the pid up later.
SPAWN_TIMEOUT = 15.0
POLL = 0.02
# One missed health check is a slow answer; two in a row is a leader that has
# stopped serving. It also keeps a dying leader from flapping to ``starting``
# just before its exit is seen.
HEALTH_FAILURES_BEFORE_UNREADY = 2
# How often a starting engine is looked at (its /health, its joins), at most.
STARTING_WATCH = 0.2
# Engine logs are read for peer-loss lines this often, at most this much per read.
LOG_SCAN_INTERVAL = 0.25
LOG_SCAN_MAX = 1 << 20
# Lines in an engine's own output saying a peer of its group is gone for good.
# Matched case-sensitively against each line; docs/engines.md says where each
# comes from and which are verified against the engines' sources.
PEER_LOST_PATTERNS = tuple(
    re.compile(p)
    for p in (
        r"\brank \d+ lost\b",  # llmgw sim leader: "rank 1 lost (no word from ...)"
        r"\blost the leader\b",  # llmgw sim worker: "lost the leader (...)"
        r"Connection closed by (remote )?peer",  # Gloo's pair.cc; NCCL's socket errors as users report them
        # Gloo's pair.cc when a peer's socket was reset (its process killed): what real
        # vLLM's Worker_PP0 raised on this project's machine when its PP1 rank died,
        # "Read error [127.0.0.1]:40115: Connection reset by peer. This is typically
        # caused by a remote worker hanging ..."; a write to it fails as "writev <addr>: ...".
        r"\b(Read error|writev) \S+: (Connection reset by peer|Broken pipe)\b",
        r"ncclRemoteError|remote process exited or there was a network error",  # NCCL
        r"Watchdog caught collective operation timeout",  # torch ProcessGroupNCCL watchdog
    )
)


def says_peer_lost(line: str) -> bool:
    """Whether one line of an engine's output says a peer of its group is gone for good."""
    return any(p.search(line) for p in PEER_LOST_PATTERNS)


# The canary: one token of a real generation.
CANARY_PROMPT = "ping"
# A gateway's traffic entry is forgotten after this many probe intervals without a report.
TRAFFIC_FORGET_INTERVALS = 3
# How many stopped replicas' generations are remembered (for refusing late launches).
MAX_FENCES = 4096
FENCES_FILE = "fences.json"

EngineKey = tuple[str, int, int]  # (replica_id, generation, rank)
OnChange = Callable[[EngineFact], None]


@dataclass
class GatewayTraffic:
    """The last report of one gateway about one leader's replica."""

    completed: int
    in_flight: int
    silent_for: float
    received_at: float  # monotonic


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _refuse(code: str, reason: str) -> CommandAck:
    return CommandAck(ok=False, code=code, reason=reason)


def _indices(values) -> str:
    return ",".join(str(v) for v in sorted(values)) or "none"


def _judge_embedding(raw: bytes) -> str | None:
    """None when ``raw`` is an OpenAI embeddings answer with a non-empty vector."""
    try:
        data = json.loads(raw).get("data") or []
        vector = data[0].get("embedding") if data and isinstance(data[0], dict) else None
    except (ValueError, AttributeError):
        return f"failed: the answer is not an OpenAI embeddings answer: {raw[:120]!r}"
    if isinstance(vector, list) and vector:
        return None
    return f"failed: the answer carries no embedding: {raw[:120]!r}"


@dataclass(eq=False)
class Engine:
    """One engine process as the supervisor knows it."""

    dir: EngineDir
    spec: EngineSpec
    pids: PidRecord | None = None
    state: EngineState = EngineState.STARTING
    detail: str = ""
    exit_code: int | None = None
    log_tail: list[str] = field(default_factory=list)
    since: float = field(default_factory=time.time)
    stopping: StopRequest | None = None
    health_failures: int = 0
    # The wrapper, when this agent started it (adopted engines have none).
    child: subprocess.Popen | None = None
    # Progress probes (leaders): when the next canary is due, the one in
    # flight, when a gateway last saw requests complete, and per gateway what
    # it last reported (all times monotonic).
    probe_due: float = 0.0
    canary: asyncio.Task | None = None
    completed_at: float = -math.inf
    traffic: dict[str, GatewayTraffic] = field(default_factory=dict)
    # How far the log has been read for peer-loss lines.
    log_offset: int = 0
    # Set when another process was found holding this leader's port: why the
    # agent ends this engine (reported as the exit's detail).
    squatted: str = ""
    # Listening-socket inodes already proved to be held by this engine's
    # processes: while one is still listening it is still ours (an inode is
    # not reused while its socket exists), so a steady leader costs one read
    # of the socket table per health check, not a walk of its fds.
    own_sockets: set[int] = field(default_factory=set)

    @property
    def cmd(self) -> LaunchCommand:
        return self.spec.command

    @property
    def key(self) -> EngineKey:
        return (self.cmd.replica_id, self.cmd.generation, self.cmd.rank)

    @property
    def label(self) -> str:
        return dir_name(*self.key)

    @property
    def pid(self) -> int:
        return self.pids.pid if self.pids else 0

    @property
    def bind_addr(self) -> str:
        """Where this leader listens (see ``EngineSpec.bind_addr``)."""
        return self.spec.bind_addr or self.cmd_host

    @property
    def cmd_host(self) -> str:
        # Specs from before bind_addr: the --host the adapter was given.
        argv = self.spec.argv
        return argv[argv.index("--host") + 1] if "--host" in argv[:-1] else ""

    @property
    def live(self) -> bool:
        return self.state != EngineState.EXITED

    @property
    def probed(self) -> bool:
        """A serving leader whose progress is watched: ready or stalled, not being stopped."""
        return (
            self.spec.serves_http and self.stopping is None and not self.squatted
            and self.state in (EngineState.READY, EngineState.STALLED)
        )  # fmt: skip

    def fact(self) -> EngineFact:
        c = self.cmd
        return EngineFact(
            replica_id=c.replica_id,
            generation=c.generation,
            deployment=c.deployment,
            rank=c.rank,
            serves_http=self.spec.serves_http,
            pid=self.pid,
            # A supervised engine is never in the scheduler's own states (absent, unreported),
            # and a StrEnum member is the very string the Literal names.
            state=self.state,
            detail=self.detail,
            exit_code=self.exit_code,
            gpus=list(c.gpus),
            http_port=c.http_port,
            rendezvous_port=c.rendezvous_port,
            log_tail=list(self.log_tail),
            since=self.since,
        )

    # -- liveness ----------------------------------------------------------------
    def load_pids(self) -> None:
        if self.pids is None:
            try:
                self.pids = self.dir.read_pid()
            except WireError as e:
                log.warning("%s: %s", self.label, e)

    def recorded_exit(self) -> int | None:
        try:
            return self.dir.read_exit_code()
        except WireError as e:
            log.warning("%s: %s", self.label, e)
            return None

    def engine_alive(self) -> bool:
        return self.pids is not None and procfs.is_alive(self.pids.pid, self.pids.start_time)

    def wrapper_alive(self) -> bool:
        if self.child is not None:
            return self.child.poll() is None  # also reaps it
        p = self.pids
        return p is not None and p.wrapper_pid > 0 and procfs.is_alive(p.wrapper_pid, p.wrapper_start_time)

    def running(self) -> bool:
        """Still running as far as anyone can tell.

        The engine may be gone while its wrapper is about to write how it
        ended; until then it counts as running, so the exit is reported once,
        with its code.
        """
        if self.engine_alive():
            return True
        return self.recorded_exit() is None and self.wrapper_alive()

    def why_unknown(self) -> str:
        """Why nobody recorded an exit code, for the log tail."""
        if self.pids is None:
            return "the engine's pid was never recorded (the agent or wrapper died while launching)"
        st = procfs.stat(self.pids.pid)
        if st is not None and st.start_time != self.pids.start_time:
            return (
                f"pid {self.pids.pid} now belongs to another process (started at tick {st.start_time}, "
                f"the engine at {self.pids.start_time}); it was not adopted and will not be signalled"
            )
        return f"the engine (pid {self.pids.pid}) and its wrapper (pid {self.pids.wrapper_pid}) are gone"


class Supervisor:
    """The engines of this node. Use from one event loop; ``adopt()`` first, then ``start()``."""

    def __init__(
        self,
        cfg: SupervisorConfig,
        *,
        mgmt_addr: str,
        mgmt_interface: str,
        on_change: OnChange | None = None,
        python: str = sys.executable,
    ):
        self.cfg = cfg
        self.mgmt_addr = mgmt_addr
        # What mgmt_addr resolves to here: the agent refreshes it at every
        # discovery (set_mgmt); resolved once now for a supervisor used alone.
        self.mgmt = addresses.resolve_mgmt(mgmt_addr)
        self.mgmt_interface = mgmt_interface
        self.on_change = on_change
        self.python = python
        self.root = Path(cfg.work_dir) / "engines"
        self._engines: dict[EngineKey, Engine] = {}
        # replica id -> the highest generation stopped on this node: a launch
        # at or below it arrived late (or is stale) and must not start.
        self._fences: dict[str, int] = {}
        # Launches and stops change the set of engines and GPUs in use; they
        # take turns so two launches cannot both see a GPU free.
        self._lock = asyncio.Lock()
        self._stops: dict[EngineKey, asyncio.Task] = {}
        # Engines the agent ends itself (a squatter holds their port).
        self._ending: dict[EngineKey, asyncio.Task] = {}
        # Leaders whose socket ownership could not be read (warned about once).
        self._unverifiable: set[EngineKey] = set()
        self._reaping: list[subprocess.Popen] = []
        self._http: aiohttp.ClientSession | None = None
        self._watch: asyncio.Task | None = None
        self._scan: asyncio.Task | None = None
        # For tests and logs: canaries sent, traffic reports refused.
        self.canaries_sent = 0
        self.bad_traffic = 0

    # -- queries -----------------------------------------------------------------
    def facts(self) -> list[EngineFact]:
        return [self._engines[k].fact() for k in sorted(self._engines)]

    # -- lifecycle -----------------------------------------------------------------
    async def adopt(self) -> list[EngineFact]:
        """Take over every engine recorded under ``work_dir``: alive ones as they are, dead ones as exited."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._load_fences()
        for path in sorted(self.root.iterdir()):
            if not path.is_dir() or path.name.startswith("."):
                continue
            e = self._load(EngineDir(path))
            if e is None:
                continue
            if e.key in self._engines:
                log.error("%s: records the same engine as %s; not adopted, left for a person to look at", path, self._engines[e.key].dir.path)
                continue
            self._engines[e.key] = e
        # Ask the leaders now, and look at the workers' links, so the first full
        # report says ``ready`` for a leader that is serving and ``joined`` for a
        # worker in its group instead of flapping through ``starting``.
        await self._probe_leaders()
        self._probe_workers()
        live = sum(e.live for e in self._engines.values())
        if self._engines:
            log.info("adopted %d engine(s) from %s: %d running, %d exited", len(self._engines), self.root, live, len(self._engines) - live)
        return self.facts()

    def start(self) -> None:
        """Start watching (and finish stops an earlier agent left unfinished)."""
        if self._watch is None:
            for e in self._engines.values():
                if e.stopping is not None:
                    self._start_stop(e)
            self._watch = asyncio.create_task(self._watch_loop(), name="supervisor-watch")
            self._scan = asyncio.create_task(self._scan_loop(), name="supervisor-log-scan")

    async def close(self) -> None:
        """Stop watching. Engines keep running; unfinished stops are finished by the next agent."""
        canaries = [e.canary for e in self._engines.values() if e.canary is not None]
        tasks = [t for t in (self._watch, self._scan, *self._stops.values(), *self._ending.values(), *canaries) if t is not None]
        for t in await cancel_and_wait(tasks, timeout=5):
            log.warning("task %s did not end within 5s of being cancelled; leaving it", t.get_name())
        self._watch = self._scan = None
        self._stops.clear()
        self._ending.clear()
        if self._http is not None:
            await self._http.close()
            self._http = None

    # -- launch ----------------------------------------------------------------
    def has(self, key: EngineKey) -> bool:
        return key in self._engines

    def weights_in_use(self) -> set[str]:
        """The weights sources (``schemas.weights_source``) the live engines here were
        launched with: the model cache never evicts these (an adopted engine counts
        too, from its recorded launch command)."""
        out = set()
        for e in self._engines.values():
            if e.live and (source := weights_source(e.cmd.weights_path, e.cmd.weights_model)):
                out.add(source)
        return out

    def precheck(self, cmd: LaunchCommand, node_gpus: set[int]) -> CommandAck | None:
        """The refusals a launch would get now (fenced, bad, stale, GPUs): asked
        before its weights are staged, so a launch that could never start is
        refused at once rather than after the copy."""
        return self._fenced(cmd) or self._check_launch(cmd, node_gpus)

    async def launch(self, cmd: LaunchCommand, node_gpus: set[int], weights: adapters.Weights | None = None) -> CommandAck:
        """Start member ``cmd.rank`` of replica ``cmd.replica_id``; idempotent by (replica, generation, rank).
        ``weights``: where it reads its weights, for a launch with a weights source."""
        async with self._lock:
            # A member already stopped here is refused even when its record
            # lingers while it stops: the launch is the late one.
            existing = self._engines.get((cmd.replica_id, cmd.generation, cmd.rank))
            refusal = self._fenced(cmd)
            if refusal is None and existing is not None:
                return self._relaunch(existing, cmd)
            refusal = refusal or self._check_launch(cmd, node_gpus)
            if refusal is not None:
                log.warning("launch of %s refused (%s): %s", dir_name(cmd.replica_id, cmd.generation, cmd.rank), refusal.code, refusal.reason)
                return refusal
            refusal, leader_addrs = await self._addresses(cmd)
            if refusal is not None:
                log.warning("launch of %s refused (%s): %s", dir_name(cmd.replica_id, cmd.generation, cmd.rank), refusal.code, refusal.reason)
                return refusal
            bind = self.mgmt.bind
            try:
                built = adapters.build(cmd, mgmt_addr=bind, mgmt_interface=self.mgmt_interface, python=self.python, weights=weights)
            except LlmgwError as e:
                log.warning("launch of %s refused (%s): %s", dir_name(cmd.replica_id, cmd.generation, cmd.rank), e.code, e)
                return _refuse(e.code if e.code != "error" else BAD_LAUNCH, str(e))
            if built.serves_http:
                refusal = self._ports_taken(cmd, bind, leader_addrs)
                if refusal is not None:
                    log.warning("launch of %s refused (%s): %s", dir_name(cmd.replica_id, cmd.generation, cmd.rank), refusal.code, refusal.reason)
                    return refusal
            return await self._spawn(cmd, built, bind, leader_addrs)

    async def _addresses(self, cmd: LaunchCommand) -> tuple[CommandAck | None, tuple[str, ...]]:
        """Refuse a launch this node cannot place on the network; else the leader's addresses here.

        The engine binds the first of mgmt_addr's addresses that is this
        machine's, so a name that does not resolve, or resolves only to other
        machines' addresses, can start nothing. A member's leader address is
        resolved here too: the kernel shows a worker's link to it by address.
        """
        if self.mgmt.problem:
            return _refuse(ADDR_UNUSABLE, f"{self.mgmt.problem}; nothing can be started on this node until it does"), ()
        if not cmd.leader_addr:
            return None, ()
        if cmd.leader_addr == self.mgmt.name:
            return None, self.mgmt.addrs
        try:
            # Blocking (the system resolver), so off the loop; quick from /etc/hosts or a cache.
            return None, await asyncio.to_thread(addresses.resolve, cmd.leader_addr)
        except addresses.Unresolved as e:
            return _refuse(ADDR_UNUSABLE, f"the leader's address {e}, so this member could not find its rendezvous"), ()

    def set_mgmt(self, res: addresses.Resolution) -> None:
        """What mgmt_addr resolves to now (the agent's discovery). Launches use it from now on.

        A leader already listening on an address the name no longer resolves
        to serves where clients, who reach the node by its name, no longer go:
        it is ended and reported, and the scheduler rebuilds its replica. A
        name that stops resolving changes nothing that runs (a resolver outage
        must not take down serving engines); launches are refused until it
        resolves again.
        """
        old, self.mgmt = self.mgmt, res
        if res.problem or res.addrs == old.addrs:
            return
        for e in self._engines.values():
            if e.live and e.spec.serves_http and e.stopping is None and not e.squatted and e.bind_addr and e.bind_addr not in res.addrs:
                self._squatted(
                    e, f"mgmt_addr {res.name} now resolves to {', '.join(res.addrs)}; this leader listens on {e.bind_addr}, where clients no longer reach it"
                )

    def _relaunch(self, e: Engine, cmd: LaunchCommand) -> CommandAck:
        if e.cmd != cmd:
            return _refuse(
                LAUNCH_CONFLICT,
                f"{e.label} already runs here from a different launch command (GPUs {_indices(e.cmd.gpus)}, "
                f"http port {e.cmd.http_port}, rendezvous port {e.cmd.rendezvous_port}); "
                "a changed member needs a new generation",
            )
        what = f"exited with code {e.exit_code}" if e.state == EngineState.EXITED else e.state
        return CommandAck(ok=True, pid=e.pid, reason=f"already launched: {e.label} pid {e.pid} ({what}); nothing started")

    def _fenced(self, cmd: LaunchCommand) -> CommandAck | None:
        fence = self._fences.get(cmd.replica_id, 0)
        if cmd.generation <= fence:
            return _refuse(
                STALE_GENERATION,
                f"replica {cmd.replica_id} generation {cmd.generation} was already stopped on this node "
                f"(stops reached generation {fence}); a launch for it arrived late",
            )
        return None

    def _check_launch(self, cmd: LaunchCommand, node_gpus: set[int]) -> CommandAck | None:
        why = check_replica_id(cmd.replica_id)
        if why:
            return _refuse(BAD_LAUNCH, why)
        if cmd.generation < 1:
            return _refuse(BAD_LAUNCH, f"replica {cmd.replica_id}: generation must be at least 1, got {cmd.generation}")
        same_replica = [e for e in self._engines.values() if e.cmd.replica_id == cmd.replica_id]
        newest = max((e.cmd.generation for e in same_replica), default=0)
        if cmd.generation < newest:
            return _refuse(
                STALE_GENERATION,
                f"replica {cmd.replica_id} generation {cmd.generation} is older than generation {newest}, "
                "which this node already runs; the older one was superseded",
            )
        unknown = set(cmd.gpus) - node_gpus
        if unknown:
            return _refuse(
                UNKNOWN_GPU,
                f"GPU {_indices(unknown)} does not exist on this node (it has GPUs {_indices(node_gpus)})",
            )
        for e in self._engines.values():
            held = set(cmd.gpus) & set(e.cmd.gpus)
            if e.live and held:
                doing = "stopping" if e.stopping else e.state
                return _refuse(
                    GPU_BUSY,
                    f"GPU {_indices(held)} held by {e.label} (pid {e.pid}, {doing}); stop it first",
                )
        return None

    def _ports_taken(self, cmd: LaunchCommand, bind: str, leader_addrs: tuple[str, ...]) -> CommandAck | None:
        """Refuse a leader whose ports someone already listens on: it could only fail, or worse, look ready."""
        ports: list[tuple[str, str | tuple[str, ...], int]] = [("HTTP", bind, cmd.http_port)]
        if cmd.nnodes > 1 or cmd.engine == "sim":  # the sim leader binds its rendezvous port even alone
            ports.append(("rendezvous", leader_addrs or bind, cmd.rendezvous_port))
        found = procnet.listeners()
        for what, addr, port in ports:
            there = procnet.answering(found, addr, port) if port > 0 else []
            if there:
                return _refuse(
                    PORT_BUSY,
                    f"{what} port {port} on {there[0].addr} is held by {self._holder(there)}; "
                    f"{dir_name(cmd.replica_id, cmd.generation, cmd.rank)} was not started",
                )
        return None

    def _holder(self, sockets: list[procnet.Listener]) -> str:
        """Who holds these listening sockets, in words: one of our engines, or a pid and its command line."""
        pids = procfs.holders({s.inode for s in sockets})
        if not pids:
            return "a process this agent cannot see (socket inode " + ", ".join(str(s.inode) for s in sockets) + ")"
        pid = next(iter(pids.values()))
        st = procfs.stat(pid)
        for other in self._engines.values():
            if other.live and other.pids is not None and (pid == other.pid or (st is not None and st.pgid == other.pid)):
                doing = "stopping" if other.stopping else other.state
                return f"our engine {other.label} (pid {pid}, {doing})"
        return f"pid {pid} ({procfs.describe(pid)})"

    def _who_listens(self, e: Engine, found: list[procnet.Listener]) -> tuple[str, str]:
        """Whose listener a connection to this leader's HTTP port reaches, from the kernel's table.

        ("ours", "") when every listener there belongs to the engine's process
        tree; ("foreign", words naming the holder); ("none", "") when nothing
        listens; ("unknown", why) when the engine's own fds cannot be read.
        """
        port = e.cmd.http_port
        there = procnet.answering(found, e.bind_addr or self.mgmt.addrs, port)
        if not there:
            return "none", ""
        if e.pids is None:
            return "unknown", "the engine's pid is not known yet"
        wanted = {s.inode for s in there}
        if wanted <= e.own_sockets:
            return "ours", ""
        inodes = procfs.socket_inodes(e.pid)
        if not wanted <= inodes:  # the socket may sit in a child (vLLM's API server, uvicorn workers)
            for pid in procfs.tree(e.pid) - {e.pid}:
                inodes |= procfs.socket_inodes(pid)
                if wanted <= inodes:
                    break
        others = [s for s in there if s.inode not in inodes]
        if not others:
            e.own_sockets = wanted
            return "ours", ""
        if not inodes and not os.access(f"/proc/{e.pid}/fd", os.R_OK | os.X_OK):
            return "unknown", f"/proc/{e.pid}/fd cannot be read by this agent"
        s = others[0]
        return "foreign", f"port {port} on {s.addr} is held by {self._holder(others)}, not by the engine we launched (pid {e.pid})"

    async def _spawn(self, cmd: LaunchCommand, built: adapters.EngineCommand, bind: str, leader_addrs: tuple[str, ...]) -> CommandAck:
        d = EngineDir(self.root / dir_name(cmd.replica_id, cmd.generation, cmd.rank))
        if d.path.exists():
            # Only a directory adopt() could not read gets here; keep it for a person.
            aside = d.path.with_name(f".{d.name}.unreadable.{int(time.time())}")
            log.warning("%s exists but could not be read at start; moved aside to %s", d.path, aside)
            d.path.rename(aside)
        d.path.mkdir(parents=True)
        host = f"[{bind}]" if ":" in bind else bind
        spec = EngineSpec(
            command=cmd,
            argv=built.argv,
            env=built.env,
            serves_http=built.serves_http,
            health_url=f"http://{host}:{cmd.http_port}/health" if built.serves_http else "",
            created_at=time.time(),
            bind_addr=bind,
            leader_addrs=list(leader_addrs),
        )
        d.write_spec(spec)
        e = Engine(dir=d, spec=spec)
        try:
            # Both bounded and quick (a local file; fork/exec of the wrapper, never waited on here:
            # the watch loop reaps it), so the loop is not handed to a thread for them.
            with open(d.log_path, "ab") as out:  # noqa: ASYNC230 - a local log file opened for append, see above
                e.child = subprocess.Popen(  # noqa: ASYNC220 - fork/exec only; the wrapper is reaped by the watch loop
                    [self.python, "-m", "llmgw.services.agent.wrapper", str(d.path)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=d.path,
                    env={**os.environ, **built.env},
                    start_new_session=True,
                )
        except OSError as err:
            d.remove()
            return _refuse(SPAWN_FAILED, f"cannot start the engine wrapper ({self.python}): {err.strerror or err}")
        self._engines[e.key] = e
        outcome = await self._await_pid(e)
        if outcome != "running" and outcome != "slow":
            tail = d.log_tail(20)
            self._forget(e)
            log.warning("launch of %s failed: %s", e.label, " | ".join(tail[-3:]) or outcome)
            return _refuse(SPAWN_FAILED, f"{e.label} did not start: " + (" | ".join(tail[-5:]) or outcome))
        log.info(
            "launched %s: %s rank %d/%d, GPUs %s, pid %s: %s",
            e.label, cmd.engine, cmd.rank, cmd.nnodes, _indices(cmd.gpus), e.pid or "(not yet known)", " ".join(built.argv),
        )  # fmt: skip
        self._notify(e)
        reason = f"launched {e.label}" if e.pid else f"launching {e.label}; its pid is not known yet"
        return CommandAck(ok=True, pid=e.pid, reason=reason)

    async def _await_pid(self, e: Engine) -> str:
        """'running' once the wrapper wrote the pid; 'failed' if it could not start the engine; 'slow'."""
        deadline = time.monotonic() + SPAWN_TIMEOUT
        while True:
            e.load_pids()
            if e.pids is not None:
                return "running"
            if e.recorded_exit() is not None:
                return "failed"
            if not e.wrapper_alive():
                e.load_pids()  # it may have written the pid just before exiting
                return "running" if e.pids is not None else "wrapper exited without starting the engine"
            if time.monotonic() > deadline:
                return "slow"
            await asyncio.sleep(POLL)

    # -- stop ------------------------------------------------------------------
    async def stop(self, replica_id: str, generation: int = 0, reason: str = "") -> CommandAck:
        """Stop this replica's engines with generation <= ``generation`` (0: all). Acks at once."""
        async with self._lock:
            targets = [e for e in self._engines.values() if e.cmd.replica_id == replica_id and (generation == 0 or e.cmd.generation <= generation)]
            fence = generation or max((e.cmd.generation for e in targets), default=0)
            if fence > self._fences.get(replica_id, 0):
                self._fences.pop(replica_id, None)
                self._fences[replica_id] = fence  # re-inserted: newest last, oldest pruned first
                self._save_fences()
            stopping, removed = [], []
            for e in targets:
                if e.live:
                    if e.stopping is None:
                        e.stopping = StopRequest(reason=reason, requested_at=time.time())
                        e.dir.write_stop(reason)
                    self._start_stop(e)
                    stopping.append(e.label)
                else:
                    self._forget(e)
                    removed.append(e.label)
        upto = f"generation <= {generation}" if generation else "any generation"
        if not targets:
            return CommandAck(ok=True, reason=f"nothing of replica {replica_id} ({upto}) runs here")
        parts = []
        if stopping:
            parts.append(f"stopping {', '.join(stopping)} (SIGTERM, SIGKILL after {format_duration(self.cfg.stop_timeout)})")
        if removed:
            parts.append(f"removed exited {', '.join(removed)}")
        log.info("stop replica %s (%s)%s: %s", replica_id, upto, f" because {reason}" if reason else "", "; ".join(parts))
        return CommandAck(ok=True, reason="; ".join(parts))

    def _start_stop(self, e: Engine) -> None:
        if e.key not in self._stops:
            self._stops[e.key] = asyncio.create_task(self._stop_engine(e), name=f"stop-{e.label}")

    async def _stop_engine(self, e: Engine) -> None:
        try:
            e.load_pids()
            if e.running():
                self._signal(e, signal.SIGTERM)
                deadline = time.monotonic() + self.cfg.stop_timeout
                while e.running() and time.monotonic() < deadline:
                    await asyncio.sleep(POLL)
                    if e.pids is None:  # launched moments ago; signal once its pid is known
                        e.load_pids()
                        self._signal(e, signal.SIGTERM)
                if e.engine_alive():
                    log.warning("%s (pid %d) still running %s after SIGTERM; sending SIGKILL", e.label, e.pid, format_duration(self.cfg.stop_timeout))
                    self._signal(e, signal.SIGKILL)
                nagged = time.monotonic()
                while e.running():
                    await asyncio.sleep(POLL)
                    if time.monotonic() - nagged > 30:
                        nagged = time.monotonic()
                        log.error("%s (pid %d) survives SIGKILL (stuck in the kernel or a driver?); still waiting", e.label, e.pid)
            self._exited(e)
            async with self._lock:
                self._forget(e)
        finally:
            self._stops.pop(e.key, None)

    def _signal(self, e: Engine, sig: signal.Signals) -> None:
        if e.pids is not None and procfs.signal_group(e.pids.pid, e.pids.start_time, sig):
            log.info("%s: %s to process group %d", e.label, sig.name, e.pids.pid)

    def _forget(self, e: Engine) -> None:
        """Drop an engine from the record: its directory goes, its wrapper is reaped."""
        if self._engines.get(e.key) is e:
            del self._engines[e.key]
        if e.canary is not None:
            e.canary.cancel()
        e.dir.remove()
        if e.child is not None and e.child.poll() is None:
            self._reaping.append(e.child)

    # -- watching ----------------------------------------------------------------
    async def _watch_loop(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:  # a bug here must not stop the watching of every engine
                log.exception("watching engines failed; trying again")
            await asyncio.sleep(self._watch_interval())

    def _watch_interval(self) -> float:
        """``health_interval``, or ``STARTING_WATCH`` while an engine is starting: its
        ``ready`` is a replica's capacity back (a restart in place, a spare), and a
        ``/health`` asked every 2 s made it up to 2 s late."""
        if any(e.live and e.state == EngineState.STARTING for e in self._engines.values()):
            return min(self.cfg.health_interval, STARTING_WATCH)
        return self.cfg.health_interval

    async def check(self) -> None:
        """One round: reap, notice exits, ask the leaders."""
        self._reaping = [p for p in self._reaping if p.poll() is None]
        for e in list(self._engines.values()):
            if not e.live:
                if e.child is not None:
                    e.child.poll()
                continue
            known = e.pids is not None
            e.load_pids()
            if not e.running():
                self._exited(e)
            elif not known and e.pids is not None:
                log.info("%s: the engine's pid is %d (the wrapper was slow to start it)", e.label, e.pid)
                self._notify(e)
        await self._probe_leaders()
        self._probe_workers()
        self._probe_progress()

    def _exited(self, e: Engine) -> None:
        if not e.live:
            return
        e.load_pids()
        code = e.recorded_exit()
        if e.canary is not None:
            e.canary.cancel()
        e.state, e.exit_code, e.since = EngineState.EXITED, code, time.time()
        e.log_tail = e.dir.log_tail(self.cfg.log_lines)
        if code is None:
            note = f"[llmgw agent] exit code unknown: {e.why_unknown()}"
            e.log_tail = [*e.log_tail[-(self.cfg.log_lines - 1) :], note] if self.cfg.log_lines > 1 else [note]
        how = "exit code unknown" if code is None else (f"killed by signal {-code}" if code < 0 else f"exit code {code}")
        e.detail = f"{e.squatted}; the agent stopped it ({how})" if e.squatted else how
        level = logging.INFO if e.stopping is not None else logging.WARNING
        log.log(level, "%s (pid %d) exited: %s%s", e.label, e.pid, how, "" if e.stopping else "; last lines: " + " | ".join(e.log_tail[-3:]))
        self._notify(e)

    def _set_state(self, e: Engine, state: EngineState, why: str, detail: str = "") -> None:
        """Move a running engine to ``state``; ``detail`` is what the control plane is told about why."""
        if e.state != state and e.live:
            e.state, e.detail, e.since = state, detail, time.time()
            log.log(logging.INFO if state in (EngineState.READY, EngineState.STARTING, EngineState.JOINED) else logging.WARNING,
                    "%s (pid %d) is %s: %s", e.label, e.pid, state, why)  # fmt: skip
            self._notify(e)

    def _notify(self, e: Engine) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(e.fact())
        except Exception:  # the listener's bug is not the engine's state
            log.exception("engine state listener failed for %s", e.label)

    def _probe_workers(self) -> None:
        """A starting worker rank that holds a connection to its leader's rendezvous
        has joined its group: ``joined``, so that operators (and ``ctl replicas``)
        do not see a worker "starting" for as long as its replica serves. A worker
        serves nothing, so there is no port to ask; the kernel's table of
        connections, matched to the worker's own process tree, is the evidence."""
        starting = [
            e for e in self._engines.values()
            if e.live and not e.spec.serves_http and e.state == EngineState.STARTING and e.pids is not None
            and e.cmd.nnodes > 1 and e.cmd.leader_addr and e.cmd.rendezvous_port
        ]  # fmt: skip
        for e in starting:
            # Where the leader's name resolved at launch (the kernel's table holds
            # addresses); a spec from before that recorded the name, an address then.
            links = procnet.connected_to(e.spec.leader_addrs or (e.cmd.leader_addr,), e.cmd.rendezvous_port)
            if not links:
                continue
            mine = procfs.socket_inodes(e.pid)
            if not links & mine:  # vLLM's and SGLang's ranks hold it in a child process
                for pid in procfs.tree(e.pid) - {e.pid}:
                    mine |= procfs.socket_inodes(pid)
            if links & mine:
                self._set_state(e, EngineState.JOINED, f"connected to its leader's rendezvous {e.cmd.leader_addr}:{e.cmd.rendezvous_port}")

    async def _probe_leaders(self) -> None:
        leaders = [
            e for e in self._engines.values()
            if e.live and e.spec.serves_http and e.spec.health_url and e.state != EngineState.PEER_LOST and not e.squatted
        ]  # fmt: skip
        if not leaders:
            return
        answers = await asyncio.gather(*(self._healthy(e.spec.health_url) for e in leaders))
        # Read after the answers: the sockets that answered are in the table.
        found = procnet.listeners()
        for e, problem in zip(leaders, answers, strict=True):  # gather answers each, in order
            self._judge(e, problem, found)

    def _judge(self, e: Engine, problem: str | None, found: list[procnet.Listener]) -> None:
        if not e.live or e.state == EngineState.PEER_LOST or e.squatted:
            return
        who, words = self._who_listens(e, found)
        if who == "foreign":  # never ready on someone else's answer; a stopping engine just ends
            if e.stopping is None:
                self._squatted(e, words)
            return
        if problem is None and who == "none":
            problem = f"it answered, but the kernel shows nothing listening on {e.bind_addr or self.mgmt.describe()}:{e.cmd.http_port} now"
        elif problem is None and who == "unknown":
            if e.pids is None:
                problem = "it answered, but the engine's pid is not known yet, so the answer cannot be proved ours"
            elif e.key not in self._unverifiable:
                # Our own child's fds unreadable (a hardened /proc): say so once, trust /health as before.
                self._unverifiable.add(e.key)
                log.warning("%s: cannot prove the listener on port %d is the engine's (%s); trusting its /health", e.label, e.cmd.http_port, words)
        if problem is None:
            e.health_failures = 0
            if e.state == EngineState.STARTING:
                self._set_state(e, EngineState.READY, f"{e.spec.health_url} answers 200")
                # Just answered: the first canary is due one interval from now.
                e.probe_due = time.monotonic() + self.cfg.probe_interval
            # A stalled leader whose /health answers again is still stalled
            # until a token shows it makes progress (the canary).
        else:
            e.health_failures += 1
            if e.state == EngineState.READY and e.stopping is None and e.health_failures >= HEALTH_FAILURES_BEFORE_UNREADY:
                self._set_state(
                    e, EngineState.STALLED, f"{e.spec.health_url} failed {e.health_failures} times running: {problem}",
                    detail=f"/health failed {e.health_failures} times in a row: {problem}",
                )  # fmt: skip

    def _squatted(self, e: Engine, why: str) -> None:
        """Another process holds this leader's port: whatever answers there is not our engine.

        Our engine cannot serve on that port, so it is ended, and its exit is
        reported with ``why``: the scheduler fails the replica and rebuilds it.
        A ready leader goes ``stalled`` at once, so nothing new is routed to it
        while it stops.
        """
        e.squatted = why
        log.error("%s (pid %d): %s; stopping our engine", e.label, e.pid, why)
        if e.canary is not None:
            e.canary.cancel()
        if e.state == EngineState.READY:
            self._set_state(e, EngineState.STALLED, why, detail=why)
        else:  # starting (or already stalled): same state, new detail, said at once
            e.detail = why
            self._notify(e)
        if e.key not in self._ending:
            self._ending[e.key] = asyncio.create_task(self._end(e), name=f"end-{e.label}")

    async def _end(self, e: Engine) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout``; the watch loop reports the exit. The record stays."""
        try:
            self._signal(e, signal.SIGTERM)
            deadline = time.monotonic() + self.cfg.stop_timeout
            # Polled: the engine is the wrapper's child, not ours, so nothing signals its exit to this loop.
            while e.engine_alive() and time.monotonic() < deadline:  # noqa: ASYNC110 - polled, see above
                await asyncio.sleep(POLL)
            if e.engine_alive():
                log.warning("%s (pid %d) still running %s after SIGTERM; sending SIGKILL", e.label, e.pid, format_duration(self.cfg.stop_timeout))
                self._signal(e, signal.SIGKILL)
        finally:
            self._ending.pop(e.key, None)

    async def _healthy(self, url: str) -> str | None:
        """None when ``url`` answers 200, else what went wrong, in words."""
        timeout_s = min(2.0, max(0.5, self.cfg.health_interval))
        try:
            async with self._session().get(url, timeout=aiohttp.ClientTimeout(total=timeout_s), allow_redirects=False) as r:
                return None if r.status == 200 else f"HTTP {r.status}"
        except TimeoutError:
            return f"no answer in {format_duration(timeout_s)}"
        except (aiohttp.ClientError, OSError) as err:
            return str(err) or type(err).__name__

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        return self._http

    # -- progress: canaries and the gateways' traffic -------------------------------
    def _probe_progress(self) -> None:
        """Send the canaries that are due; forget gateways that went quiet."""
        now = time.monotonic()
        forget = TRAFFIC_FORGET_INTERVALS * self.cfg.probe_interval
        for e in self._engines.values():
            for gw in [g for g, t in e.traffic.items() if now - t.received_at > forget]:
                del e.traffic[gw]
            if not e.probed or now < e.probe_due or (e.canary is not None and not e.canary.done()):
                continue
            e.probe_due = now + self.cfg.probe_interval
            if e.state == EngineState.READY and now - e.completed_at < self.cfg.probe_interval:
                continue  # real requests completed in the interval: no canary needed
            e.canary = asyncio.create_task(self._canary(e), name=f"canary-{e.label}")

    async def _canary(self, e: Engine) -> None:
        sent = time.time()
        self.canaries_sent += 1
        problem = await self._ask_token(e)
        e.probe_due = time.monotonic() + self.cfg.probe_interval
        if not e.probed:
            return
        if problem is None:
            if e.state == EngineState.STALLED:
                self._set_state(e, EngineState.READY, f"canary sent {_clock(sent)} got a token")
        elif e.state == EngineState.READY:
            detail = f"canary sent {_clock(sent)} {problem}"
            self._set_state(e, EngineState.STALLED, detail, detail=detail)

    async def _ask_token(self, e: Engine) -> str | None:
        """One-token completion (an embedding, for a pooling model) from the leader:
        None when it came, else what happened instead."""
        probe = adapters.progress_probe(e.cmd, CANARY_PROMPT)
        url = e.spec.health_url.rsplit("/health", 1)[0] + probe.path
        body = probe.body
        timeout_s = self.cfg.probe_timeout
        try:
            async with self._session().post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s), allow_redirects=False) as r:
                raw = await r.read()
                if r.status != 200:
                    return f"failed: HTTP {r.status}: {raw[:200].decode(errors='replace')}"
        except TimeoutError:
            return f"got no token in {format_duration(timeout_s)}"
        except (aiohttp.ClientError, OSError) as err:
            return f"failed: {str(err) or type(err).__name__}"
        if probe.expects == "embedding":
            return _judge_embedding(raw)
        try:
            answer = json.loads(raw)
            choices = answer.get("choices") or []
            texts = [c.get("text") or "" for c in choices if isinstance(c, dict)]
            tokens = (answer.get("usage") or {}).get("completion_tokens") or 0
        except (ValueError, AttributeError):
            return f"failed: the answer is not an OpenAI completion: {raw[:120]!r}"
        if any(texts) or (isinstance(tokens, int) and tokens >= 1):
            return None
        return f"failed: the answer carries no token: {raw[:120]!r}"

    def traffic(self, report: TrafficReport) -> None:
        """A gateway's evidence about the replicas whose leader runs here."""
        now = time.monotonic()
        leaders: dict[str, Engine] = {}
        for candidate in self._engines.values():
            if candidate.live and candidate.spec.serves_http:
                have = leaders.get(candidate.cmd.replica_id)
                if have is None or candidate.cmd.generation > have.cmd.generation:
                    leaders[candidate.cmd.replica_id] = candidate
        gw = report.gateway
        for rt in report.replicas:
            e = leaders.get(rt.replica_id)
            if e is None:
                continue  # not (or no longer) here: the gateway's view lags ours
            prev = e.traffic.get(gw)
            grown = rt.completed - prev.completed if prev is not None and rt.completed > prev.completed else 0
            e.traffic[gw] = GatewayTraffic(rt.completed, rt.in_flight, rt.silent_for, now)
            if grown:
                e.completed_at = now
            if not e.probed:
                continue
            if grown:
                if e.state == EngineState.STALLED:
                    self._set_state(e, EngineState.READY, f"{_plural(grown, 'request')} completed on it (gateway {gw})")
            elif rt.in_flight > 0 and rt.silent_for >= self.cfg.stall_after and e.state == EngineState.READY:
                detail = f"{_plural(rt.in_flight, 'request')} in flight, no byte for {rt.silent_for:.0f}s (gateway {gw})"
                self._set_state(e, EngineState.STALLED, detail, detail=detail)

    # -- peer loss, from the engines' own output -------------------------------------
    async def _scan_loop(self) -> None:
        while True:
            try:
                self.scan_logs()
                # Also here, so canaries go out on time with a long health_interval.
                self._probe_progress()
            except Exception:  # a bug here must not stop the watching of every engine
                log.exception("reading engine logs failed; trying again")
            await asyncio.sleep(LOG_SCAN_INTERVAL)

    def scan_logs(self) -> None:
        """Read what each running engine logged since the last scan; report a peer-loss line."""
        for e in list(self._engines.values()):
            if not e.live or e.state == EngineState.PEER_LOST or e.stopping is not None or e.squatted:
                continue
            line = self._new_peer_loss_line(e)
            if line is not None:
                self._set_state(e, EngineState.PEER_LOST, f"its log says: {line}", detail=line)

    def _new_peer_loss_line(self, e: Engine) -> str | None:
        path = e.dir.log_path
        try:
            size = os.stat(path).st_size
        except OSError:
            return None
        if size < e.log_offset:
            e.log_offset = 0  # truncated or replaced
        if size == e.log_offset:
            return None
        start = max(e.log_offset, size - LOG_SCAN_MAX)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(size - start)
        except OSError:
            return None
        end = data.rfind(b"\n")
        if end < 0:
            if len(data) < LOG_SCAN_MAX:
                return None  # half a line: read it whole next time
            end = len(data) - 1
        e.log_offset = start + end + 1
        for raw in data[: end + 1].splitlines():
            text = raw.decode("utf-8", errors="replace").strip()
            if says_peer_lost(text):
                return text[:500]
        return None

    # -- adoption ------------------------------------------------------------------
    def _load(self, d: EngineDir) -> Engine | None:
        try:
            spec = d.read_spec()
        except FileNotFoundError:
            log.error("%s has no spec.json; not adopted, left for a person to look at", d.path)
            return None
        except (WireError, OSError) as err:
            log.error("%s: unreadable spec.json (%s); not adopted, left for a person to look at", d.path, err)
            return None
        e = Engine(dir=d, spec=spec)
        e.load_pids()
        e.stopping = d.read_stop()
        if e.running():
            log.info("adopting %s: pid %d, running", e.label, e.pid)
        else:
            self._exited(e)
        return e

    def _load_fences(self) -> None:
        path = Path(self.cfg.work_dir) / FENCES_FILE
        try:
            data = json.loads(path.read_text())
            self._fences = {str(k): int(v) for k, v in data.items()}
        except FileNotFoundError:
            self._fences = {}
        except (OSError, ValueError, AttributeError, TypeError) as e:
            log.warning("%s is unreadable (%s); starting without remembered stops", path, e)
            self._fences = {}

    def _save_fences(self) -> None:
        while len(self._fences) > MAX_FENCES:
            self._fences.pop(next(iter(self._fences)))
        atomic_write(Path(self.cfg.work_dir) / FENCES_FILE, json.dumps(self._fences).encode())
