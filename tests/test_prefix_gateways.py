"""Two real gateways over one nats-server agree on where a conversation goes,
without talking to each other: the same replica (``x-llmgw-replica``) for every
turn, whichever gateway each turn goes through, and the engines' own prefix
caches hit on exactly the history each turn resends."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from .gateway_helpers import HOST, Board, Sim, gateway_config, metric_sum, replica, start_gateway, wait_for

pytestmark = pytest.mark.timeout(60)

BLOCK = 16


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


@pytest.fixture
async def two_gateways(nats_server, tmp_path):
    cfgs = [gateway_config(nats_server, f"gw{i}") for i in range(2)]  # routing: prefix, the default
    sims = [Sim(tmp_path, f"s{i}", "m", extra=("--kv-cache-tokens", "200000", "--block-size", str(BLOCK))) for i in range(3)]
    gateways, board = [], None
    try:
        await asyncio.gather(*(s.wait_serving() for s in sims))
        board = await Board.open(nats_server)  # its reload admits the gateways' certificates too
        for i, s in enumerate(sims):
            await board.put(replica(f"m-{i}", "m", s.endpoint))
        for cfg in cfgs:
            gateways.append(await start_gateway(cfg))
        for gw in gateways:
            await wait_for(lambda gw=gw: len(gw.router.models()) == 1 and sum(1 for b in gw.router.backends() if b.routable) == 3, "three replicas routed")
        yield sims, gateways, board
    finally:
        for gw in gateways:
            await gw.stop()
        for s in sims:
            s.kill()
        if board is not None:
            await board.close()


async def chat(session: aiohttp.ClientSession, gw, messages: list) -> tuple[str, dict]:
    async with session.post(f"http://{HOST}:{gw.port}/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 4}) as r:
        assert r.status == 200, await r.text()
        return r.headers["x-llmgw-replica"], await r.json()


async def test_two_gateways_send_each_conversation_to_one_replica(two_gateways):
    sims, (gw0, gw1), board = two_gateways
    where: dict[int, set[str]] = {}
    expected_hits = 0
    sent = 0
    async with aiohttp.ClientSession() as session:
        for c in range(12):
            # Its own system prompt, so the only hits are on this conversation's history.
            history = [{"role": "system", "content": words(f"sys{c}x", 40)}, {"role": "user", "content": words(f"q{c}x", 10)}]
            before = 0
            for turn in range(3):
                rid, answer = await chat(session, (gw0, gw1)[(c + turn) % 2], history)
                where.setdefault(c, set()).add(rid)
                tokens = answer["usage"]["prompt_tokens"]
                expected_hits += (before // BLOCK) * BLOCK  # the whole previous prompt's blocks
                before = tokens
                sent += tokens
                history += [answer["choices"][0]["message"], {"role": "user", "content": words(f"f{c}t{turn}x", 5)}]
    assert all(len(rids) == 1 for rids in where.values()), where
    owners = {next(iter(rids)) for rids in where.values()}
    assert len(owners) >= 2, owners  # the conversations spread; one replica for all would prove nothing

    async def engines():
        texts = [await s.metrics() for s in sims]
        return (sum(metric_sum(t, "vllm:prefix_cache_queries_total") for t in texts), sum(metric_sum(t, "vllm:prefix_cache_hits_total") for t in texts))

    assert await engines() == (sent, expected_hits)
    for gw in (gw0, gw1):
        text = gw.metrics.render().decode()
        assert metric_sum(text, "llmgw_gateway_routing_decisions_total", reason="prefix") == 18
        assert metric_sum(text, "llmgw_gateway_prefix_hit_ratio") == 1.0

    # A replica leaving moves only its conversations; both gateways still agree.
    gone = sorted(owners)[0]
    await board.put(replica(gone, "m", state="failed"))
    for gw in (gw0, gw1):
        await wait_for(lambda gw=gw: sum(1 for b in gw.router.backends() if b.routable) == 2, "the failed replica out of both gateways")
    async with aiohttp.ClientSession() as session:
        for c in range(12):
            history = [{"role": "system", "content": words(f"sys{c}x", 40)}, {"role": "user", "content": words(f"q{c}x", 10)}]
            a, _ = await chat(session, gw0, history)
            b, _ = await chat(session, gw1, history)
            assert a == b
            old = next(iter(where[c]))
            assert a == old if old != gone else a != gone
