"""A lean keep-alive HTTP/1.1 client for the one thing the gateway asks of a
replica: POST a JSON body, read the answer whole or as it streams.

Why not ``aiohttp.ClientSession``: profiled under 16 closed-loop clients, its
request path was about 30 % of the gateway's CPU (URL and header objects,
cookie and redirect machinery, a timer context, a payload writer, a
StreamReader per response), most of it for features an engine never uses.
Here a request is one pre-encoded head plus the body, written with one
``send`` (a large body never copied: ``Connection.send``); the answer is
parsed from a byte buffer: the status line, the three headers that matter (``Content-Length``, ``Transfer-Encoding``,
``Connection``) and ``Content-Type``, then the body by length, by chunks, or
to the end of the connection.

Why the answer is parsed by hand, when the gateway's server already uses
httptools (llhttp) for requests: what it must read is a small subset of
HTTP/1.1 from our own engines (uvicorn under vLLM, SGLang and the sim), and
body framing here is interleaved with what the proxy needs from the same
buffer — the flow-control high-water mark, ``max_response_bytes`` counted as
bytes arrive, ``abort`` while a read waits, 1xx answers skipped, a body that
ends at EOF — which llhttp's callback interface would split between its
callbacks and this class. Measured (docs/architecture.md, "The gateway"): a
head plus a plain body costs the same either way (~4 µs); a chunked stream
costs ~3.5 µs per chunk here against ~0.5 µs in llhttp. That per-token cost
is the case for moving to ``httptools.HttpResponseParser``, to be decided by
a same-run A/B of ``bench/gateway.py`` on a quiet machine, not by a
micro-benchmark.

Guarantees the gateway's proxy relies on:

* a connection goes back to its pool only when its answer was read to the
  end (``release``); anything else closes it (``close``), which is how an
  engine learns that nobody waits for its tokens any more;
* the pool is unbounded: the gateway never queues, engines do (and report it);
* a connection idle for ``keepalive`` seconds (4 s, under uvicorn's 5 s) is
  never reused and is closed, so we never write into a socket the engine is
  closing;
* failures are typed: ``ConnectFailed`` / ``ConnectTimeout`` (nothing was
  sent), ``ReadTimeout`` (silence longer than ``read_timeout``, before the
  answer or between chunks), ``Broken`` (anything else: reset, early EOF, a
  malformed answer), ``BadEndpoint`` (a ``ConnectFailed`` for an endpoint
  whose host or port cannot be parsed), ``Abandoned`` (the gateway gave up on
  the replica while the answer was awaited: ``Connection.abort``),
  ``OutOfDescriptors`` (EMFILE/ENFILE: the gateway's own shortage, nothing was
  sent, the replica is not to blame), ``TooLarge`` (a whole answer over
  ``max_response_bytes``: by its Content-Length, or as it arrives — it is
  never held past the limit);
* reading is flow-controlled: past ``_HIGH_WATER`` unread bytes the socket
  stops being read until the caller asks for more, so a stream relayed to a
  slow client holds at most that much here.

Bookkeeping for the proxy's stall watch, kept off the hot path's clock: a
connection counts its arrivals (``rx``, one integer increment per read) and
notes when its request was sent (``sent_at``); a periodic sweep compares the
count with the one it saw last, so no timer or clock call runs per byte.
"""

from __future__ import annotations

import asyncio
import errno
import ssl
import time
from urllib.parse import urlsplit


class UpstreamError(Exception):
    """The replica could not be asked, or its answer could not be read."""


class ConnectFailed(UpstreamError):
    def __init__(self, os_error: OSError):
        super().__init__(str(os_error) or type(os_error).__name__)
        self.os_error = os_error


class ConnectTimeout(UpstreamError):
    pass


class ReadTimeout(UpstreamError):
    pass


class Broken(UpstreamError):
    pass


class OutOfDescriptors(UpstreamError):
    """EMFILE/ENFILE: no socket could be made. Says nothing about the replica."""


class TooLarge(UpstreamError):
    """The answer is longer than ``max_response_bytes``."""


class BadEndpoint(ConnectFailed):
    """The endpoint's host or port cannot be parsed: nothing was sent anywhere."""


class Abandoned(UpstreamError):
    """The gateway stopped waiting for this answer (``Connection.abort``): the
    replica left the ready state, or it was found stalled. ``kind`` says which."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


_NO_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)
MAX_HEAD = 64 * 1024  # an answer's status line and headers; engines send a few hundred bytes
_HIGH_WATER = 256 * 1024  # stop reading a socket whose bytes we have not passed on yet
_COPY_UNDER = 16 * 1024  # request bodies under this are joined to their head for the write

# Body framing of the answer being read.
_LENGTH, _CHUNKED, _UNTIL_CLOSE, _NONE = range(4)
# Where a chunked body is: in a chunk's data, at its CRLF, at a size line, in the trailers.
_DATA, _DATA_END, _SIZE, _TRAILER = range(4)


class Connection(asyncio.Protocol):
    """One socket to a replica, and the answer being read on it (one at a time)."""

    def __init__(self, pool: _Pool):
        self.pool = pool
        self.loop = pool.client.loop
        # Set by connection_made, which asyncio calls before create_connection hands the
        # protocol back (_Pool._connect): no one holds a Connection without its transport.
        self.transport: asyncio.Transport
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.eof = False  # the peer closed (or the socket broke): no byte will come any more
        self.lost: BaseException | None = None
        self.paused = False
        self.idle_since = 0.0
        # The answer being read
        self.status = 0
        self.content_type = ""  # as sent, for passing on
        self.mimetype = ""  # lower case, parameters stripped
        self.keep_alive = True
        self._framing = _NONE
        self._left = 0  # bytes left: of the body (_LENGTH) or of the current chunk (_CHUNKED)
        self._chunk_state = _SIZE
        self.done = False  # the answer was read to its end
        # The exchange as the proxy's stall watch sees it (reset by ``send``).
        self.rx = 0  # reads so far: a counter, so the hot path calls no clock per byte
        self.rx_mark = 0  # ``rx`` when the watch last looked
        self.sent_at = 0.0  # monotonic time the request was sent
        self.active_at = 0.0  # last time the watch saw the replica send on it (or sent_at)
        self.stream = False  # the client asked for a stream
        self.answered = False  # the client was sent something (the proxy sets it)
        self.aborted: Abandoned | None = None

    # -- asyncio.Protocol: bytes in, one waiter woken ---------------------------------
    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.rx += 1
        if len(self.buf) > _HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self):
        self.eof = True
        self._wake()
        # None: let the transport close itself (a half-open socket is of no use here).

    def connection_lost(self, exc):
        self.eof = True
        self.lost = exc
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _timed_out(self, w: asyncio.Future) -> None:
        if not w.done():
            w.set_exception(ReadTimeout(f"no byte for {self.pool.client.read_timeout:g}s"))

    async def _fill(self) -> None:
        """Wait for more bytes. Raises Broken at EOF, ReadTimeout after read_timeout of silence."""
        if self.aborted is not None:
            raise self.aborted
        if self.eof:
            raise Broken(f"the connection was closed ({self.lost})" if self.lost else "the replica closed the connection")
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        self.waiter = w = self.loop.create_future()
        timer = self.loop.call_later(self.pool.client.read_timeout, self._timed_out, w)
        try:
            await w
        finally:
            timer.cancel()
            self.waiter = None

    # -- one exchange --------------------------------------------------------------
    def send(self, head: bytes, body: bytes = b"") -> None:
        """Write a request: ``head`` (through its empty line), then ``body``. One write,
        so one send(): a small body is joined to its head (a copy of a few KB costs
        less than a second buffer); a large one goes as its own buffer of the same
        write (writev, under uvloop) — never copied, as the client's bytes it is."""
        self.status = 0
        self.done = False
        self.rx = self.rx_mark = 0
        self.sent_at = self.active_at = time.monotonic()
        self.answered = False
        if len(body) < _COPY_UNDER:
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))

    def abort(self, error: Abandoned) -> None:
        """Stop waiting for this answer: whoever awaits it gets ``error`` now (and
        at every later read), and the socket is closed, which stops the engine's work."""
        if self.aborted is None:
            self.aborted = error
        w = self.waiter
        if w is not None and not w.done():
            w.set_exception(error)
        self.close()

    async def read_head(self) -> None:
        """Parse the status line and headers; 1xx answers (other than 101) are skipped."""
        while True:
            end = self.buf.find(b"\r\n\r\n")
            while end < 0:
                if len(self.buf) > MAX_HEAD:
                    raise Broken(f"the answer's head is over {MAX_HEAD} bytes")
                await self._fill()
                end = self.buf.find(b"\r\n\r\n")
            head = self.buf[:end].decode("latin-1")
            del self.buf[: end + 4]
            if self._parse_head(head):
                return

    def _parse_head(self, head: str) -> bool:
        """Sets status and framing; False for an interim (1xx) answer to skip."""
        lines = head.split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise Broken(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        self.status = status = int(code)
        if 100 <= status < 200 and status != 101:
            return False
        length = None
        chunked = False
        self.keep_alive = version == "HTTP/1.1"
        self.content_type = ""
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise Broken(f"a malformed header line: {line[:80]!r}")
            name = name.strip().lower()
            if name == "content-length":
                value = value.strip()
                if not value.isdigit():
                    raise Broken(f"a malformed Content-Length: {value[:40]!r}")
                length = int(value)
            elif name == "transfer-encoding":
                chunked = value.strip().lower().endswith("chunked")
            elif name == "content-type":
                self.content_type = value.strip()
            elif name == "connection":
                v = value.strip().lower()
                if v == "close":
                    self.keep_alive = False
                elif v == "keep-alive":
                    self.keep_alive = True
        self.mimetype = self.content_type.partition(";")[0].strip().lower()
        if status in (204, 304) or status < 200:
            self._framing, self.done = _NONE, True
        elif chunked:  # Transfer-Encoding wins over Content-Length (RFC 9112 6.3)
            self._framing, self._chunk_state, self._left = _CHUNKED, _SIZE, 0
        elif length is not None:
            self._framing, self._left = _LENGTH, length
            self.done = length == 0
        else:
            self._framing, self.keep_alive = _UNTIL_CLOSE, False
        return True

    def _take(self) -> bytes:
        """The body bytes buffered so far (decoded from chunks); sets ``done`` at the end."""
        buf = self.buf
        if self._framing == _LENGTH:
            n = min(self._left, len(buf))
            out = bytes(buf[:n])
            del buf[:n]
            self._left -= n
            self.done = self._left == 0
            return out
        if self._framing == _CHUNKED:
            return self._take_chunks()
        if self._framing == _UNTIL_CLOSE:
            out = bytes(buf)
            buf.clear()
            self.done = self.eof
            return out
        return b""

    def _take_chunks(self) -> bytes:
        buf = self.buf
        out = []
        pos = 0
        state = self._chunk_state
        while not self.done:
            if state == _DATA:
                n = min(self._left, len(buf) - pos)
                if n == 0:
                    break
                out.append(buf[pos : pos + n])
                pos += n
                self._left -= n
                if self._left:
                    break
                state = _DATA_END
            elif state == _DATA_END:
                if len(buf) - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise Broken("a chunk does not end with CRLF")
                pos += 2
                state = _SIZE
            else:  # _SIZE or _TRAILER: a line
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if len(buf) - pos > MAX_HEAD:
                        raise Broken("a chunk size line (or trailer) is too long")
                    break
                line = buf[pos:eol]
                pos = eol + 2
                if state == _TRAILER:
                    self.done = not line  # an empty line ends the trailers, and the body
                    continue
                try:
                    size = int(bytes(line).split(b";", 1)[0], 16)
                except ValueError:
                    size = -1
                if size < 0:
                    raise Broken(f"a malformed chunk size: {bytes(line[:40])!r}")
                state, self._left = (_DATA, size) if size else (_TRAILER, 0)
        self._chunk_state = state
        del buf[:pos]
        return b"".join(out)

    async def read(self) -> bytes:
        """The whole body, up to ``max_response_bytes`` (TooLarge beyond: the caller closes)."""
        limit = self.pool.client.max_response_bytes
        if self._framing == _LENGTH and self._left > limit:
            raise TooLarge(f"the answer's Content-Length ({self._left}) is over {limit} bytes")
        parts = []
        size = 0
        while True:
            data = self._take()
            if data:
                size += len(data)
                if size > limit:
                    raise TooLarge(f"the answer is over {limit} bytes")
                parts.append(data)
            if self.done:
                return b"".join(parts)
            if self._framing == _UNTIL_CLOSE and self.eof:
                return b"".join(parts)
            await self._fill()

    async def read_some(self) -> bytes:
        """The next body bytes as they arrive (may end mid-event); b"" at the end."""
        while True:
            data = self._take()
            if data or self.done:
                return data
            await self._fill()

    # -- after the exchange ---------------------------------------------------------
    def release(self) -> None:
        """Back to the pool if the answer was read to its end and the socket may be reused; else closed."""
        if self.done and self.keep_alive and not self.eof and not self.buf and not self.paused:
            self.pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        self.transport.close()  # also what stops the engine's work on an abandoned answer
        self.eof = True


class _Pool:
    """Idle connections to one host:port, most recently used last."""

    def __init__(self, client: UpstreamClient, host: str, port: int, tls: ssl.SSLContext | None):
        self.client = client
        self.host = host
        self.port = port
        self.tls = tls
        self.idle: list[Connection] = []

    async def get(self) -> Connection:
        idle = self.idle
        if idle:
            oldest_ok = time.monotonic() - self.client.keepalive
            while idle:
                conn = idle.pop()
                if not conn.eof and conn.idle_since > oldest_ok and not conn.transport.is_closing():
                    return conn
                conn.close()
        return await self._connect()

    async def _connect(self) -> Connection:
        loop = self.client.loop
        try:
            async with asyncio.timeout(self.client.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(self), self.host, self.port, ssl=self.tls, server_hostname=self.host if self.tls else None
                )
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {self.host}:{self.port} within {self.client.connect_timeout:g}s") from None
        except OSError as e:
            if e.errno in _NO_DESCRIPTORS or "Too many open files" in str(e):
                raise OutOfDescriptors(f"no socket for {self.host}:{self.port}: {e}") from None
            raise ConnectFailed(e) from None
        return conn

    def put(self, conn: Connection) -> None:
        conn.idle_since = time.monotonic()
        self.idle.append(conn)
        self.client._sweep_later()


class _Target:
    """One endpoint + path: its pool, and the request head up to Content-Length, encoded once."""

    __slots__ = ("bare", "head", "pool")

    def __init__(self, pool: _Pool, head: bytes, bare: bytes):
        self.pool = pool
        self.head = head  # with Content-Type: application/json
        self.bare = bare  # without a Content-Type: the caller sends the client's (a multipart form)


class UpstreamClient:
    def __init__(self, *, connect_timeout: float, read_timeout: float, keepalive: float = 4.0, max_response_bytes: int = 64 * 1024 * 1024):
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.keepalive = keepalive
        self.max_response_bytes = max_response_bytes
        self.loop = asyncio.get_running_loop()
        self._pools: dict[tuple, _Pool] = {}
        self._targets: dict[tuple[str, str], _Target] = {}
        self._tls: ssl.SSLContext | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self.closed = False

    def _target(self, endpoint: str, path: str) -> _Target:
        # Parsing a URL and encoding a head is a visible share of a request's CPU; endpoints change rarely.
        key = (endpoint, path)
        t = self._targets.get(key)
        if t is None:
            try:
                u = urlsplit(endpoint)
                port = u.port  # a ValueError for a port that is not a number 0-65535
                host = u.netloc.rpartition("@")[2]
                start = f"POST {u.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {host}\r\n"
                head = (start + "Content-Type: application/json\r\nAccept-Encoding: identity\r\nContent-Length: ").encode("latin-1")
                bare = (start + "Accept-Encoding: identity\r\nContent-Length: ").encode(
                    "latin-1"
                )  # a UnicodeEncodeError (a ValueError) for a host latin-1 cannot spell
            except ValueError as e:
                raise BadEndpoint(OSError(f"cannot parse the endpoint {endpoint!r}: {e}")) from None
            if u.scheme not in ("http", "https") or not u.hostname:
                raise BadEndpoint(OSError(f"not an http(s) endpoint: {endpoint!r}"))
            tls = u.scheme == "https"
            port = port or (443 if tls else 80)
            pkey = (u.scheme, u.hostname, port)
            pool = self._pools.get(pkey)
            if pool is None:
                if tls and self._tls is None:
                    self._tls = ssl.create_default_context()
                pool = self._pools[pkey] = _Pool(self, u.hostname, port, self._tls if tls else None)
            if len(self._targets) > 4096:
                self._targets.clear()
            t = self._targets[key] = _Target(pool, head, bare)
        return t

    async def post(
        self, endpoint: str, path: str, body: bytes, extra_headers: bytes = b"", flights: set | None = None, stream: bool = False, json: bool = True
    ) -> Connection:
        """Send ``body`` and read the answer's head. ``extra_headers``: whole ``Name: value\\r\\n`` lines.

        ``flights``: a set the connection joins before its request is sent (so it
        can be ``abort``-ed while the head is awaited) and leaves if this raises;
        after a return the caller removes it. ``stream``: the client asked for one.
        ``json``: the body is JSON (sent as ``application/json``); otherwise
        ``extra_headers`` carries the client's own ``Content-Type`` line.

        The caller reads the body off the returned connection and then must
        ``release()`` it (read to the end) or ``close()`` it (anything else).
        """
        if self.closed:
            raise ConnectFailed(OSError("the gateway is stopping"))
        t = self._target(endpoint, path)
        conn = await t.pool.get()
        try:
            conn.stream = stream
            conn.aborted = None
            if flights is not None:
                flights.add(conn)
            # One write, so one send(): head and body together.
            conn.send(b"%s%d\r\n%s\r\n" % (t.head if json else t.bare, len(body), extra_headers), body)
            await conn.read_head()
        except BaseException:
            conn.close()
            if flights is not None:
                flights.discard(conn)
            raise
        return conn

    def _sweep_later(self) -> None:
        if self._sweeper is None and not self.closed:
            self._sweeper = self.loop.call_later(self.keepalive / 4, self._sweep)

    def _sweep(self) -> None:
        """Close connections idle for ``keepalive``; runs while any connection is idle."""
        self._sweeper = None
        oldest_ok = time.monotonic() - self.keepalive
        left = False
        for pool in self._pools.values():
            keep = []
            for c in pool.idle:
                if c.idle_since > oldest_ok and not c.eof:
                    keep.append(c)
                else:
                    c.close()
            pool.idle[:] = keep
            left = left or bool(keep)
        if left:
            self._sweeper = self.loop.call_later(self.keepalive / 4, self._sweep)

    async def close(self) -> None:
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for pool in self._pools.values():
            for c in pool.idle:
                c.close()
            pool.idle.clear()
