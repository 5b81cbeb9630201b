"""``llmgw tui``: the console an operator keeps open during an incident.

The app owns what the screen shows — the cluster state last mirrored, the
events seen, the stories told — and recomputes the views (``model.py``) when
the feed posts news or once a second for the ages. The feed (``feed.py``) runs
in a worker; nothing here waits on the bus except the cordon/uncordon/drain
request, which runs in a worker of its own so the screen never freezes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import ClassVar

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Container
from textual.reactive import reactive
from textual.widgets import Footer, Header

from llmgw.shared.config import ServiceConfig
from llmgw.shared.errors import LlmgwError
from llmgw.shared.schemas import Event

from .banner import ConnectionBanner
from .confirm import Confirm
from .events import EventLog
from .fabrics import FabricsView
from .feed import ConnectionStatus, Feed
from .filter_bar import FilterBar
from .help import Help
from .lines import event_line, story_line
from .model import ClusterState, MarkBook, fabric_views, node_detail, remember_members, replica_views
from .node_detail import NodeDetail
from .node_row import NodeRow
from .replicas import ReplicasTable
from .story import StoryBook

# What each admin verb asks and warns before it is sent.
ADMIN = {
    "cordon": ("Cordon {node}?", "It takes no new replicas; what runs there keeps running."),
    "uncordon": ("Uncordon {node}?", "It takes replicas again."),
    "drain": ("Drain {node}?", "Its replicas are moved off (rebuilt elsewhere), then it takes none."),
}

SUBTITLE = {"connecting": "connecting …", "unreachable": "NATS unreachable", "connected": "live", "down": "NATS connection lost"}


class LlmgwApp(App[None]):
    CSS_PATH = "llmgw.tcss"
    TITLE = "llmgw"
    ENABLE_COMMAND_PALETTE = False
    # Nothing is focused until the first nodes arrive; then the first node is (fabrics.py).
    AUTO_FOCUS = None
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]  # noqa: RUF012 - Textual declares it `ClassVar[...] | None`, which mypy reads as an instance variable a ClassVar may not override
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("c", "admin('cordon')", "Cordon"),
        Binding("u", "admin('uncordon')", "Uncordon"),
        Binding("d", "admin('drain')", "Drain"),
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
    ]

    state: reactive[ClusterState] = reactive(ClusterState, always_update=True)
    pattern: reactive[str] = reactive("")
    selected_node: reactive[str] = reactive("")

    def __init__(self, cfg: ServiceConfig, *, clock: Callable[[], float] = time.time, history: int = 500) -> None:
        super().__init__()
        self.cfg = cfg
        self.clock = clock
        self.feed = Feed(cfg, history=history, clock=clock)
        self.marks = MarkBook()
        self.stories = StoryBook()
        self.events: deque[Event] = deque(maxlen=2000)
        self.members_seen: dict[str, set[str]] = {}
        self.status: ConnectionStatus | None = None
        self.history_loaded = False
        self.sub_title = SUBTITLE["connecting"]

    def compose(self) -> ComposeResult:
        # Kept by reference: queries look at the current screen, which may be a node's detail.
        self.banner = ConnectionBanner(id="banner")
        self.filter_bar = FilterBar(id="filter")
        self.fabrics = FabricsView(id="fabrics")
        self.replicas = ReplicasTable(id="replicas")
        self.event_log = EventLog(id="events")
        yield Header()
        yield self.banner
        yield self.filter_bar
        with Container(id="top"):
            yield self.fabrics
            yield self.replicas
        yield self.event_log
        yield Footer()

    def on_mount(self) -> None:
        self.follow_bus()
        self.set_interval(1.0, self.tick)

    # -- the bus -----------------------------------------------------------------

    @work(exclusive=True, group="feed")
    async def follow_bus(self) -> None:
        try:
            await self.feed.run(self.post_message)
        except LlmgwError as e:  # e.g. unreadable certificates: nothing to retry
            self.exit(return_code=2, message=f"llmgw: error: {e}")

    def on_feed_state_changed(self, message: Feed.StateChanged) -> None:
        self.state = message.state

    def on_feed_events_arrived(self, message: Feed.EventsArrived) -> None:
        log = self.event_log
        for ev in message.events:
            self.events.append(ev)
            log.add(event_line(ev))
            told = self.stories.add(ev)
            if told is not None:
                log.add(story_line(told), story=True)
        log.story = self.stories.current()
        if message.replayed:
            self.history_loaded = True
        self.refresh_views()

    def on_feed_connection_changed(self, message: Feed.ConnectionChanged) -> None:
        self.status = message.status
        self.sub_title = SUBTITLE.get(message.status.state, message.status.state)
        self.banner.now = self.clock()
        self.banner.status = message.status

    def on_feed_waiting(self, message: Feed.Waiting) -> None:
        self.banner.waiting = message.text

    # -- views ---------------------------------------------------------------------

    def watch_state(self, state: ClusterState) -> None:
        self.marks.update(state.replicas)
        remember_members(self.members_seen, state.replicas)
        self.refresh_views()

    def watch_pattern(self, pattern: str) -> None:
        self.event_log.pattern = pattern
        self.refresh_views()

    def watch_selected_node(self, node_id: str) -> None:
        self.fabrics.selected = node_id

    def refresh_views(self) -> None:
        now = self.clock()
        self.fabrics.panels = fabric_views(self.state, now, self.marks, self.pattern)
        self.replicas.replicas = replica_views(self.state, now, self.marks, rebuilding=self.stories.rebuilding, pattern=self.pattern)
        for screen in self.screen_stack:
            if isinstance(screen, NodeDetail):
                screen.view = node_detail(screen.node_id, self.state, self.events, self.members_seen, now)

    def tick(self) -> None:
        """Ages move on with the clock even when nothing on the bus does."""
        self.banner.now = self.clock()
        self.refresh_views()

    # -- nodes -----------------------------------------------------------------------

    def on_node_row_highlighted(self, message: NodeRow.Highlighted) -> None:
        self.selected_node = message.node_id

    def on_node_row_opened(self, message: NodeRow.Opened) -> None:
        self.selected_node = message.node_id
        view = node_detail(message.node_id, self.state, self.events, self.members_seen, self.clock())
        self.push_screen(NodeDetail(view))

    # -- actions ---------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # While a question or the help is up, its own keys answer; nothing else starts.
        if isinstance(self.screen, (Confirm, Help)) and action in ("admin", "filter", "help"):
            return False
        if action == "filter" and isinstance(self.screen, NodeDetail):
            return False
        return True

    def action_admin(self, verb: str) -> None:
        node = self.selected_node
        if not node:
            self.notify("Select a node first (↑/↓ in the fabrics panel).", severity="warning")
            return
        question, consequence = ADMIN[verb]

        def answered(yes: bool | None) -> None:
            if yes:
                self.send_admin(verb, node)
            else:
                self.notify(f"{verb} {node}: cancelled", timeout=3)

        self.push_screen(Confirm(question.format(node=node), consequence), answered)

    @work(group="admin")
    async def send_admin(self, verb: str, node: str) -> None:
        try:
            record = await self.feed.admin(verb, node)
        except LlmgwError as e:
            self.notify(f"{verb} {node} failed: {e}", severity="error", timeout=10)
            return
        self.notify(f"node {record.node_id} is now {record.admin}", timeout=5)

    def action_filter(self) -> None:
        bar = self.filter_bar
        bar.add_class("-shown")
        bar.focus()

    def on_input_changed(self, event: FilterBar.Changed) -> None:
        if isinstance(event.input, FilterBar):
            self.pattern = event.value.strip()

    def on_filter_bar_closed(self, message: FilterBar.Closed) -> None:
        bar = self.filter_bar
        bar.set_class(not message.cleared, "-shown")
        rows = self.fabrics.rows()
        target = next((r for r in rows if r.node_id == self.selected_node), rows[0] if rows else None)
        if target is not None:
            target.focus()
        else:
            self.set_focus(None)

    def action_help(self) -> None:
        try:
            role, name = self.cfg.tls_files().identity()
            who = f"{role}/{name}"
        except LlmgwError:
            who = "?"
        status = self.status.state if self.status else "connecting"
        self.push_screen(Help(f"{', '.join(self.cfg.server)} as {who} ({status}); config {self.cfg.source or '-'}"))


def main(args) -> int:
    from llmgw.services.ctl.session import Session

    # Checks the file, its keys and its certificates before the screen takes over,
    # so a mistake is one plain line on the terminal.
    cfg = Session(args).cfg
    # Log lines written to the terminal would tear the screen: send them to
    # Textual's log (textual console) instead.
    from textual.logging import TextualHandler

    logging.basicConfig(level=logging.WARNING, handlers=[TextualHandler()], force=True)
    app = LlmgwApp(cfg)
    app.run()
    return app.return_code or 0
