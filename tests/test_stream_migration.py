"""Stream migration: a stream whose replica fails after its client got chunks
goes on from another ready replica, and the client sees one whole answer,
equal to the unbroken one — real ``sim`` engine processes behind a real
gateway, replica records on a real nats-server.

Faults are real: a killed leader (SIGKILL: its connections reset), a killed
worker of a two-rank group (its leader's steps hang, as NCCL's do), a hung
leader (SIGSTOP: the kernel still holds its connections, nothing comes), a
silent stall (SIGUSR1: ``/health`` still 200). The sim continues
deterministically: generation from a prompt plus the start of its own answer
yields the rest of that answer, so a migrated stream can be compared with an
unbroken one byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
import pytest

from llmgw.shared import subjects as S
from llmgw.shared.schemas import Event, decode

from .gateway_helpers import replica as record
from .gateway_helpers import wait_for
from .test_gateway import base_url, gw_metric, stack  # noqa: F401 - stack is a fixture

pytestmark = pytest.mark.timeout(90)

CHAT = [{"role": "user", "content": "Tell me how a replica moves between fabrics."}]
# Long enough to be cut mid-way, short enough to finish quickly: 40 tokens at 50/s.
RATE = 50.0
LONG = {"max_tokens": 40, "ignore_eos": True, "stream": True}


async def routed(gw, *rids: str) -> None:
    await wait_for(lambda: sorted(b.id for b in gw.router.backends() if b.routable) == sorted(rids), f"exactly {rids} routed")


def events_of(raw: bytes) -> list[dict | str]:
    out: list[dict | str] = []
    for event in raw.split(b"\n\n"):
        event = event.strip()
        if not event.startswith(b"data: "):
            continue
        data = event.removeprefix(b"data: ")
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def text_of(events: list, chat: bool = True) -> str:
    parts = []
    for e in events:
        if isinstance(e, dict):
            for c in e.get("choices") or ():
                parts.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "")
    return "".join(parts)


def errors_in(events: list) -> list:
    return [e["error"] for e in events if isinstance(e, dict) and "error" in e]


async def unbroken(endpoint: str, path: str, body: dict) -> list:
    """The reference: the same request straight to a healthy engine."""
    async with aiohttp.ClientSession() as http, http.post(f"{endpoint}{path}", json=body) as r:
        assert r.status == 200, await r.text()
        return events_of(await r.read())


async def broken_stream(gw, sims: dict, path: str, body: dict, fault, *, after: int = 5, headers: dict | None = None):
    """Stream ``body`` through the gateway; after ``after`` events, ``fault(sim)`` the
    sim serving it. Returns (events, the replica id that served it first)."""
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{base_url(gw)}{path}", json=body, headers=headers or {})
        assert resp.status == 200, await resp.text()
        first = resp.headers["x-llmgw-replica"]
        head = b""
        while head.count(b"\n\n") < after:
            line = await resp.content.readline()
            assert line, f"the stream ended early: {head!r}"
            head += line
        fault(sims[first])
        rest = await asyncio.wait_for(resp.content.read(), 30)
        return events_of(head + rest), first


def kill(sim) -> None:
    sim.proc.send_signal(signal.SIGKILL)


def hang(sim) -> None:
    os.kill(sim.proc.pid, signal.SIGSTOP)


def stall(sim) -> None:
    sim.proc.send_signal(signal.SIGUSR1)  # no token, /health still 200


def kill_worker(sim) -> None:
    sim.workers[0].send_signal(signal.SIGKILL)


async def two_replicas(stack, *, workers: int = 0, **opts):
    (a, b), gw, _ = await stack.start([("a", "alpha", RATE), ("b", "alpha", RATE)], workers=workers, **opts)
    await stack.board.put(record("alpha-a", "alpha", a.endpoint))
    await stack.board.put(record("alpha-b", "alpha", b.endpoint))
    await routed(gw, "alpha-a", "alpha-b")
    return {"alpha-a": a, "alpha-b": b}, gw


def the_other(sims: dict, rid: str):
    return next(s for k, s in sims.items() if k != rid)


@pytest.mark.parametrize(
    ("fault", "cause"),
    [(kill, "stream_broken"), (hang, "stalled"), (stall, "stalled")],
    ids=["leader-killed", "leader-hung", "silent-stall"],
)
async def test_a_stream_whose_leader_fails_goes_on_from_another_replica_whole(stack, fault, cause):
    """Chat and completions, each cut mid-way by a real fault: the client gets one
    stream (one id, no error), text equal to the unbroken answer, the finish and a
    usage that counts the first attempt's prompt and every attempt's completion."""
    sims, gw = await two_replicas(stack, stall_after=1)
    chat = {"model": "alpha", "messages": CHAT, **LONG, "stream_options": {"include_usage": True}}
    events, first = await broken_stream(gw, sims, "/v1/chat/completions", chat, fault)
    other = the_other(sims, first)
    reference = await unbroken(other.endpoint, "/v1/chat/completions", chat)
    assert errors_in(events) == []
    assert events[-1] == "[DONE]"
    assert text_of(events) == text_of(reference) and len(text_of(events).split()) == 40
    assert {e["id"] for e in events if isinstance(e, dict)} == {events[0]["id"]}  # one stream
    assert [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e["choices"] and e["choices"][0]["finish_reason"]] == ["length"]
    assert events[-2]["usage"] == reference[-2]["usage"]  # prompt of the first attempt, completion of both
    roles = [e for e in events if isinstance(e, dict) and e["choices"] and "role" in e["choices"][0]["delta"]]
    assert len(roles) == 1  # the continuation's opening role chunk was not passed on
    assert gw_metric(gw, "llmgw_gateway_stream_migrations_total", model="alpha", cause=cause, outcome="continued") == 1
    assert gw_metric(gw, "llmgw_gateway_stream_migration_gap_seconds_count") == 1
    assert gw_metric(gw, "llmgw_gateway_stream_errors_total") == 0


async def test_a_completion_stream_goes_on_from_another_replica_whole(stack):
    sims, gw = await two_replicas(stack)
    body = {"model": "alpha", "prompt": "Fabrics hold replicas whole:", **LONG}
    events, first = await broken_stream(gw, sims, "/v1/completions", body, kill)
    reference = await unbroken(the_other(sims, first).endpoint, "/v1/completions", body)
    assert errors_in(events) == [] and events[-1] == "[DONE]"
    assert text_of(events, chat=False) == text_of(reference, chat=False)
    assert {e["id"] for e in events if isinstance(e, dict)} == {events[0]["id"]}


async def test_a_stream_whose_worker_is_killed_goes_on_from_another_replica(stack):
    """A two-rank group: the worker's death hangs its leader's steps (no token, no
    error); the stall watch sees the silence and the stream moves."""
    sims, gw = await two_replicas(stack, workers=1, stall_after=1)
    chat = {"model": "alpha", "messages": CHAT, **LONG}
    events, first = await broken_stream(gw, sims, "/v1/chat/completions", chat, kill_worker)
    reference = await unbroken(the_other(sims, first).endpoint, "/v1/chat/completions", chat)
    assert errors_in(events) == [] and events[-1] == "[DONE]"
    assert text_of(events) == text_of(reference)
    assert gw_metric(gw, "llmgw_gateway_stream_migrations_total", outcome="continued") == 1


async def test_a_stream_that_cannot_be_continued_exactly_ends_with_the_error_naming_why(stack):
    sims, gw = await two_replicas(stack)
    stop = {"model": "alpha", "messages": CHAT, **LONG, "stop": ["zebra"]}
    events, _ = await broken_stream(gw, sims, "/v1/chat/completions", stop, kill)
    [error] = errors_in(events)
    assert "stop sequences are not continued" in error["message"], error
    assert events[-1] == "[DONE]"
    assert gw_metric(gw, "llmgw_gateway_stream_migrations_total", outcome="refused") == 1


async def test_a_client_that_opts_out_gets_the_error_event(stack):
    sims, gw = await two_replicas(stack)
    chat = {"model": "alpha", "messages": CHAT, **LONG}
    events, _ = await broken_stream(gw, sims, "/v1/chat/completions", chat, kill, headers={"X-LLMGW-Migration": "off"})
    [error] = errors_in(events)
    assert "send the request again" in error["message"], error
    assert gw_metric(gw, "llmgw_gateway_stream_migrations_total") == 0


async def test_max_migrations_spent_ends_the_stream_with_the_error(stack):
    """One migration allowed: the first replica killed, the stream goes on from the
    second; that one killed too: the error event (the third is ready, but the budget is spent)."""
    (a, b, c), gw, _ = await stack.start([("a", "alpha", RATE), ("b", "alpha", RATE), ("c", "alpha", RATE)], max_migrations=1)
    sims = {"alpha-a": a, "alpha-b": b, "alpha-c": c}
    for rid, sim in sims.items():
        await stack.board.put(record(rid, "alpha", sim.endpoint))
    await routed(gw, *sims)
    chat = {"model": "alpha", "messages": CHAT, **LONG}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{base_url(gw)}/v1/chat/completions", json=chat)
        first = resp.headers["x-llmgw-replica"]
        raw = b""
        while raw.count(b"\n\n") < 5:
            raw += await resp.content.readline()
        kill(sims[first])
        await wait_for(lambda: gw_metric(gw, "llmgw_gateway_stream_migrations_total", outcome="continued") == 1, "the stream continued")
        second = next(b.id for b in gw.router.backends() if b.flights)
        assert second != first
        n = raw.count(b"\n\n")
        while raw.count(b"\n\n") < n + 3:
            raw += await resp.content.readline()
        kill(sims[second])
        raw += await asyncio.wait_for(resp.content.read(), 30)
    events = events_of(raw)
    [error] = errors_in(events)
    assert "moved 1 time(s) already" in error["message"], error
    assert events[-1] == "[DONE]"
    assert gw_metric(gw, "llmgw_gateway_stream_migrations_total", outcome="refused") == 1


async def test_a_plain_request_whose_first_two_replicas_die_while_it_waits_gets_one_answer(stack):
    """Hung engines (SIGSTOP) hold the request; each is then killed in turn (a reset):
    the request moves twice (max_migrations 2) and the third replica answers."""
    (a, b, c), gw, client = await stack.start([("a", "alpha", 0.0), ("b", "alpha", 0.0), ("c", "alpha", 0.0)])
    sims = {"alpha-a": a, "alpha-b": b, "alpha-c": c}
    hang(a)
    hang(b)
    await stack.board.put(record("alpha-a", "alpha", a.endpoint))
    await routed(gw, "alpha-a")
    pending = asyncio.create_task(client.chat.completions.with_raw_response.create(model="alpha", messages=CHAT, max_tokens=8))

    def waiting_on() -> str | None:
        return next((b.id for b in gw.router.backends() if b.flights), None)

    await wait_for(waiting_on, "the request waiting on alpha-a", expected="alpha-a")
    await stack.board.put(record("alpha-b", "alpha", b.endpoint))
    await routed(gw, "alpha-a", "alpha-b")
    kill(a)
    await wait_for(waiting_on, "the request moved to alpha-b", expected="alpha-b")
    await stack.board.put(record("alpha-c", "alpha", c.endpoint))
    await routed(gw, "alpha-a", "alpha-b", "alpha-c")
    kill(b)
    raw = await asyncio.wait_for(pending, 20)
    assert raw.headers["x-llmgw-replica"] == "alpha-c"
    assert raw.parse().usage.completion_tokens > 0
    assert gw_metric(gw, "llmgw_gateway_retries_total", model="alpha") == 2
    assert gw_metric(gw, "llmgw_gateway_requests_total", status="200") == 1
    assert gw_metric(gw, "llmgw_gateway_requests_total", status="502") == 0
    del sims


async def test_a_moved_stream_is_an_event_naming_the_replicas_before_and_after(stack):
    sims, gw = await two_replicas(stack)
    js = stack.board.nc.jetstream()
    sub = await js.subscribe("llmgw.event.request.>", stream=S.EVENT_STREAM, ordered_consumer=True)
    chat = {"model": "alpha", "messages": CHAT, **LONG}
    events, first = await broken_stream(gw, sims, "/v1/chat/completions", chat, kill)
    assert errors_in(events) == []
    msg = await sub.next_msg(timeout=10)
    ev = decode(msg.data, Event)
    assert ev.kind == "request" and ev.what == "migrated" and ev.subject == events[0]["id"]
    assert ev.data["before"] == first and ev.data["after"] == next(k for k in sims if k != first)
    assert ev.data["cause"] == "stream_broken" and ev.data["model"] == "alpha"
    await sub.unsubscribe()
