"""The filter line: words typed here narrow nodes, replicas and events at once."""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import Input


class FilterBar(Input):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "clear_filter", "Clear filter")]

    class Closed(Message):
        """The operator is done typing; ``cleared`` when the filter was dropped."""

        def __init__(self, cleared: bool) -> None:
            super().__init__()
            self.cleared = cleared

    def __init__(self, **kw) -> None:
        super().__init__(placeholder="filter: words to match in nodes, replicas and events (Esc clears)", **kw)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.post_message(self.Closed(cleared=not self.value.strip()))

    def action_clear_filter(self) -> None:
        self.value = ""
        self.post_message(self.Closed(cleared=True))
