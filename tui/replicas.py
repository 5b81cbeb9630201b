"""The replicas table: failed replicas in red, degraded ones marked ⚠ in orange,
replacements on their way marked ↻, deployments backing off marked ⏸."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import DataTable

from .model import ReplicaView
from .palette import GPU_CELL_STYLE, REPLICA_TONE_STYLE

COLUMNS = ("", "REPLICA", "DEPLOYMENT", "FABRIC", "MEMBERS", "STATE", "AGE", "REASON")


def state_text(view: ReplicaView) -> Text:
    style = REPLICA_TONE_STYLE.get(view.tone, "")
    if view.tone == "failing":
        return Text(f"✖ {view.state}", style=style)
    if view.tone == "degraded":
        return Text(f"⚠ {view.state}", style=style)
    if view.tone == "backoff":
        return Text(f"⏸ {view.state}", style=style)
    if view.rebuild:
        return Text(f"↻ {view.state}", style=style)
    return Text(view.state, style=style)


def summary(rows: tuple[ReplicaView, ...]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        key = "rebuilding" if r.rebuild else {"failing": "failed", "starting": "starting"}.get(r.tone, r.tone)
        counts[key] = counts.get(key, 0) + 1
    order = ("ready", "degraded", "rebuilding", "starting", "failed", "backoff", "gone")
    return " · ".join(f"{counts[k]} {k}" for k in order if counts.get(k))


class ReplicasTable(DataTable):
    replicas: reactive[tuple[ReplicaView, ...]] = reactive(tuple)

    def __init__(self, **kw) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, show_cursor=False, **kw)

    def on_mount(self) -> None:
        self.border_title = "Replicas"
        self._fill(self.replicas)

    def on_focus(self) -> None:
        self.show_cursor = True

    def on_blur(self) -> None:
        # A highlighted row when the table is not in use reads as "selected": it is not.
        self.show_cursor = False

    def watch_replicas(self, rows: tuple[ReplicaView, ...]) -> None:
        if self.is_mounted:
            self._fill(rows)

    def _fill(self, rows: tuple[ReplicaView, ...]) -> None:
        keep = None
        if self.row_count and 0 <= self.cursor_row < self.row_count:
            keep = self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        cells = []
        for r in rows:
            failing = r.tone == "failing"
            plain = "bold red" if failing else ""
            warn = r.tone in ("degraded", "backoff")
            cells.append(
                (
                    Text(f" {r.mark} ", style=GPU_CELL_STYLE.get(r.tone, "")),
                    Text(r.id, style="bold red" if failing else ("bold yellow" if r.rebuild else "bold")),
                    Text(r.deployment, style=plain),
                    Text(r.fabric, style=plain),
                    Text(r.members, style=plain),
                    state_text(r),
                    Text(r.age, style=plain, justify="right"),
                    Text(r.reason, style="red" if failing else ("yellow" if warn else "dim")),
                )
            )
        # Columns too, so their widths fit what is shown now, not the widest state ever
        # seen. Widths are given, not left to the table's lazy sizing: the same rows then
        # always draw the same way, at once.
        widths = [max([len(label), *(c[i].cell_len for c in cells)]) for i, label in enumerate(COLUMNS)]
        self.clear(columns=True)
        for label, width in zip(COLUMNS, widths, strict=True):
            self.add_column(label, width=width)
        for r, row in zip(rows, cells, strict=True):
            self.add_row(*row, key=r.id)
        self.border_subtitle = summary(rows) or "no replicas"
        if keep is not None and keep in {r.id for r in rows}:
            self.move_cursor(row=self.get_row_index(keep), animate=False)
