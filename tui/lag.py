"""How far the screen is behind the bus. Pure: times go in, a figure comes out.

Every update the console folds carries the time the server stored it (a KV
entry's or a stream message's timestamp). When a frame is drawn, the newest
update in it was stored ``at - stored`` ago: that is how old what the screen
shows is. A console keeping up draws within a frame (250 ms) of the store; one
that falls behind — its loop busy, a backlog in its socket — draws updates
that are seconds old, and must say so rather than show old state as current.

The server's clock and the console's need not agree (the console may run on
an operator's laptop). The smallest ``arrival - stored`` seen in the session is
taken as their difference plus the quickest delivery, and subtracted: so the
figure is how much later than the quickest an update reached the screen. A
console that is behind from its very first update reads low until it has
once kept up.
"""

from __future__ import annotations

SHOW_AFTER = 2.0  # seconds behind before the screen says so
HIDE_BELOW = 1.0  # and back under this before it stops saying so


class Lag:
    def __init__(self, *, show_after: float = SHOW_AFTER, hide_below: float = HIDE_BELOW) -> None:
        self.show_after = show_after
        self.hide_below = hide_below
        self.offset: float | None = None  # smallest arrival - stored seen
        self.newest: float | None = None  # stored time of the newest update since the last frame
        self.behind = 0.0  # at the last frame
        self.shown = False  # whether the screen says it is behind

    def arrived(self, stored: float, at: float) -> None:
        """An update stored by the server at ``stored`` was folded at ``at`` (both epoch seconds)."""
        d = at - stored
        self.offset = d if self.offset is None else min(self.offset, d)
        self.newest = stored if self.newest is None else max(self.newest, stored)

    def drawn(self, at: float) -> float:
        """A frame was drawn at ``at``: how far behind the bus its newest update was (0 with none)."""
        if self.newest is None or self.offset is None:
            self.behind = 0.0
        else:
            self.behind = max(0.0, at - self.newest - self.offset)
        self.newest = None
        if self.behind >= self.show_after:
            self.shown = True
        elif self.behind < self.hide_below:
            self.shown = False
        return self.behind

    def text(self) -> str:
        return f"display {self.behind:.1f} s behind the bus: catching up" if self.shown else ""
