"""A live, decoded copy of a KV bucket, kept current by a watch (no polling).

Used by the scheduler (nodes, leases, deployments, replicas), the gateway
(replicas) and the console. A value that fails to decode is logged and left
out — one bad record never stops a reader.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

from llmgw.shared.errors import WireError
from llmgw.shared.schemas import decode

T = TypeVar("T")
log = logging.getLogger("llmgw.kv")

Listener = Callable[[str, "T | None", "T | None"], None]


class KvMirror(Generic[T]):
    def __init__(self, kv, schema: type[T]):
        self.kv = kv
        self.schema = schema
        self.items: dict[str, T] = {}
        self.revisions: dict[str, int] = {}
        self.ready = asyncio.Event()
        self.changed = asyncio.Event()
        self.listeners: list[Listener] = []
        self._task: asyncio.Task | None = None
        self._watcher = None
        self._initial_seq = 0
        self._marker_seen = False

    async def start(self, timeout: float = 10.0) -> "KvMirror[T]":
        # nats-py's "initial values done" marker can come early when it races
        # its own consumer, and a scheduler acting on a partial copy of the
        # replicas would place duplicates. So "ready" means: every message the
        # bucket held when we started watching has been seen.
        info = await self.kv._js.stream_info(self.kv._stream)
        self._initial_seq = info.state.last_seq
        self._watcher = await self.kv.watchall()
        self._task = asyncio.create_task(self._run())
        try:
            await asyncio.wait_for(self.ready.wait(), timeout)
        except asyncio.TimeoutError:
            if not self._marker_seen:
                raise
            # The last message may be gone (a limit removed it): go on with what came.
            log.warning("%s: initial values did not reach sequence %d in %.0fs; continuing", self.kv._stream, self._initial_seq, timeout)
            self.ready.set()
        return self

    def _note_seen(self, revision: int) -> None:
        if revision >= self._initial_seq:
            self.ready.set()

    async def _run(self) -> None:
        async for entry in self._watcher:
            if entry is None:  # nats-py's marker: trusted only for an empty bucket
                self._marker_seen = True
                if self._initial_seq == 0:
                    self.ready.set()
                continue
            self._note_seen(entry.revision)
            old = self.items.get(entry.key)
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                self.items.pop(entry.key, None)
                self.revisions.pop(entry.key, None)
                new = None
            else:
                try:
                    new = decode(entry.value, self.schema)
                except WireError as e:
                    log.warning("%s: %s", entry.key, e)
                    continue
                self.items[entry.key] = new
                self.revisions[entry.key] = entry.revision
            for fn in self.listeners:
                try:
                    fn(entry.key, old, new)
                except Exception:
                    log.exception("listener failed for %s", entry.key)
            self.changed.set()

    async def stop(self) -> None:
        if self._watcher is not None:
            try:
                await self._watcher.stop()
            except Exception:
                pass
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


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
