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

    async def start(self, timeout: float = 10.0) -> "KvMirror[T]":
        self._watcher = await self.kv.watchall()
        self._task = asyncio.create_task(self._run())
        await asyncio.wait_for(self.ready.wait(), timeout)
        return self

    async def _run(self) -> None:
        async for entry in self._watcher:
            if entry is None:  # the initial values have all arrived
                self.ready.set()
                continue
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
