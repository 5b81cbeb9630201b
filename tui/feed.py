"""The console's side of the bus: connect, mirror the buckets, follow the event stream.

Everything here runs inside one Textual worker on the app's event loop and
talks to the app only by posting the messages below; nothing polls. Updates are
coalesced (a KV watch delivers a burst of entries at start, a rebuild a burst
of events) so the screen redraws once per burst, not once per entry.

When the connection drops, the last state seen stays on screen and the app is
told. When it comes back — possibly to a restarted server whose consumers are
gone — every bucket is watched afresh and the event stream is followed again
from the sequence after the last one seen, so nothing is missed or shown twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import BucketNotFoundError, NotFoundError
from textual.message import Message

from llmgw.services.ctl.session import Session
from llmgw.shared import bus
from llmgw.shared import subjects as S
from llmgw.shared.config import ServiceConfig
from llmgw.shared.errors import BusError, WireError
from llmgw.shared.kvmirror import KvMirror
from llmgw.shared.schemas import DeploymentSpec, Event, Lease, NodeRecord, Replica, decode
from llmgw.shared.tasks import cancel_and_wait

from .model import ClusterState

log = logging.getLogger("llmgw.tui.feed")

# How long updates are gathered before the screen hears of them.
COALESCE = 0.03
# A console should notice a server that is back within seconds, whatever a
# service's configuration allows for its own reconnects.
RECONNECT_MAX = 5.0

MIRRORED = (
    (S.BUCKET_NODES, NodeRecord),
    (S.BUCKET_LEASES, Lease),
    (S.BUCKET_REPLICAS, Replica),
    (S.BUCKET_DEPLOYMENTS, DeploymentSpec),  # a deployment's crash-loop backoff
)
# Mirrored when there, not waited for: the banner does not hold the screen for them.
OPTIONAL = frozenset({S.BUCKET_DEPLOYMENTS})


@dataclass(frozen=True)
class ConnectionStatus:
    state: str  # connecting | unreachable | connected | down
    since: float
    server: str
    detail: str = ""
    # When the connection was last lost; kept after it is back, to say for how long.
    down_since: float | None = None


class Feed(Session):
    """An operator session that stays connected and keeps the console current.

    A ``Session`` (``llmgw ctl``) for its API calls and error mapping; unlike a
    ctl command it lives as long as the console and survives outages.
    """

    class StateChanged(Message):
        def __init__(self, state: ClusterState) -> None:
            super().__init__()
            self.state = state

    class EventsArrived(Message):
        def __init__(self, events: tuple[Event, ...], replayed: bool) -> None:
            super().__init__()
            self.events = events
            self.replayed = replayed  # history from before the console started

    class ConnectionChanged(Message):
        def __init__(self, status: ConnectionStatus) -> None:
            super().__init__()
            self.status = status

    class Waiting(Message):
        """What the console is waiting for ('' when nothing): a bucket not created yet, …"""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, cfg: ServiceConfig, *, history: int = 500, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        self.history = history
        self.clock = clock
        self.server = ", ".join(cfg.server)
        self.mirrors: dict[str, KvMirror] = {}
        self.next_seq = 0  # the event stream sequence to read next (0: not started)
        self._post: Callable[[Message], object] = lambda m: None
        self._resync = asyncio.Event()
        self._flush_handle: asyncio.TimerHandle | None = None
        self._state_dirty = False
        self._events: list[Event] = []
        self._waiting: dict[str, str] = {}
        self._sub: JetStreamContext.PushSubscription | None = None
        self._down_since: float | None = None

    # -- running ---------------------------------------------------------------

    async def run(self, post: Callable[[Message], object]) -> None:
        """Connect and follow until cancelled (the worker is cancelled when the app exits)."""
        self._post = post
        try:
            await self._connect()
            while True:
                self._resync.clear()
                resync = asyncio.create_task(self._resync.wait())
                sources = {asyncio.create_task(self._keep_mirror(b, schema)) for b, schema in MIRRORED}
                sources.add(asyncio.create_task(self._follow_events()))
                pending = {resync, *sources}
                try:
                    while resync in pending:
                        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                        for t in done - {resync}:
                            if (failed := t.exception()) is not None:
                                raise failed
                finally:
                    await cancel_and_wait(pending)
        finally:
            await self._close()

    async def _connect(self) -> None:
        attempt = 0
        quiet = logging.getLogger("llmgw.tui.bus")
        while True:
            self._status("connecting")
            try:
                self.nc = await bus.connect(
                    self.cfg.server,
                    self.cfg.tls_files(),
                    name="tui",
                    initial_attempts=1,
                    connect_timeout=3,
                    reconnect_base=min(self.cfg.reconnect_base, 1.0),
                    reconnect_max=min(self.cfg.reconnect_max, RECONNECT_MAX),
                    on_disconnect=self._disconnected,
                    on_reconnect=self._reconnected,
                    logger=quiet,
                )
            except BusError as e:
                delay = bus.backoff_delay(attempt, 0.5, RECONNECT_MAX)
                attempt += 1
                self._status("unreachable", f"{e}; retrying in {delay:.1f}s")
                await asyncio.sleep(delay)
                continue
            self.js = self.nc.jetstream(timeout=5)
            self._status("connected")
            return

    async def _close(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        for m in list(self.mirrors.values()):
            try:
                await asyncio.wait_for(m.stop(), 1)
            except (TimeoutError, Exception):
                pass
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.close(), 2)
            except (TimeoutError, Exception):
                pass

    # -- connection callbacks (called by nats-py on the same loop) -------------

    async def _disconnected(self) -> None:
        self._down_since = self.clock()
        self._status("down")

    async def _reconnected(self) -> None:
        self._status("connected")
        # A restarted server has forgotten our consumers: watch and follow afresh.
        self._resync.set()

    def _status(self, state: str, detail: str = "") -> None:
        self._post(self.ConnectionChanged(ConnectionStatus(state, self.clock(), self.server, detail, self._down_since)))

    def _wait_for(self, source: str, text: str) -> None:
        if self._waiting.get(source, "") == text:
            return
        if text:
            self._waiting[source] = text
        else:
            self._waiting.pop(source, None)
        self._post(self.Waiting("; ".join(self._waiting[k] for k in sorted(self._waiting))))

    # -- buckets ---------------------------------------------------------------

    async def _keep_mirror(self, bucket: str, schema) -> None:
        """Watch ``bucket`` afresh; swap the new copy in only once it holds every key."""
        while True:
            mirror = None
            try:
                kv = await self.jetstream.key_value(bucket)
                mirror = KvMirror(kv, schema)
                mirror.listeners.append(lambda *_, m=mirror: self._changed(bucket, m))
                await mirror.start(timeout=5)
                break
            except BucketNotFoundError:
                if bucket not in OPTIONAL:  # without it the console has nothing to say yet
                    self._wait_for(bucket, f"waiting for {bucket} (its writer has not created it yet)")
            except Exception as e:  # JetStream may still be recovering after a server restart
                self._wait_for(bucket, f"cannot watch {bucket} yet ({type(e).__name__})")
            if mirror is not None:
                await mirror.stop()
            await asyncio.sleep(1.0)
        old, self.mirrors[bucket] = self.mirrors.get(bucket), mirror
        self._wait_for(bucket, "")
        self._changed(bucket, mirror)
        if old is not None:
            await old.stop()

    def _changed(self, bucket: str, mirror: KvMirror) -> None:
        if self.mirrors.get(bucket) is mirror:  # entries of a copy still loading are not news
            self._state_dirty = True
            self._schedule()

    def state(self) -> ClusterState:
        def items(bucket):
            m = self.mirrors.get(bucket)
            return dict(m.items) if m else {}

        return ClusterState(items(S.BUCKET_NODES), items(S.BUCKET_LEASES), items(S.BUCKET_REPLICAS), items(S.BUCKET_DEPLOYMENTS))

    # -- events ----------------------------------------------------------------

    async def _follow_events(self) -> None:
        while True:
            try:
                sub, last, first_run = await self._subscribe_events()
                break
            except NotFoundError:
                self._wait_for("events", f"waiting for stream {S.EVENT_STREAM}")
            except Exception as e:  # JetStream may still be recovering after a server restart
                self._wait_for("events", f"cannot follow {S.EVENT_STREAM} yet ({type(e).__name__})")
            await asyncio.sleep(1.0)
        self._wait_for("events", "")
        replaying = first_run
        if self.next_seq == 0 and not replaying:  # an empty stream: no history to wait for
            self._post(self.EventsArrived((), replayed=True))
        async for msg in sub.messages:
            seq = msg.metadata.sequence.stream
            if seq < self.next_seq:
                continue  # already shown before a reconnect
            self.next_seq = seq + 1
            try:
                self._events.append(decode(msg.data, Event))
            except WireError as e:
                log.warning("event %d: %s", seq, e)
            if replaying:
                if seq >= last:  # history complete: show it in one go
                    self._post(self.EventsArrived(tuple(self._events), replayed=True))
                    self._events.clear()
                    replaying = False
            else:
                self._schedule()

    async def _subscribe_events(self):
        """Follow the stream from the next unseen sequence (or the last ``history`` events at first)."""
        info = await self.jetstream.stream_info(S.EVENT_STREAM)
        last = info.state.last_seq
        first_run = self.next_seq == 0
        start = self.next_seq or max(1, info.state.first_seq, last - self.history + 1)
        start = min(start, last + 1)
        old, self._sub = self._sub, None
        if old is not None:
            try:
                await old.unsubscribe()
            except Exception:
                pass
        self._sub = await self.jetstream.subscribe(
            S.ALL_EVENTS,
            stream=S.EVENT_STREAM,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start),
        )
        return self._sub, last, first_run and start <= last

    # -- coalescing ------------------------------------------------------------

    def _schedule(self) -> None:
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(COALESCE, self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        if self._state_dirty:
            self._state_dirty = False
            self._post(self.StateChanged(self.state()))
        if self._events:
            events, self._events = tuple(self._events), []
            self._post(self.EventsArrived(events, replayed=False))

    # -- operator actions ------------------------------------------------------

    async def admin(self, verb: str, node_id: str) -> NodeRecord:
        """cordon | uncordon | drain through the registry's API (the operator never writes a bucket)."""
        if self.nc is None or not self.nc.is_connected:
            raise BusError(f"not connected to NATS at {self.server}; try again once the connection is back")
        return decode(await self.call("registry", verb, json.dumps({"node_id": node_id}).encode(), timeout=5), NodeRecord)
