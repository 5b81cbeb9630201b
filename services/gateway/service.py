"""``llmgw gateway``: the process — a NATS watch of the replica records feeding
the router, and the HTTP server in front of it.

The gateway only reads (its certificate may read ``llmgw_replicas`` and
``llmgw_deployments`` and nothing else), so unlike other services it creates no
bucket or stream: it waits for the scheduler to create them. Of the event
stream it publishes one kind, ``request``: a stream moved to another replica
(or not), naming the replicas before and after. Routing state arrives by KV watch, never by polling; if the bus goes
away, requests keep being routed on the last records seen.

Its one publication is evidence for the agents' progress probes: every
``traffic_interval`` a ``TrafficReport`` to ``llmgw.cmd.<node>.traffic`` for
each node leading a replica this gateway had activity on (answers completed
since the last report, or requests in flight), nothing when idle. The same
loop runs the proxy's stall watch (``Forwarder.sweep``).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import re
import resource
import signal
import time

from llmgw.shared import buckets as B
from llmgw.shared import subjects as S
from llmgw.shared.config import load_service_config, parse_listen
from llmgw.shared.errors import ConfigError
from llmgw.shared.events import EventPublisher
from llmgw.shared.kvmirror import KvMirror, open_bucket
from llmgw.shared.schemas import ReplicaTraffic, TrafficReport, encode
from llmgw.shared.states import EventKind, EventWhat
from llmgw.shared.tls import server_context

from ..runtime import ServiceRuntime, event_loop_runner
from .access import AccessLog
from .auth import ApiKeys
from .httpserver import HttpServer
from .metrics import GatewayMetrics
from .proxy import Forwarder, Migration, Upstream
from .router import Router
from .server import GatewayApp
from .workers import Supervisor, cores, worker_config

# How long a stopping gateway lets requests in flight finish.
SHUTDOWN_GRACE = 10.0
# Descriptors besides two per client connection (its own, one to a replica): NATS,
# the listener, pooled idle upstream connections, logs, the metrics listener.
FD_HEADROOM = 256


class MallocGiveBack:
    """Memory a burst of refused bodies or cut-off answers took goes back to the system.

    glibc serves allocations under its mmap threshold from heaps it rarely shrinks,
    and raises that threshold to the size of every large block freed (up to 32 MiB):
    after one 4 MiB body, hundreds of half-sent ones lived in the heap and the RSS
    they took stayed after they were let go. Here the threshold is fixed (256 KiB:
    bodies and answers joined whole are mmapped, and unmapped when freed), and when
    at least ``every`` bytes were let go unanswered since the last time, malloc_trim
    hands free heap pages back. Nothing happens off glibc."""

    M_MMAP_THRESHOLD = -3

    def __init__(self, every: int = 64 * 1024 * 1024):
        self.every = every
        self.mark = 0
        self.libc = None
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
            if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt"):
                self.libc = libc
                libc.mallopt(self.M_MMAP_THRESHOLD, 256 * 1024)
        except OSError:
            self.libc = None

    def after(self, dropped: int) -> None:
        """``dropped``: bytes let go unanswered so far, in all."""
        if self.libc is not None and dropped - self.mark >= self.every:
            self.mark = dropped
            self.libc.malloc_trim(0)


def raise_fd_limit(max_connections: int, log) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one; warn if ``max_connections``
    clients (each with a connection to a replica) cannot fit. Returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, max_connections * 2 + FD_HEADROOM)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, want, e)
    need = max_connections * 2 + FD_HEADROOM
    if soft < need:
        log.warning(
            "gateway.max_connections %d needs about %d file descriptors (2 per connection + %d) but the limit is %d: "
            "past it, requests get 503 'gateway out of file descriptors' (raise LimitNOFILE / ulimit -n, or lower max_connections)",
            max_connections, need, FD_HEADROOM, soft,
        )  # fmt: skip
    return soft


def traffic_reports(router: Router, gateway: str, reported: dict[str, int], now: float) -> list[TrafficReport]:
    """One report per leader node, for the replicas with activity since the last
    call: answers completed (``completed`` moved past ``reported``, updated here)
    or requests in flight. Empty when idle."""
    by_node: dict[str, list[ReplicaTraffic]] = {}
    for b in router.backends():
        if b.outstanding <= 0 and b.completed == reported.get(b.id, 0):
            continue
        reported[b.id] = b.completed
        if not b.node:
            continue
        by_node.setdefault(b.node, []).append(
            ReplicaTraffic(replica_id=b.id, completed=b.completed, in_flight=max(b.outstanding, 0), silent_for=round(b.silent_for, 3))
        )
    for rid in [rid for rid in reported if not router.has_record(rid)]:
        del reported[rid]
    return [TrafficReport(gateway=gateway, node_id=node, replicas=reps, sent_at=now) for node, reps in sorted(by_node.items())]


class MigrationEvents:
    """The proxy's stream migrations as events (``request`` kind), published off the
    request path: queued, at most ``QUEUED`` waiting (a replica lost under a
    thousand streams is a thousand events; past that they are dropped and counted,
    the metrics keep the whole count)."""

    QUEUED = 1024

    def __init__(self, log):
        self.log = log
        self.queue: asyncio.Queue[Migration] = asyncio.Queue(maxsize=self.QUEUED)
        self.dropped = 0

    def note(self, m: Migration) -> None:
        try:
            self.queue.put_nowait(m)
        except asyncio.QueueFull:
            self.dropped += 1
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                self.log.warning("%d stream migration event(s) not published: over %d waiting", self.dropped, self.QUEUED)

    async def publish(self, events: EventPublisher) -> None:
        while True:
            m = await self.queue.get()
            what = EventWhat.MIGRATED if m.outcome == "continued" else EventWhat.NOT_MIGRATED
            detail = f"{m.before} -> {m.after or 'none'} ({m.cause})" + (f": {m.detail}" if m.detail else "")
            await events.emit(
                EventKind.REQUEST, event_subject(m.request), what, detail, model=m.model, before=m.before, after=m.after, cause=m.cause, outcome=m.outcome
            )


_SUBJECT_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def event_subject(request_id: str) -> str:
    """A request id as one NATS subject token (an engine's ids are; a client's need not be)."""
    return _SUBJECT_UNSAFE.sub("_", request_id)[:80] or "unnamed"


class Gateway(ServiceRuntime):
    role = "gateway"
    event_loop = "uvloop"
    # It writes no control-plane state: its traffic reports are true whenever they
    # arrive, so nats-py may buffer them over a reconnect (bus.connect's default).
    bus_pending_size = 256 * 1024

    def __init__(self, cfg):
        super().__init__(cfg)
        g = cfg.gateway
        self.listen = parse_listen(g.listen)
        self.keys = ApiKeys.load(g.api_keys_file) if g.api_keys_file else None
        self.tls = server_context(cfg.source, g.tls_cert, g.tls_key) if g.tls_cert else None
        self.router = Router(
            cooldown=g.cooldown, failures_before_cooldown=g.failures_before_cooldown, retry_after=g.retry_after,
            routing=g.routing, load_bound=g.routing_load_bound, load_slack=g.routing_load_slack, prefix_chars=g.routing_prefix_chars,
        )  # fmt: skip
        self.metrics = GatewayMetrics(self.router)
        self.metrics_registry = self.metrics.registry  # metrics_listen, an optional second listener kept off the API port
        self.upstream = Upstream(g)
        self.http: HttpServer | None = None
        self.forwarder: Forwarder | None = None
        self.app: GatewayApp | None = None
        self.replicas: KvMirror | None = None
        self.deployments: KvMirror | None = None
        self.port = 0  # the bound port (listen may say 0)
        self.as_process = False  # serve() (the llmgw gateway command) rather than embedded
        self.give_back: MallocGiveBack | None = None  # as a process only: it tunes the process's malloc
        self.reuse_port = False  # a worker of 'llmgw gateway --workers N': its own SO_REUSEPORT socket on the shared port
        self.worker: int | None = None  # that worker's index
        self.moved = MigrationEvents(self.log)

    async def open_buckets(self) -> None:
        """The deployments and replicas, read through live copies (it owns no bucket
        and publishes no events); the router hears each record first."""
        deployments_kv = await open_bucket(self.js, S.BUCKET_DEPLOYMENTS, wait=3600, logger=self.log)
        replicas_kv = await open_bucket(self.js, S.BUCKET_REPLICAS, wait=3600, logger=self.log)
        self.deployments = KvMirror(deployments_kv, B.DEPLOYMENTS)
        self.deployments.listeners.append(self.router.on_deployment)
        await self.deployments.start()
        self.replicas = KvMirror(replicas_kv, B.REPLICAS)
        self.replicas.listeners.append(self.router.on_replica)
        await self.replicas.start()

    async def start(self) -> None:
        await super().start()
        if self.as_process:
            self.give_back = MallocGiveBack()
            # Everything alive now (modules, app, pools) lives as long as the process;
            # freezing it keeps full collections from walking it again — measured, a
            # 17 ms pause every few seconds under load became 0.3 ms.
            gc.freeze()

    async def setup(self) -> None:
        await self.upstream.start()
        g = self.cfg.gateway
        self.forwarder = Forwarder(
            self.router, self.upstream, self.metrics, AccessLog() if g.access_log else None,
            stall_after=g.stall_after, max_migrations=g.max_migrations, stream_migration=g.stream_migration, max_text=g.stream_migration_max_text,
        )  # fmt: skip
        self.forwarder.on_migration = self.moved.note
        self.spawn(self.moved.publish(EventPublisher(self.js, self.role, on_failure=self.write_failed)))
        if self.replicas is not None:  # after the router's: it sees the record first
            self.replicas.listeners.append(self.forwarder.on_replica)
        self.app = GatewayApp(
            self.router,
            self.forwarder,
            self.metrics,
            max_body_bytes=self.cfg.gateway.max_body_bytes,
            keys=self.keys,
            bounds=g,
        )
        self.app.replicas = self.replicas  # GET /sd/engines lists the ready leaders from these records
        raise_fd_limit(g.max_connections, self.log)
        # A client that disconnects cancels its handler, which closes the
        # upstream connection, which stops the engine's work (httpserver.py).
        self.http = self.app.server()
        host, port = self.listen
        try:
            self.port = await self.http.start(host, port, backlog=1024, tls=self.tls, reuse_port=self.reuse_port)
        except OSError as e:
            self.http = None
            raise ConfigError(f"{self.cfg.source}: gateway.listen {host}:{port}: {e.strerror or e}") from None
        self.spawn(self.watch())
        scheme = "https" if self.tls else "http"
        worker = f" (worker {self.worker})" if self.worker is not None else ""
        self.log.info("gateway serving the OpenAI API on %s://%s:%d%s%s", scheme, host, self.port, worker, " (API keys required)" if self.keys else "")

    async def watch(self) -> None:
        """The stall watch every tick, and the traffic reports every ``traffic_interval``."""
        g = self.cfg.gateway
        tick = min(g.traffic_interval, g.stall_after / 4)
        reported: dict[str, int] = {}
        next_report = 0.0
        forwarder, http = self.forwarder, self.http
        if forwarder is None or http is None:  # setup() makes both before it spawns this watch
            raise RuntimeError("the gateway watch was started before setup")
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            try:
                forwarder.sweep(now)
                if self.give_back is not None:
                    self.give_back.after(http.dropped + forwarder.dropped)
                if now >= next_report - tick / 10:
                    next_report = now + g.traffic_interval
                    for report in traffic_reports(self.router, self.instance, reported, time.time()):
                        await self.nc.publish(S.traffic(report.node_id), encode(report))
            except Exception:  # a bug here must not stop the watch for good
                self.log.exception("gateway watch: sweep or traffic report failed")

    def reload_keys(self) -> None:
        """SIGHUP: re-read the key file; a bad file keeps the keys in force."""
        if not self.cfg.gateway.api_keys_file:
            return
        try:
            self.keys = ApiKeys.load(self.cfg.gateway.api_keys_file)
        except ConfigError as e:
            self.log.error("API keys not reloaded, the previous ones stay in force: %s", e)
            return
        if self.app is not None:
            self.app.keys = self.keys
        self.log.info("API keys reloaded: %d", len(self.keys.digests))

    async def serve(self) -> None:
        # Only as a process: an embedding program keeps its own SIGHUP.
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload_keys)
        self.as_process = True
        await super().serve()

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.close(SHUTDOWN_GRACE)
        await self.upstream.close()
        for mirror in (self.replicas, self.deployments):
            if mirror is not None:
                await mirror.stop()
        await super().stop()


def main(args) -> int:
    """``llmgw gateway``: one gateway in this process, a worker of a supervising
    parent (``--worker INDEX:PORT``), or with ``--workers N`` (``gateway.workers``)
    that parent, supervising N workers (workers.py). The configuration was checked
    whole when it was read (listen addresses, TLS and key files), so the parent
    starts no worker with a file each would refuse."""
    cfg = load_service_config(args.config)
    if getattr(args, "worker", None):
        index, _, port = args.worker.partition(":")
        if not (index.isdigit() and port.isdigit()):
            raise ConfigError(f"--worker {args.worker!r}: expected INDEX:PORT")
        svc = Gateway(worker_config(cfg, int(index), int(port)))
        svc.reuse_port = True
        svc.worker = int(index)
        event_loop_runner(Gateway.event_loop)(svc.serve())
        return 0
    n = args.workers if getattr(args, "workers", None) is not None else cfg.gateway.workers
    if n < 0 or n > 1024:
        raise ConfigError(f"--workers {n}: must be from 0 (one per core) to 1024")
    n = n or cores()
    if n == 1:
        event_loop_runner(Gateway.event_loop)(Gateway(cfg).serve())
        return 0
    return Supervisor(args, cfg, n).run()
