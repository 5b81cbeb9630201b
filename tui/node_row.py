"""One node on one fabric: name, state word, lease age, and a cell per GPU."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget

from .model import NodeView
from .palette import GPU_CELL_STYLE, NODE_STATE_STYLE

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
        text.append(f"  ({view.admin_reason})", style=NODE_STATE_STYLE.get(view.state, "") if view.state in ("cordoned", "draining") else "dim")
    return text


class NodeRow(Widget, can_focus=True):
    """Focus (arrow keys or a click) highlights the node; Enter or a double click opens its detail."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("enter", "open", "Detail", key_display="⏎")]

    view: reactive[NodeView | None] = reactive(None)
    name_width: reactive[int] = reactive(8)
    selected: reactive[bool] = reactive(False)

    class Highlighted(Message):
        """The operator moved onto this node: cordon, uncordon and drain act on it."""

        def __init__(self, node_id: str) -> None:
            super().__init__()
            self.node_id = node_id

    class Opened(Message):
        """The operator asked for this node's detail."""

        def __init__(self, node_id: str) -> None:
            super().__init__()
            self.node_id = node_id

    def __init__(self, view: NodeView, *, name_width: int = 8, id: str | None = None) -> None:
        super().__init__(id=id)
        self.set_reactive(NodeRow.view, view)
        self.set_reactive(NodeRow.name_width, name_width)

    @property
    def node_id(self) -> str:
        return self.view.node_id if self.view else ""

    def render(self) -> Text:
        return row_text(self.view, self.name_width, self.size.width) if self.view else Text()

    def watch_selected(self, selected: bool) -> None:
        self.set_class(selected, "-selected")

    def on_focus(self) -> None:
        self.post_message(self.Highlighted(self.node_id))

    def on_click(self, event: events.Click) -> None:
        if event.chain >= 2:
            self.action_open()

    def action_open(self) -> None:
        self.post_message(self.Opened(self.node_id))
