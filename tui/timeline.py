"""The events panel's model: events in stream order, herds summarised, rebuilds told. Pure and bounded.

A bring-up of 10,000 nodes publishes 10,000 "joined" and 10,000 "ready"
events within a minute or two; shown one line each they bury everything else
and cost the console a line of drawing per event. So events of one kind and
verb (``node joined``) that come close together — each within ``HERD_GAP`` of
the previous — fold into one *herd* once there are ``HERD_MIN`` of them: one
line that counts as it grows ("9,840 nodes joined in 1m00s"), placed where the
herd began. Fewer stay single lines in stream order, so a small cluster's log
reads as before. The herd keeps its events: the panel shows every one of them
on one key (``e``), and a filter searches them one by one.

Rebuild stories (``story.py``) are told as lines of their own when they end.

Bounded: at most ``keep`` events are held (the oldest go first, from the front
of the oldest entry; a herd keeps its count); the stream keeps them all
(``llmgw ctl events``). Each node and replica also keeps its last
``PER_SUBJECT`` events, for the node detail without a walk of the whole log.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Container, Iterable
from dataclasses import dataclass, field

from llmgw.shared.readmodel import format_age
from llmgw.shared.schemas import Event
from llmgw.shared.states import EventKind

from .story import Rebuild, StoryBook

HERD_MIN = 10  # events of one kind and verb, close together, that make a herd
HERD_GAP = 5.0  # seconds: an event later than this after the last of its kind starts afresh
KEEP = 20_000  # events held in all
PER_SUBJECT = 50  # events kept per node and per replica, for the node detail
MAX_REPLICA_KEYS = 50_000  # replicas whose events are indexed (the oldest forgotten first)

_WORD = re.compile(r"[\w-]+")


class Seen:
    """One event as the timeline holds it, numbered in arrival (stream) order, with
    what a filter searches (kind, subject, verb and detail, lower case) made once."""

    __slots__ = ("event", "hay", "seq")

    def __init__(self, event: Event, seq: int) -> None:
        self.event = event
        self.seq = seq
        self.hay = f"{event.kind} {event.subject} {event.what} {event.detail}".lower()


@dataclass(eq=False)
class Single:
    seen: Seen


@dataclass(eq=False)
class Herd:
    serial: int  # unique in the timeline: the screen keeps its drawn line by it
    kind: str
    what: str
    first: float  # event time of the first and the last member
    last: float
    count: int = 0  # every member ever, kept or not
    members: deque[Seen] = field(default_factory=deque)

    def add(self, seen: Seen) -> None:
        self.members.append(seen)
        self.count += 1
        self.first = min(self.first, seen.event.time)
        self.last = max(self.last, seen.event.time)

    def text(self) -> str:
        """ "9,840 nodes joined in 1m00s (node00001 … node09840)" """
        noun = self.kind if self.count == 1 else f"{self.kind}s"
        span = format_age(self.last - self.first)
        first, last = self.members[0].event.subject if self.members else "", self.members[-1].event.subject if self.members else ""
        around = f" ({first} … {last})" if first and first != last else ""
        kept = f"; the oldest {self.count - len(self.members):,} no longer held" if len(self.members) < self.count else ""
        return f"{self.count:,} {noun} {self.what} in {span}{around}{kept}"


@dataclass(eq=False)
class Told:
    story: Rebuild
    serial: int = 0


Entry = Single | Herd | Told


@dataclass(eq=False)
class _Run:
    """The events of one kind and verb arriving close together: singles until a herd."""

    last: float
    singles: list[Single] = field(default_factory=list)
    herd: Herd | None = None


class Timeline:
    def __init__(self, *, keep: int = KEEP, herd_min: int = HERD_MIN, herd_gap: float = HERD_GAP, nodes: Container[str] = ()) -> None:
        self.keep = keep
        self.herd_min = herd_min
        self.herd_gap = herd_gap
        self.nodes = nodes  # known node ids: a detail naming one files the event under it
        self.entries: deque[Entry] = deque()
        self.held = 0  # events held (singles and herd members)
        self.told = 0  # stories told among the entries
        self.seq = 0
        self.version = 0  # bumped on every change the panel may show
        self.stories = StoryBook()
        self._runs: dict[tuple[str, str], _Run] = {}
        self.by_node: dict[str, deque[Seen]] = {}
        self.by_replica: dict[str, deque[Seen]] = {}

    # -- adding ---------------------------------------------------------------------

    def add(self, ev: Event) -> Rebuild | None:
        """Take the next event in stream order; returns the rebuild story it completed, if any."""
        self.seq += 1
        self.version += 1
        seen = Seen(ev, self.seq)
        self._index(seen)
        key = (ev.kind, ev.what)
        run = self._runs.get(key)
        if run is None or abs(ev.time - run.last) > self.herd_gap:
            run = self._runs[key] = _Run(last=ev.time)
        run.last = max(run.last, ev.time)
        if run.herd is not None:
            run.herd.add(seen)
        else:
            single = Single(seen)
            self.entries.append(single)
            run.singles.append(single)
            if len(run.singles) >= self.herd_min:
                self._gather(run)
        self.held += 1
        told = self.stories.add(ev)
        if told is not None:
            self.entries.append(Told(told, self.seq))
            self.told += 1
        self._trim()
        return told

    def extend(self, events: Iterable[Event]) -> list[Rebuild]:
        return [s for e in events if (s := self.add(e)) is not None]

    def _gather(self, run: _Run) -> None:
        """The run became a herd: its single lines become one, where the first was."""
        first = run.singles[0].seen
        herd = Herd(self.seq, first.event.kind, first.event.what, first.event.time, first.event.time)
        members = {id(s) for s in run.singles}
        for s in run.singles:
            herd.add(s.seen)
        kept: deque[Entry] = deque()
        placed = False
        for entry in self.entries:
            if id(entry) in members:
                if not placed:  # where the first still held was
                    kept.append(herd)
                    placed = True
                continue
            kept.append(entry)
        self.entries = kept
        run.herd, run.singles = herd, []

    def _trim(self) -> None:
        while self.held > self.keep and self.entries:
            head = self.entries[0]
            if isinstance(head, Herd):
                head.members.popleft()
                self.held -= 1
                if not head.members:
                    self.entries.popleft()
                continue
            self.entries.popleft()
            if isinstance(head, Single):
                self.held -= 1
            elif isinstance(head, Told):
                self.told -= 1

    def _index(self, seen: Seen) -> None:
        ev = seen.event
        if ev.kind == EventKind.NODE:
            self._file(self.by_node, ev.subject, seen)
            return
        if ev.kind == EventKind.REPLICA:
            self._file(self.by_replica, ev.subject, seen)
            if len(self.by_replica) > MAX_REPLICA_KEYS:
                del self.by_replica[next(iter(self.by_replica))]
        for word in set(_WORD.findall(ev.detail)):
            if word in self.nodes:
                self._file(self.by_node, word, seen)

    @staticmethod
    def _file(index: dict[str, deque[Seen]], key: str, seen: Seen) -> None:
        q = index.get(key)
        if q is None:
            q = index[key] = deque(maxlen=PER_SUBJECT)
        q.append(seen)

    # -- reading --------------------------------------------------------------------

    def node_events(self, node_id: str, replicas: Iterable[str] = ()) -> list[Event]:
        """The events touching a node, oldest first: its own, those naming it, and
        those of every replica that ever had a member on it (``replicas``)."""
        found: dict[int, Seen] = {s.seq: s for s in self.by_node.get(node_id, ())}
        for rid in replicas:
            for s in self.by_replica.get(rid, ()):
                found[s.seq] = s
        return [found[k].event for k in sorted(found)]

    def events(self) -> list[Event]:
        """Every event held, in stream order (herd members where their herd is)."""
        out: list[Event] = []
        for entry in self.entries:
            if isinstance(entry, Single):
                out.append(entry.seen.event)
            elif isinstance(entry, Herd):
                out.extend(s.event for s in entry.members)
        return out

    @property
    def rebuilding(self) -> frozenset[str]:
        return self.stories.rebuilding

    def current_story(self) -> str:
        return self.stories.current()


# --------------------------------------------------------------------------
# the panel's lines
# --------------------------------------------------------------------------


def event_lines(timeline: Timeline, pattern: str = "", expand: bool = False, among: list[tuple[str, object]] | None = None) -> list[tuple[str, object]]:
    """What the events panel lists, oldest first: ("event", Seen), ("herd", Herd),
    ("member", Seen) under an expanded herd, ("story", Told).

    A filter searches events one by one, herd members included, and the stories;
    ``among``: only those lines (the matches of a pattern this one narrows).
    """
    words = pattern.lower().split()
    if among is not None and words:
        if len(words) == 1:
            return [(k, item) for k, item in among if words[0] in _hay(item)]
        return [(k, item) for k, item in among if all(w in _hay(item) for w in words)]
    out: list[tuple[str, object]] = []
    one = words[0] if len(words) == 1 else None  # typed letter by letter: no generator per event
    for entry in timeline.entries:
        if isinstance(entry, Single):
            if all(w in entry.seen.hay for w in words):
                out.append(("event", entry.seen))
        elif isinstance(entry, Herd):
            if one is not None:
                out.extend([("event", s) for s in entry.members if one in s.hay])
            elif words:
                out.extend(("event", s) for s in entry.members if all(w in s.hay for w in words))
            else:
                out.append(("herd", entry))
                if expand:
                    out.extend(("member", s) for s in entry.members)
        elif not words or all(w in _hay(entry) for w in words):
            out.append(("story", entry))
    return out


def _hay(item: object) -> str:
    if type(item) is Seen:
        return item.hay
    if isinstance(item, Told):
        return item.story.text().lower()
    return ""
