"""A live, decoded copy of a KV bucket, kept current by a watch (no polling).

Used by the scheduler (nodes, leases, deployments, replicas), the gateway
(replicas), the registry (leases) and the console. A value that fails to
decode is logged and left out — one bad record never stops a reader.

The copy heals itself. nats-py's ordered consumer behind ``watchall`` is
ephemeral: when the nats-server restarts (or the server holding it dies) the
consumer is gone, and nats-py's own recovery — re-creating it once per two
missed heartbeats, and giving up on that attempt when the server is not back
yet — left copies frozen for good in practice (``bench/failover.py``'s
nats-restart: the scheduler kept failing a replica from its stale copy, 1,500
launches in 12 s). So the mirror watches its own watch:

* after the client reconnects (a local counter, free to read), and
* when the stream's last sequence stays ahead of what the watch delivered
  for two checks in a row (one stream-info request per ``check_interval``),

it re-reads the bucket through a new watch and tells its listeners exactly
what changed meanwhile — updates, and deletions as ``new=None`` — so a reader
never acts on a copy older than the bucket.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

from llmgw.shared.buckets import Bucket
from llmgw.shared.errors import WireError
from llmgw.shared.tasks import cancel_and_wait

T = TypeVar("T")
log = logging.getLogger("llmgw.kv")

Listener = Callable[[str, "T | None", "T | None"], None]

# How often the mirror checks its watch; the stream check costs one request.
CHECK_INTERVAL = 2.0


class _Watch:
    """One watch of the bucket, and where it stands on the bucket's history."""

    def __init__(self, watcher, initial_seq: int, fresh: dict | None):
        self.watcher = watcher
        self.initial_seq = initial_seq  # the bucket's last sequence when it started
        self.marker_seen = False
        self.caught_up = asyncio.Event()
        # For a re-read: what the bucket holds, collected until the watch has
        # caught up (key -> (revision, value or None)); None once applied, and
        # for the first watch, whose entries go straight into the copy.
        self.fresh = fresh


class KvMirror(Generic[T]):
    """A copy of ``bucket`` (a row of ``shared/buckets.py``, which says what its
    values are) read through ``kv``, that bucket opened."""

    def __init__(self, kv, bucket: Bucket[T], *, check_interval: float = CHECK_INTERVAL):
        if getattr(kv, "_stream", bucket.stream) != bucket.stream:
            raise ValueError(f"a mirror of {bucket.name} over {kv._stream}")
        self.kv = kv
        self.bucket = bucket
        self.items: dict[str, T] = {}
        self.revisions: dict[str, int] = {}
        self.ready = asyncio.Event()
        self.changed = asyncio.Event()
        self.listeners: list[Listener] = []
        self.check_interval = check_interval
        self.resyncs = 0  # how many times the copy was re-read after its watch broke
        self._task: asyncio.Task | None = None
        self._guard: asyncio.Task | None = None
        self._watch: _Watch | None = None
        self._seen = 0  # the highest stream sequence any watch delivered
        self._stopped = False
        # While listeners run for a change as it happens (not for the initial
        # read, nor for a re-read's difference): its watch entry, whose
        # ``created`` is when the server stored it. The console says from it how
        # far behind the bus its screen is.
        self.entry = None

    # -- start and stop ------------------------------------------------------
    async def start(self, timeout: float = 10.0) -> KvMirror[T]:
        # nats-py's "initial values done" marker can come early when it races
        # its own consumer, and a scheduler acting on a partial copy of the
        # replicas would place duplicates. So "ready" means: every message the
        # bucket held when we started watching has been seen.
        watch = await self._open(fresh=None)
        self._task = asyncio.create_task(self._run(watch))
        await self._wait_caught_up(watch, timeout)
        self.ready.set()
        self._guard = asyncio.create_task(self._guard_loop())
        return self

    async def _open(self, fresh: dict | None) -> _Watch:
        info = await self.kv._js.stream_info(self.kv._stream)
        watch = _Watch(await self.kv.watchall(), info.state.last_seq, fresh)
        self._watch = watch
        return watch

    async def _wait_caught_up(self, watch: _Watch, timeout: float) -> None:
        try:
            await asyncio.wait_for(watch.caught_up.wait(), timeout)
        except TimeoutError:
            if not watch.marker_seen:
                raise
            # The last message may be gone (a limit removed it): go on with what came.
            log.warning("%s: initial values did not reach sequence %d in %.0fs; continuing", self.kv._stream, watch.initial_seq, timeout)
            watch.caught_up.set()
            self._settle(watch)

    async def stop(self) -> None:
        self._stopped = True
        await cancel_and_wait((self._guard, self._task))
        if self._watch is not None:
            await self._stop_watcher(self._watch)

    @staticmethod
    async def _stop_watcher(watch: _Watch) -> None:
        try:
            await asyncio.wait_for(watch.watcher.stop(), 2.0)
        except Exception:
            pass  # a watch whose server is gone has nothing left to stop

    # -- reading a watch -------------------------------------------------------
    async def _run(self, watch: _Watch) -> None:
        """Apply ``watch``'s entries: straight into the copy, or, for a re-read,
        into ``watch.fresh`` until the watch has caught up with the bucket — then
        the copy is replaced and listeners hear only the difference (a partial
        re-read must never look like deletions)."""
        async for entry in watch.watcher:
            if entry is None:  # nats-py's marker: trusted only for an empty bucket
                watch.marker_seen = True
                if watch.initial_seq == 0:
                    watch.caught_up.set()
                    self._settle(watch)
                continue
            self._seen = max(self._seen, entry.revision)
            value: T | None = None
            if entry.operation not in ("DEL", "PURGE") and entry.value:
                try:
                    value = self.bucket.decode(entry.value)
                except WireError as e:
                    log.warning("%s/%s skipped: %s", self.bucket.name, entry.key, e)
                    if watch.fresh is None:
                        continue
                    # keep what we had for it, as the first watch does
                    watch.fresh[entry.key] = (self.revisions.get(entry.key, 0), self.items.get(entry.key))
                    continue
            if watch.fresh is not None:
                watch.fresh[entry.key] = (entry.revision, value)
            else:
                self.entry = entry if watch.caught_up.is_set() else None
                try:
                    self._apply(entry.key, entry.revision, value)
                finally:
                    self.entry = None
            if entry.revision >= watch.initial_seq:
                watch.caught_up.set()
                self._settle(watch)

    def _settle(self, watch: _Watch) -> None:
        if watch.fresh is not None:
            fresh, watch.fresh = watch.fresh, None
            self._replace(fresh)

    def _apply(self, key: str, revision: int, new: T | None) -> None:
        old = self.items.get(key)
        if new is None:
            self.items.pop(key, None)
            self.revisions.pop(key, None)
        else:
            self.items[key] = new
            self.revisions[key] = revision
        self._tell(key, old, new)
        self.changed.set()

    def _replace(self, fresh: dict[str, tuple[int, T | None]]) -> None:
        """Make the copy what a re-read found, telling listeners only what differs."""
        for key in [k for k in self.items if fresh.get(k, (0, None))[1] is None]:
            self._apply(key, 0, None)
        for key, (revision, value) in fresh.items():
            if value is not None and self.revisions.get(key) != revision:
                self._apply(key, revision, value)

    def _tell(self, key: str, old: T | None, new: T | None) -> None:
        for fn in self.listeners:
            try:
                fn(key, old, new)
            except Exception:
                log.exception("listener failed for %s", key)

    # -- watching the watch ------------------------------------------------------
    def _reconnects(self) -> int:
        nc = getattr(self.kv._js, "_nc", None)
        return int(getattr(nc, "stats", {}).get("reconnects", 0)) if nc is not None else 0

    def _connected(self) -> bool:
        nc = getattr(self.kv._js, "_nc", None)
        return bool(getattr(nc, "is_connected", True))

    async def _guard_loop(self) -> None:
        reconnects = self._reconnects()
        behind_since: int | None = None  # the stream sequence we were behind at the last check
        while not self._stopped:
            await asyncio.sleep(self.check_interval)
            if not self._connected():
                continue
            why = ""
            now_reconnects = self._reconnects()
            if now_reconnects != reconnects:
                why = "the connection to the server was re-established"
            else:
                try:
                    info = await self.kv._js.stream_info(self.kv._stream)
                except Exception:
                    continue  # the server may be on its way back; the next check sees
                last = info.state.last_seq
                if last > self._seen:
                    if behind_since is not None and self._seen < behind_since:
                        why = f"the watch delivered up to sequence {self._seen} while the bucket is at {last}"
                    behind_since = last
                else:
                    behind_since = None
            if not why:
                continue
            try:
                await self._resync(why)
                reconnects = now_reconnects
                behind_since = None
            except Exception as e:
                log.warning("%s: re-reading the bucket failed (%s); trying again in %gs", self.kv._stream, e or type(e).__name__, self.check_interval)

    async def _resync(self, why: str) -> None:
        log.info("%s: re-reading the bucket: %s", self.kv._stream, why)
        old_task, old_watch = self._task, self._watch
        await cancel_and_wait((old_task,))
        if old_watch is not None:
            await self._stop_watcher(old_watch)
        watch = await self._open(fresh={})
        self._task = asyncio.create_task(self._run(watch))
        await self._wait_caught_up(watch, 10.0)
        self.resyncs += 1


async def open_mirror(
    js,
    bucket: Bucket[T],
    *,
    wait: float = 0.0,
    timeout: float = 10.0,
    listeners: tuple[Listener, ...] = (),
    logger=None,
    check_interval: float = CHECK_INTERVAL,
) -> KvMirror[T]:
    """A started copy of ``bucket``: opened (waiting up to ``wait`` seconds for its
    writer to create it; ``BucketNotFoundError`` after), every value it held read
    (``timeout``), and kept current. ``listeners`` hear every change, the first
    read included."""
    mirror = KvMirror(await open_bucket(js, bucket.name, wait=wait, logger=logger), bucket, check_interval=check_interval)
    mirror.listeners.extend(listeners)
    try:
        return await mirror.start(timeout=timeout)
    except BaseException:
        await mirror.stop()
        raise


async def open_bucket(js, bucket: str, *, wait: float = 0.0, log_every: float = 5.0, logger=None):
    """Open a bucket another service writes, waiting (with a log line now and then) until it exists."""
    from nats.js.errors import BucketNotFoundError

    lg = logger or log
    waited = 0.0
    while True:
        try:
            return await js.key_value(bucket)
        except BucketNotFoundError:
            if waited >= wait:
                raise
            if waited % log_every < 0.5:
                lg.info("waiting for bucket %s (its writer has not created it yet)", bucket)
            await asyncio.sleep(0.5)
            waited += 0.5
