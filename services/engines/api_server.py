"""The simulated engine's OpenAI-compatible HTTP API (aiohttp).

Response shapes follow OpenAI's (and vLLM's) exactly, so the official
``openai`` client and any gateway written for vLLM parse them unchanged.
"""

from __future__ import annotations

import base64
import json
import logging
import struct
import time
import uuid

from aiohttp import web

from .api_requests import (
    MAX_MODEL_LEN,
    ApiError,
    Generation,
    bad,
    chat_request,
    completion_request,
    detokenize_request,
    embedding_request,
    parse_body,
    responses_request,
    tokenize_request,
)
from .core import EngineCore
from .metrics import CONTENT_TYPE, EngineMetrics
from .tokens import Answer, detokenize, embedding, token_id

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def build_app(
    core: EngineCore, metrics: EngineMetrics, *, served_model: str, model: str, log: logging.Logger, max_model_len: int = MAX_MODEL_LEN
) -> web.Application:
    api = _Api(core, metrics, served_model, model, log)
    api.max_model_len = max_model_len
    app = web.Application(middlewares=[api.errors])
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics_text)
    app.router.add_get("/v1/models", api.models)
    app.router.add_post("/v1/chat/completions", api.chat)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/responses", api.responses)
    app.router.add_post("/v1/embeddings", api.embeddings)
    app.router.add_post("/tokenize", api.tokenize)
    app.router.add_post("/detokenize", api.detokenize)
    # Not simulated (a 404 from the engine, as from one that lacks them): /v1/rerank, /v1/score, audio.
    app.router.add_post("/reset_prefix_cache", api.reset_prefix_cache)  # vLLM's (dev mode): benchmarks start cold
    return app


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


class _Api:
    def __init__(self, core: EngineCore, metrics: EngineMetrics, served_model: str, model: str, log: logging.Logger):
        self.core, self.metrics_ = core, metrics
        self.served_model, self.model, self.log = served_model, model, log
        self.created = int(time.time())
        self.max_model_len = MAX_MODEL_LEN

    # -- errors --------------------------------------------------------------

    @web.middleware
    async def errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err = ApiError(e.status, f"{request.method} {request.path}: {e.reason}", code=_HTTP_CODES.get(e.status, "http_error"))
            return web.json_response(err.body(), status=e.status)
        except Exception:  # a bug here must cost one request, not the engine
            self.log.exception("unexpected error serving %s %s", request.method, request.path)
            err = ApiError(500, "internal error in the simulated engine; see its log", code="internal_error")
            return web.json_response(err.body(), status=500)

    # -- plain endpoints -----------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        # Like vLLM, health says the server is up, not that the group is whole:
        # a lost peer stalls generation while /health keeps answering 200.
        return web.Response(status=200)

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics_.render(), headers={"Content-Type": CONTENT_TYPE})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.core.reset_prefix_cache()
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.served_model, "object": "model", "created": self.created, "owned_by": "llmgw-sim", "root": self.model, "parent": None}
        return web.json_response({"object": "list", "data": [card]})

    # -- generation ----------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        gen = chat_request(parse_body(await request.read()), self.served_model, self.max_model_len)
        return await self._generate(request, gen, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        gen = completion_request(parse_body(await request.read()), self.served_model, self.max_model_len)
        return await self._generate(request, gen, chat=False)

    # -- the other endpoints (vLLM's shapes) ----------------------------------

    async def embeddings(self, request: web.Request) -> web.Response:
        req = embedding_request(parse_body(await request.read()), self.served_model, self.max_model_len)
        data = []
        for i, p in enumerate(req.prompts):
            vector = embedding(p.key, req.dimensions)
            if req.base64:  # what the openai client asks for by default: little-endian float32
                value: list | str = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            else:
                value = vector
            data.append({"index": i, "object": "embedding", "embedding": value})
        tokens = sum(p.tokens for p in req.prompts)
        return web.json_response(
            {"id": "embd-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()), "model": req.model, "data": data,
             "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}}
        )  # fmt: skip

    async def tokenize(self, request: web.Request) -> web.Response:
        _, tokens = tokenize_request(parse_body(await request.read()), self.served_model)
        ids = [token_id(t) for t in tokens]
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        _, ids = detokenize_request(parse_body(await request.read()), self.served_model)
        try:
            return web.json_response({"prompt": detokenize(ids)})
        except ValueError as e:
            raise bad(str(e), "tokens") from None

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = parse_body(await request.read())
        gen = responses_request(body, self.served_model, self.max_model_len)
        p = gen.prompts[0]
        answer = Answer(p.key, 0, gen.max_tokens, gen.ignore_eos)
        shape = _Response(gen.model, body, gen.max_tokens)
        if not gen.stream:
            text: list[str] = []
            async with self.core.admit(p.tokens, [p.ids]) as seq:
                async for batch in seq.decode([answer]):
                    text += [token for _, token in batch]
                seq.finish([answer])
            return web.json_response(shape.whole("".join(text), answer, p.tokens))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            for event in shape.opening():
                await resp.write(shape.event(event))
            text = []
            async with self.core.admit(p.tokens, [p.ids]) as seq:
                async for batch in seq.decode([answer]):
                    for _, token in batch:
                        text.append(token)
                        await resp.write(shape.event({"type": "response.output_text.delta", **shape.where(), "delta": token, "logprobs": []}))
                seq.finish([answer])
            for event in shape.closing("".join(text), answer, p.tokens):
                await resp.write(shape.event(event))
            await resp.write_eof()
        except ConnectionResetError:
            self.log.debug("client left a stream of %s early", request.path)
        return resp

    async def _generate(self, request: web.Request, gen: Generation, *, chat: bool) -> web.StreamResponse:
        answers = [Answer(p.key, j, gen.max_tokens, gen.ignore_eos, p.skip) for p in gen.prompts for j in range(gen.n)]
        prompt_tokens = sum(p.tokens for p in gen.prompts)
        shape = _Shape(chat, gen.model)
        if gen.stream:
            return await self._stream(request, gen, shape, answers, prompt_tokens)

        texts: list[list[str]] = [[] for _ in answers]
        async with self.core.admit(prompt_tokens, [p.ids for p in gen.prompts]) as seq:
            async for batch in seq.decode(answers):
                for j, token in batch:
                    texts[j].append(token)
            seq.finish(answers)
        choices = [shape.choice(j, "".join(texts[j]), a.finish_reason) for j, a in enumerate(answers)]
        usage = _usage(prompt_tokens, sum(a.length for a in answers))
        return web.json_response(shape.whole(choices, usage))

    async def _stream(self, request: web.Request, gen: Generation, shape: _Shape, answers: list[Answer], prompt_tokens: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        extra = {"usage": None} if gen.include_usage else {}
        try:
            await resp.prepare(request)
            async with self.core.admit(prompt_tokens, [p.ids for p in gen.prompts]) as seq:
                if shape.chat:
                    for j in range(len(answers)):
                        await resp.write(_sse(shape.chunk([shape.delta(j, {"role": "assistant", "content": ""})], extra)))
                sent = [0] * len(answers)
                for j, answer in enumerate(answers):
                    if not answer.length:  # a continuation whose answer was all given: it ends here
                        await resp.write(_sse(shape.chunk([shape.delta(j, None, answer.finish_reason)], extra)))
                async for batch in seq.decode(answers):
                    for j, token in batch:
                        await resp.write(_sse(shape.chunk([shape.delta(j, token)], extra)))
                        sent[j] += 1
                        if sent[j] == answers[j].length:
                            await resp.write(_sse(shape.chunk([shape.delta(j, None, answers[j].finish_reason)], extra)))
                seq.finish(answers)
            if gen.include_usage:
                await resp.write(_sse(shape.chunk([], {"usage": _usage(prompt_tokens, sum(sent))})))
            await resp.write(_sse("[DONE]"))
            await resp.write_eof()
        except ConnectionResetError:
            self.log.debug("client left a stream of %s early", request.path)
        return resp


class _Shape:
    """OpenAI's object shapes for chat completions and legacy completions."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, object_: str) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def choice(self, index: int, text: str, finish_reason: str) -> dict:
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def whole(self, choices: list[dict], usage: dict) -> dict:
        obj = self._head("chat.completion" if self.chat else "text_completion")
        obj.update(choices=choices, usage=usage, system_fingerprint=None)
        return obj

    def delta(self, index: int, content: str | dict | None, finish_reason: str | None = None) -> dict:
        """A streamed choice: a token (or the role header for chat), or its ending."""
        if self.chat:
            if isinstance(content, dict):
                delta = content
            else:
                delta = {} if content is None else {"content": content}
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": index, "text": content or "", "logprobs": None, "finish_reason": finish_reason}

    def chunk(self, choices: list[dict], extra: dict) -> dict:
        obj = self._head("chat.completion.chunk" if self.chat else "text_completion")
        obj.update(choices=choices, **extra)
        return obj


class _Response:
    """vLLM's /v1/responses objects (ResponsesResponse) and stream events, one message of output text."""

    def __init__(self, model: str, body: dict, max_tokens: int):
        self.model = model
        self.id = "resp_" + uuid.uuid4().hex
        self.item_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.body = body
        self.max_tokens = max_tokens
        self.seq = 0

    def where(self) -> dict:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def event(self, obj: dict) -> bytes:
        obj["sequence_number"] = self.seq
        self.seq += 1
        return b"event: " + obj["type"].encode() + b"\ndata: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def _part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}

    def _item(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [self._part(text)]
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def _object(self, status: str, output: list, usage: dict | None, incomplete: str | None = None) -> dict:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model, "status": status,
            "output": output, "usage": usage, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.get("instructions"), "max_output_tokens": self.max_tokens, "metadata": b.get("metadata"),
            "parallel_tool_calls": b.get("parallel_tool_calls", True), "previous_response_id": b.get("previous_response_id"),
            "reasoning": None, "service_tier": "auto", "temperature": b.get("temperature"), "text": None,
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [], "top_p": b.get("top_p"),
            "truncation": "disabled", "user": b.get("user"), "error": None,
        }  # fmt: skip

    @staticmethod
    def _usage(prompt_tokens: int, answer: Answer) -> dict:
        return {
            "input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": answer.length, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + answer.length,
        }  # fmt: skip

    def whole(self, text: str, answer: Answer, prompt_tokens: int) -> dict:
        cut = answer.finish_reason == "length"
        status = "incomplete" if cut else "completed"
        return self._object(
            status, [self._item(text, "incomplete" if cut else "completed")], self._usage(prompt_tokens, answer), "max_output_tokens" if cut else None
        )

    def opening(self) -> list[dict]:
        started = self._object("in_progress", [], None)
        return [
            {"type": "response.created", "response": started},
            {"type": "response.in_progress", "response": started},
            {"type": "response.output_item.added", "output_index": 0, "item": self._item(None, "in_progress")},
            {"type": "response.content_part.added", **self.where(), "part": self._part("")},
        ]

    def closing(self, text: str, answer: Answer, prompt_tokens: int) -> list[dict]:
        final = self.whole(text, answer, prompt_tokens)
        return [
            {"type": "response.output_text.done", **self.where(), "text": text, "logprobs": []},
            {"type": "response.content_part.done", **self.where(), "part": self._part(text)},
            {"type": "response.output_item.done", "output_index": 0, "item": final["output"][0]},
            {"type": "response.completed" if final["status"] == "completed" else "response.incomplete", "response": final},
        ]
