"""The replicas table: failed replicas in red, degraded ones marked ⚠ in orange,
replacements on their way marked ↻, deployments backing off marked ⏸.

A virtual list too: at 4,000 replicas only the rows on screen are built, and
the order (problems first) is recomputed only when a replica changed.
"""

from __future__ import annotations

from collections.abc import Hashable

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from .cluster import ClusterModel
from .model import MarkBook, ReplicaView, Tone, backoff_views, replica_order, replica_summary, replica_view
from .palette import GPU_CELL_STYLE, REPLICA_TONE_STYLE
from .virtual import GUTTER, VirtualList

COLUMNS = ("", "REPLICA", "DEPLOYMENT", "FABRIC", "MEMBERS", "STATE", "AGE", "REASON")
AGE_WIDTH = 6


def state_text(view: ReplicaView) -> Text:
    style = REPLICA_TONE_STYLE.get(view.tone, "")
    if view.tone == Tone.FAILING:
        return Text(f"✖ {view.state}", style=style)
    if view.tone == Tone.DEGRADED:
        return Text(f"⚠ {view.state}", style=style)
    if view.tone == Tone.BACKOFF:
        return Text(f"⏸ {view.state}", style=style)
    if view.rebuild:
        return Text(f"↻ {view.state}", style=style)
    return Text(view.state, style=style)


def replica_cells(r: ReplicaView) -> list[Text]:
    """The row's cells, in COLUMNS order."""
    failing = r.tone == Tone.FAILING
    plain = "bold red" if failing else ""
    warn = r.tone in (Tone.DEGRADED, Tone.BACKOFF)
    return [
        Text(f" {r.mark} ", style=GPU_CELL_STYLE.get(r.tone, "")),
        Text(r.id, style="bold red" if failing else ("bold yellow" if r.rebuild else "bold")),
        Text(r.deployment, style=plain),
        Text(r.fabric, style=plain),
        Text(r.members, style=plain),
        state_text(r),
        Text(r.age, style=plain, justify="right"),
        Text(r.reason, style="red" if failing else ("yellow" if warn else "dim")),
    ]


def join_cells(cells: list[Text], widths: list[int]) -> Text:
    line = Text(no_wrap=True, overflow="ellipsis")
    for i, (cell, width) in enumerate(zip(cells, widths, strict=True)):
        if i:
            line.append("  ")
        if i == len(cells) - 1:
            line.append_text(cell)
        else:
            c = cell.copy()
            pad = width - c.cell_len
            if pad > 0:
                c.pad_left(pad) if c.justify == "right" else c.pad_right(pad)
            else:
                c.truncate(width, overflow="ellipsis")
            line.append_text(c)
    return line


class ReplicaList(VirtualList):
    CURSOR_WHEN_BLURRED = False

    def __init__(self, model: ClusterModel, marks: MarkBook, **kw) -> None:
        super().__init__(**kw)
        self.model = model
        self.marks = marks
        self.now = 0.0
        self.ids: list[str] = []
        self.backoffs: tuple[ReplicaView, ...] = ()
        self.rebuilding: frozenset[str] = frozenset()
        self.widths = [len(c) for c in COLUMNS]
        self._version = -1  # the model's replicas version the rows were built from

    def rebuild(self, pattern: str, rebuilding: frozenset[str], now: float, narrow: bool = False) -> None:
        """The rows again (``narrow``: as NodeList.rebuild)."""
        keep = self.current_id()
        self.now, self.rebuilding = now, rebuilding
        version = self.model.versions["replicas"]
        self.ids = replica_order(self.model, pattern, self.ids if narrow and version == self._version else None)
        self._version = version
        self.backoffs = backoff_views(self.model, now, pattern)
        w, b = self.model.replica_widths, self.backoffs
        self.widths = [
            3,
            max([len(COLUMNS[1]), w["id"], *(len(v.id) for v in b)]),
            max([len(COLUMNS[2]), w["deployment"], *(len(v.deployment) for v in b)]),
            max(len(COLUMNS[3]), w["fabric"]),
            max(len(COLUMNS[4]), w["members"]),
            max([len(COLUMNS[5]), w["state"] + 2, *(len(v.state) + 2 for v in b)]),  # "↻ launching"
            AGE_WIDTH,
            len(COLUMNS[7]),
        ]
        self.set_count(len(self.backoffs) + len(self.ids))
        if keep is not None:
            where = [b.id for b in self.backoffs] + self.ids
            if keep in where:
                self.cursor = where.index(keep)
        self.refresh()

    def tick(self, now: float) -> None:
        self.now = now
        self.refresh()

    def current_id(self) -> str | None:
        if not self.count:
            return None
        if self.cursor < len(self.backoffs):
            return self.backoffs[self.cursor].id
        i = self.cursor - len(self.backoffs)
        return self.ids[i] if i < len(self.ids) else None

    def view(self, index: int) -> ReplicaView | None:
        """The row's view; None for a replica deleted since the rows were listed (the
        next frame lists them again; a repaint may come first)."""
        if index < len(self.backoffs):
            return self.backoffs[index]
        replica = self.model.replicas.get(self.ids[index - len(self.backoffs)])
        return replica_view(replica, self.now, self.marks, self.rebuilding) if replica is not None else None

    def line_key(self, index: int) -> Hashable | None:
        if index < len(self.backoffs):
            return None
        rid = self.ids[index - len(self.backoffs)]
        return (rid, self.model.replica_versions.get(rid, 0), self.marks.get(rid), rid in self.rebuilding, self.now, tuple(self.widths))

    def line_text(self, index: int, width: int) -> Text:
        view = self.view(index)
        if view is None:
            return Text(f"   {self.ids[index - len(self.backoffs)]} (gone)", style="dim")
        return join_cells(replica_cells(view), self.widths)

    def header(self) -> Text:
        return Text(GUTTER) + join_cells([Text(c, style="dim") for c in COLUMNS], self.widths)

    def rows(self) -> dict[str, list[str]]:
        """Every row's cells as plain text, by replica id (tests; the screen draws only what is visible)."""
        return {v.id: [c.plain for c in replica_cells(v)] for v in (self.view(i) for i in range(self.count)) if v is not None}


class ReplicasPanel(Vertical):
    """The table under its column header, in one border."""

    DEFAULT_CSS = """
    ReplicasPanel > #replica-header { height: 1; }
    ReplicasPanel > ReplicaList { height: auto; max-height: 100%; }
    """

    def __init__(self, model: ClusterModel, marks: MarkBook, **kw) -> None:
        super().__init__(**kw)
        self.list = ReplicaList(model, marks, id="replica-list")
        self.head = Static(id="replica-header")
        self.model = model

    def compose(self) -> ComposeResult:
        yield self.head
        yield self.list

    def on_mount(self) -> None:
        self.border_title = "Replicas"
        self.border_subtitle = "no replicas"

    def rebuild(self, pattern: str, rebuilding: frozenset[str], now: float, narrow: bool = False) -> None:
        self.list.rebuild(pattern, rebuilding, now, narrow)
        self.head.update(self.list.header(), layout=False)  # one line, always
        if pattern:
            total = len(self.model.replicas)
            self.border_subtitle = f"{self.list.count:,} of {total:,} match" if self.list.count else "no replica matches"
        else:
            self.border_subtitle = replica_summary(self.model, rebuilding, len(self.list.backoffs)) or "no replicas"
