"""``llmgw up --scenario seed``: the seed's failover story, measured.

Starting from the demo deployment ready (one 2×4 replica per fabric), it
serves a request through the gateway, reads the kernel's socket table for each
node's address (only leaders listen), kills node02 as a machine dies, and
times what follows from the event stream and the buckets: node02 lost, the
ib-a replica failed and reaped, the replacement placed on ib-b and ready,
node01 idle, a request served again. ``observe_seed_story`` returns the facts
so the end-to-end test asserts on exactly what the command prints.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmgw.shared import buckets as B
from llmgw.shared import subjects as S
from llmgw.shared.kvmirror import open_mirror
from llmgw.shared.procnet import listening_on
from llmgw.shared.schemas import Event, Replica, decode
from llmgw.shared.states import ENDING_REPLICA, EventKind, LeaseState, ReplicaState

from . import simcluster


@dataclass
class Story:
    before: dict[str, Replica] = field(default_factory=dict)
    listening_before: dict[str, list[int]] = field(default_factory=dict)
    first_reply: str = ""
    killed_at: float = 0.0
    killed_pids: int = 0
    lost_at: float | None = None
    failed: Replica | None = None
    failed_at: float | None = None
    gone_at: float | None = None
    replacement: Replica | None = None
    replacement_ready_at: float | None = None
    after: dict[str, Replica] = field(default_factory=dict)
    listening_after: dict[str, list[int]] = field(default_factory=dict)
    second_reply: str = ""
    streams: StreamClients | None = None  # clients streaming through the gateway all along
    timeline: list[tuple[float, str]] = field(default_factory=list)
    # --spares: the standby spares before, and what became of them (``_follow_spares``)
    spares_before: dict[str, Replica] = field(default_factory=dict)
    left_ready_at: float | None = None  # the doomed replica's record left ready (scheduler clock)
    promoted: Replica | None = None
    capacity_back_at: float | None = None  # as many ready as before again (scheduler clock)
    new_spare: Replica | None = None
    new_spare_at: float | None = None

    def mark(self, at: float, what: str) -> None:
        self.timeline.append((at, what))


@dataclass
class StreamRun:
    prompt: str
    start: float
    end: float = 0.0
    replica: str = ""  # the replica it started on (x-llmgw-replica)
    id: str = ""
    text: str = ""
    error: str = ""  # an error event's message, a non-200 answer, a cut stream
    gap: float = 0.0  # the longest silence between two arrivals


class StreamClients:
    """``n`` clients streaming long chat answers through the gateway, one after the
    other, until ``stop``: what a user watching an answer being written sees while a
    node dies. Each client keeps its prompt, so every answer to it must be the same
    text (the sim is deterministic); ``check`` compares them with one unbroken answer."""

    MAX_TOKENS = 1000  # 5 s at the sim's default 200 tokens/s: long enough to be cut mid-way

    def __init__(self, gateway_url: str, model: str, n: int = 2):
        self.url = f"{gateway_url}/v1/chat/completions"
        self.model = model
        self.n = n
        self.runs: list[StreamRun] = []
        self.in_flight: dict[int, StreamRun] = {}
        self.references: dict[str, str] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._session: Any = None  # an aiohttp.ClientSession once started (imported then: the CLI does not need it)

    def body(self, prompt: str) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": self.MAX_TOKENS, "ignore_eos": True, "stream": True}

    def start(self) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession()
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.n)]

    async def _client(self, i: int) -> None:
        prompt = f"stream {i} of the seed scenario"
        while not self._stop.is_set():
            run = StreamRun(prompt, time.time())
            self.in_flight[i] = run
            await self._one(run)
            run.end = time.time()
            self.runs.append(run)
            del self.in_flight[i]
            if run.error:
                await asyncio.sleep(0.2)

    async def _one(self, run: StreamRun) -> None:
        import aiohttp

        try:
            async with self._session.post(self.url, json=self.body(run.prompt), timeout=aiohttp.ClientTimeout(total=120)) as r:
                run.replica = r.headers.get("x-llmgw-replica", "")
                if r.status != 200:
                    run.error = f"HTTP {r.status}: {(await r.read())[:200].decode(errors='replace')}"
                    return
                raw, last = bytearray(), 0.0
                async for chunk in r.content.iter_any():
                    now = time.monotonic()
                    run.gap = max(run.gap, now - last) if last else 0.0
                    last = now
                    raw += chunk
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            run.error = f"failed: {e or type(e).__name__}"
            return
        run.id, run.text, run.error = _stream_text(bytes(raw))

    def on(self, replicas: set[str], since: float = 0.5) -> StreamRun | None:
        """A stream in flight on one of ``replicas`` for at least ``since`` seconds."""
        now = time.time()
        return next((r for r in self.in_flight.values() if r.replica in replicas and now - r.start >= since), None)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    async def stop(self) -> None:
        """No new stream; the ones under way finish."""
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for prompt in {r.prompt for r in self.runs}:
            ref = StreamRun(prompt, time.time())
            await self._one(ref)
            self.references[prompt] = ref.text if not ref.error else ""
        if self._session is not None:
            await self._session.close()

    @property
    def errors(self) -> list[StreamRun]:
        return [r for r in self.runs if r.error]

    @property
    def differ(self) -> list[StreamRun]:
        return [r for r in self.runs if not r.error and r.text != self.references.get(r.prompt)]


def _stream_text(raw: bytes) -> tuple[str, str, str]:
    """A chat stream's id, text and error (an error event's message, or a cut stream)."""
    sid, parts, error, done = "", [], "", False
    for event in raw.split(b"\n\n"):
        event = event.strip()
        if event == b"data: [DONE]":
            done = True
        if not event.startswith(b"data: {"):
            continue
        obj = json.loads(event[6:])
        if "error" in obj:
            error = f"error event: {obj['error'].get('message', obj['error'])}"
        sid = sid or obj.get("id", "")
        for c in obj.get("choices") or ():
            parts.append((c.get("delta") or {}).get("content") or "")
    return sid, "".join(parts), error or ("" if done else "cut: no [DONE]")


def chat(gateway_url: str, model: str, prompt: str, timeout: float = 30.0) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}).encode()
    req = urllib.request.Request(f"{gateway_url}/v1/chat/completions", data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read()[:200].decode(errors='replace')}"
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        return f"failed: {e}"


async def observe_seed_story(
    js,
    *,
    gateway_url: str,
    model: str,
    addresses: dict[str, str],
    cluster_dir,
    victim: str = "node02",
    timeout: float = 180.0,
    say=print,
    streams: bool = True,
) -> Story:
    """``streams``: clients stream through the gateway all along (``StreamClients``)."""
    story = Story()
    moved = None
    replicas = await open_mirror(js, B.REPLICAS)
    leases = await open_mirror(js, B.LEASES)
    try:
        story.before = {k: v for k, v in replicas.items.items() if v.state == ReplicaState.READY}
        story.spares_before = {k: v for k, v in replicas.items.items() if v.state == ReplicaState.STANDBY}
        story.listening_before = {n: listening_on(a) for n, a in addresses.items()}
        story.first_reply = await asyncio.to_thread(chat, gateway_url, model, "hello from the seed scenario")
        doomed = {k for k, r in story.before.items() if any(m.node_id == victim for m in r.members)}
        if streams:
            story.streams = clients = StreamClients(gateway_url, model)
            clients.start()
            # The node dies under a stream: wait (briefly) for one to be under way on its replica.
            await _until(lambda: clients.on(doomed) is not None, 15)
            moved = await js.subscribe(S.event_kind_space(EventKind.REQUEST), stream=S.EVENT_STREAM, ordered_consumer=True)

        # Only this cluster's node: another cluster on the machine has a node02 too.
        cluster_root = await asyncio.to_thread(Path(cluster_dir).resolve)  # off the loop: it reads the file system
        story.killed_at = time.time()
        story.killed_pids = len(simcluster.kill_node(victim, str(cluster_root)))
        story.mark(story.killed_at, f"{victim} killed ({story.killed_pids} processes, SIGKILL)")
        say(f"killed {victim}; waiting for the control plane to notice")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lease = leases.items.get(victim)
            if story.lost_at is None and lease and lease.state == LeaseState.LOST:
                story.lost_at = lease.since
                story.mark(lease.since, f"{victim} declared lost")
                say(f"{victim} lost at t+{lease.since - story.killed_at:.1f}s")
            rebuilt = _follow_rebuild(story, replicas.items, doomed, story.killed_at, say, say_failed=False)
            if rebuilt and (not story.spares_before or _follow_spares(story, replicas.items, doomed, story.killed_at, say)):
                break
            if story.spares_before:
                _follow_spares(story, replicas.items, doomed, story.killed_at, say)
            await asyncio.sleep(0.05)
        story.after = {k: v for k, v in replicas.items.items() if v.state != ReplicaState.GONE}
        story.listening_after = {n: listening_on(a) for n, a in addresses.items()}
        story.second_reply = await asyncio.to_thread(chat, gateway_url, model, "hello again, after the rebuild")
        if story.streams is not None:
            await story.streams.stop()
            await _note_moves(story, moved)
    finally:
        if story.streams is not None and not story.streams.stopped:
            await story.streams.stop()
        await replicas.stop()
        await leases.stop()
    story.timeline.sort(key=lambda t: t[0])  # same time: in the order seen (what left ready, then what replaced it)
    return story


async def _until(predicate, timeout: float) -> bool:
    """Poll ``predicate`` every 50 ms up to ``timeout`` seconds: whether it came true."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _note_moves(story: Story, sub) -> None:
    """The gateway's ``request`` events (streams moved to another replica) into the timeline."""
    gaps = {r.id: r.gap for r in story.streams.runs} if story.streams else {}
    while True:
        try:
            msg = await sub.next_msg(timeout=0.5)
        except TimeoutError:
            break
        ev = decode(msg.data, Event)
        d = ev.data
        gap = f", the client's longest silence {gaps[ev.subject]:.1f}s" if ev.subject in gaps else ""
        story.mark(ev.time, f"stream {ev.subject} on {d.get('before')}: {d.get('cause')} -> {ev.what} to {d.get('after') or 'none'}{gap}")
    await sub.unsubscribe()


def _members(r: Replica) -> str:
    return ", ".join(f"{m.node_id}[{','.join(map(str, m.gpus))}]" for m in r.members)


def report(story: Story, addresses: dict[str, str], say=print) -> None:
    t0 = story.killed_at
    say("")
    say("Seed scenario")
    say("  before:")
    for r in sorted(story.before.values(), key=lambda r: r.id):
        say(f"    {r.id} ready on {r.fabric}: {_members(r)}  leader {r.endpoint}")
    say(f"  request through the gateway: {story.first_reply!r}")
    for node, ports in story.listening_before.items():
        say(f"    {node} ({addresses[node]}) listening: {', '.join(map(str, ports)) or 'nothing'}")
    say("  timeline:")
    for at, what in story.timeline:
        say(f"    t{at - t0:+7.1f}s  {what}")
    say("  after:")
    for r in sorted(story.after.values(), key=lambda r: r.id):
        say(f"    {r.id} {r.state} on {r.fabric}: {_members(r)}")
    busy = {m.node_id for r in story.after.values() for m in r.members}
    idle = [n for n in addresses if n not in busy]
    say(f"  nodes hosting nothing: {', '.join(idle) or 'none'}")
    say(f"  request again: {story.second_reply!r}")
    if story.streams is not None:
        c = story.streams
        say(
            f"  streams through the gateway meanwhile: {len(c.runs)} ({StreamClients.MAX_TOKENS} tokens each), "
            f"errors {len(c.errors)}, text not the unbroken answer {len(c.differ)}"
        )
        for run in c.errors[:5]:
            say(f"    error: stream {run.id or '?'} on {run.replica}: {run.error}")
    if story.spares_before:
        report_spares(story, say)
    elif story.lost_at and story.replacement_ready_at:
        say(f"  measured: lost at t+{story.lost_at - t0:.1f}s, replacement ready at t+{story.replacement_ready_at - t0:.1f}s")


def _follow_spares(story: Story, replicas: dict, doomed, t0: float, say) -> bool:
    """One look for ``--spares``: when a doomed replica left ready, when a spare was
    promoted and the ready count was back, when a new spare stood by. True once
    a new spare stands by (the background rebuild is done)."""
    for rid in sorted(doomed):
        r = replicas.get(rid)
        if story.left_ready_at is None and (r is None or r.state != ReplicaState.READY):
            story.left_ready_at = r.since if r is not None else time.time()
            story.mark(story.left_ready_at, f"{rid} leaves ready: {r.state} ({r.reason})" if r is not None else f"{rid} gone")
    if story.promoted is None:
        for rid in sorted(story.spares_before):
            r = replicas.get(rid)
            if r is not None and r.state == ReplicaState.READY:
                story.promoted = r
                story.mark(r.since, f"spare {rid} promoted: ready on {r.fabric} ({r.reason})")
                say(f"spare {rid} promoted at t+{r.since - t0:.1f}s")
    ready = [r for r in replicas.values() if r.state == ReplicaState.READY and r.deployment in {b.deployment for b in story.before.values()}]
    if story.capacity_back_at is None and story.left_ready_at is not None and len(ready) >= len(story.before):
        story.capacity_back_at = max(r.since for r in ready)
        story.mark(story.capacity_back_at, f"capacity back: {len(ready)} replicas ready ({', '.join(sorted(r.id for r in ready))})")
        say(f"capacity back at t+{story.capacity_back_at - t0:.1f}s")
    if story.new_spare is None and story.promoted is not None:
        for r in replicas.values():
            if r.state == ReplicaState.STANDBY and r.id not in story.spares_before:
                story.new_spare, story.new_spare_at = r, r.since
                story.mark(r.since, f"new spare {r.id} standing by on {r.fabric} (built in the background)")
                say(f"new spare {r.id} standing by at t+{r.since - t0:.1f}s")
    return story.new_spare is not None


def report_spares(story: Story, say=print) -> None:
    """The ``--spares`` lines of the seed report: capacity back, apart from the spare's rebuild."""
    t0 = story.killed_at
    if story.left_ready_at is None or story.capacity_back_at is None:
        say("  measured: capacity did not come back within the scenario's wait")
        return
    say(
        f"  measured: the ib-a replica left ready at t+{story.left_ready_at - t0:.1f}s; two ready again at "
        f"t+{story.capacity_back_at - t0:.1f}s ({story.capacity_back_at - story.left_ready_at:.2f}s after it, spare promoted)"
    )
    if story.new_spare_at is not None:
        say(f"  new spare standing by at t+{story.new_spare_at - t0:.1f}s (rebuilt in the background: the engine's load)")


def _start_allowance(cluster, args) -> float:
    """How long a replacement may take to load: the sim's load time, or a real engine's start."""
    if cluster.engine == "vllm":
        from .realvllm import STARTUP_TIMEOUT

        return STARTUP_TIMEOUT
    return args.engine_load_time * 4


async def run_seed_scenario(cluster, args) -> Story:
    nc, js = await cluster.connect()
    try:
        addresses = {n.spec.node_id: n.spec.mgmt_addr for n in cluster.nodes}
        story = await observe_seed_story(
            js,
            gateway_url=cluster.gateway_url,
            model=cluster.demo_model,
            addresses=addresses,
            cluster_dir=cluster.dir,
            timeout=args.node_lost_after + _start_allowance(cluster, args) + 60,
            say=cluster.say,
        )
    finally:
        await nc.close()
    report(story, addresses)
    return story


# --------------------------------------------------------------------------
# llmgw up --scenario fabric: an InfiniBand port goes DOWN on a live node
# --------------------------------------------------------------------------


@dataclass
class FabricStory:
    """What ``--scenario fabric`` saw: node02's ib-a HCA taken down, node02 itself alive."""

    victim: str = "node02"
    hca: str = "mlx5_0"
    fabric: str = "ib-a"
    before: dict[str, Replica] = field(default_factory=dict)
    first_reply: str = ""
    down_at: float = 0.0
    port: str = ""
    seen_unusable_at: float | None = None
    problem: str = ""
    failed: Replica | None = None
    failed_at: float | None = None
    gone_at: float | None = None
    replacement: Replica | None = None
    replacement_ready_at: float | None = None
    victim_leases: list[str] = field(default_factory=list)  # every lease state node02 had meanwhile
    after: dict[str, Replica] = field(default_factory=dict)
    single_node_ok: bool = False
    single_node_detail: str = ""
    multi_node_reason: str = ""
    second_reply: str = ""
    timeline: list[tuple[float, str]] = field(default_factory=list)

    def mark(self, at: float, what: str) -> None:
        self.timeline.append((at, what))


async def observe_fabric_story(
    js,
    *,
    gateway_url: str,
    model: str,
    agent_config,
    victim: str = "node02",
    hca: str = "mlx5_0",
    timeout: float = 120.0,
    say=print,
) -> FabricStory:
    """Take ``victim``'s ``hca`` port DOWN (its sysfs state file, as the kernel
    would) and time what follows: the agent's inventory, the replica on that
    fabric failed and reaped, its replacement ready on another fabric — while
    the node's lease stays ready and it still fits single-node work."""

    from ..scheduler.placement import explain
    from ..scheduler.view import ClusterView

    story = FabricStory(victim=victim, hca=hca)
    replicas = await open_mirror(js, B.REPLICAS)
    leases = await open_mirror(js, B.LEASES)
    nodes = await open_mirror(js, B.NODES)
    try:
        rec = nodes.items.get(victim)
        story.fabric = next((f.name for f in rec.fabrics if hca in f.hcas), story.fabric) if rec else story.fabric
        story.before = {k: v for k, v in replicas.items.items() if v.state == ReplicaState.READY}
        story.first_reply = await asyncio.to_thread(chat, gateway_url, model, "hello from the fabric scenario")
        doomed = {k for k, r in story.before.items() if r.fabric == story.fabric and any(m.node_id == victim for m in r.members)}

        story.down_at = time.time()
        port, before, now = simcluster.set_hca_port(agent_config, hca, up=False)
        story.port = f"{hca} port {port.name}: {before} -> {now}"
        story.mark(story.down_at, f"{victim} {story.port} (sysfs state file written)")
        say(f"{victim} {story.port}; waiting for its agent to notice")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lease = leases.items.get(victim)
            state = lease.state if lease else "none"
            if not story.victim_leases or story.victim_leases[-1] != state:
                story.victim_leases.append(state)
            rec = nodes.items.get(victim)
            fab = next((f for f in rec.fabrics if f.name == story.fabric), None) if rec else None
            if story.seen_unusable_at is None and rec is not None and fab is not None and not fab.usable:
                story.seen_unusable_at, story.problem = rec.updated_at or time.time(), fab.problem
                story.mark(story.seen_unusable_at, f"registry: {story.fabric} unusable on {victim} ({fab.problem})")
            if _follow_rebuild(story, replicas.items, doomed, story.down_at, say, say_failed=True):
                break
            await asyncio.sleep(0.1)
        story.after = {k: v for k, v in replicas.items.items() if v.state != ReplicaState.GONE}
        # Is node02 still offered work? Ask placement itself, on the live records.
        from llmgw.shared.schemas import DeploymentSpec

        view = ClusterView.build(dict(nodes.items), dict(leases.items), list(replicas.items.values()))
        one = next(iter(story.before.values()), None)
        gpus = len(one.members[0].gpus) if one and one.members else 4
        single = explain(DeploymentSpec(name="probe-single", model=model, engine="sim", replicas=1, gpus_per_node=gpus, nodes_per_replica=1), view)
        mine = next((n for n in single.nodes if n.node_id == victim), None)
        story.single_node_ok = bool(mine and mine.ok)
        story.single_node_detail = (mine.detail if mine else "no such node") or ""
        multi = explain(DeploymentSpec(name="probe-multi", model=model, engine="sim", replicas=1, gpus_per_node=gpus, nodes_per_replica=2), view)
        mine = next((n for n in multi.nodes if n.node_id == victim), None)
        story.multi_node_reason = (f"{mine.reason}: {mine.detail}" if mine and not mine.ok else "fits") if mine else "no such node"
        story.second_reply = await asyncio.to_thread(chat, gateway_url, model, "hello again, after the rebuild")
    finally:
        await replicas.stop()
        await leases.stop()
        await nodes.stop()
    story.timeline.sort(key=lambda t: t[0])  # same time: in the order seen (what left ready, then what replaced it)
    return story


def _follow_rebuild(story, replicas: dict, doomed, t0: float, say, *, say_failed: bool) -> bool:
    """One look at the replicas for a failover story (seed or fabric): note when a
    doomed replica failed and was reaped and when its replacement became ready;
    True once the replacement is ready and the doomed ones are gone."""
    for rid in doomed:
        r = replicas.get(rid)
        if r and r.state in ENDING_REPLICA and story.failed is None:
            story.failed, story.failed_at = r, r.since
            # failed and reaping happen in one scheduler cycle; the record shows the latter
            story.mark(r.since, f"{rid} failed → reaping ({r.reason})")
            if say_failed:
                say(f"{rid} failed at t+{r.since - t0:.1f}s: {r.reason}")
        if r is None and story.gone_at is None and story.failed is not None:
            story.gone_at = time.time()
            story.mark(story.gone_at, f"{rid} reaped (record gone)")
    if story.failed is not None and story.replacement_ready_at is None:
        for r in replicas.values():
            if r.id not in story.before and r.state == ReplicaState.READY:
                story.replacement, story.replacement_ready_at = r, r.since
                story.mark(r.since, f"replacement {r.id} ready on {r.fabric}")
                say(f"replacement {r.id} ready on {r.fabric} at t+{r.since - t0:.1f}s")
    if story.replacement_ready_at is not None and (story.gone_at is not None or all(rid not in replicas for rid in doomed)):
        if story.gone_at is None:
            story.gone_at = time.time()
        return True
    return False


def report_fabric(story: FabricStory, say=print) -> None:
    t0 = story.down_at
    say("")
    say("Fabric scenario")
    say("  before:")
    for r in sorted(story.before.values(), key=lambda r: r.id):
        say(f"    {r.id} ready on {r.fabric}: {_members(r)}  leader {r.endpoint}")
    say(f"  request through the gateway: {story.first_reply!r}")
    say("  timeline:")
    for at, what in story.timeline:
        say(f"    t{at - t0:+7.1f}s  {what}")
    say("  after:")
    for r in sorted(story.after.values(), key=lambda r: r.id):
        say(f"    {r.id} {r.state} on {r.fabric}: {_members(r)}")
    say(f"  {story.victim} lease meanwhile: {' -> '.join(story.victim_leases) or 'unknown'} (never lost: {LeaseState.LOST not in story.victim_leases})")
    say(f"  {story.victim} for a single-node replica: {'fits' if story.single_node_ok else 'does not fit'} ({story.single_node_detail})")
    say(f"  {story.victim} for a multi-node replica: {story.multi_node_reason}")
    say(f"  request again: {story.second_reply!r}")
    if story.failed_at and story.replacement_ready_at:
        say(
            f"  measured: failed at t+{story.failed_at - t0:.1f}s after the port went DOWN, "
            f"replacement ready {story.replacement_ready_at - story.failed_at:.1f}s after that"
        )


async def run_fabric_scenario(cluster, args) -> FabricStory:
    victim = next(n for n in cluster.nodes if n.spec.node_id == "node02")
    nc, js = await cluster.connect()
    try:
        story = await observe_fabric_story(
            js, gateway_url=cluster.gateway_url, model=cluster.demo_model, agent_config=victim.config,
            timeout=(args.discovery_interval or 10.0) + _start_allowance(cluster, args) + 60, say=cluster.say,
        )  # fmt: skip
    finally:
        await nc.close()
    report_fabric(story)
    return story
