"""Stream migration on real vLLM (its CPU build): a stream whose engine is
killed mid-answer goes on from another vLLM engine, from the token ids, and
the client's text equals the unbroken answer at temperature 0.

Two single-node ``vllm serve`` engines of the tiny model (``bench/vllm_engines.py``,
the shape ``llmgw up --engine vllm`` gives a single-node replica) behind a real
gateway, their records written under the scheduler's identity. The tiny model's
WordPiece text does not read back as the tokens that made it ("co" + "##d" is
"cod", which it reads as other pieces), which is exactly why a vLLM stream is
continued from its token ids, never from its text: this test fails if it is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal

import aiohttp
import pytest

from bench.vllm_engines import Vllm, engine_env
from llmgw.services.devcluster import realvllm

from .gateway_helpers import Board, gateway_config, start_gateway, wait_for
from .gateway_helpers import replica as record
from .test_stream_migration import errors_in, events_of, text_of
from .vllm_helpers import install_vllm

pytestmark = [pytest.mark.real_vllm, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 1024
MESSAGES = [{"role": "user", "content": "tell me about the fabric and the replica"}]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Three engines for the module: each test kills the one its stream is on, and
    at least two are alive for the next (a vLLM start is a minute or more here)."""
    vllm = install_vllm()
    env = engine_env(MAX_MODEL_LEN)
    work = tmp_path_factory.mktemp("vllm")
    started = [Vllm(vllm, work, name, max_model_len=MAX_MODEL_LEN, env=env) for name in ("a", "b", "c")]
    try:

        async def serving() -> None:
            await asyncio.gather(*(e.wait_serving(600) for e in started))

        asyncio.run(serving())
        yield {f"tiny-{e.name}": e for e in started}
    finally:
        for e in started:
            e.kill()


@pytest.fixture
async def two_vllms(engines, nats_server):
    """Two live engines of the module's behind a gateway, their records on the board."""
    alive = dict(list((rid, e) for rid, e in engines.items() if e.proc.poll() is None)[:2])
    assert len(alive) == 2, "fewer than two engines alive"
    cfg = gateway_config(nats_server, "gw-vllm", stall_after=30)  # its certificate, admitted by the board's reload
    board = await Board.open(nats_server)
    gw = None
    try:
        gw = await start_gateway(cfg)
        for rid, e in alive.items():
            await board.put(record(rid, e.model, e.endpoint, engine="vllm"))
        await wait_for(lambda: len([b for b in gw.router.backends() if b.routable]) == 2, "both vLLM replicas routed", timeout=30)
        yield alive, gw
    finally:
        if gw is not None:
            await gw.stop()
        await board.close()


async def _post_stream(url: str, body: dict) -> bytes:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.read()


def _kill_engine(engine: Vllm) -> None:
    """SIGKILL of the engine's whole process group: API server and engine core die at once."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(engine.proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_vllm_stream_killed_mid_answer_goes_on_from_the_token_ids_and_equals_the_unbroken_one(two_vllms, path):
    engines, gw = two_vllms
    chat = path == "/v1/chat/completions"
    model = realvllm.MODEL
    prompt = {"messages": MESSAGES} if chat else {"prompt": "the node is the"}
    body = {"model": model, **prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    # The unbroken answer, from each engine directly: the same at temperature 0.
    references = {rid: events_of(await _post_stream(f"{e.endpoint}{path}", body)) for rid, e in engines.items()}
    texts = {rid: text_of(ev, chat) for rid, ev in references.items()}
    assert len(set(texts.values())) == 1, texts

    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"http://127.0.0.1:{gw.port}{path}", json=body)
        assert resp.status == 200
        first = resp.headers["x-llmgw-replica"]
        head = b""
        while head.count(b"\n\n") < 8:
            line = await resp.content.readline()
            assert line, head
            head += line
        _kill_engine(engines[first])
        rest = await asyncio.wait_for(resp.content.read(), 300)
    events = events_of(head + rest)
    assert errors_in(events) == [], events[-3:]
    assert events[-1] == "[DONE]"
    other = next(rid for rid in engines if rid != first)
    reference = references[other]
    assert text_of(events, chat) == texts[other]
    assert {e["id"] for e in events if isinstance(e, dict)} == {events[0]["id"]}
    assert events[-2]["usage"]["prompt_tokens"] == reference[-2]["usage"]["prompt_tokens"]
    assert events[-2]["usage"]["completion_tokens"] == reference[-2]["usage"]["completion_tokens"] == 48
    raw = json.dumps([e for e in events if isinstance(e, dict)])
    assert "token_ids" not in raw  # asked for by the gateway, never shown to the client
    metrics = gw.metrics.render().decode()
    assert 'outcome="continued"' in metrics and "llmgw_gateway_stream_migrations_total" in metrics
