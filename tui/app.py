"""``llmgw tui``: the console an operator keeps open during an incident.

The app owns the folded copy of the cluster (``cluster.py``), the timeline of
events (``timeline.py``) and the stories; the feed (``feed.py``, in a worker
on the same loop) folds every bus update into them as it arrives, which is
cheap and changes nothing on screen. The screen is redrawn by frames, at most
one per ``frame`` seconds (250 ms) and only while something changed: each
frame redraws the rows on screen that changed and the aggregates, and says
when the screen is behind the bus. Keys act on the model at once, outside the
frames. The clock moves the ages once a second.

Nothing here waits on the bus except the cordon/uncordon/drain request, which
runs in a worker of its own so the screen never freezes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Mapping
from typing import ClassVar

from textual import events, work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import Header

from llmgw.shared.config import ServiceConfig
from llmgw.shared.errors import LlmgwError
from llmgw.shared.schemas import Event

from .banner import ConnectionBanner
from .cluster import ClusterModel, narrows
from .confirm import MAIN, Confirm
from .events import EventLog
from .fabric_table import FabricTable
from .feed import ConnectionStatus, Feed
from .filter_bar import FilterBar
from .focus import focus_now
from .help import Help
from .lag import SHOW_AFTER, Lag
from .model import MarkBook, NodeDetailView, node_detail
from .node_detail import NodeDetail
from .node_list import NodeList
from .replicas import ReplicasPanel
from .timeline import Timeline

# What each admin verb asks and warns before it is sent.
ADMIN = {
    "cordon": ("Cordon {node}?", "It takes no new replicas; what runs there keeps running."),
    "uncordon": ("Uncordon {node}?", "It takes replicas again."),
    "drain": ("Drain {node}?", "Its replicas are moved off (rebuilt elsewhere), then it takes none."),
}

SUBTITLE = {"connecting": "connecting …", "unreachable": "NATS unreachable", "connected": "live", "down": "NATS connection lost"}

# At most one frame per FRAME seconds: bus updates are folded as they come and drawn together.
FRAME = 0.25
# The cluster's records (hundreds of thousands of objects at 10,000 nodes) live as
# long as the console. Python's full garbage collection walks every object it
# tracks: tens to hundreds of milliseconds here, at moments no one chooses — a key
# pressed then waited for it. So what is held after a bucket is read, and every
# minute, is moved out of the collector's way (gc.freeze); records replaced later
# are still freed when their last reference goes, as nothing in them is cyclic.
FREEZE_EVERY = 60  # ticks (seconds)


class LlmgwApp(App[None]):
    CSS_PATH = "llmgw.tcss"
    TITLE = "llmgw"
    ENABLE_COMMAND_PALETTE = False
    AUTO_FOCUS = "NodeList"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]  # noqa: RUF012 - Textual declares it `ClassVar[...] | None`, which mypy reads as an instance variable a ClassVar may not override
    # Every key is handled whole, in the app's own turn, in the order typed. Textual
    # hands a key to the focused widget through that widget's queue and looks at the
    # next key at once, so a key that moves the focus or opens a screen ("/", Enter,
    # c) would leave the keys already waiting behind it (Esc, y, the letters of a
    # filter — a busy console or a fast typist) with the widget it left. So the
    # console's bindings are all priority bindings (Textual runs those in the app's
    # turn), their effects happen at once (focus_now, callbacks rather than
    # messages), and the filter line takes its keys from on_event below.
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("c", "admin('cordon')", "Cordon", priority=True),
        Binding("u", "admin('uncordon')", "Uncordon", priority=True),
        Binding("d", "admin('drain')", "Drain", priority=True),
        Binding("slash", "filter", "Filter", key_display="/", priority=True),
        Binding("e", "herds", "Every event", priority=True),
        Binding("question_mark", "help", "Help", key_display="?", priority=True),
        Binding("q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        cfg: ServiceConfig,
        *,
        clock: Callable[[], float] = time.time,
        history: int = 500,
        frame: float = FRAME,
        behind_after: float = SHOW_AFTER,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.clock = clock
        self.frame = frame
        self.feed = Feed(cfg, history=history, clock=clock)
        self.model = ClusterModel()
        self.timeline = Timeline(nodes=self.model.nodes)
        self.marks = MarkBook()
        self.lag = Lag(show_after=behind_after, hide_below=min(behind_after, 1.0))
        self.loaded: set[str] = set()  # buckets read whole at least once
        self.history_loaded = False
        self.status: ConnectionStatus | None = None
        self.pattern = ""
        self._panels_pattern = ""  # the filter the replicas and events panels were last drawn with
        self.selected_node = ""
        self.frames = 0
        self.ticks = 0
        self._frame_due: asyncio.TimerHandle | None = None
        self._last_frame = 0.0
        self._rebuilding: frozenset[str] = frozenset()
        self._timeline_seen = -1
        self.sub_title = SUBTITLE["connecting"]

    def compose(self) -> ComposeResult:
        # Kept by reference: queries look at the current screen, which may be a node's detail.
        self.banner = ConnectionBanner(id="banner")
        self.filter_bar = FilterBar(self.filter_changed, self.filter_closed, id="filter")
        self.fabric_table = FabricTable(self.model, on_choose=self.fabric_chosen, id="fabrics")
        self.node_list = NodeList(self.model, self.marks, self.clock, on_highlight=self.node_highlighted, on_open=self.node_opened, id="nodes")
        self.replicas = ReplicasPanel(self.model, self.marks, id="replicas")
        self.event_log = EventLog(self.timeline, id="events")
        yield Header()
        yield self.banner
        yield self.filter_bar
        yield self.fabric_table
        with Horizontal(id="main"):
            with Vertical(id="left"):
                yield self.node_list
            with Vertical(id="right"):
                yield self.replicas
                yield self.event_log
        yield Confirm(MAIN)

    def on_mount(self) -> None:
        # Composed once, shown again and again (each composed anew cost a key dearly).
        self.detail, self.help = NodeDetail(), Help()
        self.install_screen(self.detail, "detail")
        self.install_screen(self.help, "help")
        self.follow_bus()
        self.set_interval(1.0, self.tick)

    # -- the bus: folded as it comes ---------------------------------------------

    @work(exclusive=True, group="feed")
    async def follow_bus(self) -> None:
        try:
            await self.feed.run(self)
        except LlmgwError as e:  # e.g. unreadable certificates: nothing to retry
            self.exit(return_code=2, message=f"llmgw: error: {e}")

    def bucket_loaded(self, bucket: str, items: Mapping[str, object]) -> None:
        self.model.replace(bucket, items)
        self.loaded.add(bucket)
        gc.freeze()
        self.frame_soon()

    def bucket_changed(self, bucket: str, key: str, value: object | None, stored: float | None) -> None:
        self.model.fold(bucket, key, value)
        if stored is not None:
            self.lag.arrived(stored, time.time())
        self.frame_soon()

    def events_arrived(self, events: list[Event], replayed: bool, stored: float | None) -> None:
        for ev in events:
            self.timeline.add(ev)
        if replayed:
            self.history_loaded = True
            gc.freeze()
        if stored is not None:
            self.lag.arrived(stored, time.time())
        self.frame_soon()

    def connection_changed(self, status: ConnectionStatus) -> None:
        self.status = status
        self.sub_title = SUBTITLE.get(status.state, status.state)
        self.banner.now = self.clock()
        self.banner.status = status

    def waiting(self, text: str) -> None:
        self.banner.waiting = text

    # -- frames -------------------------------------------------------------------

    def frame_soon(self) -> None:
        """Something changed: draw it in the next frame (at once if the last was long enough ago)."""
        if self._frame_due is not None:
            return
        delay = max(0.0, self._last_frame + self.frame - time.monotonic())
        self._frame_due = asyncio.get_running_loop().call_later(delay, self.draw)

    def draw(self) -> None:
        """One frame: what changed among the rows on screen, the aggregates, the lists' order."""
        self._frame_due = None
        self._last_frame = time.monotonic()
        self.frames += 1
        now = self.clock()
        changes = self.model.take_changes()
        if changes.replicas:
            self.marks.update(self.model.replicas)
        if changes.order or (self.pattern and changes.facts):
            self.node_list.rebuild(self.pattern)
        else:
            self.node_list.update(changes, now)
        if changes.totals or changes.order:
            self.fabric_table.update()
            self.fabric_table.follow(self.node_list.fabric)
        rebuilding = self.timeline.rebuilding
        refilter = self.pattern != self._panels_pattern  # letters typed since the last frame
        narrow = refilter and narrows(self.pattern, self._panels_pattern)
        self._panels_pattern = self.pattern
        if refilter or changes.replicas or changes.deployments or rebuilding != self._rebuilding:
            self._rebuilding = rebuilding
            self.replicas.rebuild(self.pattern, rebuilding, now, narrow)
        if refilter or self.timeline.version != self._timeline_seen:
            self._timeline_seen = self.timeline.version
            self.event_log.pattern = self.pattern
            self.event_log.rebuild(narrow=narrow)
        self._refresh_details(changes.nodes, now)
        self.lag.drawn(time.time())
        self.banner.behind = self.lag.text()

    def tick(self) -> None:
        """Ages move on with the clock even when nothing on the bus does."""
        self.ticks += 1
        if self.ticks % FREEZE_EVERY == 0:
            gc.freeze()
        now = self.clock()
        self.banner.now = now
        self.node_list.tick(now)
        if any(d.failures for d in self.model.deployments.values()):  # a backoff's countdown
            self.replicas.rebuild(self.pattern, self._rebuilding, now)
        else:
            self.replicas.list.tick(now)
        self._refresh_details(None, now)
        if self.lag.shown:  # nothing arrived since: it is not behind any more
            self.lag.drawn(time.time())
            self.banner.behind = self.lag.text()

    def _refresh_details(self, nodes: set[str] | None, now: float) -> None:
        for screen in self.screen_stack:
            if isinstance(screen, NodeDetail) and (nodes is None or screen.node_id in nodes or self.timeline.version != screen.timeline_seen):
                screen.timeline_seen = self.timeline.version
                screen.view = self.detail_view(screen.node_id, now)

    def detail_view(self, node_id: str, now: float) -> NodeDetailView:
        events = self.timeline.node_events(node_id, self.model.members_seen.get(node_id, ()))
        return node_detail(node_id, self.model, events, now)

    # -- nodes ---------------------------------------------------------------------

    def node_highlighted(self, node_id: str, fabric: str) -> None:
        self.selected_node = node_id
        self.fabric_table.follow(fabric)

    def node_opened(self, node_id: str) -> None:
        self.selected_node = node_id
        if self.detail in self.screen_stack:
            return
        self.detail.show(self.detail_view(node_id, self.clock()), self.timeline.version)
        self.push_screen("detail")

    def fabric_chosen(self, fabric: str) -> None:
        self.node_list.show_fabric(fabric)

    # -- actions ---------------------------------------------------------------------

    async def on_event(self, event: events.Event) -> None:
        if isinstance(event, events.Key) and not event.is_forwarded and self.focused is self.filter_bar and self.filter_bar.take(event):
            return
        await super().on_event(event)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # While a question or the help is up, its own keys answer; nothing else starts.
        if (isinstance(self.screen, Help) or self.asking()) and action in ("admin", "filter", "help", "herds"):
            return False
        if isinstance(self.screen, Help) and action == "quit":
            return False  # q closes the help
        if action in ("filter", "herds") and isinstance(self.screen, NodeDetail):
            return False
        return True

    def asking(self) -> bool:
        """Whether the screen asks a question (its keys answer it; nothing else starts)."""
        return any(c.asking for c in self.screen.query(Confirm))

    def action_admin(self, verb: str) -> None:
        node = self.screen.node_id if isinstance(self.screen, NodeDetail) else self.selected_node
        if not node:
            self.notify("Select a node first (↑/↓ in the nodes panel).", severity="warning")
            return
        question, consequence = ADMIN[verb]

        def answered(yes: bool) -> None:
            if yes:
                self.notify(f"{verb} {node}: sent", timeout=3)
                self.send_admin(verb, node)
            else:
                self.notify(f"{verb} {node}: cancelled", timeout=3)

        self.screen.query_one(Confirm).ask(question.format(node=node), consequence, answered)

    @work(group="admin")
    async def send_admin(self, verb: str, node: str) -> None:
        try:
            record = await self.feed.admin(verb, node)
        except LlmgwError as e:
            self.notify(f"{verb} {node} failed: {e}", severity="error", timeout=10)
            return
        self.notify(f"node {record.node_id} is now {record.admin}", timeout=5)

    def action_filter(self) -> None:
        focus_now(self.filter_bar)

    def filter_changed(self, value: str) -> None:
        self.set_pattern(value.strip())

    def set_pattern(self, pattern: str) -> None:
        """The filter narrows nodes, replicas and events at once, on the model, not on widgets."""
        if pattern == self.pattern:
            return
        narrow = narrows(pattern, self.pattern)  # a letter typed on: search only the last matches
        self.pattern = pattern
        # The node list, where the cursor is, answers the letter at once; the replicas and
        # events panels follow in the next frame (at most FRAME later), once for all the
        # letters typed meanwhile: at 10,000 nodes each of them costs as much as the list.
        self.node_list.rebuild(pattern, narrow)
        self.frame_soon()

    def filter_closed(self, cleared: bool) -> None:
        focus_now(self.node_list)

    def action_herds(self) -> None:
        """Every event of every herd, or the herds summarised again."""
        self.event_log.expand = not self.event_log.expand
        self.event_log.rebuild()

    def action_help(self) -> None:
        try:
            role, name = self.cfg.tls_files().identity()
            who = f"{role}/{name}"
        except LlmgwError:
            who = "?"
        status = self.status.state if self.status else "connecting"
        self.help.show(f"{', '.join(self.cfg.server)} as {who} ({status}); config {self.cfg.source or '-'}")
        self.push_screen("help")


def main(args) -> int:
    from llmgw.shared.operator import load_operator_config

    # Checks the file, its keys and its certificates before the screen takes over,
    # so a mistake is one plain line on the terminal.
    cfg = load_operator_config(getattr(args, "config", None))
    # Log lines written to the terminal would tear the screen: send them to
    # Textual's log (textual console) instead.
    from textual.logging import TextualHandler

    logging.basicConfig(level=logging.WARNING, handlers=[TextualHandler()], force=True)
    app = LlmgwApp(cfg)
    app.run()
    return app.return_code or 0
