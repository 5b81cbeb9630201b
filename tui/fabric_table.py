"""The fabrics first, as aggregates: nodes by state, GPUs free and used, replicas by state.

One line per fabric (and one for nodes on no fabric), kept by the folds in
``cluster.py`` as counts, so drawing it costs the number of fabrics. The line
of the fabric in focus — the node list's cursor is in it — is marked; moving
here moves the node list to that fabric.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from rich.text import Text

from .cluster import ClusterModel
from .model import FabricRow, fabric_row, replica_tone
from .node_list import state_counts
from .palette import REPLICA_TONE_STYLE
from .virtual import VirtualList


def fabric_cells(row: FabricRow) -> list[Text]:
    """name, nodes, nodes by state, GPUs, replicas by state."""
    gpus = Text(f"GPUs {row.gpus_free:,} free · {row.gpus_used:,} used of {row.gpus_total:,}")
    if row.gpus_out:
        gpus.append(f", {row.gpus_out:,} out of service", style="bold red")
    replicas = Text(f"{row.replicas:,} replica{'s' if row.replicas != 1 else ''}")
    if row.replica_states:
        replicas.append(": ")
        for i, (state, n) in enumerate(row.replica_states):
            if i:
                replicas.append(" · ", style="dim")
            replicas.append(f"{n:,} {state}", style=REPLICA_TONE_STYLE.get(replica_tone(state), ""))
    return [
        Text(row.name, style="bold"),
        Text(f"{row.nodes:,} node{'s' if row.nodes != 1 else ''}", justify="right"),
        state_counts(row.node_states),
        gpus,
        replicas,
    ]


def fabric_text(cells: list[Text], widths: list[int]) -> Text:
    """The cells in columns ``widths`` wide (the last one as long as it is)."""
    text = Text(no_wrap=True, overflow="ellipsis")
    for i, cell in enumerate(cells):
        if i:
            text.append("  │ " if i >= 3 else "  ", style="dim" if i >= 3 else "")
        if i < len(cells) - 1:
            cell = cell.copy()
            pad = widths[i] - cell.cell_len
            if pad > 0:
                cell.pad_left(pad) if cell.justify == "right" else cell.pad_right(pad)
        text.append_text(cell)
    return text


def totals_title(model: ClusterModel) -> str:
    """The whole cluster in one line: "Fabrics · 10,000 nodes (9,998 ready · 2 lost) · GPUs … · 4,000 replicas (4,000 ready)"."""
    a = fabric_row("all", model.all)
    nodes = " · ".join(f"{n:,} {s}" for s, n in a.node_states)
    replicas = " · ".join(f"{n:,} {s}" for s, n in a.replica_states)
    return (
        f"Fabrics · {a.nodes:,} nodes{f' ({nodes})' if nodes else ''} · GPUs {a.gpus_free:,} free · {a.gpus_used:,} used of {a.gpus_total:,}"
        f" · {a.replicas:,} replicas{f' ({replicas})' if replicas else ''}"
    )


class FabricTable(VirtualList):
    def __init__(self, model: ClusterModel, *, on_choose: Callable[[str], None], **kw) -> None:
        super().__init__(**kw)
        self.on_choose = on_choose  # the operator moved to this fabric: the node list shows it (at once, as NodeList's)
        self.model = model
        self.names: list[str] = []
        self.widths: list[int] = []
        self.focus_fabric = ""  # the node list's fabric
        self._quiet = False

    def on_mount(self) -> None:
        self.border_title = "Fabrics"

    def update(self) -> None:
        """The aggregates changed: redraw (and re-list when fabrics came or went)."""
        names = self.model.fabric_names()
        if names != self.names:
            self.names = names
            self.set_count(len(names))
            self.follow(self.focus_fabric)
        # Columns as wide as their widest cell now: twenty fabrics cost nothing to measure.
        cells = [fabric_cells(fabric_row(n, self.model.totals[n])) for n in names]
        self.widths = [max([0, *(c[i].cell_len for c in cells)]) for i in range(5)]
        self.refresh()
        self.border_title = totals_title(self.model)

    def follow(self, fabric: str) -> None:
        """The node list's cursor is in ``fabric``: mark it here without moving the list back."""
        if fabric == self.focus_fabric and self.names and self.names[self.cursor] == fabric:
            return  # a move within the same fabric: nothing here changes
        self.focus_fabric = fabric
        if fabric in self.names:
            self._quiet = True
            try:
                self.move_to(self.names.index(fabric))
            finally:
                self._quiet = False

    def line_key(self, index: int) -> Hashable | None:
        name = self.names[index]
        t = self.model.totals.get(name)
        return (fabric_row(name, t), tuple(self.widths)) if t is not None else None

    def line_text(self, index: int, width: int) -> Text:
        name = self.names[index]
        t = self.model.totals.get(name)
        if t is None:
            return Text(name, style="dim")
        return fabric_text(fabric_cells(fabric_row(name, t)), self.widths)

    def cursor_moved(self) -> None:
        if not self._quiet and self.cursor < len(self.names):
            self.on_choose(self.names[self.cursor])

    def opened(self) -> None:
        self.cursor_moved()
