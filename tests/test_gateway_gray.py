"""Gray failures at the gateway: requests are moved off a replica
that stops making progress, in front of real ``sim`` engine processes fed
replica records on a real nats-server.

Faults are real: a hung engine is a SIGSTOPped process (the kernel still
accepts its connections, so nothing fails — it just never answers), a dead one
is SIGKILLed. The control plane's verdict is a record written under the
scheduler's identity (``Board``), as the scheduler would write it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal

import aiohttp
import openai
import pytest

from llmgw.shared import bus
from llmgw.shared import subjects as S
from llmgw.shared.schemas import TrafficReport, decode

from .gateway_helpers import replica as record
from .gateway_helpers import wait_for
from .test_gateway import HELLO, base_url, gw_metric, stack  # noqa: F401 - stack is a fixture

pytestmark = pytest.mark.timeout(60)


def stop(sim) -> None:
    os.kill(sim.proc.pid, signal.SIGSTOP)


def resume(sim) -> None:
    os.kill(sim.proc.pid, signal.SIGCONT)


def flights(gw, rid: str) -> int:
    b = gw.router.backend(rid)
    return len(b.flights) if b is not None else 0


async def routed(gw, *rids: str) -> None:
    await wait_for(lambda: sorted(b.id for b in gw.router.backends() if b.routable) == sorted(rids), f"exactly {rids} routed")


async def read_events(resp: aiohttp.ClientResponse, n: int) -> list[bytes]:
    """The first ``n`` data lines of an SSE answer."""
    out = []
    while len(out) < n:
        line = await resp.content.readline()
        assert line, f"the stream ended after {out}"
        if line.startswith(b"data: "):
            out.append(line)
    return out


async def test_requests_waiting_on_a_replica_that_turns_degraded_are_answered_by_another(stack):
    """(a) plain and (b) a stream without its first chunk, on a hung engine whose
    record turns degraded: both answered by the other replica; (e) the degraded
    one gets no new request, even once its engine answers again."""
    (a, b), gw, client = await stack.start([("a", "alpha", 0.0), ("b", "alpha", 0.0)], stall_after=60)
    board = stack.board
    await board.put(record("alpha-a", "alpha", a.endpoint))
    await routed(gw, "alpha-a")
    stop(a)
    plain = asyncio.create_task(client.chat.completions.with_raw_response.create(model="alpha", messages=HELLO, max_tokens=5))
    streamed = asyncio.create_task(client.chat.completions.with_raw_response.create(model="alpha", messages=HELLO, max_tokens=5, stream=True))
    await wait_for(lambda: flights(gw, "alpha-a") == 2, "both requests sent to the hung engine")
    await board.put(record("alpha-b", "alpha", b.endpoint))
    await routed(gw, "alpha-a", "alpha-b")
    assert not plain.done() and not streamed.done()  # nothing moves them but the verdict

    await board.put(record("alpha-a", "alpha", state="degraded"))
    raw = await asyncio.wait_for(plain, 10)
    assert raw.headers["x-llmgw-replica"] == "alpha-b"
    assert raw.parse().usage.completion_tokens == 5
    raw_stream = await asyncio.wait_for(streamed, 10)
    assert raw_stream.headers["x-llmgw-replica"] == "alpha-b"
    chunks = [c async for c in raw_stream.parse()]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == raw.parse().choices[0].message.content
    assert gw_metric(gw, "llmgw_gateway_retries_total", model="alpha", reason="left_ready") == 2
    assert gw_metric(gw, "llmgw_gateway_requests_total", status="200") == 2
    assert flights(gw, "alpha-a") == 0

    # (e) Degraded takes nothing new, whether or not its engine answers.
    resume(a)
    attempts_on_a = gw_metric(gw, "llmgw_gateway_replica_requests_total", replica="alpha-a")
    for _ in range(4):
        raw = await client.completions.with_raw_response.create(model="alpha", prompt="p", max_tokens=2)
        assert raw.headers["x-llmgw-replica"] == "alpha-b"
    assert gw_metric(gw, "llmgw_gateway_replica_requests_total", replica="alpha-a") == attempts_on_a


async def test_a_stream_under_way_ends_with_an_error_event_when_its_replica_stalls_or_fails(stack):
    """(c) A stream that already sent chunks cannot move: it ends with an OpenAI
    error event, then [DONE], then a properly ended chunked body — never a hang.
    Stalled silently (SIGUSR1: no token, /health still 200, the record still
    ready): after stall_after of silence. Failed: at once, although its engine
    still streams."""
    (a, b), gw, _ = await stack.start([("a", "alpha", 20.0), ("b", "beta", 20.0)], stall_after=1)
    board = stack.board
    await board.put(record("alpha-a", "alpha", a.endpoint))
    await board.put(record("beta-b", "beta", b.endpoint))
    await routed(gw, "alpha-a", "beta-b")
    url = f"{base_url(gw)}/v1/chat/completions"
    body = {"messages": HELLO, "max_tokens": 2000, "ignore_eos": True, "stream": True}

    async with aiohttp.ClientSession() as http:
        resp = await http.post(url, json={**body, "model": "alpha"})
        assert resp.status == 200 and resp.headers["x-llmgw-replica"] == "alpha-a"
        await read_events(resp, 3)
        a.proc.send_signal(signal.SIGUSR1)
        rest = await asyncio.wait_for(resp.content.read(), 10)  # to the chunked body's end
        events = [e.strip() for e in rest.split(b"\n\n") if e.strip()]
        assert events[-1] == b"data: [DONE]", events[-2:]
        error = json.loads(events[-2].removeprefix(b"data: "))["error"]
        assert error["code"] == "replica_unavailable" and error["type"] == "server_error", error
        assert "alpha-a" in error["message"] and "no byte" in error["message"], error
        assert gw_metric(gw, "llmgw_gateway_stream_errors_total", model="alpha", reason="stalled") == 1
        async with http.get(f"{a.endpoint}/health") as health:
            assert health.status == 200  # a gray failure: the engine still says it is fine

        resp = await http.post(url, json={**body, "model": "beta"})
        await read_events(resp, 2)
        await board.put(record("beta-b", "beta", state="failed"))
        rest = await asyncio.wait_for(resp.content.read(), 10)
        events = [e.strip() for e in rest.split(b"\n\n") if e.strip()]
        assert events[-1] == b"data: [DONE]"
        error = json.loads(events[-2].removeprefix(b"data: "))["error"]
        assert error["code"] == "replica_unavailable" and "beta-b is failed" in error["message"], error
        assert b.proc.poll() is None  # its engine was still streaming: the record's word ended it
        assert gw_metric(gw, "llmgw_gateway_stream_errors_total", model="beta", reason="left_ready") == 1
    assert gw_metric(gw, "llmgw_gateway_inflight_requests") == 0


async def test_passive_ejection_of_a_silent_replica_and_of_a_refused_connection(stack):
    """(d) Records still say ready. A hung engine: once its stream in flight has had
    no byte for stall_after it is ejected, its requests (the plain one too) are
    retried elsewhere and new ones avoid it. A killed engine: ejected on the first
    refused connection, the request retried."""
    (a, b, c), gw, client = await stack.start([("a", "alpha", 0.0), ("b", "alpha", 0.0), ("c", "alpha", 0.0)], stall_after=0.5, cooldown=60)
    board = stack.board
    await board.put(record("alpha-a", "alpha", a.endpoint))
    await routed(gw, "alpha-a")
    stop(a)
    plain = asyncio.create_task(client.chat.completions.with_raw_response.create(model="alpha", messages=HELLO, max_tokens=3))
    streamed = asyncio.create_task(client.chat.completions.with_raw_response.create(model="alpha", messages=HELLO, max_tokens=3, stream=True))
    await wait_for(lambda: flights(gw, "alpha-a") == 2, "both requests sent to the hung engine")
    await board.put(record("alpha-b", "alpha", b.endpoint))
    await routed(gw, "alpha-a", "alpha-b")
    assert (await asyncio.wait_for(plain, 10)).headers["x-llmgw-replica"] == "alpha-b"
    raw = await asyncio.wait_for(streamed, 10)
    assert raw.headers["x-llmgw-replica"] == "alpha-b" and [c async for c in raw.parse()]
    assert gw_metric(gw, "llmgw_gateway_cooldowns_total", replica="alpha-a", reason="stalled") == 1
    assert gw_metric(gw, "llmgw_gateway_retries_total", reason="stalled") == 2
    assert gw_metric(gw, "llmgw_gateway_replica_cooling", replica="alpha-a") == 1
    for _ in range(3):  # new ones avoid it (the record still says ready)
        raw = await client.completions.with_raw_response.create(model="alpha", prompt="p", max_tokens=2)
        assert raw.headers["x-llmgw-replica"] == "alpha-b"

    # A killed engine: the first refused connection ejects it; of two requests, one
    # met it (round-robin between equals) and was retried; both answered by b.
    c.kill()
    await board.put(record("alpha-c", "alpha", c.endpoint))
    await routed(gw, "alpha-a", "alpha-b", "alpha-c")
    for _ in range(2):
        raw = await client.completions.with_raw_response.create(model="alpha", prompt="p", max_tokens=2)
        assert raw.headers["x-llmgw-replica"] == "alpha-b"
    assert gw_metric(gw, "llmgw_gateway_upstream_errors_total", replica="alpha-c", kind="connect") == 1
    assert gw_metric(gw, "llmgw_gateway_cooldowns_total", replica="alpha-c", reason="connect") == 1
    assert gw_metric(gw, "llmgw_gateway_retries_total", reason="connect") == 1


async def test_a_long_plain_answer_is_not_taken_for_a_stall(stack):
    """A plain answer arrives whole at its end: its silence is no evidence. Only
    streams are, so a generation longer than stall_after is answered as usual."""
    (a,), gw, client = await stack.start([("a", "alpha", 10.0)], stall_after=0.3)
    await stack.board.put(record("alpha-a", "alpha", a.endpoint))
    await routed(gw, "alpha-a")
    raw = await client.completions.with_raw_response.create(model="alpha", prompt="p", max_tokens=12, extra_body={"ignore_eos": True})  # ~1.2 s
    assert raw.headers["x-llmgw-replica"] == "alpha-a" and raw.parse().usage.completion_tokens == 12
    assert gw_metric(gw, "llmgw_gateway_cooldowns_total") == 0
    assert gw_metric(gw, "llmgw_gateway_retries_total") == 0


async def test_traffic_reports_reach_the_leaders_node(stack, nats_server):
    """(f) Per busy leader node, every traffic_interval: cumulative completed, in
    flight, silence; from the gateway's instance; nothing while idle."""
    (a, b), gw, client = await stack.start([("a", "alpha", 20.0), ("b", "beta", 20.0)], traffic_interval=0.2, stall_after=60)
    reports: list[TrafficReport] = []
    misaddressed: list[str] = []

    async def heard(msg) -> None:
        report = decode(msg.data, TrafficReport)
        reports.append(report)
        if msg.subject != S.traffic(report.node_id):
            misaddressed.append(msg.subject)

    tls = nats_server.issue("ops", "operator")
    nats_server.reload()
    ops = await bus.connect(nats_server.url, tls, name="ops", initial_attempts=3)
    try:
        await ops.subscribe(S.ALL_TRAFFIC, cb=heard)
        await ops.flush()
        board = stack.board
        await board.put(record("alpha-a", "alpha", a.endpoint, node="node07"))
        await board.put(record("beta-b", "beta", b.endpoint, node="node08"))
        await routed(gw, "alpha-a", "beta-b")

        def on(node):
            return [(r, t) for r in list(reports) for t in r.replicas if r.node_id == node]

        stream = await client.completions.create(model="alpha", prompt="p", max_tokens=30, stream=True, extra_body={"ignore_eos": True})
        first = await wait_for(lambda: [x for x in on("node07") if x[1].in_flight == 1], "a report of the stream in flight")
        report, traffic = first[0]
        assert report.gateway == gw.instance and traffic.replica_id == "alpha-a" and traffic.completed == 0
        assert not on("node08")  # beta is idle
        [p async for p in stream]
        for _ in range(2):
            await client.completions.create(model="alpha", prompt="p", max_tokens=2)
        await wait_for(lambda: [x for x in on("node07") if x[1].completed == 3 and x[1].in_flight == 0], "a report of three completed")
        counts = [t.completed for _, t in on("node07")]
        assert counts == sorted(counts), counts  # cumulative: never goes back

        # Idle: node07 hears nothing more while node08's traffic makes reports tick.
        quiet_from = len(on("node07"))
        busy = await client.completions.create(model="beta", prompt="p", max_tokens=40, stream=True, extra_body={"ignore_eos": True})
        await wait_for(lambda: len(on("node08")) >= 4, "four reports of beta's stream")
        assert len(on("node07")) == quiet_from, on("node07")[quiet_from:]
        [p async for p in busy]

        # A hung leader: its stream in flight shows a growing silence.
        stop(a)
        hung = asyncio.create_task(client.completions.create(model="alpha", prompt="p", max_tokens=2, stream=True))
        await wait_for(lambda: [x for x in on("node07") if x[1].in_flight == 1 and x[1].silent_for >= 0.6], "a report of the silence", timeout=10)
        resume(a)
        [p async for p in await asyncio.wait_for(hung, 10)]
        assert not misaddressed
    finally:
        await ops.close()


async def test_an_endpoint_that_cannot_be_parsed_is_a_502_and_a_cooldown(stack):
    """(g) A record whose endpoint urlsplit refuses: a clear 502 (not a 500), the
    replica ejected; the gateway goes on serving the model's other replicas."""
    (a,), gw, client = await stack.start([("a", "alpha", 0.0)], cooldown=60)
    board = stack.board
    await board.put(record("alpha-bad", "alpha", "http://[::1:8000"))  # an unclosed IPv6 bracket
    await routed(gw, "alpha-bad")
    with pytest.raises(openai.InternalServerError) as err:
        await client.chat.completions.create(model="alpha", messages=HELLO, max_tokens=2)
    assert err.value.status_code == 502 and err.value.body["code"] == "upstream_error"
    assert "cannot parse the endpoint" in err.value.message and "alpha-bad" in err.value.message
    assert gw_metric(gw, "llmgw_gateway_cooldowns_total", replica="alpha-bad", reason="endpoint") == 1
    with pytest.raises(openai.InternalServerError) as err:  # cooling down: 503 from the router, nothing sent
        await client.chat.completions.create(model="alpha", messages=HELLO, max_tokens=2)
    assert err.value.status_code == 503 and "cooling down" in err.value.message

    await board.put(record("alpha-port", "alpha", "http://127.0.0.1:99999"))  # a port out of range
    await board.put(record("alpha-a", "alpha", a.endpoint))
    await routed(gw, "alpha-bad", "alpha-port", "alpha-a")
    for _ in range(2):  # one of them meets alpha-port first and is retried on alpha-a
        raw = await client.chat.completions.with_raw_response.create(model="alpha", messages=HELLO, max_tokens=2)
        assert raw.headers["x-llmgw-replica"] == "alpha-a"
    assert gw_metric(gw, "llmgw_gateway_cooldowns_total", replica="alpha-port", reason="endpoint") == 1
    assert gw_metric(gw, "llmgw_gateway_requests_total", status="500") == 0


def test_router_counts_survive_a_replica_leaving_ready_and_ejection_does_not_extend():
    """Pure: ``completed`` only grows (the agents compare it with the last report),
    even across degraded -> ready, which drops and re-creates the backend; an
    ejection while cooling keeps the first deadline; reports group by leader node."""
    from llmgw.services.gateway.router import Router
    from llmgw.services.gateway.service import traffic_reports

    now = [100.0]
    r = Router(cooldown=10, failures_before_cooldown=3, retry_after=1, clock=lambda: now[0])
    r.on_replica("x", None, record("x", "m", "http://127.0.0.1:1", node="n1"))
    r.on_replica("y", None, record("y", "m", "http://127.0.0.1:2", node="n2"))
    reported: dict[str, int] = {}
    assert traffic_reports(r, "gw", reported, 0.0) == []  # idle: nothing
    for _ in range(3):
        b = r.pick("m", exclude=(r.backend("y"),))
        r.succeeded(b)
        r.release(b)
    busy = r.pick("m", exclude=(r.backend("x"),))  # one in flight on y
    reports = traffic_reports(r, "gw", reported, 0.0)
    assert [(p.node_id, [(t.replica_id, t.completed, t.in_flight) for t in p.replicas]) for p in reports] == [("n1", [("x", 3, 0)]), ("n2", [("y", 0, 1)])]
    r.release(busy)
    assert traffic_reports(r, "gw", reported, 0.0) == []  # nothing new on x, nothing in flight on y

    r.on_replica("x", None, record("x", "m", state="degraded", node="n1"))
    assert r.backend("x") is None
    r.on_replica("x", None, record("x", "m", "http://127.0.0.1:1", node="n1"))
    assert r.backend("x").completed == 3
    assert traffic_reports(r, "gw", reported, 0.0) == []  # back, but no activity

    b = r.backend("x")
    assert r.eject(b, "stalled") and b.cool_until == 110.0
    now[0] = 105.0
    assert not r.eject(b, "connect") and b.cool_until == 110.0 and b.ejected == "stalled"


@pytest.mark.parametrize(
    "endpoint, why",
    [
        ("http://[::1:8000", "Invalid IPv6 URL"),
        ("http://127.0.0.1:99999", "Port out of range"),
        ("http://127.0.0.1:x", "could not be cast to integer"),
        ("http://日本:80", "'latin-1' codec"),
        ("ftp://a", "not an http(s) endpoint"),
    ],
)
async def test_every_unusable_endpoint_is_a_bad_endpoint_not_a_crash(endpoint, why):
    from llmgw.services.gateway.upstream import BadEndpoint, ConnectFailed, UpstreamClient

    client = UpstreamClient(connect_timeout=1, read_timeout=1)
    with pytest.raises(BadEndpoint, match=re.escape(why)) as err:
        await client.post(endpoint, "/v1/completions", b"{}")
    assert isinstance(err.value, ConnectFailed)  # nothing was sent anywhere
    await client.close()
