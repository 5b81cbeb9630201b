"""The gateway bounds every resource a client (or a replica) can make it hold
(slow clients, floods, oversized bodies): each test is the attack, on real
sockets, against a real gateway fed a replica record on a real nats-server.

The replica is a tiny real HTTP server in the test (``Upstream``): it answers
normally, or with an answer far too large, or with a stream that never ends,
as the request's own ``"mode"`` field asks (the gateway forwards the body
untouched). Two tests need the gateway as its own process: the one that reads
its peak memory (``VmHWM``) and the one that runs it out of file descriptors
(``RLIMIT_NOFILE`` set for it alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import resource
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import yaml

from llmgw.services.gateway import server
from llmgw.services.gateway.httpserver import _HIGH_WATER as CLIENT_HIGH_WATER
from llmgw.services.gateway.upstream import _HIGH_WATER as UPSTREAM_HIGH_WATER
from llmgw.shared.natsserver import free_port

from .gateway_helpers import HOST, Board, gateway_config, metric_sum, replica, start_gateway, wait_for
from .test_gateway_httpserver import expect_closed, read_answer

pytestmark = pytest.mark.timeout(60)

MODEL = "org/bounded"
MiB = 1024 * 1024


class Upstream:
    """A replica's HTTP server, small and real. ``mode`` in the request body picks the answer:
    ``ok`` (default), ``huge`` (``huge_total`` bytes, chunked), ``huge-length`` (the same,
    with its Content-Length), ``stream`` (SSE events as fast as the reader takes them)."""

    def __init__(self, huge_total: int = 256 * MiB):
        self.huge_total = huge_total
        self.requests: list[dict] = []
        self.sent = 0  # body bytes written by the huge or streaming answer
        self.blocked = False  # a streaming answer waits in drain(): nobody reads it
        self.ended = asyncio.Event()  # a huge or streaming answer stopped (done, or its reader left)
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, HOST, 0)
        self.port = self.server.sockets[0].getsockname()[1]

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                body = json.loads(await reader.readexactly(length))
                self.requests.append(body)
                await self._answer(body.get("mode", "ok"), writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, mode: str, w: asyncio.StreamWriter) -> None:
        if mode == "ok":
            body = json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "ok"}]}).encode()
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await w.drain()
            return
        piece = b"x" * MiB
        try:
            if mode == "huge-length":
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % self.huge_total)
                while self.sent < self.huge_total:
                    w.write(piece)
                    self.sent += len(piece)
                    await w.drain()
            elif mode == "huge":
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
                while self.sent < self.huge_total:
                    w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.sent += len(piece)
                    await w.drain()
                w.write(b"0\r\n\r\n")
            elif mode == "stream":
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                event = b"data: " + json.dumps({"choices": [{"text": "t" * 4000}]}).encode() + b"\n\n"
                chunk = b"%x\r\n%s\r\n" % (len(event), event)
                while True:
                    w.write(chunk)
                    self.sent += len(event)
                    self.blocked = True
                    await w.drain()
                    self.blocked = False
            await w.drain()
        finally:
            self.ended.set()


def request_bytes(body: dict | bytes, *, stream: bool = False) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)


def completion(**extra) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 1, **extra}


async def ask(port: int, body: dict | bytes, timeout: float = 10.0):
    """One request on a fresh connection; its answer."""
    r, w = await asyncio.open_connection(HOST, port)
    try:
        w.write(request_bytes(body))
        return await read_answer(r, "POST", timeout=timeout)
    finally:
        w.close()


@pytest.fixture
async def bounded(nats_server):
    """start(**gateway settings) -> (gateway, upstream): an in-process gateway whose one
    ready replica of MODEL is an ``Upstream``. Everything is stopped, pass or fail."""
    made = {"gateways": [], "upstreams": [], "board": None}

    async def start(upstream: Upstream | None = None, **opts):
        up = upstream or Upstream()
        await up.start()
        made["upstreams"].append(up)
        cfg = gateway_config(nats_server, f"gw{len(made['gateways'])}", **opts)
        board = made["board"] = made["board"] or await Board.open(nats_server)  # its reload admits the gateway
        nats_server.reload()
        gw = await start_gateway(cfg)
        made["gateways"].append(gw)
        await board.put(replica("bounded-1", MODEL, up.endpoint))
        await wait_for(lambda: MODEL in gw.router.models(), f"{MODEL} routable")
        return gw, up

    yield start
    for gw in made["gateways"]:
        await gw.stop()
    for up in made["upstreams"]:
        await up.close()
    if made["board"] is not None:
        await made["board"].close()


def gw_metric(gw, name: str, **labels) -> float:
    return metric_sum(gw.metrics.render().decode(), name, **labels)


# -- slow clients: a deadline, not an idle timer ---------------------------------------------
async def trickle(w: asyncio.StreamWriter, every: float = 0.05, limit: int = 400) -> int:
    """The head one byte every ``every`` seconds (each byte reset the old idle timer),
    header lines that never end the head; how many bytes were sent."""
    line = b"X-Slow: 1\r\n"
    sent = 0
    with contextlib.suppress(ConnectionError):
        for _ in range(limit):
            w.write(line[sent % len(line) : sent % len(line) + 1])
            await w.drain()
            sent += 1
            await asyncio.sleep(every)
    return sent


async def test_slow_header_trickle_is_closed_at_the_read_deadline(bounded):
    gw, up = await bounded(request_read_timeout=0.5)
    r, w = await asyncio.open_connection(HOST, gw.port)
    t0 = time.monotonic()
    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n")
    trickling = asyncio.ensure_future(trickle(w))
    a = await read_answer(r, "POST", timeout=10)  # the old gateway: no answer while bytes keep coming
    took = time.monotonic() - t0
    assert a.status == 408 and a.json()["error"]["code"] == "request_timeout", (a.status, a.body)
    assert a.headers["connection"] == "close"
    await expect_closed(r)
    assert took >= 0.5, took  # not before its deadline
    assert not trickling.done()  # the client was still sending when it was closed
    trickling.cancel()
    assert up.requests == []
    await wait_for(lambda: gw_metric(gw, "llmgw_gateway_bounded_total", reason="read_timeout"), "read_timeout counted", expected=1.0)
    assert (await ask(gw.port, completion())).status == 200  # and the gateway goes on


async def test_slow_body_trickle_is_closed_at_the_read_deadline(bounded):
    gw, up = await bounded(request_read_timeout=0.5)
    r, w = await asyncio.open_connection(HOST, gw.port)
    t0 = time.monotonic()
    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 100000\r\n\r\n{")

    async def body_trickle():
        with contextlib.suppress(ConnectionError):
            for _ in range(400):
                w.write(b" ")
                await w.drain()
                await asyncio.sleep(0.05)

    trickling = asyncio.ensure_future(body_trickle())
    a = await read_answer(r, "POST", timeout=10)
    assert a.status == 408 and a.headers["connection"] == "close", (a.status, a.body)
    assert time.monotonic() - t0 >= 0.5
    assert not trickling.done()
    trickling.cancel()
    await expect_closed(r)
    assert up.requests == []
    await wait_for(lambda: gw.http.buffered, "its body let go", expected=0)


# -- connections ---------------------------------------------------------------------------------
async def test_connections_beyond_max_connections_are_refused_while_a_client_is_served(bounded):
    gw, up = await bounded(max_connections=3)
    served_r, served_w = await asyncio.open_connection(HOST, gw.port)
    served_w.write(request_bytes(completion()))
    assert (await read_answer(served_r, "POST")).status == 200
    idle = [await asyncio.open_connection(HOST, gw.port) for _ in range(2)]
    await wait_for(lambda: len(gw.http.connections), "three connections open", expected=3)

    r, w = await asyncio.open_connection(HOST, gw.port)
    w.write(request_bytes(completion()))
    a = await read_answer(r, "POST")
    assert a.status == 503 and a.headers["connection"] == "close" and a.headers["retry-after"] == "1"
    assert "maximum of 3 client connections" in a.json()["error"]["message"]
    await expect_closed(r)
    assert len(up.requests) == 1  # the refused request went nowhere
    assert len(gw.http.connections) == 3

    served_w.write(request_bytes(completion()))  # the client already in is served all along
    assert (await read_answer(served_r, "POST")).status == 200
    assert gw_metric(gw, "llmgw_gateway_bounded_total", reason="connection_limit") == 1

    idle[0][1].close()  # a place frees: a new client gets it
    await wait_for(lambda: len(gw.http.connections), "a connection closed", expected=2)
    assert (await ask(gw.port, completion())).status == 200
    for _, iw in idle[1:]:
        iw.close()
    served_w.close()


# -- request bodies ------------------------------------------------------------------------------
async def test_half_sent_bodies_hit_the_global_cap_while_a_normal_request_succeeds(bounded):
    gw, up = await bounded(max_body_bytes=64_000, max_buffered_body_bytes=256_000)
    attackers = []
    for i in range(4):  # 4 x 60,000 bytes held, each body 4,000 bytes short of its Content-Length
        r, w = await asyncio.open_connection(HOST, gw.port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 64000\r\n\r\n" + b" " * 60_000)
        attackers.append((r, w))
        await wait_for(lambda: gw.http.buffered, f"attacker {i} held", expected=60_000 * (i + 1))
    conns = [weakref.ref(c) for c in gw.http.connections]

    r, w = await asyncio.open_connection(HOST, gw.port)  # one more: 300,000 would be held
    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 64000\r\n\r\n" + b" " * 60_000)
    a = await read_answer(r, "POST")
    assert a.status == 503 and a.json()["error"]["code"] == "gateway_overloaded" and a.headers["connection"] == "close"
    await wait_for(lambda: gw.http.buffered, "the refused body let go", expected=240_000)

    ok = await ask(gw.port, completion(prompt="p" * 1000))  # fits in what is left
    assert ok.status == 200 and ok.json()["choices"][0]["text"] == "ok"
    assert len(up.requests) == 1
    assert gw_metric(gw, "llmgw_gateway_bounded_total", reason="body_buffer_full") == 1

    for _, aw in attackers:  # they leave: every byte they made the gateway hold is let go
        aw.close()
    await wait_for(lambda: gw.http.buffered, "all bodies let go", expected=0)
    await wait_for(lambda: len(gw.http.connections), "their connections gone", expected=0)
    gc.collect()
    assert [c for c in conns if c() is not None] == []  # no reference keeps a closed connection (and its body)


# -- answers from a replica ------------------------------------------------------------------------
def gateway_process(nats_server, work: Path, *, nofile: int | None = None, **gateway) -> tuple[subprocess.Popen, int, Path]:
    """``llmgw gateway`` as its own process; ``nofile``: its RLIMIT_NOFILE (soft and hard)."""
    tls = nats_server.issue(f"gwp{len(list(work.glob('gw*.yaml')))}", "gateway")
    nats_server.reload()
    port = free_port(HOST)
    conf = {"server": nats_server.url, "tls": {"ca": tls.ca, "cert": tls.cert, "key": tls.key}, "gateway": {"listen": f"{HOST}:{port}", **gateway}}
    path = work / f"gw{port}.yaml"
    path.write_text(yaml.safe_dump(conf))
    log = work / f"gw{port}.log"

    def limit():
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw.services", "--log-level", "warning", "gateway", "-c", str(path), "--workers", "1"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=limit,
        )  # fmt: skip
    return proc, port, log


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def server_side_sockets(port: int) -> int:
    """TCP sockets whose local port is ``port`` and that are connected (or closed by the
    peer and not yet by us): the gateway's client connections, not its listener."""
    n = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] in ("01", "08"):  # ESTABLISHED, CLOSE_WAIT
            n += 1
    return n


@contextlib.asynccontextmanager
async def process_stack(nats_server, tmp_path, upstream: Upstream, **kw):
    board = await Board.open(nats_server)
    await upstream.start()
    proc, port, log = gateway_process(nats_server, tmp_path, **kw)
    try:
        await board.put(replica("bounded-1", MODEL, upstream.endpoint))

        async def routable():
            if proc.poll() is not None:
                raise AssertionError(f"the gateway exited {proc.returncode}:\n{log.read_text()}")
            with contextlib.suppress(OSError, EOFError, asyncio.TimeoutError):
                r, w = await asyncio.open_connection(HOST, port)
                w.write(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
                a = await read_answer(r, timeout=2)
                w.close()
                return MODEL in a.body.decode()
            return False

        await wait_for(routable, f"the gateway process routes {MODEL}", timeout=30, interval=0.1)
        yield proc, port, log
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        await upstream.close()
        await board.close()


async def test_huge_plain_answer_is_502_and_never_held_whole(nats_server, tmp_path):
    up = Upstream(huge_total=256 * MiB)
    async with process_stack(nats_server, tmp_path, up, max_response_bytes=4 * MiB) as (proc, port, _log):
        assert (await ask(port, completion())).status == 200  # warm: the pool, the code paths
        peak_before = status_kib(proc.pid, "VmHWM")

        a = await ask(port, completion(mode="huge"), timeout=30)
        assert a.status == 502, (a.status, a.body[:300])
        err = a.json()["error"]
        assert err["code"] == "upstream_response_too_large" and f"{4 * MiB} bytes" in err["message"]
        await asyncio.wait_for(up.ended.wait(), 10)  # the gateway closed its connection: the replica stopped
        assert up.sent < 64 * MiB, up.sent  # it was cut off early, not read to its 256 MiB end

        up.sent = 0
        up.ended.clear()
        a = await ask(port, completion(mode="huge-length"), timeout=30)  # refused by its Content-Length
        assert a.status == 502 and a.json()["error"]["code"] == "upstream_response_too_large"
        await asyncio.wait_for(up.ended.wait(), 10)

        grew = status_kib(proc.pid, "VmHWM") - peak_before
        assert grew < 48 * 1024, f"the gateway's peak RSS grew by {grew} KiB"  # the old gateway: 256 MiB and more

        ok = await ask(port, completion())  # not held against the replica: it still serves
        assert ok.status == 200
        text = await ask_metrics(port)
        assert metric_sum(text, "llmgw_gateway_cooldowns_total") == 0
        assert metric_sum(text, "llmgw_gateway_bounded_total", reason="response_too_large") == 2


async def ask_metrics(port: int) -> str:
    r, w = await asyncio.open_connection(HOST, port)
    w.write(b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n")
    a = await read_answer(r)
    w.close()
    return a.body.decode()


async def test_stream_to_a_client_that_does_not_read_is_flow_controlled(bounded):
    gw, up = await bounded()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # a small kernel share on the client's side
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (HOST, gw.port))
    _reader, w = await asyncio.open_connection(sock=sock, limit=16 * 1024)  # the client never reads: that is the test
    w.write(request_bytes(completion(mode="stream", stream=True)))
    backend = gw.router.backend("bounded-1")

    def held_back():  # the replica waits on the gateway, which waits on the client (it reads nothing)
        flights = list(backend.flights)
        return up.blocked and len(flights) == 1 and flights[0].paused

    await wait_for(held_back, "the replica's stream paused by the gateway", timeout=20)
    conn = next(iter(backend.flights))
    client = next(iter(gw.http.connections))
    assert len(conn.buf) <= 512 * 1024, len(conn.buf)  # what the gateway holds from the replica
    # And for the client: a relayed write is made only below the write high-water mark (after
    # a drain), and is at most what the upstream connection held when it paused (its high
    # water plus one read of up to 256 KiB). More arrived at once on a loaded machine than
    # the 256 KiB this test first allowed; without flow control it would be the whole stream.
    bound = CLIENT_HIGH_WATER + UPSTREAM_HIGH_WATER + 256 * 1024
    assert client.transport.get_write_buffer_size() <= bound, (client.transport.get_write_buffer_size(), bound)
    assert up.sent < 64 * MiB, up.sent  # the kernel's buffers and the gateway's: not the stream
    sent_at_pause = up.sent
    for _ in range(50):
        await asyncio.sleep(0)
    assert up.sent <= sent_at_pause + 8 * 1024
    w.close()  # the client leaves: the replica's stream is closed too
    await asyncio.wait_for(up.ended.wait(), 10)
    await wait_for(lambda: len(backend.flights), "no stream in flight", expected=0)


# -- descriptors -----------------------------------------------------------------------------------
async def test_out_of_descriptors_is_503_and_the_replica_is_not_blamed(nats_server, tmp_path):
    nofile = 96
    up = Upstream()
    async with process_stack(nats_server, tmp_path, up, nofile=nofile) as (proc, port, log):
        # No request has reached the replica yet (readiness was asked with GET /v1/models):
        # the gateway holds no upstream connection, so the first generation request must open one.
        await wait_for(lambda: server_side_sockets(port), "the readiness probes' connections closed", expected=0)
        base = open_fds(proc.pid)
        fillers = [await asyncio.open_connection(HOST, port) for _ in range(nofile - 1 - base)]
        # The gateway holds all its descriptors but one.
        await wait_for(lambda: open_fds(proc.pid), "the fillers accepted", expected=nofile - 1)
        r, w = await asyncio.open_connection(HOST, port)  # the last descriptor: no socket is left for the replica
        await wait_for(lambda: open_fds(proc.pid), "the gateway at its limit", expected=nofile)
        w.write(request_bytes(completion()))
        a = await read_answer(r, "POST")
        assert a.status == 503, (a.status, a.body)
        assert a.json()["error"]["message"].startswith("gateway out of file descriptors") and a.headers["retry-after"] == "1"
        assert up.requests == []

        r2, w2 = await asyncio.open_connection(HOST, port)  # beyond the limit: closed at once, not left hanging
        w2.write(request_bytes(completion()))
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(r2.read(), 5) == b""
        w2.close()

        for _, fw in fillers:
            fw.close()
        w.close()
        await wait_for(lambda: open_fds(proc.pid) < nofile // 2, "the fillers' descriptors released", timeout=10)
        ok = await ask(port, completion())  # the replica was never taken out of rotation
        assert ok.status == 200 and len(up.requests) == 1
        text = await ask_metrics(port)
        assert metric_sum(text, "llmgw_gateway_cooldowns_total") == 0
        assert metric_sum(text, "llmgw_gateway_replica_cooling") == 0
        assert metric_sum(text, "llmgw_gateway_upstream_errors_total") == 0
        assert metric_sum(text, "llmgw_gateway_bounded_total", reason="out_of_fds") >= 1
    assert "gateway out of file descriptors" in log.read_text()


# -- JSON nesting -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [b"", b"{}", b'{"a": [1, {"b": []}]}', b"{" * 64, b"{" * 65, b"[" * 40 + b"{" * 25, b'"' + b"[" * 70 + b'"', b"x" * 200_000 + b"[" * 64, b"{[" * 33],
)
@pytest.mark.parametrize("limit", [0, 1, 64, 300])
def test_brackets_over_says_what_counting_them_says(body, limit):
    # The pre-check before the depth scan: memchr finds, stopped at limit + 1, in place of bytes.count.
    assert server.brackets_over(body, limit) == (body.count(b"{") + body.count(b"[") > limit)


async def test_deep_json_is_400_before_it_reaches_a_replica(bounded):
    gw, up = await bounded()
    deep = b'{"model": "%s", "prompt": "x", "extra": %s%s}' % (MODEL.encode(), b"[" * 100_000, b"]" * 100_000)
    a = await ask(gw.port, deep)
    assert a.status == 400, (a.status, a.body[:300])  # the old gateway: 500 (RecursionError)
    assert a.json()["error"]["message"] == "JSON nested deeper than 64 levels"
    just_over = b'{"model": "%s", "extra": %s%s}' % (MODEL.encode(), b"[" * 64, b"]" * 64)  # 65 levels with the object
    assert (await ask(gw.port, just_over)).status == 400
    at_limit = b'{"model": "%s", "extra": %s1%s, "text": "%s"}' % (MODEL.encode(), b"[" * 63, b"]" * 63, b"[{" * 100)
    ok = await ask(gw.port, at_limit)  # 64 levels, and brackets inside a string are text
    assert ok.status == 200, (ok.status, ok.body[:300])
    assert len(up.requests) == 1
    assert gw_metric(gw, "llmgw_gateway_bounded_total", reason="json_too_deep") == 2
