"""The event log: history first, then live events at the bottom, with rebuild stories told in between."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual import events
from textual.reactive import reactive
from textual.widgets import RichLog

from .model import matches

KEEP = 2000
# Width of a line's time stamp ("19:47:51.142  "): a story's wrapped lines start under its text.
STORY_INDENT = 14


class EventLog(RichLog):
    """Lines are cut at the right edge (stories wrap) and drawn again on resize or a new filter."""

    pattern: reactive[str] = reactive("")
    # The rebuild still unfolding, shown under the log until it completes.
    story: reactive[str] = reactive("")

    def __init__(self, **kw) -> None:
        super().__init__(wrap=False, markup=False, auto_scroll=True, max_lines=KEEP, **kw)
        self.entries: deque[tuple[Text, bool]] = deque(maxlen=KEEP)
        self._drawn_width = 0

    def on_mount(self) -> None:
        self.border_title = "Events"

    @property
    def line_width(self) -> int:
        # One column stays free for the scrollbar that appears once the log is full.
        return max(20, self.scrollable_content_region.width - 1)

    def add(self, text: Text, *, story: bool = False) -> None:
        self.entries.append((text, story))
        if self._drawn_width and matches(self.pattern, text.plain):
            self._show(text, story)

    def _show(self, text: Text, story: bool) -> None:
        width = self.line_width
        if story:  # stories matter most: wrapped under their text, never cut
            stamp, body = text.divide([STORY_INDENT])
            for i, line in enumerate(body.wrap(self.app.console, width - STORY_INDENT)):
                self.write((stamp if i == 0 else Text(" " * STORY_INDENT)) + line, width=width)
        else:
            line = text.copy()
            line.truncate(width, overflow="ellipsis")
            self.write(line, width=width)

    def _redraw(self) -> None:
        self.clear()
        self._drawn_width = self.line_width
        for text, story in self.entries:
            if matches(self.pattern, text.plain):
                self._show(text, story)

    def on_resize(self, event: events.Resize) -> None:
        if event.size.width and self.line_width != self._drawn_width:
            self.call_after_refresh(self._redraw)
        else:
            # Panels above grew or shrank: keep the newest events in view.
            self.call_after_refresh(self.scroll_end, animate=False)

    def watch_pattern(self) -> None:
        if self._drawn_width:
            self._redraw()

    def watch_story(self, story: str) -> None:
        self.border_subtitle = f"rebuilding: {story}" if story else ""
