"""The node's model cache: weights copied onto local disk, within a disk budget.

Layout under ``cache.dir``::

    index.json            what is cached: source, digest, size, last use (rewritten whole, atomically)
    entries/<name>/       one model's files, as copied from its source
    staging/<name>.<rnd>/ a copy in progress; renamed into entries/ when complete

An entry is the weights of one *source* (``schemas.weights_source``:
``path:/srv/models/x`` or ``model:org/name``). Its digest is a sha256 over
every file's relative path, size and bytes, computed while copying (the copy
reads each byte once). A source whose files changed since they were copied
(another size or mtime: its ``stamp``) is staged again.

Room is made least recently used first (``evictions``, the pure core), and
never from an entry a running engine reads (``in_use``: the caller says which,
from the engines it supervises) nor from a copy in progress (``reserved``).
When the budget cannot hold a model even after evicting everything evictable,
the model is not cached (the caller points the engine at the source).

Everything here is synchronous file work on one thread at a time: the agent
calls it from its event loop for the small steps and from a worker thread for
the copy (``staging.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

from llmgw.shared.files import write_atomic
from llmgw.shared.schemas import CacheEntry, ModelCacheReport

INDEX = "index.json"
ENTRIES = "entries"
STAGING = "staging"


@dataclass
class Entry:
    """One cached model (``index.json``'s rows)."""

    source: str
    name: str  # its directory under entries/
    digest: str
    size: int
    stamp: str  # the source's file list (paths, sizes, mtimes) when copied
    last_use: float
    staged_at: float


def entry_name(source: str) -> str:
    """A directory name for a source: stable, file-system safe, unique enough."""
    return hashlib.sha256(source.encode()).hexdigest()[:24]


def evictions(entries: Mapping[str, Entry], need: int, budget: int, in_use: Iterable[str] = (), reserved: int = 0) -> list[str] | None:
    """The sources to evict so that ``need`` more bytes fit in ``budget``, least
    recently used first (ties by source), never one ``in_use``; [] when it fits
    already; None when it cannot fit even with every evictable entry gone.

    ``reserved``: bytes promised to copies in progress (not in ``entries`` yet).
    """
    held = sum(e.size for e in entries.values())
    free = budget - held - reserved
    if need <= free:
        return []
    busy = set(in_use)
    out: list[str] = []
    for e in sorted((e for e in entries.values() if e.source not in busy), key=lambda e: (e.last_use, e.source)):
        out.append(e.source)
        free += e.size
        if need <= free:
            return out
    return None


class Digest:
    """A tree's content digest, fed file by file in sorted relative-path order."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def file(self, rel: str, size: int) -> None:
        self._h.update(f"{rel}\0{size}\0".encode())

    def data(self, chunk: bytes) -> None:
        self._h.update(chunk)

    def hexdigest(self) -> str:
        return f"sha256:{self._h.hexdigest()}"


@dataclass(frozen=True)
class SourceFile:
    rel: str
    size: int
    mtime_ns: int


def stamp_of(files: Iterable[SourceFile]) -> str:
    """What changes when the source's files change (names, sizes, mtimes), short."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.rel}\0{f.size}\0{f.mtime_ns}\n".encode())
    return h.hexdigest()[:32]


class ModelCache:
    """The cache directory and its index. Not thread-safe: one caller at a time."""

    def __init__(self, root: str, budget: int):
        self.root = root
        self.budget = budget
        self.entries: dict[str, Entry] = {}
        self.problems: dict[str, str] = {}  # source -> why its last staging failed
        self.dropped: list[str] = []  # what opening found broken and removed, in words

    # -- opening -----------------------------------------------------------------
    def open(self) -> None:
        """Read the index and make the disk agree with it: a copy left in staging/
        by an agent that died mid-copy is removed, as is an entry whose directory
        is gone or a directory no entry names; entries beyond the budget (it was
        lowered) are evicted, least recently used first."""
        for sub in (ENTRIES, STAGING):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        for name in os.listdir(os.path.join(self.root, STAGING)):
            shutil.rmtree(os.path.join(self.root, STAGING, name), ignore_errors=True)
            self.dropped.append(f"an unfinished copy ({name}) from before this agent started")
        try:
            with open(os.path.join(self.root, INDEX)) as f:
                rows = json.load(f)
            loaded = {r["source"]: Entry(**r) for r in rows}
        except FileNotFoundError:
            loaded = {}
        except (OSError, ValueError, TypeError, KeyError) as err:
            self.dropped.append(f"an unreadable index ({type(err).__name__}: {err}); the cache starts empty")
            loaded = {}
        on_disk = set(os.listdir(os.path.join(self.root, ENTRIES)))
        for source, e in loaded.items():
            if e.name in on_disk:
                self.entries[source] = e
            else:
                self.dropped.append(f"{source}: its directory is gone")
        named = {e.name for e in self.entries.values()}
        for name in on_disk - named:
            shutil.rmtree(os.path.join(self.root, ENTRIES, name), ignore_errors=True)
            self.dropped.append(f"directory {name}, which no entry names")
        for source in evictions(self.entries, 0, self.budget) or []:  # nothing runs yet: never None
            self.dropped.append(f"{source}: over the budget of {self.budget} bytes")
            self.remove(source, save=False)
        self.save()

    # -- reading -----------------------------------------------------------------
    def path(self, source: str) -> str:
        return os.path.join(self.root, ENTRIES, self.entries[source].name)

    def used(self) -> int:
        return sum(e.size for e in self.entries.values())

    def holds(self, source: str, stamp: str | None) -> bool:
        """Whether ``source`` is cached and, when its stamp is known now, unchanged since."""
        e = self.entries.get(source)
        return e is not None and (stamp is None or e.stamp == stamp)

    def report(self, in_use: Iterable[str], staging: Mapping[str, tuple[int, int]]) -> ModelCacheReport:
        """The inventory's view: entries by source, then copies in progress (source -> (copied, total))."""
        busy = set(in_use)
        rows = [
            CacheEntry(source=e.source, digest=e.digest, size=e.size, staged_bytes=e.size, complete=True, last_use=e.last_use, in_use=e.source in busy)
            for e in sorted(self.entries.values(), key=lambda e: e.source)
        ]
        rows += [
            CacheEntry(source=s, size=total, staged_bytes=done, complete=False, last_use=0.0, in_use=True, problem="")
            for s, (done, total) in sorted(staging.items())
            if s not in self.entries
        ]
        rows += [CacheEntry(source=s, problem=p) for s, p in sorted(self.problems.items()) if s not in self.entries and s not in staging]
        return ModelCacheReport(budget=self.budget, used=self.used(), entries=rows)

    # -- changing ----------------------------------------------------------------
    def touch(self, source: str, at: float | None = None) -> None:
        e = self.entries.get(source)
        if e is not None:
            e.last_use = time.time() if at is None else at
            self.save()

    def staging_dir(self, source: str) -> str:
        d = os.path.join(self.root, STAGING, f"{entry_name(source)}.{os.urandom(4).hex()}")
        os.makedirs(d)
        return d

    def commit(self, source: str, staged: str, *, digest: str, size: int, stamp: str) -> Entry:
        """Make the finished copy in ``staged`` the entry for ``source`` (replacing an older one)."""
        if source in self.entries:
            self.remove(source, save=False)
        name = entry_name(source)
        final = os.path.join(self.root, ENTRIES, name)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(staged, final)
        now = time.time()
        e = self.entries[source] = Entry(source=source, name=name, digest=digest, size=size, stamp=stamp, last_use=now, staged_at=now)
        self.problems.pop(source, None)
        self.save()
        return e

    def remove(self, source: str, *, save: bool = True) -> None:
        e = self.entries.pop(source)
        # Renamed first: the entry is gone at once even if deleting its files takes a while.
        doomed = os.path.join(self.root, STAGING, f"{e.name}.evicted.{os.urandom(4).hex()}")
        try:
            os.rename(os.path.join(self.root, ENTRIES, e.name), doomed)
        except FileNotFoundError:
            return
        finally:
            if save:
                self.save()
        shutil.rmtree(doomed, ignore_errors=True)

    def save(self) -> None:
        rows = [asdict(e) for e in sorted(self.entries.values(), key=lambda e: e.source)]
        write_atomic(os.path.join(self.root, INDEX), json.dumps(rows, indent=1).encode())
