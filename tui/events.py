"""The event log: history first, live events at the bottom, herds summarised, rebuild stories told.

A virtual list over the timeline (``timeline.py``): only the lines on screen
are drawn. ``e`` shows every event of every herd, and back.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Hashable

from rich.text import Text
from textual import events

from .lines import event_line, story_line
from .palette import HERD_STYLE
from .timeline import Herd, Seen, Timeline, Told, event_lines
from .virtual import VirtualList

# Width of a line's time stamp ("19:47:51.142  "): a story's wrapped lines start under its text.
STORY_INDENT = 14
MEMBER_INDENT = "    "


def herd_line(herd: Herd, expanded: bool) -> Text:
    at = dt.datetime.fromtimestamp(herd.first).strftime("%H:%M:%S.%f")[:-3]
    text = Text(f"{at}  ")
    text.append(f"▤ {herd.text()}", style=HERD_STYLE)
    if not expanded:
        text.append("  (e: every event)", style="dim")
    return text


class EventLog(VirtualList):
    """Newest at the bottom; it follows new events unless scrolled up."""

    FIXED_HEIGHT = True

    HAS_CURSOR = False

    def __init__(self, timeline: Timeline, **kw) -> None:
        super().__init__(**kw)
        self.timeline = timeline
        self.pattern = ""
        self.expand = False
        self.lines: list[tuple[str, object]] = []  # one per line on screen: stories are wrapped into several
        self._built = (-1, "", False, 0)
        self._matched: list[tuple[str, object]] = []
        # Whether the log follows new events. Kept, not only read off the scroll position:
        # before the first layout the list has no height, a scroll to its end is cut
        # short, and read back it would say the operator had scrolled up.
        self._following = True

    def on_mount(self) -> None:
        self.border_title = "Events"

    @property
    def at_end(self) -> bool:
        return self.top + self.height >= self.count

    def rebuild(self, force: bool = False, narrow: bool = False) -> None:
        """The lines again, when the timeline, the filter or the width changed (``narrow``: as NodeList.rebuild)."""
        width = self.scrollable_content_region.width
        key = (self.timeline.version, self.pattern, self.expand, width)
        if key == self._built and not force:
            return
        laid_out = self.is_mounted and self.scrollable_content_region.height > 0
        follow = self._following if not laid_out else (self.at_end or not self.count)
        self._following = follow
        among = self._matched if narrow and key[0] == self._built[0] and key[2:] == self._built[2:] else None
        self._built = key
        matched = event_lines(self.timeline, self.pattern, self.expand, among)
        self._matched = matched
        if not self.timeline.told:
            lines = matched  # nothing to wrap: the list as it is (tens of thousands when filtering)
        else:
            lines = []
            for kind, item in matched:
                if kind == "story" and isinstance(item, Told):
                    text = story_line(item.story)
                    stamp, body = text.divide([STORY_INDENT])
                    for i, part in enumerate(body.wrap(self.app.console, max(10, width - STORY_INDENT))):
                        lines.append(("text", (stamp if i == 0 else Text(" " * STORY_INDENT)) + part))
                else:
                    lines.append((kind, item))
        self.lines = lines
        self.set_count(len(lines))
        if follow:
            self.scroll_to(y=max(0, len(lines) - self.height), animate=False, force=True)
        self.border_title = "Events" + (" · every event" if self.expand else "") + (f' matching "{self.pattern}"' if self.pattern else "")
        story = self.timeline.current_story()
        self.border_subtitle = f"rebuilding: {story}" if story else ""

    def line_key(self, index: int) -> Hashable | None:
        kind, item = self.lines[index]
        if isinstance(item, Seen):  # an event never changes
            return (kind, item.seq)
        if isinstance(item, Herd):  # a herd's line does, as it grows
            return (kind, item.serial, item.count, self.expand)
        return None

    def line_text(self, index: int, width: int) -> Text:
        kind, item = self.lines[index]
        if kind == "text" and isinstance(item, Text):
            return item
        if kind == "herd" and isinstance(item, Herd):
            return herd_line(item, self.expand)
        if isinstance(item, Seen):
            line = event_line(item.event)
            return Text(MEMBER_INDENT) + line if kind == "member" else line
        return Text("")

    def on_resize(self, event: events.Resize) -> None:
        following = self._following
        self.rebuild()
        if following:
            self.scroll_to(y=max(0, self.count - self.height), animate=False, force=True)

    def text(self) -> str:
        """Every line, as plain text (tests; the screen draws only what is visible)."""
        return "\n".join(self.line_text(i, 200).plain for i in range(self.count))
