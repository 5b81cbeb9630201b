"""The bottom line: the keys, always the same words.

Textual's Footer rebuilds a widget per key whenever the focus or the screen
changes; on a busy machine that cost every screen switch hundreds of
milliseconds. The console's keys do not change with the focus, so one line of
text says them.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

MAIN = (("⏎", "Detail"), ("c", "Cordon"), ("u", "Uncordon"), ("d", "Drain"), ("/", "Filter"), ("e", "Every event"), ("?", "Help"), ("q", "Quit"))
DETAIL = (("esc", "Back"), ("c", "Cordon"), ("u", "Uncordon"), ("d", "Drain"), ("q", "Quit"))


def keys_text(keys: tuple[tuple[str, str], ...]) -> Text:
    text = Text()
    for key, what in keys:
        text.append(f" {key} ", style="bold reverse")
        text.append(f" {what}  ")
    return text


class KeysLine(Static):
    DEFAULT_CSS = "KeysLine { height: 1; dock: bottom; background: $panel; }"

    def __init__(self, keys: tuple[tuple[str, str], ...], **kw) -> None:
        super().__init__(keys_text(keys), **kw)
