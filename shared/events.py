"""Publishing to and reading from the event stream (LLMGW_EVENTS)."""

from __future__ import annotations

import logging

from nats.js import JetStreamContext

from . import subjects as S
from .schemas import Event, encode, now

log = logging.getLogger("llmgw.events")


class EventPublisher:
    """Every state transition becomes an event with a timestamp; losing one is logged, never fatal."""

    def __init__(self, js: JetStreamContext, source: str):
        self.js = js
        self.source = source
        self.failures = 0

    async def emit(self, kind: str, subject: str, what: str, detail: str = "", at: float | None = None, **data: str) -> Event:
        ev = Event(time=at if at is not None else now(), kind=kind, subject=subject, what=what, detail=detail, data={k: str(v) for k, v in data.items()})
        try:
            await self.js.publish(S.event(kind, subject, what), encode(ev), timeout=2)
        except Exception as e:  # the stream may be briefly unavailable; the state change already happened
            self.failures += 1
            log.warning("event %s.%s.%s not stored: %s", kind, subject, what, e or type(e).__name__)
        return ev
