"""A list that draws only the lines on screen.

At 10,000 nodes a widget per row cost the console a whole core and 2 GB; this
one is a single Textual line-API widget over a model: it knows how many lines
there are and asks for the text of a line only when that line is on screen. So
a frame, a scroll, a page or a jump costs the height of the screen, whatever
the length of the list.

Subclasses say how many lines there are (``set_count``), what a line says
(``line_text``) and which lines the cursor may rest on (``selectable``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import ClassVar

from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

# Lines kept as drawn, at most: a few screens' worth.
DRAWN_KEPT = 600
CURSOR = "▶ "  # the cursor row's gutter: visible in plain text too (a screen reader, a capture)
GUTTER = "  "


class VirtualList(ScrollView, can_focus=True):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up,k", "move(-1)", "Up", show=False, priority=True),
        Binding("down,j", "move(1)", "Down", show=False, priority=True),
        Binding("pageup", "page(-1)", "Page up", show=False, priority=True),
        Binding("pagedown", "page(1)", "Page down", show=False, priority=True),
        Binding("home", "edge(-1)", "First", show=False, priority=True),
        Binding("end", "edge(1)", "Last", show=False, priority=True),
    ]
    COMPONENT_CLASSES: ClassVar[set[str]] = {"virtual-list--cursor", "virtual-list--cursor-blurred"}
    DEFAULT_CSS = """
    VirtualList { overflow-x: hidden; overflow-y: auto; scrollbar-size-vertical: 1; }
    VirtualList > .virtual-list--cursor { background: $accent 45%; text-style: bold; }
    VirtualList > .virtual-list--cursor-blurred { background: $primary 25%; }
    """

    # False: a log to scroll through, no row to act on.
    HAS_CURSOR: ClassVar[bool] = True
    # True: the list's height does not follow its length (1fr) and its scrollbar is
    # always there (overflow-y: scroll), so a new length never lays the screen out again.
    FIXED_HEIGHT: ClassVar[bool] = False
    # False: the cursor is drawn only while the list has the focus (a row marked
    # in a list not in use reads as "selected", and it is not).
    CURSOR_WHEN_BLURRED: ClassVar[bool] = True

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.count = 0
        self.cursor = 0
        self._base_style: Style | None = None
        self._drawn: dict[Hashable, Strip] = {}  # line_key -> the line as drawn
        self._drawn_style: Style | None = None  # the widget's style those lines were drawn in

    # -- what subclasses provide ------------------------------------------------

    def line_text(self, index: int, width: int) -> Text:
        raise NotImplementedError

    def selectable(self, index: int) -> bool:
        return True

    def line_key(self, index: int) -> Hashable | None:
        """What line ``index`` looks like depends on, all of it (None: draw it every time).

        A line drawn is kept by this key: a cursor move or a title change repaints
        the whole list, and the lines that did not change then cost a lookup."""
        return None

    def cursor_moved(self) -> None:
        """The cursor rests on another line (or the same line means another thing)."""

    # -- size and drawing -------------------------------------------------------

    @property
    def height(self) -> int:
        return max(1, self.scrollable_content_region.height)

    @property
    def top(self) -> int:
        return round(self.scroll_offset.y)

    def set_count(self, count: int) -> None:
        """The list now has ``count`` lines; the cursor stays within them. Redraws."""
        old, self.count = self.count, count
        size = Size(max(1, self.scrollable_content_region.width), count)
        height = self.scrollable_content_region.height
        if self.is_mounted and height and (self.FIXED_HEIGHT or (old > height and count > height)):
            # Full before and after: the widget's size and its scrollbar stay as they are,
            # so the screen need not be laid out again (setting virtual_size does that, and
            # a filter typed at 10,000 nodes changed three lists' lengths per letter).
            self.set_reactive(VirtualList.virtual_size, size)
            self._scroll_update(size)
            if self.scroll_y > count - height:
                self.scroll_to(y=count - height, animate=False, force=True)
        else:
            self.virtual_size = size
        if self.HAS_CURSOR and count:
            self.cursor = min(self.cursor, count - 1)
            if not self.selectable(self.cursor):
                self.cursor = self._step(self.cursor, +1) if self._step(self.cursor, +1) != self.cursor else self._step(self.cursor, -1)
        self.refresh()

    @property
    def base_style(self) -> Style:
        """The widget's own style (its background, its colour), computed once per CSS change:
        ``rich_style`` walks every ancestor, and a frame asks for it per line."""
        if self._base_style is None:
            self._base_style = self.rich_style
        return self._base_style

    def notify_style_update(self) -> None:
        # (A focus change restyles the border; the lines keep their style, and their
        # cache, unless the widget's own style changed: render_line compares.)
        self._base_style = None
        super().notify_style_update()

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        index = self.top + y
        style = self.base_style
        if style != self._drawn_style:
            self._drawn.clear()
            self._drawn_style = style
        if index >= self.count or width <= 0:
            return Strip.blank(width, style)
        on = self.HAS_CURSOR and index == self.cursor and (self.has_focus or self.CURSOR_WHEN_BLURRED)
        key = self.line_key(index)
        if key is not None:
            key = (key, on, on and self.has_focus, width)
            if (strip := self._drawn.get(key)) is not None:
                return strip
        strip = self._draw_line(index, width, on, style)
        if key is not None:
            if len(self._drawn) > DRAWN_KEPT:
                self._drawn.clear()
            self._drawn[key] = strip
        return strip

    def _draw_line(self, index: int, width: int, on: bool, style: Style) -> Strip:
        if self.HAS_CURSOR:
            text = Text(CURSOR if on else GUTTER, no_wrap=True, overflow="ellipsis")
            text.append_text(self.line_text(index, width - len(GUTTER)))
            if on:
                text.stylize(self.get_component_rich_style("virtual-list--cursor" if self.has_focus else "virtual-list--cursor-blurred"))
        else:
            text = self.line_text(index, width)
        text.truncate(width, overflow="ellipsis")
        return Strip(text.render(self.app.console)).crop_extend(0, width, style).apply_style(style)

    def visible_lines(self) -> list[str]:
        """The lines on screen, as plain text (what the screen shows of this widget)."""
        return [self.render_line(y).text.rstrip() for y in range(self.height) if self.top + y < self.count]

    def on_focus(self) -> None:
        if self.HAS_CURSOR and self.count:
            self.refresh_line(self.cursor)  # the cursor's colour says where the keys go

    def on_blur(self) -> None:
        if self.HAS_CURSOR and self.count:
            self.refresh_line(self.cursor)

    # -- the cursor -------------------------------------------------------------

    def _step(self, index: int, delta: int) -> int:
        """The nearest selectable line from ``index`` in the direction of ``delta`` (itself if none)."""
        i = index
        while 0 <= i + delta < self.count:
            i += delta
            if self.selectable(i):
                return i
        return index

    def move_to(self, index: int) -> None:
        if not self.count:
            return
        index = max(0, min(self.count - 1, index))
        if not self.selectable(index):
            forward = self._step(index, +1)
            index = forward if forward != index else self._step(index, -1)
        changed = index != self.cursor
        if not changed:
            self.reveal(index)
            return
        old, self.cursor = self.cursor, index
        top = self.top
        self.reveal(index)
        if self.top == top:  # not scrolled: only the two lines changed
            self.refresh_line(old)
            self.refresh_line(index)
        else:
            self.refresh()
        self.cursor_moved()

    def reveal(self, index: int) -> None:
        """Scroll just enough for line ``index`` to be on screen."""
        top, h = self.top, self.height
        if index < top:
            self.scroll_to(y=index, animate=False, force=True)
        elif index >= top + h:
            self.scroll_to(y=index - h + 1, animate=False, force=True)

    def action_move(self, delta: int) -> None:
        if not self.HAS_CURSOR:
            self.scroll_to(y=self.top + delta, animate=False)
            return
        self.move_to(self._step(self.cursor, delta))

    def action_page(self, delta: int) -> None:
        if not self.HAS_CURSOR:
            self.scroll_to(y=self.top + delta * self.height, animate=False)
            return
        target = max(0, min(self.count - 1, self.cursor + delta * self.height))
        # the page moves with the cursor: what was the last line is now the first
        self.scroll_to(y=max(0, self.top + delta * self.height), animate=False, force=True)
        self.move_to(target)

    def action_edge(self, delta: int) -> None:
        if not self.HAS_CURSOR:
            self.scroll_to(y=0 if delta < 0 else max(0, self.count - self.height), animate=False)
            return
        self.move_to(0 if delta < 0 else self.count - 1)

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or not self.HAS_CURSOR:
            return
        index = self.top + offset.y
        if index < self.count and self.selectable(index):
            self.move_to(index)
            if event.chain >= 2:
                self.opened()

    def opened(self) -> None:
        """Enter or a double click on the cursor line."""
