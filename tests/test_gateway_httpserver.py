"""The gateway's own HTTP/1.1 server (``httpserver.py``) over real sockets.

Every test speaks raw bytes to a real ``HttpServer`` on 127.0.0.1 and reads
the answer's exact framing (status line, headers, Content-Length / chunked /
to-EOF body), with small handlers defined here: keep-alive and HTTP/1.0,
pipelining, chunked uploads, the body limit, ``Expect``, HEAD, malformed
input, streamed answers, client disconnects, handler errors, idle timeouts,
``close(grace)``, and write flow control towards a slow reader. The tests that
lean on transport behaviour run once more on uvloop, the gateway's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import socket
import time
from dataclasses import dataclass
from urllib.parse import parse_qs

import pytest

from llmgw.services.gateway import errors
from llmgw.services.gateway.httpserver import DISCARD_TIME, MAX_HEAD, MAX_QUEUED, MAX_URL, HttpServer, Request, Response

from .waiting import eventually

HOST = "127.0.0.1"
LIMIT = 1000  # max_body_bytes of every server here
READ_TIMEOUT = 5.0  # no answer within this is a hang


# -- reading answers off the wire ------------------------------------------------------
@dataclass
class Answer:
    version: str  # "HTTP/1.1"
    status: int
    reason: str
    headers: dict[str, str]  # lower-case name -> value
    body: bytes  # de-chunked
    raw_body: bytes  # the bytes after the head, exactly as sent
    chunks: list[bytes] | None = None  # the data chunks of a chunked body, in order

    def json(self):
        return json.loads(self.body)


async def _read_answer(reader: asyncio.StreamReader, method: str) -> Answer:
    line = await reader.readline()
    if not line:
        raise EOFError("the connection closed before an answer")
    assert line.endswith(b"\r\n"), f"status line without CRLF: {line!r}"
    version, status, reason = line[:-2].decode("latin-1").split(" ", 2)
    assert version in ("HTTP/1.0", "HTTP/1.1") and status.isdigit() and len(status) == 3, f"bad status line {line!r}"
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        assert line.endswith(b"\r\n"), f"header line without CRLF: {line!r}"
        if line == b"\r\n":
            break
        name, sep, value = line[:-2].decode("latin-1").partition(":")
        assert sep and name == name.strip() and name, f"bad header line {line!r}"
        assert name.lower() not in headers, f"header {name} sent twice"
        headers[name.lower()] = value.strip()
    code = int(status)
    if method == "HEAD" or 100 <= code < 200 or code in (204, 304):
        return Answer(version, code, reason, headers, b"", b"")
    if headers.get("transfer-encoding", "").lower() == "chunked":
        assert "content-length" not in headers, "both Content-Length and chunked"
        raw, chunks = bytearray(), []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            raw += size_line
            size = int(size_line[:-2].split(b";")[0], 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    t = await reader.readuntil(b"\r\n")
                    raw += t
                    if t == b"\r\n":
                        break
                break
            data = await reader.readexactly(size + 2)
            assert data.endswith(b"\r\n"), f"chunk not followed by CRLF: {data[-10:]!r}"
            raw += data
            chunks.append(data[:-2])
        return Answer(version, code, reason, headers, b"".join(chunks), bytes(raw), chunks)
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
        return Answer(version, code, reason, headers, body, body)
    body = await reader.read()  # to the end of the connection
    return Answer(version, code, reason, headers, body, body)


async def read_answer(reader: asyncio.StreamReader, method: str = "GET", timeout: float = READ_TIMEOUT) -> Answer:
    """One answer: fails on bad framing, a close before it ends, or no answer within ``timeout``."""
    return await asyncio.wait_for(_read_answer(reader, method), timeout)


async def expect_closed(reader: asyncio.StreamReader, timeout: float = 2.0) -> None:
    """The server closes the connection (within ``timeout``) without sending anything more."""
    try:
        rest = await asyncio.wait_for(reader.read(), timeout)
    except ConnectionResetError:
        rest = b""
    assert rest == b"", f"bytes after the answer: {rest[:200]!r}"


async def still_open(reader: asyncio.StreamReader, wait: float = 0.1) -> bool:
    """True when, for ``wait`` seconds, the server neither closes nor sends anything."""
    try:
        data = await asyncio.wait_for(reader.read(1), wait)
    except TimeoutError:
        return True
    assert data == b"", f"unexpected bytes from the server: {data!r}"
    return False


# -- the handlers --------------------------------------------------------------------
def _query(req: Request) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(req.url.partition(b"?")[2].decode()).items()}


def echo(req: Request) -> Response:
    return Response.json({
        "method": req.method,
        "path": req.path,
        "query": _query(req),
        "version": req.version.decode(),
        "body": req.body.decode("latin-1"),
        "headers": {k.decode(): v.decode("latin-1") for k, v in req.headers.items()},
        "too_large": req.too_large,
    })  # fmt: skip


class App:
    """The handler: routes by path; records what it saw for the tests to check."""

    def __init__(self):
        self.seen: list[Request] = []
        self.log: list[tuple[str, str]] = []  # (id, "start" | "end"), for ordering checks
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.finished = asyncio.Event()
        self.written = 0  # bytes /big has written so far
        self.max_buffered = 0  # the most /big ever saw waiting in the transport's write buffer
        self.stream_error: BaseException | None = None
        self.big_conn = None  # the connection /big writes to
        self.writing = False  # /big is inside a write (waiting, if the transport is paused)

    async def __call__(self, req: Request):
        self.seen.append(req)
        q = _query(req)
        path = req.path
        if req.too_large:  # as the gateway does (server.py): answer at once, without the body
            return errors.too_large(LIMIT)
        if path == "/echo":
            return echo(req)
        if path == "/fixed":
            return Response(200, b"x" * 123, content_type="text/plain")
        if path == "/sleep":
            self.log.append((q["id"], "start"))
            await asyncio.sleep(float(q["s"]))
            self.log.append((q["id"], "end"))
            return echo(req)
        if path == "/stream":
            s = req.start_stream(200, {"X-Stream": "yes"}, "text/event-stream")
            for i in range(int(q.get("n", 3))):
                await s.write(b"data: %d\n\n" % i)
                await asyncio.sleep(0)
            await s.end()
            return s
        if path == "/block":
            self.started.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            self.finished.set()
            return Response.json({"released": True})
        if path == "/raise":
            raise RuntimeError("boom")
        if path == "/stream-raise":
            s = req.start_stream(200, {}, "text/event-stream")
            await s.write(b"data: first\n\n")
            raise RuntimeError("boom mid-stream")
        if path == "/stream-forever":
            s = req.start_stream(200, {}, "text/event-stream")
            self.started.set()
            try:
                while True:
                    await s.write(b"data: tick\n\n")
                    await asyncio.sleep(0.01)
            except BaseException as e:  # how the handler learns the client left
                self.stream_error = e
                self.cancelled.set()
                raise
        if path == "/big":
            total, piece = int(q["total"]), b"z" * int(q["chunk"])
            s = req.start_stream(200, {}, "application/octet-stream")
            self.big_conn = req.conn
            self.started.set()
            while self.written < total:
                self.writing = True
                await s.write(piece)
                self.writing = False
                self.written += len(piece)
                self.max_buffered = max(self.max_buffered, req.conn.transport.get_write_buffer_size())
            await s.end()
            self.finished.set()
            return s
        return Response.json({"error": "no such path"}, status=404)


class Served:
    def __init__(self, server: HttpServer, port: int, app: App):
        self.server, self.port, self.app = server, port, app
        self.writers: list[asyncio.StreamWriter] = []

    async def connect(self, **kw) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        r, w = await (asyncio.open_connection(**kw) if "sock" in kw else asyncio.open_connection(HOST, self.port, **kw))
        self.writers.append(w)
        return r, w

    async def serves_a_new_connection(self) -> None:
        r, w = await self.connect()
        w.write(b"GET /echo?after=1 HTTP/1.1\r\nHost: t\r\n\r\n")
        a = await read_answer(r)
        assert a.status == 200 and a.json()["query"] == {"after": "1"}
        w.close()


@contextlib.asynccontextmanager
async def serve(app: App | None = None, *, idle_timeout: float = 30.0, grace: float = 0.5):
    app = app or App()
    server = HttpServer(app, max_body_bytes=LIMIT, error_body=errors.refusal, idle_timeout=idle_timeout)
    port = await server.start(HOST, 0)
    s = Served(server, port, app)
    try:
        yield s
    finally:
        await server.close(grace)
        for w in s.writers:
            w.close()


def assert_refusal(a: Answer, status: int, code: str) -> None:
    """The server's own refusal: errors.refusal's JSON body, and the connection to be closed."""
    assert a.status == status, (a.status, a.body)
    assert a.headers["content-type"] == "application/json"
    assert a.headers["connection"] == "close"
    err = a.json()["error"]
    assert err["code"] == code and err["message"] and err["param"] is None
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")


# -- 1. keep-alive and HTTP/1.0 ------------------------------------------------------------
async def test_two_requests_on_one_connection_are_both_answered_in_order():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"GET /echo?n=1 HTTP/1.1\r\nHost: t\r\n\r\n")
        first = await read_answer(r)
        w.write(b"POST /echo?n=2 HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello")
        second = await read_answer(r)
        assert (first.status, first.json()["method"], first.json()["query"]) == (200, "GET", {"n": "1"})
        assert (second.status, second.json()["method"], second.json()["body"]) == (200, "POST", "hello")
        assert "connection" not in first.headers  # HTTP/1.1 keeps the connection by default
        assert len(s.app.seen) == 2 and s.app.seen[0].conn is s.app.seen[1].conn
        assert await still_open(r)


async def test_http10_without_keep_alive_gets_connection_close_and_a_close():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"GET /echo HTTP/1.0\r\n\r\n")
        a = await read_answer(r)
        assert a.status == 200 and a.version == "HTTP/1.0" and a.json()["version"] == "1.0"
        assert a.headers["connection"] == "close"
        await expect_closed(r)


async def test_http10_with_keep_alive_stays_open():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"GET /echo?n=1 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        first = await read_answer(r)
        assert first.status == 200 and first.version == "HTTP/1.0"
        assert first.headers["connection"] == "keep-alive"
        w.write(b"GET /echo?n=2 HTTP/1.0\r\n\r\n")  # the second without keep-alive: answered, then closed
        second = await read_answer(r)
        assert second.json()["query"] == {"n": "2"} and second.headers["connection"] == "close"
        await expect_closed(r)


async def test_http11_with_connection_close_closes():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"GET /echo HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        a = await read_answer(r)
        assert a.status == 200 and a.version == "HTTP/1.1" and a.headers["connection"] == "close"
        await expect_closed(r)


# -- 13. Date, Server, the status line's version --------------------------------------------
async def test_date_and_server_headers_and_the_status_line_version():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"GET /fixed HTTP/1.1\r\nHost: t\r\n\r\n")
        a = await read_answer(r)
        assert a.version == "HTTP/1.1" and a.reason == "OK"
        assert a.headers["server"] == "llmgw"
        assert a.headers["content-type"] == "text/plain" and a.headers["content-length"] == "123"
        date = email.utils.parsedate_to_datetime(a.headers["date"])
        assert a.headers["date"].endswith(" GMT") and abs(date.timestamp() - time.time()) < 5
        r, w = await s.connect()
        w.write(b"GET /fixed HTTP/1.0\r\n\r\n")
        a = await read_answer(r)
        assert a.version == "HTTP/1.0" and a.status == 200 and a.headers["server"] == "llmgw" and "date" in a.headers


# -- 2. pipelining ----------------------------------------------------------------------------
async def test_pipelined_requests_are_answered_one_at_a_time_in_order():
    async with serve() as s:
        r, w = await s.connect()
        # The first sleeps longest: answered as they finish, the order would be b, c, a.
        w.write(
            b"POST /sleep?id=a&s=0.15 HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nAAA"
            b"GET /sleep?id=b&s=0 HTTP/1.1\r\nHost: t\r\n\r\n"
            b"POST /sleep?id=c&s=0.05 HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nCC\r\n0\r\n\r\n"
        )
        answers = [await read_answer(r) for _ in range(3)]
        assert [a.json()["query"]["id"] for a in answers] == ["a", "b", "c"]
        assert [a.json()["body"] for a in answers] == ["AAA", "", "CC"]
        # One at a time: each handler started after the one before it ended.
        assert s.app.log == [("a", "start"), ("a", "end"), ("b", "start"), ("b", "end"), ("c", "start"), ("c", "end")]


async def test_many_pipelined_requests_pause_reading_and_are_all_answered():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"GET /block HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.wait_for(s.app.started.wait(), 2)
        conn = s.app.seen[0].conn
        n = 3 * MAX_QUEUED
        for i in range(n):
            w.write(b"GET /echo?i=%d HTTP/1.1\r\nHost: t\r\n\r\n" % i)
            await asyncio.sleep(0.002)  # pacing: separate writes, so the server reads them one by one
        # MAX_QUEUED requests wait behind the running one: the server stops reading more.
        await eventually(lambda: len(conn.queue) >= MAX_QUEUED and not conn.transport.is_reading(), what=f"{MAX_QUEUED} queued and reading paused", timeout=5)
        s.app.release.set()
        assert (await read_answer(r)).json() == {"released": True}
        answers = [await read_answer(r) for _ in range(n)]
        assert [int(a.json()["query"]["i"]) for a in answers] == list(range(n))
        await eventually(conn.transport.is_reading, what="reading again once they are answered", timeout=5)
        w.write(b"GET /echo?i=last HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await read_answer(r)).json()["query"] == {"i": "last"}


# -- 3. chunked request bodies -----------------------------------------------------------------
async def test_chunked_body_in_several_writes_with_an_extension_arrives_whole():
    async with serve() as s:
        r, w = await s.connect()
        pieces = [
            b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"5;name=value\r\nhel",  # a chunk extension, and a chunk split across writes
            b"lo\r\n",
            b"1",  # a size line split across writes
            b"0\r\n, world! and mor\r\n",
            b"6\r\ne data\r\n0\r\n",
            b"X-Trailer: 1\r\n\r\n",
        ]
        for p in pieces:
            w.write(p)
            await w.drain()
            await asyncio.sleep(0.01)
        a = await read_answer(r)
        assert a.status == 200 and a.json()["body"] == "hello, world! and more data"
        assert len(s.app.seen) == 1
        w.write(b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n")  # and the connection goes on
        assert (await read_answer(r)).status == 200


# -- 4. the body limit -----------------------------------------------------------------------
async def test_declared_body_over_the_limit_is_answered_413_while_the_client_still_sends():
    async with serve() as s:
        r, w = await s.connect()
        size = 300_000
        w.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % size)
        w.write(b"b" * 10_000)
        # Handed to the handler at once, with no body: the answer comes before the body is all sent.
        a = await read_answer(r)
        assert a.status == 413 and a.json()["error"]["code"] == "request_too_large"
        assert a.headers["connection"] == "close"
        assert len(s.app.seen) == 1 and s.app.seen[0].too_large and s.app.seen[0].body == b""
        sent = 10_000
        while sent < size:  # the rest is read and dropped: no reset while the client finishes
            w.write(b"b" * 10_000)
            await w.drain()
            sent += 10_000
        await expect_closed(r)
        await s.serves_a_new_connection()


async def test_chunked_body_growing_over_the_limit_is_answered_413():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):  # 900 bytes: within the limit, so no answer yet
            w.write(b"12c\r\n" + b"c" * 300 + b"\r\n")
        await w.drain()
        assert await still_open(r, 0.1) and s.app.seen == []
        w.write(b"12c\r\n" + b"c" * 300 + b"\r\n")  # 1200 > LIMIT
        a = await read_answer(r)
        assert a.status == 413 and a.json()["error"]["code"] == "request_too_large" and a.headers["connection"] == "close"
        assert len(s.app.seen) == 1 and s.app.seen[0].too_large and s.app.seen[0].body == b""
        for _ in range(20):
            w.write(b"12c\r\n" + b"c" * 300 + b"\r\n")
        w.write(b"0\r\n\r\n")
        await w.drain()
        await expect_closed(r)
        assert len(s.app.seen) == 1


async def test_over_limit_body_never_finished_is_closed_after_the_discard_time():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n" + b"d" * 100)
        t0 = time.monotonic()
        assert (await read_answer(r)).status == 413
        await expect_closed(r, timeout=DISCARD_TIME + 2)
        assert time.monotonic() - t0 < DISCARD_TIME + 1.5


# -- 5. Expect ---------------------------------------------------------------------------------
async def test_expect_100_continue_before_the_body_then_the_answer():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        interim = await read_answer(r)
        assert (interim.version, interim.status, interim.reason, interim.headers) == ("HTTP/1.1", 100, "Continue", {})
        assert s.app.seen == []  # the body is not sent yet
        w.write(b"hello")
        a = await read_answer(r)
        assert a.status == 200 and a.json()["body"] == "hello"
        w.write(b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await read_answer(r)).status == 200


async def test_expect_with_a_declared_body_over_the_limit_gets_413_without_100():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n")
        a = await read_answer(r)
        assert a.status == 413 and a.json()["error"]["code"] == "request_too_large"
        assert a.headers["connection"] == "close"
        await expect_closed(r, timeout=DISCARD_TIME + 2)  # the body never comes: closed after the discard time


async def test_unknown_expectation_gets_417():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: something-else\r\n\r\n")
        a = await read_answer(r)
        assert_refusal(a, 417, "expectation_failed")
        assert "something-else" in a.json()["error"]["message"]
        await expect_closed(r)
        assert s.app.seen == []
        await s.serves_a_new_connection()


async def test_pipelined_expect_gets_its_100_only_after_the_answer_before_it():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"GET /sleep?id=a&s=0.1 HTTP/1.1\r\nHost: t\r\n\r\nPOST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        first = await read_answer(r)  # a 100 here would be read as the answer to the first request
        assert first.status == 200 and first.json()["query"]["id"] == "a"
        interim = await read_answer(r)
        assert interim.status == 100
        w.write(b"hello")
        second = await read_answer(r)
        assert second.status == 200 and second.json()["body"] == "hello"


# -- 6. HEAD -----------------------------------------------------------------------------------
async def test_head_has_the_get_content_length_and_no_body():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"GET /fixed HTTP/1.1\r\nHost: t\r\n\r\n")
        get = await read_answer(r)
        # Pipelined: any body byte after HEAD's head would break the answer that follows.
        w.write(b"HEAD /fixed HTTP/1.1\r\nHost: t\r\n\r\nHEAD /stream HTTP/1.1\r\nHost: t\r\n\r\nGET /echo?after=head HTTP/1.1\r\nHost: t\r\n\r\n")
        head = await read_answer(r, "HEAD")
        streamed_head = await read_answer(r, "HEAD")
        after = await read_answer(r)
        assert get.body == b"x" * 123
        assert head.status == 200 and head.headers["content-length"] == get.headers["content-length"] == "123"
        assert streamed_head.status == 200 and streamed_head.headers["transfer-encoding"] == "chunked"
        assert after.status == 200 and after.json()["query"] == {"after": "head"}
        assert await still_open(r)


# -- 7. malformed input --------------------------------------------------------------------------
def _many_headers() -> bytes:
    # 64 headers of 1024 bytes each (name, value, ": ", CRLF) after Host: only the last takes
    # the head over MAX_HEAD, so the server has read the whole request when it refuses it.
    n = MAX_HEAD // 1024
    return b"GET /echo HTTP/1.1\r\nHost: t\r\n" + b"".join(b"X-Pad-%02d: %s\r\n" % (i, b"p" * 1012) for i in range(n)) + b"\r\n"


MALFORMED = {
    "garbage-request-line": (b"GET / HTTX/1.1 what\r\n\r\n", 400, "malformed_request"),
    "bad-header-line": (b"GET / HTTP/1.1\r\nHost: t\r\nno colon here\r\n\r\n", 400, "malformed_request"),
    "bare-lf": (b"GET / HTTP/1.1\nHost: t\n\n", 400, "malformed_request"),
    "control-char-in-url": (b"GET /\x7f HTTP/1.1\r\nHost: t\r\n\r\n", 400, "malformed_request"),
    # llhttp reports any unknown first token as a bad method; the server tells a TLS handshake
    # (https:// to a plain port), other bytes that are not HTTP, and a method it does not serve apart.
    "tls-on-plain-port": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 \r\n\r\n", 400, "malformed_request", "use http://, not https://"),
    "not-http": (b"hello world\r\n\r\n", 400, "malformed_request", "not an HTTP/1.x request line"),
    "unknown-method": (b"BREW /pot HTTP/1.1\r\nHost: t\r\n\r\n", 501, "not_implemented", "the method BREW is not supported"),
    "head-over-max": (_many_headers(), 431, "headers_too_large"),
    "url-over-max": (b"GET /" + b"u" * MAX_URL + b" HTTP/1.1\r\nHost: t\r\n\r\n", 414, "uri_too_long"),
    "upgrade": (b"GET /ws HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n", 501, "not_implemented"),
    "connect": (b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", 501, "not_implemented"),
    "bad-content-length": (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5x\r\n\r\nhello", 400, "malformed_request"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_request_gets_a_clear_error_then_close_and_the_server_goes_on(case):
    raw, status, code, *says = MALFORMED[case]
    async with serve() as s:
        r, w = await s.connect()
        w.write(raw)
        a = await read_answer(r)
        assert_refusal(a, status, code)
        for words in says:
            assert words in json.loads(a.body)["error"]["message"], a.body
        await expect_closed(r)
        assert s.app.seen == []  # refused by the server itself: no handler ever saw it
        await s.serves_a_new_connection()


async def test_one_endless_header_line_is_refused_431_before_it_ends():
    """The parser buffers a header line until it ends: the head limit must hold while it grows."""
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Endless: ")
        answer = asyncio.ensure_future(read_answer(r, timeout=10))
        sent = 0
        while sent < 4 * MAX_HEAD and not answer.done():
            w.write(b"e" * 16384)
            await w.drain()
            sent += 16384
            await asyncio.wait({answer}, timeout=0.05)
        assert answer.done(), f"no answer after {sent} bytes of one header line"
        assert_refusal(answer.result(), 431, "headers_too_large")
        await expect_closed(r)
        await s.serves_a_new_connection()


# -- 8. streamed answers ---------------------------------------------------------------------------
async def test_streamed_answer_on_http11_is_chunked_and_the_connection_is_reused():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"GET /stream?n=3 HTTP/1.1\r\nHost: t\r\n\r\n")
        a = await read_answer(r)
        assert a.status == 200 and a.headers["transfer-encoding"] == "chunked" and "content-length" not in a.headers
        assert a.headers["content-type"] == "text/event-stream" and a.headers["x-stream"] == "yes"
        assert a.chunks == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
        assert a.raw_body.endswith(b"\r\n0\r\n\r\n")
        assert "connection" not in a.headers
        w.write(b"GET /echo?after=stream HTTP/1.1\r\nHost: t\r\n\r\n")
        after = await read_answer(r)
        assert after.status == 200 and after.json()["query"] == {"after": "stream"}


async def test_streamed_answer_on_http10_is_not_chunked_and_ends_with_close():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"GET /stream?n=3 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        a = await read_answer(r)  # no length, not chunked: read to EOF, so the server must close
        assert a.version == "HTTP/1.0" and a.status == 200
        assert "transfer-encoding" not in a.headers and "content-length" not in a.headers
        assert a.headers["connection"] == "close"
        assert a.raw_body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


# -- 9. a client that leaves -----------------------------------------------------------------------
async def test_client_disconnect_cancels_its_waiting_handler():
    async with serve() as s:
        _reader, w = await s.connect()
        w.write(b"GET /block HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.wait_for(s.app.started.wait(), 2)
        assert not s.app.cancelled.is_set()
        w.close()
        await asyncio.wait_for(s.app.cancelled.wait(), 1.0)
        assert not s.app.finished.is_set()
        await s.serves_a_new_connection()


async def test_client_disconnect_stops_a_streaming_handler():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"GET /stream-forever HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await asyncio.wait_for(r.readuntil(b"data: tick\n\n"), 2)).startswith(b"HTTP/1.1 200 OK\r\n")
        w.close()
        await asyncio.wait_for(s.app.cancelled.wait(), 1.0)
        assert isinstance(s.app.stream_error, (asyncio.CancelledError, ConnectionResetError))


# -- 10. a handler that raises -------------------------------------------------------------------
async def test_handler_that_raises_gets_500_and_the_server_goes_on():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"GET /raise HTTP/1.1\r\nHost: t\r\n\r\n")
        a = await read_answer(r)
        assert a.status == 500 and a.headers["content-type"] == "application/json"
        err = a.json()["error"]
        assert err["code"] == "internal_error" and err["type"] == "server_error" and "boom" not in err["message"]
        w.write(b"GET /echo?after=500 HTTP/1.1\r\nHost: t\r\n\r\n")  # the same connection goes on
        assert (await read_answer(r)).json()["query"] == {"after": "500"}
        await s.serves_a_new_connection()


async def test_handler_that_raises_mid_stream_cuts_the_stream_short():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"GET /stream-raise HTTP/1.1\r\nHost: t\r\n\r\n")
        # No terminating chunk: the client must see the stream broken, not ended.
        with pytest.raises(asyncio.IncompleteReadError) as e:
            await read_answer(r)
        assert e.value.partial == b""  # the first chunk was read whole; the close came where the next size line was due
        await s.serves_a_new_connection()


# -- 11. idle connections --------------------------------------------------------------------------
async def test_idle_keep_alive_connection_is_closed_after_idle_timeout():
    async with serve(idle_timeout=0.3) as s:
        r, w = await s.connect()
        w.write(b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await read_answer(r)).status == 200
        t0 = time.monotonic()
        await expect_closed(r, timeout=3)
        idle = time.monotonic() - t0
        assert 0.25 <= idle < 1.5, idle  # kept for idle_timeout, closed by the next sweep after it


async def test_stalled_request_head_is_closed_after_idle_timeout():
    async with serve(idle_timeout=0.3) as s:
        r, w = await s.connect()
        w.write(b"GET /echo HTTP/1.1\r\nHost: t\r\n")  # never finished
        t0 = time.monotonic()
        await expect_closed(r, timeout=3)
        assert 0.25 <= time.monotonic() - t0 < 1.5
        assert s.app.seen == []


async def test_a_running_handler_is_not_idle():
    async with serve(idle_timeout=0.2) as s:
        r, w = await s.connect()
        w.write(b"GET /block HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.wait_for(s.app.started.wait(), 2)
        assert await still_open(r, 0.6)  # three sweeps
        s.app.release.set()
        assert (await read_answer(r)).json() == {"released": True}


# -- 12. close(grace) ---------------------------------------------------------------------------
async def test_close_lets_a_request_in_flight_finish_and_closes_idle_connections_at_once():
    async with serve() as s:
        idle_r, idle_w = await s.connect()
        idle_w.write(b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await read_answer(idle_r)).status == 200
        busy_r, busy_w = await s.connect()
        busy_w.write(b"GET /block HTTP/1.1\r\nHost: t\r\n\r\n")  # in flight until released: no race with a timer
        await asyncio.wait_for(s.app.started.wait(), 5)
        closing = asyncio.ensure_future(s.server.close(3.0))
        await expect_closed(idle_r, timeout=2.0)  # at once: while the request in flight still runs
        assert not closing.done() and not s.app.finished.is_set()
        t0 = time.monotonic()
        s.app.release.set()
        a = await read_answer(busy_r)
        assert a.status == 200 and a.json() == {"released": True} and a.headers["connection"] == "close"
        await expect_closed(busy_r)
        await asyncio.wait_for(closing, 2.5)
        assert time.monotonic() - t0 < 2.5  # it returned when the work was done, not at the grace's end (3 s)
        with pytest.raises(OSError):  # ConnectionRefusedError: nobody listens any more
            await asyncio.open_connection(HOST, s.port)


async def test_close_cancels_a_request_still_running_after_the_grace():
    async with serve() as s:
        r, w = await s.connect()
        w.write(b"GET /block HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.wait_for(s.app.started.wait(), 2)
        t0 = time.monotonic()
        await s.server.close(0.3)
        took = time.monotonic() - t0
        assert 0.25 <= took < 1.0, took
        await asyncio.wait_for(s.app.cancelled.wait(), 1.0)
        assert not s.app.finished.is_set()
        await expect_closed(r)  # no answer: the request was cut off
        with pytest.raises(OSError):
            await asyncio.open_connection(HOST, s.port)


async def test_head_just_under_the_limit_arriving_in_small_pieces_is_served():
    """The head limit counts head bytes only: not a body, not the answer before, not a slow head."""
    async with serve() as s:
        r, w = await s.connect()
        pad = b"".join(b"X-Pad-%02d: %s\r\n" % (i, b"p" * 1012) for i in range(MAX_HEAD // 1024 - 2))
        w.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 900\r\n\r\n" + b"b" * 900 + b"GET /echo?second=1 HTTP/1.1\r\n")
        await w.drain()
        second = b"Host: t\r\n" + pad + b"\r\n"
        for i in range(0, len(second), 4096):  # the second head in 16 reads
            await asyncio.sleep(0.005)
            w.write(second[i : i + 4096])
            await w.drain()
        first, second = await read_answer(r), await read_answer(r)
        assert first.status == 200 and first.json()["body"] == "b" * 900
        assert second.status == 200 and second.json()["query"] == {"second": "1"}
        assert len(second.json()["headers"]) == MAX_HEAD // 1024 - 1


# -- 14. a slow reader -----------------------------------------------------------------------------
async def test_stream_to_a_slow_reader_waits_instead_of_buffering():
    total, piece = 16 * 1024 * 1024, 64 * 1024
    async with serve() as s:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # keep the kernel's share small
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (HOST, s.port))
        r, w = await s.connect(sock=sock, limit=16 * 1024)  # and the StreamReader's share
        w.write(b"GET /big?total=%d&chunk=%d HTTP/1.1\r\nHost: t\r\n\r\n" % (total, piece))
        await asyncio.wait_for(s.app.started.wait(), 2)

        # The client reads nothing: the handler ends up inside a write, with the transport
        # past its high-water mark (paused) — waited for as that, not for 0.3 s.
        def stalled():
            t = s.app.big_conn.transport
            return s.app.writing and t.get_write_buffer_size() >= t.get_write_buffer_limits()[1]

        await eventually(stalled, what="the handler's write waiting on a paused transport", timeout=10)
        stalled_at = s.app.written
        for _ in range(20):  # let everything runnable run: the write still waits
            await asyncio.sleep(0)
        assert not s.app.finished.is_set() and s.app.writing
        assert s.app.written == stalled_at < total // 2, (stalled_at, s.app.written)  # its writes wait
        assert s.app.max_buffered <= 2 * piece + 64 * 1024, s.app.max_buffered  # the high-water mark, not the stream
        a = await read_answer(r, timeout=20)  # now read: it all comes, in order, and the stream ends
        assert a.status == 200 and len(a.body) == total and a.body.count(b"z") == total
        assert s.app.finished.is_set() and s.app.written == total
        w.write(b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await read_answer(r)).status == 200


# -- the same on uvloop --------------------------------------------------------------------------
# The gateway runs on uvloop (services/runtime.py), whose transports are not asyncio's: the
# tests that lean on transport behaviour (pausing reads, write flow control, connection_lost,
# closing with unread bytes) run on it too.
UVLOOP_CASES = [
    test_many_pipelined_requests_pause_reading_and_are_all_answered,
    test_declared_body_over_the_limit_is_answered_413_while_the_client_still_sends,
    test_one_endless_header_line_is_refused_431_before_it_ends,
    test_streamed_answer_on_http11_is_chunked_and_the_connection_is_reused,
    test_streamed_answer_on_http10_is_not_chunked_and_ends_with_close,
    test_client_disconnect_cancels_its_waiting_handler,
    test_client_disconnect_stops_a_streaming_handler,
    test_close_lets_a_request_in_flight_finish_and_closes_idle_connections_at_once,
    test_stream_to_a_slow_reader_waits_instead_of_buffering,
]


@pytest.mark.parametrize("case", UVLOOP_CASES, ids=lambda f: f.__name__.removeprefix("test_"))
def test_on_uvloop(case):
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)
        runner.run(case())
