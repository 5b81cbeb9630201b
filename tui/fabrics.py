"""Every fabric's panel, plus one for nodes on no fabric; the arrow keys walk all their nodes."""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.reactive import reactive

from .fabric_panel import FabricPanel, dom_id
from .model import FabricView
from .node_row import NodeRow


class FabricsView(VerticalScroll, can_focus=False):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up,k", "move(-1)", "Up", show=False),
        Binding("down,j", "move(1)", "Down", show=False),
    ]

    panels: reactive[tuple[FabricView, ...]] = reactive(tuple)
    # The node cordon/uncordon/drain act on; marked even when focus is elsewhere.
    selected: reactive[str] = reactive("")

    def compose(self):
        yield from (FabricPanel(v, id=dom_id("fabric", v.name)) for v in self.panels)

    def rows(self) -> list[NodeRow]:
        return list(self.query(NodeRow))

    async def watch_panels(self, panels: tuple[FabricView, ...]) -> None:
        if not self.is_mounted:
            return
        existing = {p.view.name: p for p in self.query(FabricPanel) if p.view is not None}
        if list(existing) == [v.name for v in panels]:
            for view in panels:
                existing[view.name].view = view
        else:
            await self.recompose()
        self.call_after_refresh(self._settle)

    def watch_selected(self, node_id: str) -> None:
        for row in self.rows():
            row.selected = row.node_id == node_id

    def _settle(self) -> None:
        """After rows changed: keep the selection marked, and give the keys a node to act on."""
        rows = self.rows()
        for row in rows:
            row.selected = row.node_id == self.selected
        if rows and self.app.focused is None and self.screen is self.app.screen:
            target = next((r for r in rows if r.node_id == self.selected), rows[0])
            target.focus()

    def action_move(self, delta: int) -> None:
        rows = self.rows()
        if not rows:
            return
        focused = self.app.focused
        i = rows.index(focused) if focused in rows else -1
        target = rows[max(0, min(len(rows) - 1, i + delta))] if i >= 0 else rows[0]
        target.focus()
        target.scroll_visible()
