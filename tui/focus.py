"""Move the focus now, not after the messages already queued.

Textual's ``Widget.focus()`` moves the focus from a callback queued behind
the messages already waiting. A fast typist's next key ("/" then Esc, Enter
then Enter), or any key that waited while the console was busy, is then
already in the queue and goes to the widget the focus is leaving: an Esc
meant for the filter reaches the node list, and the filter stays open with
every later key typed into it. ``Screen.set_focus`` moves it at once, so each
key goes where the keys before it left the focus.
"""

from __future__ import annotations

from textual.widget import Widget


def focus_now(widget: Widget) -> None:
    widget.screen.set_focus(widget)
