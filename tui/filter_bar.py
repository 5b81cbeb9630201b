"""The filter line: words typed here narrow nodes, replicas and events at once.

One line of text, there all along, not Textual's Input shown on demand: the
Input lays the whole screen out again on every letter (its width follows its
text), and a line that appears or goes moves every panel below it — each a
whole screen of output per key. A filter needs letters, Backspace, Enter and
Esc, and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.text import Text
from textual import events
from textual.reactive import reactive
from textual.widget import Widget

PLACEHOLDER = "filter: words to match in nodes, replicas and events (Enter keeps it, Esc clears)"


class FilterBar(Widget, can_focus=True):
    DEFAULT_CSS = "FilterBar { height: 1; padding: 0 1; }"

    value: reactive[str] = reactive("")

    def render(self) -> Text:
        text = Text("/ ", style="bold")
        if self.value:
            text.append(self.value)
        elif not self.has_focus:
            text.append("filter", style="dim")
            return text
        if self.has_focus:
            text.append("▏", style="blink")
            if not self.value:
                text.append(PLACEHOLDER, style="dim")
        return text

    def __init__(self, on_change: Callable[[str], None], on_close: Callable[[bool], None], **kw) -> None:
        super().__init__(**kw)
        # Both called at once, not by message: each value so that the lists it narrows
        # are drawn in the same frame as the letter; Enter or Esc (``cleared`` when the
        # filter was dropped) so that the focus has left before the next key is read.
        self.on_change = on_change
        self.on_close = on_close

    def watch_value(self, value: str) -> None:
        self.on_change(value)

    def check_consume_key(self, key: str, character: str | None) -> bool:
        # letters typed here are words of the filter, not the app's keys (c is not cordon)
        return character is not None and character.isprintable()

    def take(self, event: events.Key) -> bool:
        """Apply a key typed here (letters, Backspace, Enter, Esc); False for any other key.

        The app calls it in its own turn, as the key arrives, so the letters and the
        Enter or Esc that closes the filter are applied in the order typed."""
        if event.key == "enter":
            self.on_close(not self.value.strip())
        elif event.key == "escape":
            self.value = ""
            self.on_close(True)
        elif event.key == "backspace":
            self.value = self.value[:-1]
        elif event.character is not None and event.character.isprintable():
            self.value += event.character
        else:
            return False
        return True

    def on_key(self, event: events.Key) -> None:
        if self.take(event):
            event.stop()
            event.prevent_default()

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()
