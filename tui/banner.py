"""The line that says the console cannot see the cluster right now, or sees it late — and when it can again."""

from __future__ import annotations

import datetime as dt

from textual.reactive import reactive
from textual.widgets import Static

from .feed import ConnectionStatus
from .model import format_age

# How long "connection back" stays up after an outage.
BACK_FOR = 5.0


def _clock(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%H:%M:%S")


def banner_text(status: ConnectionStatus | None, waiting: str, now: float, behind: str = "") -> tuple[str, str]:
    """(css class, text); class '' hides the banner. ``behind``: how far the screen is
    behind the bus, when it is (``lag.Lag.text``)."""
    if status is None or status.state == "connecting":
        return "-info", f"connecting to NATS at {status.server if status else '…'} …"
    if status.state == "unreachable":
        return "-down", f"cannot reach NATS: {status.detail}"
    if status.state == "down":
        return "-down", (
            f"✖ NATS connection lost at {_clock(status.since)} ({format_age(now - status.since)} ago) — showing the last state seen; reconnecting …"
        )
    if status.down_since is not None and now - status.since < BACK_FOR:
        return "-back", f"✔ NATS connection back at {_clock(status.since)} after {format_age(status.since - status.down_since)}"
    if behind:
        return "-behind", f"⏳ {behind}"
    if waiting:
        return "-info", waiting
    return "", ""


class ConnectionBanner(Static):
    status: reactive[ConnectionStatus | None] = reactive(None)
    waiting: reactive[str] = reactive("")
    now: reactive[float] = reactive(0.0)
    behind: reactive[str] = reactive("")

    _shown: tuple[str, str] | None = None

    def _update_banner(self) -> None:
        # Called once a second for the ages: a banner that says the same is not redrawn
        # (an update lays the screen out again).
        shown = banner_text(self.status, self.waiting, self.now, self.behind)
        if shown == self._shown:
            return
        self._shown = shown
        cls, text = shown
        for c in ("-down", "-back", "-info", "-behind"):
            self.set_class(c == cls, c)
        self.update(text)

    def watch_status(self) -> None:
        self._update_banner()

    def watch_waiting(self) -> None:
        self._update_banner()

    def watch_now(self) -> None:
        self._update_banner()

    def watch_behind(self) -> None:
        self._update_banner()
