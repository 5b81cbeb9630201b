"""What every control-plane service process shares: connect, provision, metrics,
events, its nats.micro API, leadership, and a clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.micro import Service, add_service
from nats.micro.request import Request
from prometheus_client import REGISTRY, CollectorRegistry, Counter, start_http_server

from llmgw.shared import api, bus
from llmgw.shared import buckets as B
from llmgw.shared import subjects as S
from llmgw.shared.api import Endpoint
from llmgw.shared.coalesce import loop_factory as coalesce_loop_factory
from llmgw.shared.config import ServiceConfig, load_service_config, parse_listen
from llmgw.shared.errors import BusError, ConfigError, LlmgwError, WireError
from llmgw.shared.events import EventPublisher
from llmgw.shared.leader import Leadership
from llmgw.shared.names import is_valid_name
from llmgw.shared.schemas import ApiError, decode, encode
from llmgw.shared.tasks import cancel_and_wait

VERSION = "0.1.0"
# Control-plane writes (KV puts, event publishes) the bus refused or did not
# acknowledge: while a NATS cluster has no quorum, this grows and the service
# keeps its last view (docs/operations.md, "While a NATS server is down").
BUS_WRITE_FAILURES = Counter("llmgw_bus_write_failures_total", "Control-plane writes (KV, events) the bus refused or did not acknowledge", ["service"])


class Turn(StrEnum):
    """Where a leader-elected service stands after ``follow_leadership``."""

    STANDING_BY = "standing-by"  # not leading (or no longer): do nothing
    TOOK_OVER = "took-over"  # just became the acting instance this round
    ACTING = "acting"  # was acting already and still leads


class ServiceRuntime:
    role: str = ""
    # The gateway's hot path is socket I/O, where uvloop costs a third less CPU
    # per request (docs/architecture.md, "The gateway"); the rest keep the standard loop.
    event_loop: str = "asyncio"
    # What nats-py may buffer while disconnected (``bus.connect``): nothing for a
    # service that writes control-plane state (a write that failed is never
    # replayed later, over a newer one).
    bus_pending_size: int = 0
    # What metrics_listen serves.
    metrics_registry: CollectorRegistry = REGISTRY
    # Seconds the loop lets input gather before reading it (shared/coalesce.py):
    # 0, except where a service's own section sets it (health.io_coalesce).
    io_coalesce: float = 0.0
    log: logging.Logger

    def __init__(self, cfg: ServiceConfig):
        self.cfg = cfg
        self.log = logging.getLogger(f"llmgw.{self.role}")
        # Made by start(); services use them through ``nc`` and ``js``, which are only
        # there once connected.
        self._nc: NATS | None = None
        self._js: JetStreamContext | None = None
        self.kv: dict = {}
        self._events: EventPublisher | None = None  # made by open_buckets; read through ``events``
        self.micro: Service | None = None
        self.leadership: Leadership | None = None
        # Whether this instance acts on its leadership (``follow_leadership``):
        # leading is decided by the lease, acting starts only once taking over is done.
        self.acting = False
        self.stopping = asyncio.Event()
        self.tasks: list[asyncio.Task] = []
        role, name = cfg.tls_files().identity()
        if role != self.role:
            raise ConfigError(f"{cfg.source}: tls.cert is a '{role}' certificate (CN={name}); the {self.role} needs one issued with --role {self.role}")
        self.identity = name
        # Unique per process, so a restarted instance never mistakes an old lease for its own.
        self.instance = f"{name}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"

    @property
    def nc(self) -> NATS:
        """The connection to NATS; a use before ``start`` connected is a bug, said as one."""
        if self._nc is None:
            raise BusError(f"the {self.role} is not connected to NATS yet")
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        """JetStream on that connection (same terms)."""
        if self._js is None:
            raise BusError(f"the {self.role} is not connected to NATS yet")
        return self._js

    @property
    def events(self) -> EventPublisher:
        """The event stream's publisher, made with the buckets (a service that opens
        only others' buckets, the gateway, has none and publishes no events)."""
        if self._events is None:
            raise BusError(f"the {self.role} has no event publisher (not started, or it publishes no events)")
        return self._events

    # -- lifecycle -----------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        if cfg.metrics_listen:
            host, port = parse_listen(cfg.metrics_listen)  # HOST:PORT, checked when the file was read
            try:
                start_http_server(port, addr=host, registry=self.metrics_registry)
            except (OSError, ValueError) as e:
                raise ConfigError(f"{cfg.source}: metrics_listen {cfg.metrics_listen}: {e}") from None
        self._nc = nc = await bus.connect(
            cfg.server,
            cfg.tls_files(),
            name=self.role,
            reconnect_base=cfg.reconnect_base,
            reconnect_max=cfg.reconnect_max,
            logger=self.log,
            on_disconnect=self.on_bus_disconnect,
            on_reconnect=self.on_bus_reconnect,
            pending_size=self.bus_pending_size,
        )
        self._js = nc.jetstream(timeout=5)
        await self.open_buckets()
        await self.setup()

    @property
    def buckets(self) -> tuple[B.Bucket, ...]:
        """The buckets this service writes (``shared/buckets.py``)."""
        return B.written_by(self.role)

    async def open_buckets(self) -> None:
        """Connected, before ``setup``: the buckets and streams the service needs.

        The buckets it writes and the event stream: created with kv_replicas when
        missing. The streams it owns are brought to kv_replicas when they exist
        with another count (a grown cluster); only an owner may update a stream
        (``shared/buckets.py``). A service that writes none and only reads
        others' (the gateway) opens those instead."""
        events = B.publishes_events(self.role)
        self.kv = await bus.provision(self.js, tuple(b.name for b in self.buckets), events=events, replicas=self.cfg.kv_replicas)
        for stream in B.owned_by(self.role):
            await bus.ensure_replicas(self.js, stream, self.cfg.kv_replicas, logger=self.log)
        self._events = EventPublisher(self.js, self.role, on_failure=self.write_failed) if events else None

    async def setup(self) -> None:
        """Subscriptions, watchers and API endpoints of the concrete service."""

    async def on_bus_disconnect(self) -> None:
        """The connection to NATS dropped (the concrete service may pause judgements)."""

    async def on_bus_reconnect(self) -> None:
        """The connection to NATS is back."""

    def write_failed(self, what: str, e: BaseException | None = None) -> None:
        """Count (and log) a control-plane write the bus refused or did not acknowledge."""
        BUS_WRITE_FAILURES.labels(self.role).inc()
        stamp = time.monotonic()
        if stamp - getattr(self, "_write_failed_logged", -60.0) < 5.0:
            return  # counted; logged at most every 5 s (a batch fails together)
        self._write_failed_logged = stamp
        self.log.warning("bus write failed (%s): %s; keeping the last view", what, (e and (str(e) or type(e).__name__)) or "no ack")

    async def add_api(self, handlers: dict[Endpoint, Callable[[Any], Awaitable[Any]]]) -> None:
        """Serve this service's endpoints (``shared/api.py``) as a nats.micro
        service (``nats micro ls`` finds it): each request decoded as its
        endpoint's request type before the handler sees it, each answer encoded.
        Every endpoint the table gives this service has a handler, and only those."""
        mine = set(api.served_by(self.role))
        if set(handlers) != mine:
            missing = ", ".join(sorted(e.verb for e in mine - set(handlers)))
            extra = ", ".join(sorted(f"{e.service}.{e.verb}" for e in set(handlers) - mine))
            raise ValueError(f"the {self.role}'s API handlers do not match shared/api.py (no handler: {missing or '-'}; not the {self.role}'s: {extra or '-'})")
        self.micro = micro = await add_service(
            self.nc, name=f"llmgw-{self.role}", version=VERSION, description=f"llmgw {self.role}", queue_group=f"llmgw-{self.role}"
        )
        for endpoint, handler in handlers.items():
            await micro.add_endpoint(name=endpoint.verb, subject=endpoint.subject, handler=self._wrap(endpoint, handler))

    def _wrap(self, endpoint: Endpoint, handler: Callable[[Any], Awaitable[Any]]):
        async def run(req: Request) -> None:
            try:
                reply = await handler(decode(req.data, endpoint.request))
                if not isinstance(reply, endpoint.reply):
                    raise TypeError(f"{endpoint.verb} answered {type(reply).__name__}, not {endpoint.reply.__name__}")
                await req.respond(encode(reply))
            except WireError as e:
                await req.respond_error("400", str(e), data=encode(ApiError(code="bad_request", description=str(e))))
            except LlmgwError as e:
                await req.respond_error("400", str(e), data=encode(ApiError(code=e.code, description=str(e))))
            except Exception as e:  # never leave a caller hanging on a bug
                self.log.exception("%s: %s failed", self.role, endpoint.verb)
                await req.respond_error("500", f"{type(e).__name__}: {e}", data=encode(ApiError(code="internal", description=str(e))))

        return run

    def node_message(self, msg, schema, counter, what: str):
        """Decode a message an agent published on ``llmgw.node.<node>.…``, or None.

        The server already binds the subject to the certificate; the payload
        must claim the same node. Every rejection is logged with the node and
        counted by ``counter`` (a Counter with a ``result`` label).
        """
        node = S.node_of(msg.subject)
        try:
            obj = decode(msg.data, schema)
        except WireError as e:
            counter.labels("malformed").inc()
            self.log.warning("%s from %s rejected: %s", what, node or msg.subject, e)
            return None
        if getattr(obj, "node_id", None) != node or not is_valid_name(node):
            counter.labels("inconsistent").inc()
            self.log.warning("%s on %s claims node_id %r; rejected", what, msg.subject, getattr(obj, "node_id", None))
            return None
        return obj

    def spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self.tasks.append(t)
        return t

    def lead(self, ttl: float) -> Leadership:
        self.leadership = Leadership(_CountedWrites(self.kv[B.LEADERS.name], self.write_failed), self.role, self.instance, ttl)
        self.spawn(self.leadership.run())
        return self.leadership

    async def follow_leadership(self, take_over: Callable[[], Awaitable[None]]) -> Turn:
        """One round of "leading and not acting: take over; not leading and acting:
        step down", for the services that only one instance of may act (health,
        scheduler). ``take_over`` runs before ``acting`` is set, so a standby never
        acts on state it has not caught up on; if it raises, the instance is still
        not acting and the exception is the caller's (the next round tries again).
        Stepping down is immediate: the round that finds the lease lost does nothing."""
        leading = bool(self.leadership and self.leadership.is_leader)
        if leading and not self.acting:
            await take_over()
            self.acting = True
            return Turn.TOOK_OVER
        if not leading:
            self.acting = False
            return Turn.STANDING_BY
        return Turn.ACTING

    async def stop(self) -> None:
        """Stop, each step bounded: a stop that waits for ever on the bus (a drain
        whose flush never returns, a task that will not end) leaves a process
        that neither serves nor exits — systemd's stop timeout or a test's
        timeout would be all that ends it."""
        stuck = await cancel_and_wait(self.tasks, timeout=5)
        for t in stuck:
            self.log.warning("task %s did not end within 5s of being cancelled; leaving it", t.get_name())
        if self.leadership:
            try:
                await asyncio.wait_for(self.leadership.resign(), 3)
            except Exception:
                pass  # the lease runs out by itself; a standby takes over after its TTL
        if self.micro:
            try:
                await asyncio.wait_for(self.micro.stop(), 3)
            except Exception:
                pass
        nc = self._nc
        if nc and not nc.is_closed:
            try:
                await asyncio.wait_for(nc.drain(), 3)
            except Exception:
                pass
            if not nc.is_closed:
                try:
                    await asyncio.wait_for(nc.close(), 2)
                except Exception:
                    pass

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        await self.start()
        self.log.info("%s %s running", self.role, self.identity)
        await self.stopping.wait()
        self.log.info("%s stopping", self.role)
        await self.stop()


class _CountedWrites:
    """A KV bucket whose failed writes count as bus write failures (the leadership
    renewals: while a cluster has no quorum they are the first writes to fail).
    A lost compare-and-set race is an answer, not a failure."""

    def __init__(self, kv, failed):
        self._kv, self._failed = kv, failed

    def __getattr__(self, name):
        return getattr(self._kv, name)

    async def _write(self, op, *args, **kw):
        try:
            return await getattr(self._kv, op)(*args, **kw)
        except Exception as e:
            if type(e).__name__ not in ("KeyWrongLastSequenceError", "KeyNotFoundError"):
                self._failed(f"leadership {op}", e)
            raise

    async def create(self, *args, **kw):
        return await self._write("create", *args, **kw)

    async def update(self, *args, **kw):
        return await self._write("update", *args, **kw)


LOOP_ENV = "LLMGW_EVENT_LOOP"  # asyncio | uvloop: overrides a service's choice (A/B benchmarks)


def event_loop_runner(preferred: str, coalesce: float = 0.0):
    """``asyncio.run`` or ``uvloop.run``: the service's preference, unless
    LLMGW_EVENT_LOOP says otherwise; asyncio where uvloop is not installed.
    ``coalesce`` > 0: asyncio's loop over a ``CoalescingSelector`` of that window
    (uvloop has no selector to wrap: there it is left out, and said)."""
    choice = os.environ.get(LOOP_ENV) or preferred
    if choice not in ("asyncio", "uvloop"):
        raise ConfigError(f"{LOOP_ENV}={choice!r}: use asyncio or uvloop")
    if choice == "uvloop":
        try:
            import uvloop
        except ImportError:
            if os.environ.get(LOOP_ENV) == "uvloop":
                raise ConfigError(f"{LOOP_ENV}=uvloop, but uvloop is not installed (pip install uvloop)") from None
        else:
            if coalesce > 0:
                logging.getLogger("llmgw").warning("%s=uvloop: reads are not coalesced (%.0f ms asked); that needs asyncio's loop", LOOP_ENV, coalesce * 1000)
            return uvloop.run
    if coalesce > 0:
        factory = coalesce_loop_factory(coalesce)

        def run(coro):
            with asyncio.Runner(loop_factory=factory) as runner:
                return runner.run(coro)

        return run
    return asyncio.run


def run_service(cls, args) -> int:
    cfg = load_service_config(args.config)
    svc = cls(cfg)
    event_loop_runner(cls.event_loop, svc.io_coalesce)(svc.serve())
    return 0
