"""Every node, one row each, grouped under its fabric: a virtual list over the folded cluster.

Only the rows on screen are ever built (``model.node_view``). Scrolling,
paging, jumping to a fabric and the filter move an index over the model's
sorted rows; none of them touches a widget per node, so they cost the same at
10 nodes and at 10,000.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable
from itertools import groupby
from operator import itemgetter
from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType

from llmgw.shared.states import NodeState

from .cluster import Changes, ClusterModel
from .model import STATE_ORDER, MarkBook, NodeView, node_view, ordered_counts
from .palette import GPU_CELL_STYLE, NODE_STATE_STYLE
from .virtual import VirtualList

# GPU cells come in groups of four, so "GPU 5" can be counted at a glance.
CELL_GROUP = 4
STATE_WIDTH = 8  # "cordoned", "draining"


def row_text(view: NodeView, name_width: int, width: int) -> Text:
    """The row as text; wider rows also show free GPUs, the address and any fabric problem."""
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(f"{view.node_id:<{name_width}} ")
    text.append(f"{view.state:<{STATE_WIDTH}}", style=NODE_STATE_STYLE.get(view.state, ""))
    text.append(f" {view.lease_age:>6} ")
    for i, cell in enumerate(view.cells):
        if i and i % CELL_GROUP == 0:
            text.append(" ")
        text.append(cell.mark, style=GPU_CELL_STYLE.get(cell.tone, ""))
    if view.admin:
        text.append(f"  {view.admin}", style=NODE_STATE_STYLE.get(view.admin, ""))
    if width - text.cell_len >= 24:
        text.append(f"  {view.gpus_free}/{len(view.cells)} free  {view.mgmt_addr}", style="dim")
    if view.problem:
        text.append(f"  ! {view.problem}", style="bold red")
    if view.admin_reason:  # last: the row's end is cut with an ellipsis when narrow
        text.append(f"  ({view.admin_reason})", style=NODE_STATE_STYLE.get(view.state, "") if view.state in (NodeState.CORDONED, NodeState.DRAINING) else "dim")
    return text


def state_counts(counts) -> Text:
    """ "498 ready · 2 lost", each count in its state's colour, most urgent first."""
    text = Text()
    for i, (state, n) in enumerate(counts):
        if i:
            text.append(" · ", style="dim")
        text.append(f"{n:,} {state}", style=NODE_STATE_STYLE.get(state, ""))
    return text


class NodeList(VirtualList):
    """Rows (fabric, node) under a header line per fabric; the cursor rests on rows only."""

    FIXED_HEIGHT = True

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "open", "Detail", key_display="⏎", priority=True),
        Binding("left,[", "fabric(-1)", "Fabric", show=False, priority=True),
        Binding("right,]", "fabric(1)", "Fabric", show=False, priority=True),
    ]

    def __init__(
        self,
        model: ClusterModel,
        marks: MarkBook,
        clock,
        *,
        on_highlight: Callable[[str, str], None],
        on_open: Callable[[str], None],
        **kw,
    ) -> None:
        super().__init__(**kw)
        # Called at once, not by message: the key after this one (a cordon, an Esc) must
        # find the app already on the node the cursor rests on, or in its detail.
        self.on_highlight = on_highlight  # (node id, fabric): cordon, uncordon and drain act on it
        self.on_open = on_open  # node id: the operator asked for its detail
        self.model = model
        self.marks = marks
        self.clock = clock
        self.now = clock()
        self.pattern = ""
        self.matched = 0  # rows matching the filter
        self.lines: list[tuple[str, str]] = []  # (fabric, node id); node id "" for a fabric's header
        self.heads: list[int] = []  # the indices of the header lines
        self.matched_rows: list[tuple[bool, str, str]] = []
        self._versions = (-1, -1)  # the model's (order, facts) versions the lines were built from
        self._title = self._subtitle = ""
        self.name_width = 8
        self._drawn_width = 0

    def on_mount(self) -> None:
        self.border_title = "Nodes"

    # -- the lines --------------------------------------------------------------

    def rebuild(self, pattern: str, narrow: bool = False) -> None:
        """Lines from the model's rows (those matching ``pattern``); the cursor stays on its node.

        ``narrow``: ``pattern`` only narrows the last one (a letter typed on), so when
        no row came, went or changed its facts since, only the last matches are searched."""
        keep = self.current()
        versions = (self.model.versions["order"], self.model.versions["facts"])
        among = self.matched_rows if narrow and versions == self._versions else None
        self.pattern = pattern
        rows = self.model.matching_rows(pattern, among)
        self.matched_rows, self._versions = rows, versions
        lines: list[tuple[str, str]] = []
        heads: list[int] = []
        for fab, group in groupby(rows, key=itemgetter(1)):  # a header, then the fabric's rows
            heads.append(len(lines))
            lines.append((fab, ""))
            lines.extend([(fab, node) for _, _, node in group])
        self.lines, self.heads = lines, heads
        self.matched = len(rows)
        self.name_width = max(8, self.model.name_width)
        where = self._find(keep) if keep is not None else None
        if where is not None:
            self.cursor = where
        elif pattern:
            self.cursor = 1  # the first match
        self.set_count(len(lines))
        self.reveal(self.cursor)
        self._titles()
        if self.current() != keep:
            self.cursor_moved()

    def _find(self, line: tuple[str, str]) -> int | None:
        """Where a (fabric, node) line is: a bisect over the header positions, then in its fabric."""
        fabric = line[0]
        for h in self.heads:  # a few tens of fabrics
            if self.lines[h][0] == fabric:
                end = next((e for e in self.heads if e > h), len(self.lines))
                i = bisect.bisect_left(self.lines, line, h + 1, end)
                return i if i < end and self.lines[i] == line else None
        return None

    def update(self, changes: Changes, now: float) -> None:
        """A frame: redraw the rows on screen whose node changed (and the headers, when counts did)."""
        self.now = now
        top = self.top
        for y, (_, node) in enumerate(self.lines[top : top + self.height]):
            if (node and node in changes.nodes) or (not node and changes.totals):
                self.refresh_line(top + y)
        if changes.totals:
            self._titles()

    def tick(self, now: float) -> None:
        self.now = now
        self.refresh()

    def selectable(self, index: int) -> bool:
        return bool(self.lines[index][1]) if index < len(self.lines) else False

    def current(self) -> tuple[str, str] | None:
        if self.cursor < len(self.lines) and self.lines[self.cursor][1]:
            return self.lines[self.cursor]
        return None

    @property
    def node_id(self) -> str:
        cur = self.current()
        return cur[1] if cur else ""

    @property
    def fabric(self) -> str:
        cur = self.current()
        return cur[0] if cur else ""

    def line_key(self, index: int) -> Hashable | None:
        fabric, node = self.lines[index]
        if not node:
            return None  # a header: a few, and its counts change with any row
        # the marks book only grows: its size says whether a GPU's mark may read differently
        # (a row repainted between a replica's arrival and the frame that gives it a mark)
        return (fabric, node, self.model.row_versions.get(node, 0), len(self.marks.marks), self.now, self.name_width)

    def line_text(self, index: int, width: int) -> Text:
        fabric, node = self.lines[index]
        if not node:
            return self._header(fabric)
        if node not in self.model.facts:
            return Text(node, style="dim")
        return row_text(node_view(self.model, fabric, node, self.now, self.marks), self.name_width, width)

    def _header(self, fabric: str) -> Text:
        t = self.model.totals.get(fabric)
        text = Text(f"── {fabric}", style="bold")
        if t is None:
            return text
        text.append(f" · {t.node_count:,} node{'s' if t.node_count != 1 else ''}: ", style="dim")
        text.append_text(state_counts(ordered_counts(t.nodes, STATE_ORDER)))
        text.append(f" · {t.gpus_free:,}/{t.gpus_total:,} GPUs free", style="dim")
        return text

    def _titles(self) -> None:
        # Set only when they change: a border's title repaints the whole list, and the
        # cursor's moves would repaint it all for nothing. (So no "row 3 of 10,000".)
        if self.pattern:
            title = f'Nodes matching "{self.pattern}" · {self.matched:,} of {len(self.model.facts):,}'
        else:
            title = f"Nodes · {self.fabric}" if self.fabric else "Nodes"
        subtitle = "no node matches" if self.pattern and not self.matched else ""
        if title != self._title:
            self._title = self.border_title = title
        if subtitle != self._subtitle:
            self._subtitle = self.border_subtitle = subtitle

    # -- keys --------------------------------------------------------------------

    def cursor_moved(self) -> None:
        cur = self.current()
        self._titles()
        if cur is not None:
            self.on_highlight(cur[1], cur[0])

    def action_open(self) -> None:
        self.opened()

    def opened(self) -> None:
        if self.node_id:
            self.on_open(self.node_id)

    def action_fabric(self, delta: int) -> None:
        """The first row of the previous or next fabric."""
        if not self.heads:
            return
        k = max(0, bisect.bisect_right(self.heads, self.cursor) - 1) + delta
        if 0 <= k < len(self.heads):
            self.show_fabric(self.lines[self.heads[k]][0])

    def show_fabric(self, fabric: str) -> None:
        """Put the cursor on ``fabric``'s first row, its header at the top of the list."""
        head = next((i for i in self.heads if self.lines[i][0] == fabric), None)
        if head is None:
            return
        self.scroll_to(y=head, animate=False, force=True)
        self.move_to(head + 1)

    def select(self, node_id: str) -> bool:
        """Put the cursor on ``node_id``'s (first) row; False when it is not listed."""
        for i, (_, node) in enumerate(self.lines):
            if node == node_id:
                self.move_to(i)
                return True
        return False
