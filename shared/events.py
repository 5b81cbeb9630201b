"""Publishing to and reading from the event stream (LLMGW_EVENTS).

Every event may carry an id (``Nats-Msg-Id``): JetStream drops a second
publish of the same id within the stream's duplicate window (2 minutes), and
``stored`` tells whether the newest event on a subject carries an id, for a
re-publish after the window. The scheduler uses both for its event outbox
(``Replica.pending_events``): a transition's events are written with its record
and published after it; a scheduler that takes over publishes what the stream
lacks.
"""

from __future__ import annotations

import logging

from nats.js import JetStreamContext

from . import subjects as S
from .schemas import Event, encode, now
from .states import EventKind, EventWhat

log = logging.getLogger("llmgw.events")

MSG_ID = "Nats-Msg-Id"


def event_id(ev: Event) -> str:
    """A stable id for an event: the same event, published again, has the same id."""
    return f"{ev.kind}.{ev.subject}.{ev.what}.{ev.time!r}"


class EventPublisher:
    """Every state transition becomes an event with a timestamp; losing one is logged, never fatal."""

    def __init__(self, js: JetStreamContext, source: str, on_failure=None):
        self.js = js
        self.source = source
        self.failures = 0
        self.on_failure = on_failure  # called with (what, exception): the service's write-failure count

    async def emit(self, kind: EventKind, subject: str, what: EventWhat, detail: str = "", at: float | None = None, msg_id: str = "", **data: str) -> Event:
        ev = Event(time=at if at is not None else now(), kind=kind, subject=subject, what=what, detail=detail, data={k: str(v) for k, v in data.items()})
        await self.publish(ev, msg_id=msg_id)
        return ev

    async def publish(self, ev: Event, *, msg_id: str = "") -> bool:
        """Store ``ev``; False (logged and counted) when the stream did not acknowledge it."""
        try:
            await self.js.publish(S.event(ev.kind, ev.subject, ev.what), encode(ev), timeout=2, headers={MSG_ID: msg_id} if msg_id else None)
        except Exception as e:  # the stream may be briefly unavailable; the state change already happened
            self.failures += 1
            log.warning("event %s.%s.%s not stored: %s", ev.kind, ev.subject, ev.what, e or type(e).__name__)
            if self.on_failure is not None:
                self.on_failure(f"event {ev.kind}.{ev.subject}.{ev.what}", e)
            return False
        return True

    async def stored(self, ev: Event, msg_id: str) -> bool:
        """Whether the newest event on ``ev``'s subject is the one with ``msg_id``
        (raises when the stream cannot be asked)."""
        try:
            last = await self.js.get_last_msg(S.EVENT_STREAM, S.event(ev.kind, ev.subject, ev.what))
        except Exception as e:
            if type(e).__name__ in ("NotFoundError", "MsgNotFoundError") or getattr(e, "code", None) == 404:
                return False
            raise
        return (last.headers or {}).get(MSG_ID) == msg_id
