"""Staging: copying a deployment's weights from their source into the node's model cache.

A source is a directory: the deployment's ``weights_path`` (shared storage,
mounted at the same path on every node), or its ``weights_model`` under the
agent's ``cache.mirror``. ``Stager.ensure`` answers where an engine finds the
weights, and whether they were already here:

* ``hit``: the cache holds the source, unchanged since it was copied (its
  files' names, sizes and mtimes), or the source cannot be read now but a copy
  is here (shared storage down is exactly when a cached copy matters);
* ``staged``: copied now — the copy reads each byte once, hashing as it goes
  (the entry's digest), into ``staging/`` and is renamed into place whole;
* ``uncached``: no cache, or the model does not fit the budget even with every
  evictable entry gone, or an older copy of it is in use: the engine reads
  the source itself.

One copy per source at a time: a second launch (or a pre-stage) of a source
being copied waits for that copy. Progress (bytes copied of the total) is
reported through ``on_progress`` at most every ``progress_interval``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.shared.errors import LlmgwError
from llmgw.shared.schemas import weights_source
from llmgw.shared.specs import check_weights

from .modelcache import Digest, ModelCache, SourceFile, evictions, stamp_of

log = logging.getLogger("llmgw.agent.staging")

CHUNK = 1 << 20


class WeightsUnavailable(LlmgwError):
    """The weights source cannot be read on this node and no copy is cached."""

    code = "weights_unavailable"


@dataclass(frozen=True)
class Source:
    key: str  # schemas.weights_source: what cache entries and placement name it by
    dir: str  # where its files are on this node


@dataclass(frozen=True)
class Outcome:
    """Where the engine reads its weights, and how they got there."""

    dir: str
    how: str  # "hit" | "staged" | "uncached"
    why: str = ""  # for "uncached": why not from the cache

    @property
    def cached(self) -> bool:
        """The weights were already on this node before this launch asked."""
        return self.how == "hit"


def resolve(weights_path: str, weights_model: str, mirror: str) -> Source:
    """The source a launch names, as a directory on this node."""
    try:
        check_weights(weights_path, weights_model)
    except LlmgwError as e:
        raise WeightsUnavailable(str(e)) from None
    key = weights_source(weights_path, weights_model)
    if weights_path:
        return Source(key, weights_path)
    if not mirror:
        raise WeightsUnavailable(
            f"the deployment names model {weights_model!r}, but this agent has no cache.mirror to find it under; set cache.mirror in its configuration"
        )
    return Source(key, os.path.join(mirror, weights_model))


def scan(src: str) -> list[SourceFile]:
    """The source's regular files (symlinked files followed, as hub snapshots use
    them; symlinked directories not, so a loop cannot trap the walk), sorted."""
    if not os.path.isdir(src):
        what = "does not exist" if not os.path.exists(src) else "is not a directory"
        raise WeightsUnavailable(f"weights source {src} {what} on this node")
    files = []
    try:
        for dirpath, dirnames, filenames in os.walk(src, onerror=_raise):
            dirnames.sort()
            for name in filenames:
                full = os.path.join(dirpath, name)
                st = os.stat(full)
                if os.path.isfile(full):
                    files.append(SourceFile(os.path.relpath(full, src), st.st_size, st.st_mtime_ns))
    except OSError as e:
        raise WeightsUnavailable(f"weights source {src} cannot be read: {e.strerror or e} ({e.filename or src})") from None
    if not files:
        raise WeightsUnavailable(f"weights source {src} holds no files")
    return sorted(files, key=lambda f: f.rel)


def _raise(e: OSError) -> None:
    raise e


class Cancelled(Exception):
    pass


def copy_tree(
    src: str, files: list[SourceFile], dst: str, progress: Callable[[int], None], cancel: threading.Event, rate: int | None = None
) -> tuple[str, int]:
    """Copy ``files`` from ``src`` into ``dst``: (digest, bytes copied), at most
    ``rate`` bytes a second when given. Blocking: run in a thread."""
    digest = Digest()
    done = 0
    started = time.monotonic()
    for f in files:
        target = os.path.join(dst, f.rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        digest.file(f.rel, f.size)
        size = 0
        with open(os.path.join(src, f.rel), "rb") as inp, open(target, "wb") as out:
            while chunk := inp.read(CHUNK):
                if cancel.is_set():
                    raise Cancelled()
                out.write(chunk)
                digest.data(chunk)
                size += len(chunk)
                done += len(chunk)
                progress(done)
                if rate and (ahead := done / rate - (time.monotonic() - started)) > 0:
                    cancel.wait(ahead)
        if size != f.size:  # the digest promised f.size bytes: the copy would not be what it names
            raise OSError(f"{f.rel} changed while it was copied ({f.size} bytes when listed, {size} read)")
    return digest.hexdigest(), done


@dataclass
class _Job:
    task: asyncio.Task
    total: int
    done: int = 0
    reported_at: float = 0.0


class Stager:
    """The cache's one user on the agent's loop: what is cached, what is being copied."""

    def __init__(
        self,
        cache: ModelCache | None,
        *,
        mirror: str,
        in_use: Callable[[], set[str]],
        on_change: Callable[[], None],
        progress_interval: float = 1.0,
        copy_rate: int | None = None,
    ):
        self.cache = cache
        self.mirror = mirror
        self.in_use = in_use  # sources running engines read (never evicted)
        self.on_change = on_change  # the cache's report changed: publish it
        self.progress_interval = progress_interval
        self.copy_rate = copy_rate
        self.jobs: dict[str, _Job] = {}
        self._cancel = threading.Event()
        self.evicted = 0
        self.staged = 0

    def report(self):
        if self.cache is None:
            return None
        return self.cache.report(self.in_use(), {s: (j.done, j.total) for s, j in self.jobs.items()})

    def progress(self, source: str) -> tuple[int, int] | None:
        j = self.jobs.get(source)
        return (j.done, j.total) if j is not None else None

    async def ensure(self, source: Source) -> Outcome:
        """The weights of ``source`` on this node: from the cache, copied into it now, or the source itself."""
        if self.cache is None:
            await asyncio.to_thread(scan, source.dir)  # refuse a source that is not there
            return Outcome(source.dir, "uncached", "this agent keeps no model cache")
        job = self.jobs.get(source.key)
        if job is not None:
            return await asyncio.shield(job.task)
        cache = self.cache
        try:
            files = await asyncio.to_thread(scan, source.dir)
        except WeightsUnavailable as e:
            if cache.holds(source.key, None):
                log.warning("%s; using the copy cached here", e)
                cache.touch(source.key)
                return Outcome(cache.path(source.key), "hit")
            raise
        stamp = stamp_of(files)
        if cache.holds(source.key, stamp):
            cache.touch(source.key)
            self.on_change()
            return Outcome(cache.path(source.key), "hit")
        busy = self.in_use()
        stale = source.key in cache.entries
        if stale and source.key in busy:
            return Outcome(source.dir, "uncached", "the copy cached here is older than the source and an engine still runs from it")
        total = sum(f.size for f in files)
        others = {k: e for k, e in cache.entries.items() if k != source.key}
        reserved = sum(j.total for j in self.jobs.values())
        victims = evictions(others, total, cache.budget, busy, reserved)
        if victims is None:
            why = f"the model ({total} bytes) does not fit the cache budget ({cache.budget} bytes) beside what is in use or being copied"
            log.warning("%s: %s; the engine reads the source", source.key, why)
            return Outcome(source.dir, "uncached", why)
        if stale:
            cache.remove(source.key)
        for victim in victims:
            log.info(
                "evicting %s (%d bytes, last used %s) to make room for %s",
                victim,
                cache.entries[victim].size,
                time.ctime(cache.entries[victim].last_use),
                source.key,
            )
            cache.remove(victim)
            self.evicted += 1
        task = asyncio.create_task(self._stage(source, files, stamp, total), name=f"stage-{source.key}")
        self.jobs[source.key] = _Job(task, total)
        self.on_change()
        return await asyncio.shield(task)

    async def _stage(self, source: Source, files: list[SourceFile], stamp: str, total: int) -> Outcome:
        cache = self.cache
        assert cache is not None
        loop = asyncio.get_running_loop()
        job_started = time.monotonic()

        def moved(done: int) -> None:  # on the copying thread
            loop.call_soon_threadsafe(self._moved, source.key, done)

        staged = cache.staging_dir(source.key)
        log.info("staging %s from %s (%d bytes in %d files)", source.key, source.dir, total, len(files))
        try:
            digest, size = await asyncio.to_thread(copy_tree, source.dir, files, staged, moved, self._cancel, self.copy_rate)
            cache.commit(source.key, staged, digest=digest, size=size, stamp=stamp)
        except (OSError, Cancelled) as e:
            shutil.rmtree(staged, ignore_errors=True)
            if isinstance(e, Cancelled):
                raise asyncio.CancelledError() from None
            cache.problems[source.key] = f"copying from {source.dir} failed: {e.strerror or e}"
            raise WeightsUnavailable(cache.problems[source.key]) from None
        finally:
            self.jobs.pop(source.key, None)
            self.on_change()
        self.staged += 1
        log.info("staged %s: %d bytes, %s, in %.1fs", source.key, size, digest, time.monotonic() - job_started)
        return Outcome(cache.path(source.key), "staged")

    def _moved(self, source: str, done: int) -> None:
        job = self.jobs.get(source)
        if job is None:
            return
        job.done = done
        now = time.monotonic()
        if now - job.reported_at >= self.progress_interval:
            job.reported_at = now
            self.on_change()

    async def close(self) -> None:
        """Stop every copy in progress (its partial files are removed)."""
        self._cancel.set()
        tasks = [j.task for j in self.jobs.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
