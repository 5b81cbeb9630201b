"""Rebuild stories: consecutive events composed into one line an operator reads at a glance.

    node02 lost → demo-g1 failed → reaped → demo-g3 placed on ib-b → ready (20.1 s)

Pure: events go in, in stream order; stories come out. Nothing here knows the
buckets, so the history replayed at start tells the same stories as live events.

A story opens when a replica fails. Its cause is a node declared lost shortly
before, when the failure names that node (the scheduler's reason is
"node node02 lost"); else the replica's own degradation, when it was degraded
(its leader stopped making progress) until it failed; otherwise the failure's
own reason. The first replica of
the same deployment created after the failure is its replacement. The story
ends when the replacement is ready, or stands by (a warm spare rebuilt); its
duration counts from the cause. A standby spare promoted in the failure's
cycle is a step of it ("demo-g3 promoted"). A replica restarting in place is
its own story, ended when that replica is up again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from llmgw.shared.schemas import Event
from llmgw.shared.states import EventKind, EventWhat, ReplicaState

# A lost node explains a failure only if the failure follows soon after.
CAUSE_WINDOW = 300.0
# A spare promoted this shortly before a failure of its deployment took that
# replica's place (it is promoted when the replica leaves ready, which may be a
# moment before the replica is failed).
PROMOTION_WINDOW = 60.0

_PLACED_ON_FABRIC = re.compile(r"^placed on ([^\s:]+):")
_PLACED_ON_NODE = re.compile(r"^placed (\S+)")


def _names(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def _deployment(ev: Event) -> str:
    return ev.data.get("deployment") or re.sub(r"-g\d+$", "", ev.subject)


def placed_where(detail: str) -> str:
    """'placed on ib-b: node03 (leader), node04' -> 'ib-b'; 'placed node05' -> 'node05'."""
    m = _PLACED_ON_FABRIC.match(detail) or _PLACED_ON_NODE.match(detail)
    return m.group(1).rstrip(",") if m else ""


@dataclass
class Rebuild:
    deployment: str
    failed: str  # the replica that failed
    started: float  # the cause's time
    steps: list[str] = field(default_factory=list)
    replacement: str = ""
    reaping_step: int | None = None  # index of "reaping", turned into "reaped" when the record goes
    ready_at: float | None = None

    @property
    def done(self) -> bool:
        return self.ready_at is not None

    @property
    def seconds(self) -> float | None:
        return None if self.ready_at is None else self.ready_at - self.started

    def text(self) -> str:
        return " → ".join(self.steps) + ("" if self.done else " …")


class StoryBook:
    def __init__(self, keep: int = 50) -> None:
        self.lost: dict[str, float] = {}  # node -> when it was declared lost
        self.degraded: dict[str, float] = {}  # replica -> when it became degraded
        self.promoted: dict[str, tuple[str, float]] = {}  # deployment -> (spare promoted with no story open, when)
        self.open: list[Rebuild] = []
        self.told: list[Rebuild] = []
        self.keep = keep

    @property
    def rebuilding(self) -> frozenset[str]:
        """Replicas that are the replacement of a failed one, still on their way."""
        return frozenset(s.replacement for s in self.open if s.replacement)

    def current(self) -> str:
        """The story still unfolding, newest first ('' when none)."""
        return self.open[-1].text() if self.open else ""

    def add(self, ev: Event) -> Rebuild | None:
        """Take the next event; returns a story it completed."""
        if ev.kind == EventKind.NODE:
            self._node(ev)
        elif ev.kind == EventKind.DEPLOYMENT and ev.what == EventWhat.DELETED:
            self.open = [s for s in self.open if s.deployment != ev.subject]
        elif ev.kind == EventKind.REPLICA:
            return self._replica(ev)
        return None

    def _node(self, ev: Event) -> None:
        if ev.what == EventWhat.LOST:
            self.lost[ev.subject] = ev.time
        elif ev.what in (EventWhat.READY, EventWhat.JOINED):
            self.lost.pop(ev.subject, None)

    def _replica(self, ev: Event) -> Rebuild | None:
        if ev.what == EventWhat.DEGRADED:
            self.degraded[ev.subject] = ev.time
            return None
        if ev.what in (EventWhat.READY, EventWhat.GONE) and ev.data.get("from") != "":
            self.degraded.pop(ev.subject, None)
        if ev.what == EventWhat.RESTARTING:
            steps = [f"{ev.subject} restarting in place"]
            self.open.append(Rebuild(deployment=_deployment(ev), failed=ev.subject, started=ev.time, steps=steps, replacement=ev.subject))
        elif ev.what == EventWhat.READY and ev.data.get("from") == ReplicaState.STANDBY:
            self._promoted(ev)
        elif ev.what == EventWhat.FAILED:
            self._failed(ev)
        elif ev.what == EventWhat.REAPING:
            self._reaping(ev)
        elif ev.what == EventWhat.GONE:
            for s in self.open:
                if s.failed == ev.subject and s.reaping_step is not None:
                    s.steps[s.reaping_step] = "reaped"
        elif ev.data.get("from", "x") == "" or ev.what == EventWhat.LAUNCHING:
            self._placed(ev)
        if ev.what in (EventWhat.READY, EventWhat.STANDBY):
            return self._ready(ev)
        return None

    def _promoted(self, ev: Event) -> None:
        dep = _deployment(ev)
        stories = [s for s in self.open if s.deployment == dep and s.replacement != ev.subject]
        if stories:
            stories[-1].steps.append(f"{ev.subject} promoted")
        else:
            self.promoted[dep] = (ev.subject, ev.time)

    def _reaping(self, ev: Event) -> None:
        for s in self.open:
            if s.failed == ev.subject and s.reaping_step is None:
                s.reaping_step = len(s.steps)
                s.steps.append("reaping")

    def _failed(self, ev: Event) -> None:
        for s in self.open:
            if s.replacement == ev.subject:  # the replacement failed too: the same story goes on
                s.steps.append(f"{ev.subject} failed")
                s.replacement = ""
                return
        cause, started = "", ev.time
        for node, at in sorted(self.lost.items(), key=lambda kv: -kv[1]):
            if 0 <= ev.time - at <= CAUSE_WINDOW and _names(ev.detail, node):
                cause, started = f"{node} lost", at
                break
        if not cause and ev.subject in self.degraded:
            cause, started = f"{ev.subject} degraded", self.degraded.pop(ev.subject)
        steps = [cause, f"{ev.subject} failed"] if cause else [f"{ev.subject} failed ({ev.detail})" if ev.detail else f"{ev.subject} failed"]
        spare, at = self.promoted.pop(_deployment(ev), ("", 0.0))
        if spare and 0 <= ev.time - at <= PROMOTION_WINDOW:
            steps.append(f"{spare} promoted")
        self.open.append(Rebuild(deployment=_deployment(ev), failed=ev.subject, started=started, steps=steps))

    def _placed(self, ev: Event) -> None:
        new = ev.data.get("from") == ""
        for s in self.open:
            if s.deployment != _deployment(ev) or ev.subject == s.failed:
                continue
            if s.replacement == ev.subject or (not s.replacement and new and ev.time >= s.started):
                s.replacement = ev.subject
                if ev.what == EventWhat.LAUNCHING:
                    where = placed_where(ev.detail)
                    s.steps.append(f"{ev.subject} placed on {where}" if where else f"{ev.subject} placed")
                elif ev.what == EventWhat.PENDING:
                    s.steps.append(f"{ev.subject} pending")
                return

    def _ready(self, ev: Event) -> Rebuild | None:
        for s in self.open:
            if s.replacement == ev.subject:
                s.ready_at = ev.time
                s.steps.append(f"{'standing by' if ev.what == EventWhat.STANDBY else 'ready'} ({s.seconds:.1f} s)")
                self.open.remove(s)
                self.told = [*self.told, s][-self.keep :]
                return s
        return None
