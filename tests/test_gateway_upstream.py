"""The gateway's own HTTP/1.1 client (``services/gateway/upstream.py``) against
real servers on loopback: an aiohttp server for what engines send (lengths,
chunked streams, keep-alive), and raw asyncio servers for answers aiohttp will
not produce (trailers, 1xx, bodies to EOF, bytes split anywhere, broken ones).
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from llmgw.services.gateway.upstream import Broken, ConnectFailed, ReadTimeout, UpstreamClient

from .waiting import eventually

pytestmark = pytest.mark.timeout(30)

HOST = "127.0.0.1"


@pytest.fixture
async def engine():
    """An aiohttp server standing in for an engine; ``seen`` records each request."""
    seen: list[dict] = []
    gate = asyncio.Event()  # the streaming handler waits on it between its two events
    gone = asyncio.Event()  # set when a streaming client went away

    async def plain(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append(
            {
                "path": request.path,
                "headers": {k.lower(): v for k, v in request.headers.items()},
                "body": body,
                "peer": request.transport.get_extra_info("peername"),
            }
        )
        return web.json_response({"echo": body.decode()}, status=int(request.query.get("status", 200)))

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)  # chunked: no Content-Length
        try:
            await resp.write(b"data: one\n\n")
            await gate.wait()
            await resp.write(b"data: two\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            gone.set()
            raise
        await resp.write_eof()
        return resp

    async def silent(request: web.Request) -> web.Response:
        await asyncio.sleep(10)
        return web.Response()

    app = web.Application()
    app.router.add_post("/base/v1/chat/completions", plain)
    app.router.add_post("/v1/chat/completions", plain)
    app.router.add_post("/v1/stream", stream)
    app.router.add_post("/v1/silent", silent)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    port = runner.addresses[0][1]

    class Engine:
        endpoint = f"http://{HOST}:{port}"

    e = Engine()
    e.seen, e.gate, e.gone = seen, gate, gone
    yield e
    await runner.cleanup()


@pytest.fixture
async def raw():
    """Start a raw TCP server that answers every request with ``handler(reader, writer)``; yields a starter."""
    servers = []

    async def start(handler) -> str:
        async def serve(reader, writer):
            await reader.readuntil(b"\r\n\r\n")  # our requests carry a small body; the handler need not read it
            try:
                await handler(reader, writer)
            finally:
                writer.close()

        server = await asyncio.start_server(serve, HOST, 0)
        servers.append(server)
        return f"http://{HOST}:{server.sockets[0].getsockname()[1]}"

    yield start
    for s in servers:
        s.close()
        await s.wait_closed()


@pytest.fixture
async def client():
    c = UpstreamClient(connect_timeout=2.0, read_timeout=5.0, keepalive=4.0)
    yield c
    await c.close()


async def test_length_bodies_reuse_one_connection_and_send_the_head(engine, client):
    peers = set()
    for i in range(3):
        conn = await client.post(engine.endpoint, "/v1/chat/completions", b'{"n": %d}' % i, b"X-Request-Id: r-%d\r\n" % i)
        assert conn.status == 200 and conn.mimetype == "application/json" and conn.content_type.startswith("application/json")
        assert await conn.read() == b'{"echo": "{\\"n\\": %d}"}' % i
        assert conn.done
        conn.release()
        peers.add(engine.seen[-1]["peer"])
    assert len(peers) == 1  # one socket, reused: each answer was read to its end
    h = engine.seen[-1]["headers"]
    assert h["content-type"] == "application/json" and h["x-request-id"] == "r-2" and h["host"] == engine.endpoint[len("http://") :]
    assert h["content-length"] == str(len(b'{"n": 2}')) and "authorization" not in h

    # An endpoint with a path prefix; an error status is an answer like any other.
    conn = await client.post(engine.endpoint + "/base/", "/v1/chat/completions?status=500", b"{}")
    assert conn.status == 500 and await conn.read() == b'{"echo": "{}"}'
    conn.release()
    assert engine.seen[-1]["path"] == "/base/v1/chat/completions"


async def test_a_stream_arrives_piece_by_piece_and_ends(engine, client):
    conn = await client.post(engine.endpoint, "/v1/stream", b"{}")
    assert conn.status == 200 and conn.mimetype == "text/event-stream"
    assert await conn.read_some() == b"data: one\n\n"  # before the server sends more
    engine.gate.set()
    rest = b""
    while piece := await conn.read_some():
        rest += piece
    assert rest == b"data: two\n\ndata: [DONE]\n\n" and conn.done
    conn.release()
    assert sum(len(p.idle) for p in client._pools.values()) == 1


async def test_closing_an_unfinished_answer_closes_the_socket(engine, client):
    conn = await client.post(engine.endpoint, "/v1/stream", b"{}")
    assert await conn.read_some() == b"data: one\n\n"
    conn.release()  # not read to its end: closed, not pooled
    assert sum(len(p.idle) for p in client._pools.values()) == 0
    await asyncio.wait_for(engine.gone.wait(), 5)  # the engine learns nobody waits


async def test_timeouts_and_refused_connections(engine):
    quick = UpstreamClient(connect_timeout=1.0, read_timeout=0.3)
    try:
        with pytest.raises(ReadTimeout):
            await quick.post(engine.endpoint, "/v1/silent", b"{}")
        conn = await quick.post(engine.endpoint, "/v1/stream", b"{}")
        assert await conn.read_some() == b"data: one\n\n"
        with pytest.raises(ReadTimeout):  # silence between chunks counts too
            await conn.read_some()
        conn.close()
    finally:
        await quick.close()
    # A port nobody listens on any more.
    closed = UpstreamClient(connect_timeout=1.0, read_timeout=1.0)
    try:
        srv = await asyncio.start_server(lambda r, w: None, HOST, 0)
        port = srv.sockets[0].getsockname()[1]
        srv.close()
        await srv.wait_closed()
        with pytest.raises(ConnectFailed) as err:
            await closed.post(f"http://{HOST}:{port}", "/v1/chat/completions", b"{}")
        assert isinstance(err.value.os_error, ConnectionRefusedError)
    finally:
        await closed.close()


async def test_idle_connections_are_not_reused_after_keepalive_and_are_closed(engine):
    c = UpstreamClient(connect_timeout=1.0, read_timeout=5.0, keepalive=0.2)
    try:
        conn = await c.post(engine.endpoint, "/v1/chat/completions", b"{}")
        await conn.read()
        conn.release()
        first = engine.seen[-1]["peer"]

        # past its keepalive the sweeper drops it from the pool and closes it (waited for, not slept for)
        def swept():
            return (sum(len(p.idle) for p in c._pools.values()), conn.transport.is_closing())

        await eventually(swept, (0, True), what="the idle connection swept and closed", timeout=5)
        conn = await c.post(engine.endpoint, "/v1/chat/completions", b"{}")
        await conn.read()
        conn.release()
        assert engine.seen[-1]["peer"] != first
    finally:
        await c.close()


async def test_chunked_split_anywhere_with_extensions_trailers_and_interim_answers(raw, client):
    answer = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTRANSFER-ENCODING: chunked\r\n\r\n"
        b"b;ext=1\r\ndata: one\n\n\r\n"
        b"10\r\ndata: two-three\n\r\n"
        b"0\r\nX-Trailer: yes\r\n\r\n"
    )

    async def bytewise(reader, writer):
        for i in range(len(answer)):
            writer.write(answer[i : i + 1])
            await writer.drain()
            await asyncio.sleep(0)
        await reader.read()  # keep the socket open until the client is done

    url = await raw(bytewise)
    conn = await client.post(url, "/v1/chat/completions", b"{}")
    assert conn.status == 200 and conn.mimetype == "text/event-stream"
    assert await conn.read() == b"data: one\n\ndata: two-three\n"
    assert conn.done and not conn.buf
    conn.release()
    assert sum(len(p.idle) for p in client._pools.values()) == 1


async def test_body_to_eof_connection_close_and_http10_are_not_pooled(raw, client):
    async def to_eof(reader, writer):
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"a":')
        await writer.drain()
        writer.write(b" 1}")

    async def close_after(reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        await reader.read()

    async def old(reader, writer):
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await reader.read()

    for handler, body in ((to_eof, b'{"a": 1}'), (close_after, b"{}"), (old, b"{}")):
        conn = await client.post(await raw(handler), "/v1/chat/completions", b"{}")
        assert await conn.read() == body
        conn.release()
        assert sum(len(p.idle) for p in client._pools.values()) == 0, handler.__name__
        assert conn.transport.is_closing()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}",  # EOF inside the body
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",  # EOF inside a chunk
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # not a chunk size
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200",  # EOF inside the head
        b"",
    ],
)
async def test_broken_answers_are_broken(raw, client, answer):
    async def send(reader, writer):
        writer.write(answer)
        await writer.drain()

    url = await raw(send)
    with pytest.raises(Broken):
        conn = await client.post(url, "/v1/chat/completions", b"{}")
        try:
            await conn.read()
        finally:
            conn.close()
