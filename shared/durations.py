"""Durations as people write them in configuration: ``500ms``, ``5s``, ``1m``, ``1h30m``."""

from __future__ import annotations

import re

from .errors import ConfigError

_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: object, where: str = "duration") -> float:
    """Seconds from ``5s``/``1m``/``250ms``/``1h30m``, or a bare number of seconds."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a duration such as 5s or 1m, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{where}: a duration cannot be negative ({value})")
        return float(value)
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a duration such as 5s or 1m, got {type(value).__name__}")
    text = value.strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return float(text)
    pos, total = 0, 0.0
    for m in _PART.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ConfigError(f"{where}: {value!r} is not a duration; write e.g. 500ms, 5s, 1m or 1h30m")
    return total


def format_duration(seconds: float) -> str:
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if seconds < 60 or seconds != int(seconds):
        return f"{seconds:g}s"
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s}s" if s else f"{m}m"
