"""One log format for every llmgw process: time, level, component, message."""

from __future__ import annotations

import logging
import sys

from .errors import ConfigError


def setup_logging(level: str = "info") -> None:
    lvl = getattr(logging, str(level).upper(), None)
    if not isinstance(lvl, int):
        raise ConfigError(f"--log-level {level!r}: expected debug, info, warning or error")
    logging.basicConfig(
        level=lvl,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    # nats-py and aiohttp are chatty at INFO about things our own logs already say.
    for noisy in ("nats", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(max(lvl, logging.WARNING))
    # asyncio's SSL transport warns on every TLS close ("returning true from
    # eof_received() has no effect"): noise, not news.
    logging.getLogger("asyncio").setLevel(max(lvl, logging.ERROR))
