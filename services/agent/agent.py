"""``llmgw agent --config agent.yaml``: one per node.

It tells the control plane what this node has (inventory), that it is alive
(heartbeats), and what its engines do (status reports); it answers launch,
stop and list commands addressed to this node. All of it under the node's own
certificate, whose common name must be the configured node id.

What it sends, and when:

* ``Inventory`` at start, on every reconnect, when re-discovery finds a change,
  and every ``inventory_interval`` regardless;
* ``Heartbeat`` every ``heartbeat_interval``, only while connected: a heartbeat
  held back during a disconnect and delivered later would vouch for a moment
  that has passed, so none is ever buffered;
* ``StatusReport(full=True)`` at start, on every reconnect, every
  ``full_report_interval`` (30 s), and at once when the agent notices its own
  loop stalled (two heartbeat ticks far more than a heartbeat apart: the
  process was stopped, frozen or starved, e.g. ``kill -STOP`` / ``-CONT``).
  Such an agent may come back on the same connection after its node was
  declared lost and its replicas rebuilt elsewhere; nothing changed locally,
  so without this no report would go out and its stale engines would run on
  unfenced. ``full=False`` carries just the engines that changed in between
  (at once: a leader going ``stalled`` or an engine ``peer-lost`` is news the
  scheduler acts on). Changes seen while disconnected are dropped, not
  queued: the full report on reconnect carries the current state of every
  engine, which supersedes them.

One agent per work dir: an exclusive ``flock`` on ``work_dir/agent.lock``,
taken before anything else, with the holder's pid written in it. A second
agent on the same work dir (a second systemd unit, an operator's manual start)
would act on every launch and stop and move the other's engine directories
around; it exits 2 at once naming the holder. The kernel drops the lock when
the process ends, however it ends; engines never inherit it.

What it listens to, besides commands: the gateways' ``TrafficReport`` on
``llmgw.cmd.<node>.traffic`` — evidence of progress (or of silence) for the
leaders it supervises, which the supervisor merges with its own canaries. A
malformed report is logged, counted and dropped; the agent carries on.

SIGTERM or SIGINT ends the agent and nothing else: engines keep running and the
next agent adopts them (invariant 5).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import fcntl
import logging
import math
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw.shared import bus, procfs
from llmgw.shared import subjects as S
from llmgw.shared.addresses import Resolution
from llmgw.shared.durations import format_duration
from llmgw.shared.errors import ConfigError, LlmgwError, WireError
from llmgw.shared.schemas import (
    MAX_PAYLOAD,
    CommandAck,
    EngineFact,
    Heartbeat,
    Inventory,
    LaunchCommand,
    StageCommand,
    StatusReport,
    StopCommand,
    TrafficReport,
    decode,
    encode,
)
from llmgw.shared.tasks import cancel_and_wait

from .config import AgentConfig, check_identity, load_agent_config
from .discovery import Discovery, DiscoveryError, NvmlHealth, discover
from .modelcache import ModelCache
from .staging import Stager
from .supervisor import Supervisor
from .weights import WeightsLauncher

__all__ = ["Agent", "main"]

log = logging.getLogger("llmgw.agent")

DRAIN_TIMEOUT = 5.0
# Above this a full report sheds log tails to their last lines rather than
# exceed the server's max_payload and not arrive at all.
REPORT_BUDGET = MAX_PAYLOAD * 3 // 4
SHED_TAIL_LINES = 20
# The agent's own loop is called stalled when two heartbeat ticks are further
# apart than this many heartbeat intervals (plus LOOP_STALL_SLACK for a loaded
# machine's scheduling noise): a full report then goes out at once.
LOOP_STALL_INTERVALS = 3
LOOP_STALL_SLACK = 0.5
LOCK_FILE = "agent.lock"


class WorkDirBusy(LlmgwError):
    """Another agent holds this work dir."""

    code = "work_dir_busy"


def _agent_version() -> str:
    try:
        from importlib.metadata import version

        return version("llmgw")
    except Exception:
        return ""


class _FullReport:
    """Queued in place of an engine fact: send the full list now (start, reconnect)."""


_FULL = _FullReport()


class Agent:
    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg
        self.node = cfg.node_id
        # New per process start: the health monitor tells a restarted agent
        # from a running one by it, and resets its sequence expectations.
        self.boot_id = uuid.uuid4().hex
        self.seq = 0
        self.nc: NATS | None = None
        self.found: Discovery | None = None
        self.inventory: Inventory | None = None
        self.supervisor = Supervisor(
            cfg.supervisor,
            mgmt_addr=cfg.mgmt_addr,
            mgmt_interface=cfg.mgmt_interface,
            on_change=self._engine_changed,
        )
        # The model cache (None without a cache section): launches that name a
        # weights source go through the launcher, which stages them first.
        c = cfg.cache
        self.stager = Stager(
            ModelCache(c.dir, c.budget_bytes) if c is not None else None,
            mirror=c.mirror if c is not None else "",
            in_use=self.supervisor.weights_in_use,
            on_change=self._cache_changed,
            progress_interval=c.progress_interval if c is not None else 1.0,
            copy_rate=c.copy_rate_bytes if c is not None else None,
        )
        self.weights = WeightsLauncher(self.supervisor, self.stager, on_change=self._engine_changed)
        self._cache_dirty = asyncio.Event()
        self._in_use: set[str] = set()
        self._outbox: asyncio.Queue[EngineFact | _FullReport] = asyncio.Queue()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.bad_traffic = 0
        self._lock_fd: int | None = None
        self._full_sent_at = time.monotonic()  # the start's full report is on its way
        self.loop_stalls = 0

    # -- run ---------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        # Before anything reads or writes the work dir: a second agent leaves it untouched.
        self._make_work_dir()
        self._lock_work_dir()
        try:
            self._open_cache()
            self.found = await asyncio.to_thread(discover, self.cfg)
            self.inventory = self._inventory(self.found)
            if self.found.mgmt is not None:
                self.supervisor.set_mgmt(self.found.mgmt)
            await self.supervisor.adopt()
            self._log_summary()
            self.supervisor.start()
            self.nc = nc = await self._connect()
            if nc is None:
                return 0  # asked to stop before the bus answered
            await self._subscribe(nc)
            await self._announce()
            self._tasks += [
                asyncio.create_task(self._heartbeats(), name="heartbeats"),
                asyncio.create_task(self._rediscover(), name="rediscover"),
                asyncio.create_task(self._publish_status(), name="status"),
                asyncio.create_task(self._publish_cache(), name="cache"),
            ]
            await self._stop.wait()
            return 0
        finally:
            await self._shutdown()

    def _open_cache(self) -> None:
        cache = self.stager.cache
        if cache is None:
            return
        try:
            cache.open()
        except OSError as e:
            raise ConfigError(f"{self.cfg.source}: cache.dir: cannot use {cache.root}: {e.strerror or e}") from None
        for what in cache.dropped:
            log.warning("model cache: removed %s", what)
        log.info(
            "model cache %s: %d model(s), %d of %d bytes; mirror %s",
            cache.root, len(cache.entries), cache.used(), cache.budget, self.stager.mirror or "none",
        )  # fmt: skip

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("%s: stopping the agent; engines keep running and will be adopted by the next one", sig.name)
        self._stop.set()

    def _make_work_dir(self) -> None:
        wd = self.cfg.supervisor.work_dir
        try:
            os.makedirs(wd, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{self.cfg.source}: supervisor.work_dir: cannot create {wd}: {e.strerror or e}") from None

    def _lock_work_dir(self) -> None:
        wd = os.path.abspath(self.cfg.supervisor.work_dir)
        path = os.path.join(wd, LOCK_FILE)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inheritable (PEP 446): engines never hold it
        except OSError as e:
            raise ConfigError(f"{self.cfg.source}: supervisor.work_dir: cannot open {path}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            except OSError:
                holder = ""
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ConfigError(f"{self.cfg.source}: supervisor.work_dir: cannot lock {path}: {e.strerror or e}") from None
            who = f"pid {holder}" if holder.isdigit() else "pid unknown"
            raise WorkDirBusy(f"another llmgw agent ({who}) is running on work dir {wd}; refusing to start") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    async def _connect(self) -> NATS | None:
        # The first connect waits a draw in [0, reconnect_base): nodes powered on
        # together (or agents restarted together) then do not all open their TLS
        # connection in one instant (shared/bus.py first_connect_delay).
        connecting = asyncio.create_task(
            bus.connect(
                list(self.cfg.servers),
                self.cfg.tls,
                name="agent",
                reconnect_base=self.cfg.reconnect_base,
                reconnect_max=self.cfg.reconnect_max,
                on_reconnect=self._on_reconnect,
                logger=log,
                first_delay=bus.first_connect_delay(self.cfg.reconnect_base),
            )
        )
        stopping = asyncio.create_task(self._stop.wait())
        await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if connecting.done():
            return connecting.result()
        connecting.cancel()
        try:
            await connecting
        except (asyncio.CancelledError, Exception):
            pass
        return None

    async def _shutdown(self) -> None:
        # Heartbeats stop first, so the health monitor sees silence rather than
        # a heartbeat from an agent that is already going.
        for t in await cancel_and_wait(self._tasks, timeout=5):
            log.warning("task %s did not end within 5s of being cancelled; leaving it", t.get_name())
        # Draining lets a command already received finish and be answered;
        # only then does the supervisor stop watching. Engines keep running.
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), DRAIN_TIMEOUT)
            except Exception:
                try:
                    await self.nc.close()
                except Exception:
                    pass
        await self.weights.close()
        await self.supervisor.close()
        log.info("agent %s stopped (boot %s)", self.node, self.boot_id)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock; the file stays (removing it would race a starting agent)
            self._lock_fd = None

    # -- what we publish ---------------------------------------------------------
    def _bus(self) -> NATS | None:
        """The connection while it is up; None while it is down (or not made yet)."""
        return self.nc if self.nc is not None and self.nc.is_connected else None

    @property
    def last_found(self) -> Discovery:
        """What discovery found last; run() discovers before anything reads it."""
        if self.found is None:
            raise RuntimeError("read before the first discovery")
        return self.found

    async def _announce(self) -> None:
        """What a (re)connected control plane needs at once: inventory, all engines, a heartbeat."""
        await self._publish_inventory()
        self._outbox.put_nowait(_FULL)
        await self._heartbeat()

    async def _on_reconnect(self) -> None:
        await self._announce()

    async def _heartbeat(self) -> None:
        nc = self._bus()
        if nc is None:
            return
        self.seq += 1
        hb = Heartbeat(node_id=self.node, boot_id=self.boot_id, seq=self.seq, sent_at=time.time())
        await nc.publish(S.heartbeat(self.node), encode(hb))

    async def _heartbeats(self) -> None:
        every = self.cfg.heartbeat_interval
        stalled_after = LOOP_STALL_INTERVALS * every + LOOP_STALL_SLACK
        last = time.monotonic()
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()  # CLOCK_MONOTONIC runs on while the process is stopped
            gap, last = now - last, now
            if gap > stalled_after:
                self.loop_stalls += 1
                log.warning(
                    "this agent's own loop stalled for %s (heartbeat every %s): the process was stopped, frozen or starved; "
                    "the control plane may have declared this node lost meanwhile, so a full status report goes out now",
                    format_duration(round(gap, 1)), format_duration(every),
                )  # fmt: skip
                self._outbox.put_nowait(_FULL)
            elif now - self._full_sent_at >= self.cfg.full_report_interval:
                self._full_sent_at = now  # queued; a report already queued or sent resets it too
                self._outbox.put_nowait(_FULL)
            try:
                await self._heartbeat()
            except Exception as e:
                log.warning("heartbeat not sent: %s", e)

    def _inventory(self, found: Discovery) -> Inventory:
        return Inventory(
            node_id=self.node,
            boot_id=self.boot_id,
            hostname=socket.gethostname(),
            agent_version=_agent_version(),
            mgmt_addr=self.cfg.mgmt_addr,
            mgmt_interface=self.cfg.mgmt_interface,
            mgmt_ips=list(found.mgmt.local) if found.mgmt else [],
            addr_problem=found.mgmt.problem if found.mgmt else "",
            gpus=found.gpus,
            fabrics=found.fabrics,
            hcas=found.hcas,
            model_cache=self.stager.report(),
        )

    async def _publish_inventory(self) -> None:
        nc = self._bus()
        if nc is None or self.inventory is None:
            return
        self.inventory.sent_at = time.time()
        await nc.publish(S.inventory(self.node), encode(self.inventory))

    def _engine_pids(self) -> set[int]:
        """Every process of the engines this agent supervises (wrapper, engine, its tree):
        a GPU process outside this set was not started by llmgw (docs/hardware.md)."""
        pids: set[int] = set()
        for e in list(self.supervisor._engines.values()):
            p = e.pids
            if p is not None and e.live:
                pids |= procfs.tree(p.pid) | {p.pid, p.wrapper_pid}
        return pids

    async def _rediscover(self) -> None:
        # discovery.interval: GPU health and HCA ports are re-read this often and
        # a change is published at once, not only on reconnect (docs/hardware.md).
        every = min(self.cfg.discovery.interval, self.cfg.inventory_interval)
        nvml = NvmlHealth() if self.cfg.discovery.prefer_nvml else None
        last_sent = time.monotonic()
        last_error = ""
        while True:
            await asyncio.sleep(every)
            try:
                found = await asyncio.to_thread(discover, self.cfg, previous=self.last_found.gpus, known_pids=self._engine_pids, nvml=nvml)
            except LlmgwError as e:
                # Keep publishing what we last knew; say so once per distinct failure.
                if str(e) != last_error:
                    log.error("re-discovery failed, keeping the last inventory: %s", e)
                    last_error = str(e)
                found = None
            if found is not None:
                last_error = ""
                known = self.last_found
                if found.mgmt is not None and found.mgmt != known.mgmt:
                    self._mgmt_changed(known.mgmt, found.mgmt)
                changed = (found.gpus, found.fabrics, found.hcas, found.mgmt) != (known.gpus, known.fabrics, known.hcas, known.mgmt)
                if changed:
                    log.warning("inventory changed: %s", self._describe(found))
                    for w in set(found.warnings) - set(known.warnings):
                        log.warning("discovery: %s", w)
                    self.found, self.inventory = found, self._inventory(found)
                if not changed and time.monotonic() - last_sent < self.cfg.inventory_interval:
                    continue
            elif time.monotonic() - last_sent < self.cfg.inventory_interval:
                continue
            try:
                await self._publish_inventory()
                last_sent = time.monotonic()
            except Exception as e:
                log.warning("inventory not sent: %s", e)

    def _mgmt_changed(self, old: Resolution | None, new: Resolution) -> None:
        """Say what a DNS change means here, and let the supervisor act on it."""
        was = old.describe() if old is not None else "unknown"
        if new.problem:
            log.error("%s (was %s); launches are refused until it resolves here again, running engines keep their address", new.problem, was)
        else:
            log.warning("mgmt_addr now resolves to %s (was %s); engines launched from now on bind %s", ", ".join(new.addrs), was, new.bind)
        self.supervisor.set_mgmt(new)

    def _engine_changed(self, fact: EngineFact) -> None:
        self._outbox.put_nowait(fact)
        if self.stager.cache is not None and (in_use := self.supervisor.weights_in_use()) != self._in_use:
            self._in_use = in_use  # an engine started from, or stopped reading, a cached model
            self._cache_dirty.set()

    def _cache_changed(self) -> None:
        """The cache's report changed (a copy started, moved on, finished; an eviction; a use)."""
        self._cache_dirty.set()
        self.weights.progressed()

    async def _publish_cache(self) -> None:
        """The inventory again, with the cache as it is now: at most once per
        ``cache.progress_interval``, however often it changes."""
        every = self.cfg.cache.progress_interval if self.cfg.cache is not None else 1.0
        while True:
            await self._cache_dirty.wait()
            self._cache_dirty.clear()
            if self.inventory is not None:
                self.inventory.model_cache = self.stager.report()
                try:
                    await self._publish_inventory()
                except Exception as e:
                    log.warning("inventory (model cache) not sent: %s", e)
            await asyncio.sleep(every)

    def _full_report(self) -> StatusReport:
        engines = self.supervisor.facts() + self.weights.facts()
        report = StatusReport(node_id=self.node, boot_id=self.boot_id, full=True, engines=engines, sent_at=time.time())
        if len(encode(report)) > REPORT_BUDGET:
            for f in report.engines:
                f.log_tail = f.log_tail[-SHED_TAIL_LINES:]
        return report

    async def _publish_status(self) -> None:
        """The one writer of status reports, so a full report is never overtaken by an older change."""
        while True:
            items = [await self._outbox.get()]
            while not self._outbox.empty():
                items.append(self._outbox.get_nowait())
            nc = self._bus()
            if nc is None:
                continue  # the full report on reconnect carries all of it
            if any(isinstance(i, _FullReport) for i in items):
                # Taken now, the full list is newer than every change queued with it.
                report = self._full_report()
                self._full_sent_at = time.monotonic()
            else:
                latest: dict[tuple, EngineFact] = {}
                for f in items:
                    if isinstance(f, EngineFact):  # always, in this branch
                        latest[(f.replica_id, f.generation, f.rank)] = f
                report = StatusReport(node_id=self.node, boot_id=self.boot_id, full=False, engines=list(latest.values()), sent_at=time.time())
            try:
                await nc.publish(S.status(self.node), encode(report))
            except Exception as e:
                log.warning("status report not sent: %s", e)

    # -- commands ------------------------------------------------------------------
    async def _subscribe(self, nc: NATS) -> None:
        await nc.subscribe(S.cmd_launch(self.node), cb=self._answering(self._launch))
        await nc.subscribe(S.cmd_stop(self.node), cb=self._answering(self._stop_cmd))
        await nc.subscribe(S.cmd_list(self.node), cb=self._answering(self._list))
        await nc.subscribe(S.cmd_inventory(self.node), cb=self._answering(self._inventory_cmd))
        await nc.subscribe(S.cmd_stage(self.node), cb=self._answering(self._stage_cmd))
        await nc.subscribe(S.traffic(self.node), cb=self._on_traffic)
        await nc.flush()

    def _answering(self, handler: Callable[[bytes], Awaitable[CommandAck | StatusReport | Inventory]]):
        """Every request gets exactly one reply: the handler's, or the error that stopped it."""

        async def on_msg(msg: Msg) -> None:
            # A command is a request published on our own command subject. A
            # JetStream push delivery keeps its stream's subject and has a $JS
            # reply; a reply someone redirected here has no reply: ignore both
            # (nats-server does not check a consumer's deliver subject).
            if not msg.subject.startswith(f"{S.CMD_SPACE}.{self.node}.") or not msg.reply or msg.reply.startswith("$JS."):
                log.warning("%s: not a command request (reply %r); ignored", msg.subject, msg.reply)
                return
            try:
                reply = await handler(msg.data)
            except WireError as e:
                log.warning("%s: %s", msg.subject, e)
                reply = CommandAck(ok=False, code=e.code, reason=str(e))
            except Exception as e:
                log.exception("%s: handling failed", msg.subject)
                reply = CommandAck(ok=False, code="internal_error", reason=f"the agent failed handling this: {type(e).__name__}: {e}")
            if not msg.reply:
                log.warning("%s: request without a reply subject; done but unacknowledged", msg.subject)
                return
            try:
                await msg.respond(encode(reply))
            except Exception as e:
                log.warning("%s: reply not sent: %s", msg.subject, e)

        return on_msg

    async def _on_traffic(self, msg: Msg) -> None:
        try:
            report = decode(msg.data, TrafficReport)
            problem = _traffic_problem(report, self.node)
            if problem:
                raise WireError("TrafficReport", f"from gateway {report.gateway!r}: {problem}")
            self.supervisor.traffic(report)
        except WireError as e:
            self.bad_traffic += 1
            log.warning("%s: dropped a traffic report (%d so far): %s", msg.subject, self.bad_traffic, e)
        except Exception:  # a bug here must not end the subscription
            self.bad_traffic += 1
            log.exception("%s: handling a traffic report failed", msg.subject)

    async def _launch(self, data: bytes) -> CommandAck:
        cmd = decode(data, LaunchCommand)
        gpus = {g.index for g in self.found.gpus} if self.found else set()
        return await self.weights.launch(cmd, gpus)

    async def _stop_cmd(self, data: bytes) -> CommandAck:
        cmd = decode(data, StopCommand)
        waited = await self.weights.stop(cmd.replica_id, cmd.generation)
        ack = await self.supervisor.stop(cmd.replica_id, cmd.generation, cmd.reason)
        if waited:
            ack.reason = f"ended the wait for weights of {', '.join(waited)}; {ack.reason}"
        return ack

    async def _stage_cmd(self, data: bytes) -> CommandAck:
        return await self.weights.stage(decode(data, StageCommand))

    async def _list(self, data: bytes) -> StatusReport:
        return self._full_report()

    async def _inventory_cmd(self, data: bytes) -> Inventory:
        """The registry asks when it has no record of a node it sees alive."""
        inventory = self.inventory
        if inventory is None:  # made with the first discovery, before the subscriptions
            raise RuntimeError("asked for the inventory before the first discovery")
        inventory.sent_at = time.time()
        return inventory

    # -- logs ------------------------------------------------------------------
    @staticmethod
    def _describe(found: Discovery) -> str:
        names: dict[str, int] = {}
        for g in found.gpus:
            names[g.name] = names.get(g.name, 0) + 1
        gpus = ", ".join(f"{n} x {name}" for name, n in names.items()) or "none"
        bad = [f"GPU {g.index} {g.problem or 'unhealthy'}" for g in found.gpus if not g.healthy]
        bad += [f"GPU {g.index} {g.foreign_mib} MiB held by pid {', '.join(map(str, g.foreign_pids))}" for g in found.gpus if g.foreign_pids]
        if bad:
            gpus += "; out of service: " + "; ".join(bad)
        fabrics = (
            ", ".join(f"{f.name} [{', '.join(f.hcas)}]" + ("" if f.usable else f" NOT USABLE: {f.problem}") for f in found.fabrics)
            or "none (single-node replicas only)"
        )
        return f"GPUs: {len(found.gpus)} ({gpus}); fabrics: {fabrics}"

    def _mgmt_words(self) -> str:
        m = self.last_found.mgmt
        return m.describe() if m is not None else self.cfg.mgmt_addr

    def _log_summary(self) -> None:
        c = self.cfg
        log.info(
            "agent %s (boot %s) from %s: mgmt %s on %s, engines bind %s; %s; heartbeat every %s; work dir %s; %d engine(s) on record",
            self.node, self.boot_id, c.source, self._mgmt_words(), c.mgmt_interface, self.supervisor.mgmt.bind or "nothing", self._describe(self.last_found),
            format_duration(c.heartbeat_interval), c.supervisor.work_dir, len(self.supervisor.facts()),
        )  # fmt: skip
        for w in self.last_found.warnings:
            log.warning("discovery: %s", w)
        m = self.last_found.mgmt
        if m is not None and m.problem:
            log.error("%s: launches are refused until it resolves to an address of this machine", m.problem)


def _traffic_problem(report: TrafficReport, node: str) -> str:
    """What makes a well-typed report unusable, or ''."""
    if not report.gateway:
        return "no gateway name"
    if report.node_id != node:
        return f"it is about node {report.node_id!r}, not this node {node!r}"
    for rt in report.replicas:
        if rt.completed < 0 or rt.in_flight < 0:
            return f"replica {rt.replica_id!r}: negative counts (completed {rt.completed}, in_flight {rt.in_flight})"
        if not math.isfinite(rt.silent_for) or rt.silent_for < 0:
            return f"replica {rt.replica_id!r}: silent_for must be a number of seconds >= 0, got {rt.silent_for}"
    return ""


def main(args: argparse.Namespace) -> int:
    cfg = load_agent_config(args.config)
    check_identity(cfg)
    try:
        return asyncio.run(Agent(cfg).run())
    except DiscoveryError as e:
        raise ConfigError(f"{cfg.source}: discovery: {e}") from None
