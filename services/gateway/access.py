"""The optional access log (``gateway.access_log: true``): one line per
generation request, when its answer has ended (for a stream: its last byte).

Off by default: a line costs ~30 µs of gateway CPU per request, a third more
than the rest of a proxied request (measured, docs/performance.md); the
metrics carry the aggregates either way. The logger is ``llmgw.gateway.access``, so it
can be routed or silenced on its own.
"""

from __future__ import annotations

import logging

from .httpserver import Request

log = logging.getLogger("llmgw.gateway.access")


def client_address(request: Request) -> str:
    transport = request.conn.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    return f"{peer[0]}" if peer else "-"


class AccessLog:
    def __init__(self, logger: logging.Logger = log):
        self.log = logger
        # Asked for is asked for: a service run with --log-level warning still writes these.
        if not logger.isEnabledFor(logging.INFO):
            logger.setLevel(logging.INFO)

    def answered(self, request: Request, model: str, status: int, seconds: float, replica: str = "") -> None:
        rid = request.headers.get(b"x-request-id", b"-").decode("latin-1")
        self.log.info(
            '%s "%s %s" %d model=%s replica=%s %.1fms request_id=%s',
            client_address(request),
            request.method,
            request.raw_path,
            status,
            model or "-",
            replica or "-",
            seconds * 1e3,
            rid,
        )
