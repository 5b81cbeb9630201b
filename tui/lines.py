"""Event and story lines as styled text: the ctl's event format, coloured by what happened."""

from __future__ import annotations

import datetime as dt

from rich.text import Text

from llmgw.shared.readmodel import format_event
from llmgw.shared.schemas import Event

from .palette import EVENT_STYLE, STORY_STYLE
from .story import Rebuild


def event_line(ev: Event) -> Text:
    return Text(format_event(ev), style=EVENT_STYLE.get(ev.what, ""), no_wrap=True, overflow="ellipsis")


def story_line(story: Rebuild) -> Text:
    at = dt.datetime.fromtimestamp(story.ready_at or story.started).strftime("%H:%M:%S.%f")[:-3]
    text = Text(f"{at}  ")
    text.append("▶ rebuild: " + story.text(), style=STORY_STYLE)
    return text
