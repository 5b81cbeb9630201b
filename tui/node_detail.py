"""One node in detail: inventory, the replicas on it and its recent events, kept live."""

from __future__ import annotations

from typing import ClassVar

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Header, Static

from llmgw.shared.states import AdminState

from .confirm import DETAIL, Confirm
from .lines import event_line
from .model import NodeDetailView, replica_tone
from .palette import NODE_STATE_STYLE, REPLICA_TONE_STYLE


def _table(title: str, *columns: str) -> Table:
    t = Table(title=title, title_justify="left", title_style="bold", box=None, padding=(0, 2, 0, 0), header_style="dim")
    for c in columns:
        t.add_column(c, no_wrap=True)
    return t


def detail_renderable(v: NodeDetailView) -> Group:
    if not v.known:
        head = Text(f"{v.node_id}: no record in the registry (it may have been removed)", style="bold red")
        return Group(head, Text(""), _events(v))
    head = Text()
    head.append(v.node_id, style="bold")
    head.append("  ")
    head.append(f" {v.state} ", style=NODE_STATE_STYLE.get(v.state, ""))
    head.append(f"  admin {v.admin}", style="bold" if v.admin != AdminState.ACTIVE else "")
    head.append(f" ({v.admin_reason})\n" if v.admin_reason else "\n", style="bold" if v.admin != AdminState.ACTIVE else "")
    head.append(f"lease   {v.lease}\nmgmt    {v.mgmt}\nfabrics {v.fabrics}")

    gpus = _table("GPUs", "#", "NAME", "MEMORY", "HELD BY")
    for g in v.gpus:
        held = g.replica or Text("free", style="dim")
        if g.problem:  # out of service: say which and why
            held = Text(f"{g.replica + ' · ' if g.replica else ''}{g.problem}", style="bold red")
        gpus.add_row(str(g.index), g.name, g.memory, held)
    hcas = _table("HCAs", "HCA", "PORTS (STATE RATE)", "USABLE")
    for h in v.hcas:
        usable = Text("yes", style="green") if h.usable else Text(f"no: {h.problem}" if h.problem else "no", style="bold red")
        hcas.add_row(h.name, h.ports, usable)
    reps = _table("Replicas on this node", "REPLICA", "STATE", "RANK", "ROLE", "GPUS", "ENGINE")
    for m in v.members:
        engine = Text(m.engine_state)
        if m.engine_detail:  # a stalled canary, a lost peer: what the agent saw
            engine.append(f": {m.engine_detail}", style="yellow")
        reps.add_row(m.replica, Text(m.state, style=REPLICA_TONE_STYLE.get(replica_tone(m.state), "")), str(m.rank), m.role, m.gpus, engine)
    parts: list[RenderableType] = [head, Text(""), gpus, Text(""), hcas if v.hcas else Text("HCAs: none reported", style="dim"), Text("")]
    parts.append(reps if v.members else Text("Replicas on this node: none", style="dim"))
    parts += [Text(""), _events(v)]
    return Group(*parts)


def _events(v: NodeDetailView):
    if not v.events:
        return Text("Recent events: none seen", style="dim")
    return Group(Text("Recent events", style="bold"), *(event_line(e) for e in v.events))


class NodeDetail(Screen[None]):
    """A full screen, not a modal: the app's cordon, uncordon and drain keys work here too."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "close", "Back", priority=True)]

    view: reactive[NodeDetailView | None] = reactive(None)

    def __init__(self, view: NodeDetailView | None = None) -> None:
        super().__init__()
        self.node_id = view.node_id if view else ""
        self.timeline_seen = -1  # the timeline's version this view was built from
        self.set_reactive(NodeDetail.view, view)

    def show(self, view: NodeDetailView, timeline_seen: int) -> NodeDetail:
        """Another node, on the same screen (installed once by the app: composing one per
        Enter cost a key hundreds of milliseconds on a busy machine)."""
        self.node_id, self.timeline_seen = view.node_id, timeline_seen
        self.view = view
        if self.is_mounted:
            self.query_one("#detail").border_title = f"node {self.node_id}"
            self.query_one("#detail", VerticalScroll).scroll_home(animate=False)
        return self

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll(id="detail"):
            yield Static(id="detail-body")
        yield Confirm(DETAIL)

    def on_mount(self) -> None:
        self.query_one("#detail").border_title = f"node {self.node_id}"
        self._draw()

    def watch_view(self) -> None:
        if self.is_mounted:
            self._draw()

    def _draw(self) -> None:
        if self.view is not None:
            self.query_one("#detail-body", Static).update(detail_renderable(self.view))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # Esc answers "no" to a question asked here before it closes the screen
        return not (action == "close" and self.query_one(Confirm).asking)

    def action_close(self) -> None:
        self.dismiss(None)
