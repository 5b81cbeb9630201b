"""The sim engine's prefix cache, read back from its own /metrics under vLLM's names
and checked against what was sent (a real ``llmgw engine sim`` process)."""

from __future__ import annotations

import subprocess
import sys
import time

import aiohttp
import pytest

from tests.gateway_helpers import Sim, metric_sum

BLOCK = 16
CACHE = 256  # tokens: 16 blocks


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


@pytest.fixture
async def sim(tmp_path):
    s = Sim(tmp_path, "cache", "m", extra=("--kv-cache-tokens", str(CACHE), "--block-size", str(BLOCK), "--prefill-rate", "20000"))
    try:
        await s.wait_serving()
        yield s
    finally:
        s.kill()


async def post(s: Sim, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as c, c.post(f"{s.endpoint}{path}", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def counters(s: Sim) -> tuple[float, float, float, float]:
    text = await s.metrics()
    return (
        metric_sum(text, "vllm:prefix_cache_queries_total", model_name="m"),
        metric_sum(text, "vllm:prefix_cache_hits_total", model_name="m"),
        metric_sum(text, "vllm:prompt_tokens_total", model_name="m"),
        metric_sum(text, "vllm:kv_cache_usage_perc", model_name="m"),
    )


async def test_hits_misses_and_eviction_counted_in_tokens_as_sent(sim):
    a = words("a", 100)
    sent = hits = 0

    async def complete(prompt: str) -> int:
        r = await post(sim, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2})
        return r["usage"]["prompt_tokens"]

    n = await complete(a)
    assert n == 100  # one token per word, as the engine counts them
    sent += n
    assert await counters(sim) == (sent, 0, sent, 6 / 16)  # 6 full blocks cached of 16

    sent += await complete(a)  # all of it cached, but the last token is always computed: 6 blocks
    hits += 96
    assert await counters(sim) == (sent, hits, sent, 6 / 16)

    shared = a.split()[:40] + words("b", 60).split()  # the same first 40 tokens: 2 whole blocks
    sent += await complete(" ".join(shared))
    hits += 32
    assert (await counters(sim))[:3] == (sent, hits, sent)

    for tag in "cde":  # 3 x 6 new blocks: the cache (16 blocks) lets a's go, least recently used first
        sent += await complete(words(tag, 100))
    q, h, p, usage = await counters(sim)
    assert (q, h, p, usage) == (sent, hits, sent, 1.0)
    sent += await complete(a)
    assert await counters(sim) == (sent, hits, sent, 1.0)  # evicted: no hit


async def test_chat_turns_hit_on_the_history_they_resend(sim):
    history = [{"role": "system", "content": words("s", 50)}, {"role": "user", "content": words("q", 20)}]
    first = await post(sim, "/v1/chat/completions", {"model": "m", "messages": history, "max_tokens": 4})
    t1 = first["usage"]["prompt_tokens"]
    assert t1 == 50 + 20 + 2 * 3  # words plus the template's 3 tokens per message
    history += [first["choices"][0]["message"], {"role": "user", "content": words("r", 30)}]
    second = await post(sim, "/v1/chat/completions", {"model": "m", "messages": history, "max_tokens": 4})
    t2 = second["usage"]["prompt_tokens"]
    assert t2 > t1
    q, h, p, _ = await counters(sim)
    assert (q, h, p) == (t1 + t2, (t1 // BLOCK) * BLOCK, t1 + t2)


async def test_uncached_prompt_tokens_cost_prefill_time(sim):
    # 4,000 uncached tokens at 20,000 tokens/s: at least 0.2 s before anything comes back.
    started = time.monotonic()
    r = await post(sim, "/v1/completions", {"model": "m", "prompt": words("long", 4000), "max_tokens": 1})
    assert r["usage"]["prompt_tokens"] == 4000
    assert time.monotonic() - started >= 0.2


async def test_no_cache_flags_no_cache_counts(tmp_path):
    """Without --kv-cache-tokens nothing is cached or counted (today's behaviour)."""
    s = Sim(tmp_path, "plain", "m")
    try:
        await s.wait_serving()
        for _ in range(2):
            await post(s, "/v1/completions", {"model": "m", "prompt": words("a", 100), "max_tokens": 2})
        assert await counters(s) == (0, 0, 200, 0)
    finally:
        s.kill()


@pytest.mark.parametrize(
    "flags, says",
    [
        (("--block-size", "0"), "--block-size"),
        (("--kv-cache-tokens", "-1"), "--kv-cache-tokens"),
        (("--kv-cache-tokens", "8", "--block-size", "16"), "at least one block"),
        (("--prefill-rate", "-5"), "--prefill-rate"),
        (("--prefill-rate", "nan"), "--prefill-rate"),
        (("--max-model-len", "3"), "--max-model-len"),
    ],
)
def test_bad_cache_flags_are_one_clear_error(flags, says):
    argv = [sys.executable, "-m", "llmgw.services", "engine", "sim", "--model", "m", "--nnodes", "1", "--rank", "0",
            "--leader-addr", "127.0.0.1", "--rendezvous-port", "1", "--host", "127.0.0.1", "--port", "2", "--load-time", "0", *flags]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr
