"""The bottom line: the keys, and the question asked before an operator action
changes the cluster (answers True or False).

One line that is there all along, not a dialog over the screen: a modal screen
makes the terminal redraw everything beneath it (dimmed) and again when it
goes, and a line that appears moves every panel above it; both are a whole
screen of output per key. This line changes its words and nothing else moves.
While it asks, it has the focus: y answers yes, n or Esc no, nothing else
starts.

Textual's Footer is not used for the keys: it rebuilds a widget per key
whenever the focus or the screen changes (hundreds of milliseconds a key on a
busy machine); the console's keys do not change with the focus.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.widget import Widget

from .focus import focus_now

MAIN = (("⏎", "Detail"), ("c", "Cordon"), ("u", "Uncordon"), ("d", "Drain"), ("/", "Filter"), ("e", "Every event"), ("?", "Help"), ("q", "Quit"))
DETAIL = (("esc", "Back"), ("c", "Cordon"), ("u", "Uncordon"), ("d", "Drain"), ("q", "Quit"))


def keys_text(keys: tuple[tuple[str, str], ...]) -> Text:
    text = Text()
    for key, what in keys:
        text.append(f" {key} ", style="bold reverse")
        text.append(f" {what}  ")
    return text


class Confirm(Widget, can_focus=False):
    DEFAULT_CSS = """
    Confirm { dock: bottom; height: 1; background: $panel; }
    Confirm.-asking { background: $warning 40%; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes", priority=True),
        Binding("n,escape", "answer(False)", "No", priority=True),
    ]

    def __init__(self, keys: tuple[tuple[str, str], ...] = MAIN, **kw) -> None:
        super().__init__(**kw)
        self.keys = keys_text(keys)
        self.question = ""
        self.consequence = ""
        self._answered: Callable[[bool], None] | None = None
        self._focus_before: Widget | None = None

    @property
    def asking(self) -> bool:
        return self._answered is not None

    def ask(self, question: str, consequence: str, answered: Callable[[bool], None]) -> None:
        self.question, self.consequence, self._answered = question, consequence, answered
        self._focus_before = self.app.focused
        self.add_class("-asking")
        self.can_focus = True
        self.refresh()
        focus_now(self)

    def render(self) -> Text:
        if not self.asking:
            return self.keys
        text = Text(f" {self.question}", style="bold")
        text.append(f"  {self.consequence}  ", style="dim")
        text.append(" y ", style="bold reverse")
        text.append(" yes  ")
        text.append(" n ", style="bold reverse")
        text.append(" no (Esc)")
        return text

    def action_answer(self, yes: bool) -> None:
        answered, self._answered = self._answered, None
        self.remove_class("-asking")
        self.can_focus = False
        self.refresh()
        if self._focus_before is not None and self._focus_before.is_attached:
            focus_now(self._focus_before)
        if answered is not None:
            answered(yes)

    def on_blur(self) -> None:
        # Clicked away or tabbed off: no answer is a no.
        if self.asking:
            self.action_answer(False)
