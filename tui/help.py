"""Keys, what the colours and cells mean, and where the console is connected."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from .model import Tone
from .palette import GPU_CELL_STYLE, NODE_STATE_STYLE

KEYS = (
    ("↑ ↓  j k", "move between nodes (or fabrics, replicas, events: the panel in focus)"),
    ("PgUp PgDn  Home End", "a page, the first, the last"),
    ("← →  [ ]", "the previous / next fabric's nodes"),
    ("⏎ / double click", "node detail: inventory, replicas, recent events"),
    ("c", "cordon the selected node: it takes no new replicas"),
    ("u", "uncordon: it takes replicas again"),
    ("d", "drain: its replicas move off, then it takes none"),
    ("/", "filter nodes, replicas and events (Esc clears); a node's name jumps to it"),
    ("e", 'every event of each summarised herd ("9,840 nodes joined in 1m00s"), and back'),
    ("tab", "next panel"),
    ("?", "this help"),
    ("q", "quit"),
)


def help_table(connection: str) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold cyan", no_wrap=True)
    t.add_column()
    for key, what in KEYS:
        t.add_row(key, what)
    t.add_row("", "")
    t.add_row("node states", Text(" ").join(Text(s, style=st) for s, st in NODE_STATE_STYLE.items()))
    cells = Text()
    for tone, label in (
        (Tone.READY, "A ready"), (Tone.STANDBY, "S standby spare"), (Tone.DEGRADED, "D degraded"), (Tone.STARTING, "B starting"), (Tone.FAILING, "C failed/reaping"), (Tone.FREE, "· free"),
        (Tone.BROKEN, "✗ GPU unhealthy"), (Tone.FOREIGN, "f GPU busy, not llmgw's"),
    ):  # fmt: skip
        cells.append(label[0], style=GPU_CELL_STYLE[tone])
        cells.append(label[1:] + "  ")
    t.add_row("GPU cells", cells)
    t.add_row("", "one cell per GPU; the letter is the replica's mark in the replicas table")
    t.add_row("", "")
    t.add_row("connection", connection)
    return t


class Help(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,question_mark,q", "close", "Close", priority=True)]

    def __init__(self, connection: str = "") -> None:
        super().__init__()
        self.connection = connection

    def show(self, connection: str) -> Help:
        """The same screen again, with where the console is connected now."""
        self.connection = connection
        if self.is_mounted:
            self.query_one("#help-table", Static).update(help_table(connection))
        return self

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(help_table(self.connection), id="help-table")

    def on_mount(self) -> None:
        self.query_one("#help").border_title = "llmgw console — help"

    def action_close(self) -> None:
        self.dismiss(None)
