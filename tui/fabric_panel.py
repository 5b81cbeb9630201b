"""One fabric's panel: its nodes, one row each, under the fabric's name."""

from __future__ import annotations

import re

from textual.containers import Vertical
from textual.reactive import reactive

from .model import FabricView
from .node_row import NodeRow


def dom_id(*parts: str) -> str:
    """A widget id from names that may hold any character (fabric names come from configuration)."""
    return "-".join(re.sub(r"[^A-Za-z0-9_-]", "_", p) for p in parts)


class FabricPanel(Vertical):
    view: reactive[FabricView | None] = reactive(None)

    def __init__(self, view: FabricView, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.set_reactive(FabricPanel.view, view)

    # The view is given at construction; None is only the reactive's class default.
    def compose(self):
        if self.view is not None:
            yield from self._rows(self.view)

    def on_mount(self) -> None:
        if self.view is not None:
            self._titles(self.view)

    def _rows(self, view: FabricView) -> list[NodeRow]:
        width = max([8, *(len(n.node_id) for n in view.nodes)])
        return [NodeRow(n, name_width=width, id=dom_id("node", view.name, n.node_id)) for n in view.nodes]

    def _titles(self, view: FabricView) -> None:
        self.border_title = view.name
        self.border_subtitle = view.summary

    def rows(self) -> list[NodeRow]:
        return list(self.query(NodeRow))

    async def watch_view(self, old: FabricView | None, new: FabricView | None) -> None:
        if new is None or not self.is_mounted:
            return
        self._titles(new)
        rows = self.rows()
        width = max([8, *(len(n.node_id) for n in new.nodes)])
        if [r.node_id for r in rows] == [n.node_id for n in new.nodes]:
            for row, view in zip(rows, new.nodes, strict=True):  # the same node ids, checked above
                row.view, row.name_width = view, width
            return
        # Nodes joined or left (or the filter changed): rows are rebuilt; the
        # fabrics view puts the focus back on the node that had it.
        focused = self.app.focused.node_id if isinstance(self.app.focused, NodeRow) and self.app.focused in rows else ""
        await self.recompose()
        for row in self.rows():
            if row.node_id == focused:
                row.focus()
