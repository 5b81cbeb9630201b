"""The gateway's HTTP/1.1 server: ``httptools`` (llhttp, the parser Node.js
uses) under an ``asyncio.Protocol``, and nothing else.

Why not aiohttp's server: measured under 16 closed-loop clients on two cores,
the same proxy cost ~45 µs less CPU per request on a bare protocol than on
aiohttp's low-level server (request/response objects, multidicts, a payload
stream and a writer per request), and at saturation every microsecond of the
gateway's is latency added to every request (docs/performance.md). What a
proxy in front of engines needs from HTTP is small and is all here:

* keep-alive, pipelining (one request answered at a time, in order; reading
  pauses while requests queue), HTTP/1.0 and ``Connection: close``;
* request bodies by ``Content-Length`` or chunked, with a size limit enforced
  while reading: an over-limit request is handed to the handler at once with
  ``too_large`` set and no body, and its connection is closed after the answer
  (the rest of its body is read and dropped for a moment first, so the client
  sees the answer rather than a reset);
* ``Expect: 100-continue`` (and 417 for any other expectation);
* answers whole (``Response``) or streamed (``Request.start_stream``: chunked
  on HTTP/1.1, to the end of the connection on 1.0, with write flow control);
* HEAD answered without a body; a ``Date`` header cached per second;
* a client that disconnects cancels its handler — how the proxy learns to
  close the upstream connection, which is how an engine stops generating;
* malformed requests, heads over ``MAX_HEAD`` bytes: a specific error answer
  (400 / 431 / 414 / 501) and the connection closed; the server keeps running;
* idle connections (keep-alive, or a request head that stalls) closed after
  ``idle_timeout``; ``close(grace)`` stops accepting, lets requests in flight
  finish for ``grace`` seconds, then cancels them.

Bounds on what clients can make it hold (docs/architecture.md,
"Threat models"):

* ``max_connections`` open at once: one more is answered 503 and closed (its
  request bytes read and dropped for a moment first, so the answer is not lost
  to a reset), without entering ``connections``;
* ``request_read_timeout``: a request's head and body must arrive within it
  of the request's first byte — a deadline, not an idle timer, so a client
  trickling a byte at a time is closed at it all the same (408 when nothing
  else is due on the connection);
* ``max_buffered_body_bytes``: request bodies held at once, every connection
  together, from their first byte until their handler returns (or their
  connection closes, when they are dropped at once): a body that would go over
  it is answered 503 and its connection closed;
* accepting at EMFILE/ENFILE: asyncio's loop retries after a second and logs
  each failure — here logged at most once per ``LOG_EVERY`` seconds (uvloop,
  the gateway's loop, accepts with libuv's spare descriptor and closes at once:
  the client sees a prompt close, never a hang). A 503 needs a descriptor to be
  sent on, so the real bound is ``max_connections`` sized under the limit.

Error bodies of the server's own refusals come from ``on_error`` (the gateway
answers in OpenAI's error shape).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
import ssl
import time
import weakref
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus
from urllib.parse import unquote

import httptools

log = logging.getLogger("llmgw.gateway.http")

MAX_HEAD = 64 * 1024  # request line + headers
MAX_URL = 8 * 1024
MAX_QUEUED = 8  # pipelined requests held before reading pauses
DISCARD_TIME = 1.0  # how long an over-limit body is read and dropped before closing
_HIGH_WATER = 64 * 1024  # transport write buffer high-water mark (streams wait for drain above it)
REFUSE_LINGER = 0.25  # how long a connection over max_connections is read and dropped before closing
MAX_LINGERING = 64  # more refused connections than this at once are closed without the linger
LOG_EVERY = 10.0  # seconds between two log lines of the same throttled kind
# The loop exception handlers installed by _watch_accept_errors, so a second server on
# the same loop does not wrap the first one's filter again.
_ACCEPT_FILTERS: weakref.WeakSet[Callable[..., object]] = weakref.WeakSet()


class Throttled:
    """A warning logged at most once per ``every`` seconds, with how many were not."""

    def __init__(self, logger: logging.Logger, every: float = LOG_EVERY):
        self.logger = logger
        self.every = every
        self.last = -every
        self.skipped = 0

    def warning(self, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self.last < self.every:
            self.skipped += 1
            return
        skipped, self.skipped, self.last = self.skipped, 0, now
        if skipped:
            msg += " (and %d more like it since the last line)"
            args = (*args, skipped)
        self.logger.warning(msg, *args)


_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}


def _status_line(status: int, version: bytes) -> bytes:
    version = b"1.0" if version == b"1.0" else b"1.1"  # an HTTP/1.x server answers 1.x
    key = status if version == b"1.1" else -status
    line = _STATUS_LINES.get(key)
    if line is None:
        line = _STATUS_LINES[key] = b"HTTP/%s %d %s\r\n" % (version, status, _REASONS.get(status, b"Unknown"))
    return line


def _header_lines(headers: dict | bytes | None) -> bytes:
    """``Name: value`` lines; bytes are taken as lines already encoded (the hot path's)."""
    if not headers:
        return b""
    if isinstance(headers, bytes):
        return headers
    out = []
    for name, value in headers.items():
        v = str(value)
        if "\r" in v or "\n" in v:  # never let a value split the head
            raise ValueError(f"header {name!r} has a line break in its value")
        out.append(f"{name}: {v}\r\n".encode("latin-1"))
    return b"".join(out)


class Response:
    """A whole answer. ``headers``: name -> value, or header lines encoded
    already; Content-Length, Date and Connection are the server's to set."""

    __slots__ = ("body", "head", "status")

    def __init__(self, status: int = 200, body: bytes = b"", headers: dict | bytes | None = None, content_type: str = "application/json"):
        self.status = status
        self.body = body
        # Encoded now: the hot path builds a response in one place and the server only frames it.
        self.head = b"Content-Type: %s\r\n%s" % (content_type.encode("latin-1"), _header_lines(headers))

    @classmethod
    def json(cls, value, status: int = 200, headers: dict | None = None) -> Response:
        return cls(status, json.dumps(value).encode(), headers)


class Request:
    """One parsed request. ``headers``: lower-case name -> value, as bytes
    (repeated names joined with ``, ``); ``header()`` decodes one."""

    __slots__ = ("_path", "body", "conn", "headers", "keep_alive", "method", "stream", "too_large", "url", "version")

    def __init__(self, conn: HttpConnection, method: str, url: bytes, headers: dict, version: bytes, keep_alive: bool):
        self.conn = conn
        self.method = method
        self.url = url
        self.headers = headers
        self.version = version
        self.keep_alive = keep_alive
        self.body = b""
        self.too_large = False  # the body was over the limit: it was not read, body is empty
        self.stream: Stream | None = None
        self._path: str | None = None

    def header(self, name: str) -> str | None:
        v = self.headers.get(name.encode("latin-1"))
        return None if v is None else v.decode("latin-1")

    @property
    def raw_path(self) -> str:
        """The path as sent (percent escapes kept), without the query."""
        url = self.url
        if not url.startswith(b"/"):  # absolute form (a proxy-style request line) or '*'
            try:
                url = httptools.parse_url(url).path or b"/"
            except httptools.HttpParserInvalidURLError:
                url = b"/"
        return url.partition(b"?")[0].decode("utf-8", "surrogateescape")

    @property
    def path(self) -> str:
        """The path, percent-decoded."""
        p = self._path
        if p is None:
            raw = self.raw_path
            p = self._path = unquote(raw, errors="surrogateescape") if "%" in raw else raw
        return p

    def start_stream(self, status: int, headers: dict | bytes, content_type: str) -> Stream:
        """Send the head of a streamed answer; write the body with ``Stream.write``."""
        self.stream = s = Stream(self)
        s.start(status, headers, content_type)
        return s


class Stream:
    """A streamed answer: chunked on HTTP/1.1, to the end of the connection on 1.0."""

    __slots__ = ("chunked", "ended", "head_only", "request")

    def __init__(self, request: Request):
        self.request = request
        self.chunked = request.version == b"1.1"
        self.ended = False
        self.head_only = request.method == "HEAD"

    def start(self, status: int, headers: dict | bytes, content_type: str) -> None:
        conn = self.request.conn
        if not self.chunked:
            self.request.keep_alive = False
        framing = b"Transfer-Encoding: chunked\r\n" if self.chunked else b""
        conn.write_head(self.request, status, b"Content-Type: %s\r\n%s%s" % (content_type.encode("latin-1"), _header_lines(headers), framing))

    async def write(self, data: bytes) -> None:
        """Send ``data`` now; waits while the client is slower than the stream. Raises
        ConnectionResetError once the client has gone."""
        conn = self.request.conn
        if conn.transport is None or conn.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        if data and not self.head_only:
            conn.transport.write(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)
        if conn.write_paused:
            await conn.drain()

    async def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        conn = self.request.conn
        if conn.transport is None or conn.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        if self.chunked and not self.head_only:
            conn.transport.write(b"0\r\n\r\n")


Handler = Callable[[Request], Awaitable["Response | Stream"]]
ErrorBody = Callable[[int, str], Response]


def plain_error(status: int, message: str) -> Response:
    return Response(status, message.encode() + b"\n", content_type="text/plain; charset=utf-8")


class _Date:
    """The Date header, formatted once a second."""

    def __init__(self):
        self.second = 0
        self.line = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.line = b"Date: %s\r\n" % formatdate(now, usegmt=True).encode()
        return self.line


class HttpConnection(asyncio.Protocol):
    """One client connection: bytes in -> requests, one handled at a time."""

    def __init__(self, server: HttpServer):
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: collections.deque[Request] = collections.deque()
        self.task: asyncio.Task | None = None  # the handler running now
        self.write_paused = False
        self.drain_waiter: asyncio.Future | None = None
        self.read_paused = False
        self.last_active = 0.0
        self.closing = False  # answer what is in flight, then close
        self.discarding: asyncio.TimerHandle | None = None
        self.refused = False  # over max_connections: answered 503, its bytes are dropped
        self.reading_since = 0.0  # loop time a request's first byte came; 0: none being read
        self.held = 0  # body bytes of this connection counted in server.buffered
        self._body_held = 0  # of which: the body being read now
        # The request being parsed
        self._url = b""
        self._headers: dict = {}
        self._head_bytes = 0
        self._in_head = False  # between on_message_begin and on_headers_complete
        self._heads = 0  # heads begun on this connection
        self._head_raw = 0  # bytes of reads spent wholly inside the current head
        self._continue_due = False  # a 100 Continue owed once the answers before it are sent
        self._body: list[bytes] = []
        self._body_len = 0
        self._parsing: Request | None = None  # dispatched early (too large) but still being read

    # -- asyncio.Protocol ------------------------------------------------------------
    def connection_made(self, transport):
        self.transport = transport
        server = self.server
        if len(server.connections) >= server.max_connections:
            self._refuse_connection()
            return
        transport.set_write_buffer_limits(high=_HIGH_WATER)
        self.last_active = self.loop.time()
        server.connections.add(self)

    def _refuse_connection(self) -> None:
        """Over max_connections: 503, then the client's request bytes are dropped for a
        moment (a close with unread bytes is a reset that can destroy the answer)."""
        server = self.server
        self.refused = True
        server.refused("connection_limit", "gateway at its connection limit (%d): new connections answered 503", server.max_connections)
        req = Request(self, "GET", b"/", {}, b"1.1", False)
        resp = server.error_body(503, f"the gateway has its maximum of {server.max_connections} client connections open; try again shortly")
        self.write_head(req, 503, resp.head + b"Retry-After: 1\r\n", resp.body)
        if server.lingering >= MAX_LINGERING:
            self._close()
            return
        server.lingering += 1
        self.discarding = self.loop.call_later(REFUSE_LINGER, self._close)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        self.last_active = self.loop.time()
        head = self._heads if self._in_head else -1
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, _Refused):
                return  # answered and closing
            log.error("error in the HTTP server reading a request", exc_info=e.__context__ or e)
            self._answer_and_close(500, "internal error in the gateway; see its log")
        except httptools.HttpParserUpgrade:
            self._answer_and_close(501, "protocol upgrades are not supported")
        except httptools.HttpParserInvalidMethodError:
            self._answer_and_close(*_bad_method(data))
        except httptools.HttpParserError as e:
            if self.discarding is not None:  # the rest of a refused body: nobody reads it
                self._close()
                return
            self._answer_and_close(400, f"malformed HTTP request: {e}")
        else:
            # httptools holds a header line whole until it ends before on_header sees it, so
            # on_header alone cannot stop one endless line: a read that began and ended inside
            # the same head is all head, and counts against MAX_HEAD as it arrives.
            if self._in_head and head == self._heads:
                self._head_raw += len(data)
                if self._head_raw > MAX_HEAD:
                    self._answer_and_close(431, f"the request head is larger than {MAX_HEAD} bytes")

    def eof_received(self):
        # A client that shuts its side has gone (HTTP clients do not half-close):
        # returning None lets the transport close, which cancels the handler.
        return None

    def connection_lost(self, exc):
        server = self.server
        if self.refused:
            if self.discarding is not None:
                server.lingering -= 1
                self.discarding.cancel()
            self.transport = None
            return
        server.connections.discard(self)
        self.transport = None
        if self.task is not None:
            self.task.cancel()  # the client left: its handler stops, which closes upstream
        self.queue.clear()
        # Every body of this connection is let go now (the running handler's too: it is
        # cancelled), so nothing it held counts against the other clients.
        self._body = []
        self._body_held = 0
        self._parsing = None
        if self.held:
            server.buffered -= self.held
            server.dropped += self.held
            self.held = 0
        if self.drain_waiter is not None and not self.drain_waiter.done():
            self.drain_waiter.set_exception(ConnectionResetError("the client closed the connection"))
        if self.discarding is not None:
            self.discarding.cancel()

    def pause_writing(self):
        self.write_paused = True

    def resume_writing(self):
        self.write_paused = False
        w = self.drain_waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def drain(self) -> None:
        if self.transport is None:
            raise ConnectionResetError("the client closed the connection")
        self.drain_waiter = self.loop.create_future()
        try:
            await self.drain_waiter
        finally:
            self.drain_waiter = None

    # -- httptools callbacks ---------------------------------------------------------
    def on_message_begin(self):
        self.reading_since = self.loop.time()
        if self._body_held:
            self._drop_body()
        self._url = b""
        self._headers = {}
        self._head_bytes = 0
        self._in_head = True
        self._heads += 1
        self._head_raw = 0
        self._continue_due = False
        self._body = []
        self._body_len = 0
        self._parsing = None

    def on_url(self, url: bytes):
        self._url += url
        if len(self._url) > MAX_URL:
            self._refuse(414, f"the request target is longer than {MAX_URL} bytes")

    def on_header(self, name: bytes, value: bytes):
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD:
            self._refuse(431, f"the request head is larger than {MAX_HEAD} bytes")
        name = name.lower()
        old = self._headers.get(name)
        self._headers[name] = value if old is None else old + b", " + value

    def on_headers_complete(self):
        self._in_head = False
        p = self.parser
        if p.should_upgrade():
            # Refused here, not on HttpParserUpgrade: llhttp raises that only after
            # on_message_complete, when the request is already with a handler and the 501
            # could no longer be sent.
            self._refuse(501, "protocol upgrades are not supported")
        req = Request(self, p.get_method().decode("latin-1"), self._url, self._headers, p.get_http_version().encode(), p.should_keep_alive())
        if self.closing:
            req.keep_alive = False
        declared = self._headers.get(b"content-length")
        limit = self.server.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            self._too_large(req)
            return
        expect = self._headers.get(b"expect")
        if expect is not None and req.version == b"1.1":
            if expect.lower() != b"100-continue":
                self._refuse(417, f"unsupported expectation: {expect.decode('latin-1')!r}")
            if self.task is None:
                self._send_continue()
            else:
                # Answers before it are still due: a 100 now would be read as theirs. It is
                # sent when its turn comes (_finish).
                self._continue_due = True
        self._parsing = req

    def on_body(self, body: bytes):
        req = self._parsing
        if req is None or req.too_large:
            return  # a refused body: read and dropped
        n = len(body)
        self._body_len += n
        server = self.server
        if self._body_len > server.max_body_bytes:
            self._drop_body()
            self._too_large(req)
            return
        if server.buffered + n > server.max_buffered_body_bytes:
            self._drop_body()
            server.refused("body_buffer_full", "request bodies held reached max_buffered_body_bytes (%d): bodies answered 503", server.max_buffered_body_bytes)
            self._refuse(503, f"the gateway holds its maximum of request bodies ({server.max_buffered_body_bytes} bytes); try again shortly")
        server.buffered += n
        self.held += n
        self._body_held += n
        self._body.append(body)

    def _drop_body(self) -> None:
        """Let go of the body being read (refused): its bytes no longer count."""
        self._body = []
        n = self._body_held
        self._body_held = 0
        self.held -= n
        self.server.buffered -= n
        self.server.dropped += n

    def on_message_complete(self):
        self.reading_since = 0.0
        req = self._parsing
        self._parsing = None
        self._continue_due = False  # the body came without it
        if req is None:
            return
        if req.too_large:  # answered already; the body it did send has now been dropped
            self._close_after_answer()
            return
        body = self._body
        req.body = body[0] if len(body) == 1 else b"".join(body)
        self._body = []
        self._body_held = 0  # still counted (held) until its handler returns
        self._dispatch(req)

    # -- requests ------------------------------------------------------------------
    def _too_large(self, req: Request) -> None:
        """Hand an over-limit request to the handler now (it answers 413, or 401
        first); the body is dropped as it comes, and the connection closed."""
        req.too_large = True
        req.keep_alive = False
        self.closing = True
        self.reading_since = 0.0  # what is left is dropped, and closed after DISCARD_TIME
        self._parsing = req
        self._dispatch(req)
        if self.discarding is None:
            self.discarding = self.loop.call_later(DISCARD_TIME, self._close)

    def _close_after_answer(self) -> None:
        if self.task is None and not self.queue:
            self._close()

    def _dispatch(self, req: Request) -> None:
        if self.task is None:
            self._start(req)
        else:
            self.queue.append(req)
            if len(self.queue) >= MAX_QUEUED and not self.read_paused and self.transport is not None:
                self.read_paused = True
                self.transport.pause_reading()

    def _start(self, req: Request) -> None:
        self.task = self.loop.create_task(self._run(req))

    async def _run(self, req: Request) -> None:
        try:
            resp = await self.server.handler(req)
        except asyncio.CancelledError:
            return  # the client left (connection_lost) or the server stopped
        except Exception:
            log.exception("unhandled error answering %s %s", req.method, req.url[:200])
            if req.stream is None:
                resp = self.server.error_body(500, "internal error in the gateway; see its log")
            else:
                req.keep_alive = False  # a stream cut short: the client must not wait for more
                resp = req.stream
        finally:
            self.task = None
            n = len(req.body)
            if n and self.held >= n:  # (0 once the connection closed: all let go then)
                self.held -= n
                self.server.buffered -= n
        self._finish(req, resp)

    def _finish(self, req: Request, resp: Response | Stream) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if isinstance(resp, Response):
            self.write_head(req, resp.status, resp.head, resp.body)
        elif not resp.ended:  # a handler that returned a stream it did not end: the stream is cut short
            req.keep_alive = False
        if not req.keep_alive or self.server.stopping:
            if req.too_large and self._parsing is req and not self.server.stopping:
                return  # its body is still arriving: closed when it ends or after DISCARD_TIME
            self._close()
            return
        self.last_active = self.loop.time()
        if self.queue:
            if self.read_paused and len(self.queue) < MAX_QUEUED:
                self.read_paused = False
                self.transport.resume_reading()
            self._start(self.queue.popleft())
        elif self.closing:
            self._close()
        elif self._continue_due:
            self._continue_due = False
            self._send_continue()

    def _send_continue(self) -> None:
        if self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def write_head(self, req: Request, status: int, head: bytes, body: bytes | None = None) -> None:
        """Write a status line and headers (``head``: whole lines), then ``body`` if whole."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        keep = req.keep_alive and not self.server.stopping and not self.closing
        if not keep:
            req.keep_alive = False
        conn = (b"" if req.version == b"1.1" else b"Connection: keep-alive\r\n") if keep else b"Connection: close\r\n"
        length = b"" if body is None else b"Content-Length: %d\r\n" % len(body)
        data = b"%s%s%s%sServer: llmgw\r\n%s\r\n" % (_status_line(status, req.version), head, length, conn, self.server.date.get())
        if body and req.method != "HEAD":
            data += body
        self.transport.write(data)

    def _refuse(self, status: int, message: str) -> None:
        """From a parser callback: answer, close, and stop parsing."""
        self._answer_and_close(status, message)
        raise _Refused()

    def _answer_and_close(self, status: int, message: str) -> None:
        """A request the server itself cannot take: say why, and close."""
        if self.transport is not None and not self.transport.is_closing() and self.task is None:
            req = Request(self, "GET", b"/", {}, b"1.1", False)
            resp = self.server.error_body(status, message)
            self.write_head(req, status, resp.head, resp.body)
        # With a handler running, its answer is lost to a client that broke the protocol: close.
        self._close()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()  # flushes what was written first

    def _read_timed_out(self, timeout: float) -> None:
        self.server.refused("read_timeout", "a request not received within request_read_timeout (%gs): closed", timeout)
        self._answer_and_close(408, f"the request was not received within {timeout:g}s")

    @property
    def idle(self) -> bool:
        return self.task is None and not self.queue


_METHOD_LINE = re.compile(rb"([A-Z][A-Z_-]{0,31}) \S+ HTTP/\d\.\d\r?\n")


def _bad_method(data: bytes) -> tuple[int, str]:
    """llhttp reports any unknown first word as a bad method; say which it was:
    a TLS handshake on this plain-HTTP port, a method we do not serve, or not HTTP."""
    if data[:1] == b"\x16" and data[1:2] == b"\x03":
        return 400, "a TLS handshake arrived on a plain-HTTP port: use http://, not https://"
    # The data may start mid-stream (pipelining); look for a request line anywhere in it.
    m = _METHOD_LINE.search(data)
    if m:
        return 501, f"the method {m.group(1).decode()} is not supported"
    return 400, "malformed HTTP request: not an HTTP/1.x request line"


class _Refused(Exception):
    """Stops the parser after a refusal (raised out of a callback, caught in data_received)."""


class HttpServer:
    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int,
        error_body: ErrorBody = plain_error,
        idle_timeout: float = 75.0,
        max_connections: int = 4096,
        request_read_timeout: float = 30.0,
        max_buffered_body_bytes: int = 256 * 1024 * 1024,
        on_refused: Callable[[str], None] | None = None,
    ):
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.error_body = error_body
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self.request_read_timeout = request_read_timeout
        self.max_buffered_body_bytes = max_buffered_body_bytes
        self.on_refused = on_refused  # called with the reason of each refusal (metrics)
        self.buffered = 0  # request body bytes held, all connections together
        self.dropped = 0  # body bytes let go unanswered (refused, or their client left): so far, in all
        self.lingering = 0  # refused connections not closed yet
        self._throttled: dict[str, Throttled] = {}
        self.loop = asyncio.get_running_loop()
        self.connections: set[HttpConnection] = set()
        self.date = _Date()
        self.stopping = False
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int, *, backlog: int = 1024, tls: ssl.SSLContext | None = None, reuse_port: bool = False) -> int:
        """Listen (HTTPS with ``tls``); returns the bound port (``port`` may be 0).
        ``reuse_port``: SO_REUSEPORT, one of several processes' sockets on the port."""
        self._server = await self.loop.create_server(lambda: HttpConnection(self), host, port, backlog=backlog, ssl=tls, reuse_port=reuse_port or None)
        self._watch_accept_errors()
        self._sweeper = self.loop.call_later(self._sweep_every, self._sweep)
        return self._server.sockets[0].getsockname()[1]

    @property
    def _sweep_every(self) -> float:
        return min(self.idle_timeout, self.request_read_timeout / 2, 5.0)

    def refused(self, reason: str, msg: str, *args) -> None:
        """Count a refusal and log it, at most once per LOG_EVERY seconds per reason."""
        if self.on_refused is not None:
            self.on_refused(reason)
        t = self._throttled.get(reason)
        if t is None:
            t = self._throttled[reason] = Throttled(log)
        t.warning(msg, *args)

    def _watch_accept_errors(self) -> None:
        """asyncio's loop reports every failed accept (EMFILE: one per queued connection,
        every second); say it once in a while instead, in the gateway's words."""
        loop = self.loop
        previous = loop.get_exception_handler()
        if previous in _ACCEPT_FILTERS:
            return

        def handler(loop, context):
            if str(context.get("message", "")).startswith("socket.accept() out of system resource"):
                exc = context.get("exception")
                self.refused("out_of_fds", "gateway out of file descriptors accepting a connection (%s): connections wait in the backlog", exc)
                return
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        _ACCEPT_FILTERS.add(handler)
        loop.set_exception_handler(handler)

    def _sweep(self) -> None:
        """Close connections that sent no byte and had no answer pending for idle_timeout,
        and those whose request did not all arrive within request_read_timeout."""
        now = self.loop.time()
        oldest_ok = now - self.idle_timeout
        read_timeout = self.request_read_timeout
        late = now - read_timeout
        for c in list(self.connections):
            if c.idle and c.last_active < oldest_ok:
                c._close()
            elif 0.0 < c.reading_since < late and not c.read_paused and not c._continue_due:
                # Not while reading is paused (requests queue behind a handler) or a 100
                # Continue is owed: then the wait is the server's, not the client's.
                c._read_timed_out(read_timeout)
        self._sweeper = self.loop.call_later(self._sweep_every, self._sweep)

    async def close(self, grace: float) -> None:
        """Stop accepting; close idle connections; let requests in flight finish for ``grace`` seconds."""
        self.stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        deadline = self.loop.time() + grace
        while True:
            for c in list(self.connections):
                if c.idle:
                    c._close()
            busy = [c for c in self.connections if not c.idle]
            if not busy or self.loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        for c in list(self.connections):
            if c.task is not None:
                c.task.cancel()
            c._close()
        # Let the transports' close callbacks run.
        for _ in range(3):
            if not self.connections:
                break
            await asyncio.sleep(0)
