"""The gateway's routes, on its own HTTP server (``httpserver.py``).

Checks run cheapest first, and all before any replica is chosen: the API key,
the body's size (the server flags an over-limit body without reading it), the
body itself, the model. A request refused here never reaches a replica. Every
route handles its own errors, so the hot path is one coroutine call deep.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import unquote

import msgspec

from . import errors
from .auth import ApiKeys
from .httpserver import HttpServer, Request, Response, Stream
from .metrics import UNKNOWN_MODEL, GatewayMetrics
from .proxy import Forwarder
from .router import NoReadyReplica, Router, UnknownModel

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
_KNOWN_PATHS = {"/v1/models": "GET", "/healthz": "GET", "/metrics": "GET", **{p: "POST" for p in GENERATION_PATHS}}
_NEED_KEY = "a valid API key is required: send 'Authorization: Bearer KEY'"


class _Head(msgspec.Struct):
    """The only fields the gateway reads; the body itself is forwarded untouched.
    ``stream`` is not checked here (the engine judges it): only ``true`` makes a stream."""

    model: str | None = None
    stream: Any = None


_decode_head = msgspec.json.Decoder(_Head).decode


class GatewayApp:
    def __init__(self, router: Router, forwarder: Forwarder, metrics: GatewayMetrics, *, max_body_bytes: int, keys: ApiKeys | None):
        self.router = router
        self.forwarder = forwarder
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.keys = keys
        self.first_seen: dict[str, int] = {}  # model -> when this gateway first saw it ready ("created")

    def server(self) -> HttpServer:
        return HttpServer(self.handle, max_body_bytes=self.max_body_bytes, error_body=errors.refusal)

    async def handle(self, request: Request) -> Response | Stream:
        """The routes: POST the two generation paths; GET (and HEAD) the rest; anything else -> fallback."""
        method = request.method
        path = request.path
        if method == "POST":
            if path == "/v1/chat/completions":
                return await self._generate(request, "/v1/chat/completions")
            if path == "/v1/completions":
                return await self._generate(request, "/v1/completions")
        elif method == "GET" or method == "HEAD":
            if path == "/v1/models":
                return self.models(request)
            if path == "/healthz":
                return self.healthz()
            if path == "/metrics":
                return self.metrics_text()
            raw = request.raw_path
            if raw.startswith("/v1/models/") and len(raw) > 11:
                # The name is one path segment as sent; %2F inside it is part of the name (org/name).
                return self.model(request, unquote(raw[11:], errors="surrogateescape"))
        return self.fallback(request)

    # -- generation --------------------------------------------------------------
    async def _generate(self, request: Request, path: str) -> Response | Stream:
        started = time.perf_counter()
        if self.keys is not None and not self.keys.allows(request.header("authorization")):
            return self._refused(request, started, errors.unauthorized(_NEED_KEY))
        if request.too_large:
            return self._refused(request, started, errors.too_large(self.max_body_bytes))
        body = request.body
        try:
            head = _decode_head(body)
            model = head.model
        except msgspec.ValidationError as e:
            if "Expected `object`" in str(e) and "$." not in str(e):
                return self._refused(request, started, errors.bad_request("the request body must be a JSON object", code="invalid_json"))
            return self._refused(request, started, errors.bad_request(f"invalid request: {e}", param="model"))
        except msgspec.DecodeError as e:
            what = "is empty" if not body.strip() else f"is not valid JSON ({e})"
            return self._refused(request, started, errors.bad_request(f"the request body {what}", code="invalid_json"))
        if not model:
            return self._refused(request, started, errors.bad_request("'model' is required: name one of GET /v1/models", code="missing_field", param="model"))
        try:
            return await self.forwarder.forward(request, path, body, model, head.stream is True)
        except UnknownModel as e:
            return self._refused(request, started, errors.not_found(f"{e}; GET /v1/models lists the models served"), UNKNOWN_MODEL)
        except NoReadyReplica as e:
            return self._refused(request, started, errors.unavailable(str(e), e.retry_after), model)

    def _refused(self, request: Request, started: float, resp: Response, model: str = "") -> Response:
        seconds = time.perf_counter() - started
        self.metrics.answered(model, resp.status, seconds)
        if self.forwarder.access is not None:
            self.forwarder.access.answered(request, model, resp.status, seconds)
        return resp

    # -- models ------------------------------------------------------------------
    def _card(self, model: str) -> dict:
        created = self.first_seen.setdefault(model, int(time.time()))
        return {"id": model, "object": "model", "created": created, "owned_by": "llmgw"}

    def _authorized(self, request: Request) -> bool:
        return self.keys is None or self.keys.allows(request.header("authorization"))

    def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return errors.unauthorized(_NEED_KEY)
        return Response.json({"object": "list", "data": [self._card(m) for m in self.router.models()]})

    def model(self, request: Request, name: str) -> Response:
        if not self._authorized(request):
            return errors.unauthorized(_NEED_KEY)
        if name not in self.router.models():
            return errors.not_found(f"no ready replica serves the model '{name}'")
        return Response.json(self._card(name))

    # -- operations (no key needed: probes and scrapers carry none) ----------------
    def healthz(self) -> Response:
        return Response.json({"status": "ok", "models": self.router.models()})

    def metrics_text(self) -> Response:
        return Response(200, self.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    def fallback(self, request: Request) -> Response:
        allowed = _KNOWN_PATHS.get(request.path)
        if allowed is not None:
            return errors.error_response(405, f"{request.method} {request.path}: use {allowed}", code="method_not_allowed", headers={"Allow": allowed})
        return errors.not_found(f"{request.method} {request.path}: no such endpoint", code="not_found", param=None)
