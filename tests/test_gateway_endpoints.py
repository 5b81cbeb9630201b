"""Every OpenAI-compatible endpoint through a real gateway, with the official
``openai`` client, in front of real ``sim`` engine processes fed replica
records on a real nats-server: embeddings, responses (plain and streamed),
completions, chat, /tokenize and /detokenize, and a multipart transcription
routed by its form field (the sim does not simulate audio: its own 404 passes
through, and the replica that answered shows the routing)."""

from __future__ import annotations

import io
import json

import aiohttp
import openai
import pytest

from .gateway_helpers import replica, wait_for
from .test_gateway import base_url, gw_metric, stack  # noqa: F401  (stack: the fixture)

pytestmark = pytest.mark.timeout(60)

NEW_PATHS = ("/v1/embeddings", "/v1/responses", "/v1/rerank", "/v1/score", "/tokenize", "/detokenize")


async def _two_models(stack):
    (a, b), gw, client = await stack.start([("a", "org/alpha", 0.0), ("b", "org/beta", 0.0)])
    await stack.board.put(replica("alpha-1", "org/alpha", a.endpoint))
    await stack.board.put(replica("beta-1", "org/beta", b.endpoint))
    await wait_for(lambda: gw.router.models(), "both models routed", expected=["org/alpha", "org/beta"])
    return gw, client


async def test_every_endpoint_with_the_openai_client(stack):
    gw, client = await _two_models(stack)

    raw = await client.embeddings.with_raw_response.create(model="org/beta", input=["the fabric", "a node"], dimensions=16)
    assert raw.headers["x-llmgw-replica"] == "beta-1"
    emb = raw.parse()  # the client asks for base64 and decodes it
    assert emb.model == "org/beta" and [d.index for d in emb.data] == [0, 1]
    assert all(len(d.embedding) == 16 and abs(sum(x * x for x in d.embedding) - 1) < 1e-3 for d in emb.data)
    again = await client.embeddings.create(model="org/beta", input="the fabric", dimensions=16, encoding_format="float")
    assert again.data[0].embedding == pytest.approx(emb.data[0].embedding, abs=1e-6)  # deterministic, either encoding
    assert emb.usage.prompt_tokens == 4

    raw = await client.responses.with_raw_response.create(model="org/alpha", input="Which fabric holds the replica?", max_output_tokens=12)
    assert raw.headers["x-llmgw-replica"] == "alpha-1"
    resp = raw.parse()
    assert resp.object == "response" and resp.model == "org/alpha" and resp.status in ("completed", "incomplete")
    assert resp.output_text and resp.usage.output_tokens == len(resp.output_text.split()) <= 12
    events = [e async for e in await client.responses.create(model="org/alpha", input="Which fabric holds the replica?", max_output_tokens=12, stream=True)]
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == resp.output_text  # streamed token by token, the same text
    assert events[-1].response.output_text == resp.output_text

    done = await client.completions.create(model="org/beta", prompt="GPUs on one fabric", max_tokens=5)
    assert done.object == "text_completion" and 0 < done.usage.completion_tokens <= 5
    chat = await client.chat.completions.create(model="org/alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert chat.object == "chat.completion" and chat.choices[0].message.content

    root = base_url(gw)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{root}/tokenize", json={"model": "org/alpha", "prompt": "the fabric holds ranks"}) as r:
            assert r.status == 200 and r.headers["x-llmgw-replica"] == "alpha-1"
            tok = await r.json()
        assert tok["count"] == len(tok["tokens"]) == 4 and tok["max_model_len"] > 0
        async with s.post(f"{root}/detokenize", json={"model": "org/alpha", "tokens": tok["tokens"]}) as r:
            assert r.status == 200 and (await r.json())["prompt"] == "the fabric holds ranks"
        # Not simulated: the engine's own 404 passes through, and is no failure of the replica.
        async with s.post(f"{root}/v1/rerank", json={"model": "org/alpha", "query": "q", "documents": ["d"]}) as r:
            assert r.status == 404 and r.headers["x-llmgw-replica"] == "alpha-1"
            assert "error" in await r.json()
    assert gw_metric(gw, "llmgw_gateway_upstream_errors_total") == 0
    assert gw.router.models() == ["org/alpha", "org/beta"]  # nothing cooled down


async def test_multipart_transcription_is_routed_by_its_form_field(stack):
    gw, client = await _two_models(stack)
    for model, rid in (("org/beta", "beta-1"), ("org/alpha", "alpha-1")):
        with pytest.raises(openai.NotFoundError) as caught:
            await client.audio.transcriptions.create(model=model, file=("a.wav", io.BytesIO(b"RIFF" + bytes(64)), "audio/wav"))
        # The engine's own 404 (the sim has no audio), from the replica of the form's model.
        assert caught.value.response.headers["x-llmgw-replica"] == rid
        assert "/v1/audio/transcriptions" in caught.value.message

    root = base_url(gw)
    async with aiohttp.ClientSession() as s:
        form = aiohttp.FormData()
        form.add_field("model", "org/nope")
        form.add_field("file", b"RIFF", filename="a.wav", content_type="audio/wav")
        async with s.post(f"{root}/v1/audio/transcriptions", data=form) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        cut = b'--XX\r\nContent-Disposition: form-data; name="model"\r\n\r\norg/alpha'  # never closed
        async with s.post(f"{root}/v1/audio/transcriptions", data=cut, headers={"Content-Type": "multipart/form-data; boundary=XX"}) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["code"] == "invalid_form" and "not closed by the boundary" in err["message"]
        async with s.post(f"{root}/v1/audio/translations", data=b"{}", headers={"Content-Type": "application/json"}) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and "multipart/form-data" in err["message"]
        form = aiohttp.FormData()
        form.add_field("file", b"RIFF", filename="a.wav", content_type="audio/wav")
        async with s.post(f"{root}/v1/audio/transcriptions", data=form) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["param"] == "model"


async def test_unknown_model_on_each_new_path_is_a_404_in_openais_shape(stack):
    gw, _ = await _two_models(stack)
    async with aiohttp.ClientSession() as s:
        for path in NEW_PATHS:
            async with s.post(f"{base_url(gw)}{path}", data=json.dumps({"model": "org/nope", "input": "x"})) as r:
                body = await r.json()
                assert r.status == 404, path
                assert body["error"]["code"] == "model_not_found" and body["error"]["type"] == "invalid_request_error", path
                assert "x-llmgw-replica" not in r.headers
