"""The console's side of the bus: connect, watch the buckets, follow the event stream.

What it reads, and why (``docs/architecture.md``, "The console"): the four
buckets the read model needs (nodes, leases, replicas, deployments), each
watched whole — every record once at start, then each change as it happens —
and the event stream from its last ``history`` events on. A console that can
jump to any of 10,000 nodes or filter them needs every node's record and
lease; after the first read it costs only the changes (at 10,000 nodes the
health monitor writes about 65 leases a second: checkpoints, and state changes
at once). Nothing is copied per change: each one goes straight to the app's
folds (``cluster.py``, ``timeline.py``), on the app's own loop.

Everything here runs inside one Textual worker and talks to the app through
the ``Sink`` methods below; nothing polls.

When the connection drops, the last state seen stays on screen and the app is
told. When it comes back — possibly to a restarted server whose consumers are
gone — each bucket's mirror re-reads its bucket by itself and hands over only
what changed meanwhile (``shared/kvmirror.py``), and the event stream is
followed again from the sequence after the last one seen, so nothing is missed
or shown twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import BucketNotFoundError, NotFoundError

from llmgw.shared import api, bus
from llmgw.shared import buckets as B
from llmgw.shared import subjects as S
from llmgw.shared.buckets import Bucket
from llmgw.shared.config import ServiceConfig
from llmgw.shared.errors import BusError, WireError
from llmgw.shared.kvmirror import KvMirror
from llmgw.shared.operator import OperatorSession
from llmgw.shared.schemas import Event, NodeRecord, NodeRequest
from llmgw.shared.tasks import cancel_and_wait

from .cluster import DEPLOYMENTS, LEASES, NODES, REPLICAS

log = logging.getLogger("llmgw.tui.feed")

# A console should notice a server that is back within seconds, whatever a
# service's configuration allows for its own reconnects.
RECONNECT_MAX = 5.0

# bucket -> the model's name for it
MIRRORED: dict[Bucket, str] = {
    B.NODES: NODES,
    B.LEASES: LEASES,
    B.REPLICAS: REPLICAS,
    B.DEPLOYMENTS: DEPLOYMENTS,  # a deployment's crash-loop backoff
}
# Mirrored when there, not waited for: the banner does not hold the screen for them.
OPTIONAL = frozenset({B.DEPLOYMENTS.name})


@dataclass(frozen=True)
class ConnectionStatus:
    state: str  # connecting | unreachable | connected | down
    since: float
    server: str
    detail: str = ""
    # When the connection was last lost; kept after it is back, to say for how long.
    down_since: float | None = None


class Sink(Protocol):
    """What the feed tells the app; each is called on the app's loop."""

    def bucket_loaded(self, bucket: str, items: Mapping[str, object]) -> None:
        """A bucket was read whole (at start, or once it exists)."""

    def bucket_changed(self, bucket: str, key: str, value: object | None, stored: float | None) -> None:
        """One record changed (None: deleted); ``stored``: when the server stored it, None for a re-read."""

    def events_arrived(self, events: list[Event], replayed: bool, stored: float | None) -> None:
        """Events in stream order; ``replayed``: history from before the console started."""

    def connection_changed(self, status: ConnectionStatus) -> None: ...

    def waiting(self, text: str) -> None:
        """What the console is waiting for ('' when nothing): a bucket not created yet, …"""


def _epoch(ts) -> float | None:
    return ts.timestamp() if ts is not None else None


class Feed:
    """Keeps the console current over an operator session (``shared/operator.py``,
    as ``llmgw ctl``'s) that, unlike a ctl command's, lives as long as the console
    and survives outages.
    """

    def __init__(self, cfg: ServiceConfig, *, history: int = 500, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.session = OperatorSession(cfg, name="tui")
        self.history = history
        self.clock = clock
        self.server = ", ".join(cfg.server)
        self.mirrors: dict[str, KvMirror] = {}
        self.next_seq = 0  # the event stream sequence to read next (0: not started)
        self.sink: Sink | None = None
        self._resync = asyncio.Event()
        self._waiting: dict[str, str] = {}
        self._sub: JetStreamContext.PushSubscription | None = None
        self._down_since: float | None = None

    # -- running ---------------------------------------------------------------

    async def run(self, sink: Sink) -> None:
        """Connect and follow until cancelled (the worker is cancelled when the app exits)."""
        self.sink = sink
        mirrors: set[asyncio.Task] = set()
        try:
            await self._connect()
            # Each mirror heals itself after a reconnect; started once each.
            mirrors = {asyncio.create_task(self._keep_mirror(b, name)) for b, name in MIRRORED.items()}
            while True:
                self._resync.clear()
                resync = asyncio.create_task(self._resync.wait())
                events = asyncio.create_task(self._follow_events())
                pending = {resync, events, *mirrors}
                try:
                    while resync in pending:
                        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                        for t in done - {resync}:
                            if (failed := t.exception()) is not None:
                                raise failed
                            mirrors.discard(t)
                finally:
                    # A restarted server has forgotten the event consumer: follow afresh.
                    await cancel_and_wait({resync, events})
        finally:
            await cancel_and_wait(mirrors)
            await self._close()

    async def _connect(self) -> None:
        attempt = 0
        quiet = logging.getLogger("llmgw.tui.bus")
        while True:
            self._status("connecting")
            try:
                await self.session.connect(
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
            self._status("connected")
            return

    async def _close(self) -> None:
        for m in list(self.mirrors.values()):
            try:
                await asyncio.wait_for(m.stop(), 1)
            except (TimeoutError, Exception):
                pass
        await self.session.close(timeout=2)

    # -- connection callbacks (called by nats-py on the same loop) -------------

    async def _disconnected(self) -> None:
        self._down_since = self.clock()
        self._status("down")

    async def _reconnected(self) -> None:
        self._status("connected")
        self._resync.set()

    def _status(self, state: str, detail: str = "") -> None:
        if self.sink is not None:
            self.sink.connection_changed(ConnectionStatus(state, self.clock(), self.server, detail, self._down_since))

    def _wait_for(self, source: str, text: str) -> None:
        if self._waiting.get(source, "") == text:
            return
        if text:
            self._waiting[source] = text
        else:
            self._waiting.pop(source, None)
        if self.sink is not None:
            self.sink.waiting("; ".join(self._waiting[k] for k in sorted(self._waiting)))

    # -- buckets ---------------------------------------------------------------

    async def _keep_mirror(self, row: Bucket, name: str) -> None:
        """Watch the bucket once it exists; hand it over whole, then change by change."""
        bucket = row.name
        self._wait_for(bucket, f"reading {bucket} …")
        while True:
            mirror = None
            try:
                kv = await self.session.jetstream.key_value(bucket)
                mirror = KvMirror(kv, row)
                mirror.listeners.append(self._listener(bucket, name, mirror))
                await mirror.start(timeout=30)
                break
            except BucketNotFoundError:
                if bucket not in OPTIONAL:  # without it the console has nothing to say yet
                    self._wait_for(bucket, f"waiting for {bucket} (its writer has not created it yet)")
                else:
                    self._wait_for(bucket, "")
            except Exception as e:  # JetStream may still be recovering after a server restart
                self._wait_for(bucket, f"cannot watch {bucket} yet ({type(e).__name__})")
            if mirror is not None:
                await mirror.stop()
            await asyncio.sleep(1.0)
        self.mirrors[bucket] = mirror
        self._wait_for(bucket, "")
        if self.sink is not None:
            self.sink.bucket_loaded(name, mirror.items)

    def _listener(self, bucket: str, name: str, mirror: KvMirror) -> Callable[[str, object | None, object | None], None]:
        def changed(key: str, _old: object | None, new: object | None) -> None:
            self._changed(bucket, name, mirror, key, new)

        return changed

    def _changed(self, bucket: str, name: str, mirror: KvMirror, key: str, new: object | None) -> None:
        # Changes of a copy still reading its bucket are in what bucket_loaded hands over.
        if self.sink is None or self.mirrors.get(bucket) is not mirror:
            return
        self.sink.bucket_changed(name, key, new, _epoch(mirror.entry.created) if mirror.entry is not None else None)

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
        history: list[Event] = []
        if self.next_seq == 0 and not replaying and self.sink is not None:  # an empty stream: no history to wait for
            self.sink.events_arrived([], True, None)
        async for msg in sub.messages:
            seq = msg.metadata.sequence.stream
            if seq < self.next_seq:
                continue  # already shown before a reconnect
            self.next_seq = seq + 1
            try:
                ev = B.EVENTS.decode(msg.data)
            except WireError as e:
                log.warning("event %d: %s", seq, e)
                ev = None
            if replaying:
                if ev is not None:
                    history.append(ev)
                if seq >= last:  # history complete: show it in one go
                    if self.sink is not None:
                        self.sink.events_arrived(history, True, None)
                    history, replaying = [], False
            elif ev is not None and self.sink is not None:
                self.sink.events_arrived([ev], False, _epoch(msg.metadata.timestamp))

    async def _subscribe_events(self):
        """Follow the stream from the next unseen sequence (or the last ``history`` events at first)."""
        info = await self.session.jetstream.stream_info(S.EVENT_STREAM)
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
        self._sub = await self.session.jetstream.subscribe(
            S.ALL_EVENTS,
            stream=S.EVENT_STREAM,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start),
        )
        return self._sub, last, first_run and start <= last

    # -- operator actions ------------------------------------------------------

    async def admin(self, verb: str, node_id: str) -> NodeRecord:
        """cordon | uncordon | drain through the registry's API (the operator never writes a bucket)."""
        if not self.session.connected:
            raise BusError(f"not connected to NATS at {self.server}; try again once the connection is back")
        return await self.session.call(api.ADMIN[verb], NodeRequest(node_id=node_id), timeout=5)
