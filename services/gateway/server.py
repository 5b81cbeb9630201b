"""The gateway's routes, on its own HTTP server (``httpserver.py``).

Checks run cheapest first, and all before any replica is chosen: the API key,
the body's size (the server flags an over-limit body without reading it), the
body itself, the model. A request refused here never reaches a replica. Every
route handles its own errors, so the hot path is one coroutine call deep.

A body nested deeper than ``max_json_depth`` is refused (400) before it is
decoded: decoders recurse, and a 100,000-deep body made msgspec (and would make
an engine's JSON parser) raise RecursionError. The check costs two memchr scans
on an ordinary body (``brackets_over``); only one with more brackets than the
limit is measured (``json_depth_over``). The body is then decoded once
(``prefix.read``: the model, whether it streams, and what the prefix router keys
on, the prompt's text skipped over undecoded) and forwarded as sent.
"""

from __future__ import annotations

import itertools
import operator
import re
import time
from typing import TYPE_CHECKING
from urllib.parse import unquote

import msgspec

from llmgw.shared.config import GatewaySection

from . import errors, prefix
from .auth import ApiKeys
from .httpserver import HttpServer, Request, Response, Stream
from .metrics import UNKNOWN_MODEL, GatewayMetrics
from .promsd import engine_targets
from .proxy import Forwarder
from .router import NoReadyReplica, Router, UnknownModel

if TYPE_CHECKING:  # annotations only: the HTTP side imports nothing of the bus
    from llmgw.shared.kvmirror import KvMirror
    from llmgw.shared.schemas import Replica

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
# The other OpenAI-compatible (and vLLM / SGLang) endpoints, proxied the same way:
# JSON bodies naming their model, and the audio ones, multipart forms with a
# ``model`` field. An engine that does not implement one answers for itself (a 404
# passed through as its answer, not counted against the replica).
JSON_PATHS = (
    "/v1/embeddings", "/v1/responses", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score",
    "/tokenize", "/detokenize", "/pooling", "/classify",
)  # fmt: skip
FORM_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")
_PROXIED = {**{p: False for p in GENERATION_PATHS + JSON_PATHS}, **{p: True for p in FORM_PATHS}}  # path -> is a form
_KNOWN_PATHS = {"/v1/models": "GET", "/healthz": "GET", "/metrics": "GET", "/sd/engines": "GET", **{p: "POST" for p in _PROXIED}}
_NEED_KEY = "a valid API key is required: send 'Authorization: Bearer KEY'"


# A JSON string (escapes included): brackets inside one are text, not nesting.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_SQUARE = bytes.maketrans(b"{}", b"[]")  # depth is depth, whichever brackets make it
_RUNS = re.compile(rb"\[+|\]+")


def brackets_over(body: bytes, limit: int) -> bool:
    """Whether ``body`` holds more than ``limit`` opening brackets (``{`` and ``[``, strings
    included): ``body.count(b"{") + body.count(b"[") > limit``, found with ``bytes.find``
    (memchr) and stopped at ``limit + 1``. ``bytes.count`` of one byte is a plain loop in
    CPython: ~280 µs for a 190 KB chat body, where memchr skips it in a few µs."""
    if limit > 256:  # past a few hundred finds, one pass of count is the cheaper
        return body.count(b"{") + body.count(b"[") > limit
    n = 0
    find = body.find
    for bracket in (b"{", b"["):
        i = find(bracket)
        while i >= 0:
            n += 1
            if n > limit:
                return True
            i = find(bracket, i + 1)
    return False


def json_depth_over(body: bytes, limit: int) -> bool:
    """Whether ``body``'s brackets (outside strings) nest deeper than ``limit``, at
    C speed. A pass drops every innermost pair (one level) and is cheap where pairs
    are many; passes run while each shrinks the text by 1/8 or more. What is left
    has runs of 4 or more brackets on average, and is scanned run by run: the depth
    peaks at the end of each run of openers. An ordinary body costs two
    memchr scans (``brackets_over``); ``max_body_bytes`` of brackets shaped against
    this, tens of milliseconds (docs/performance.md)."""
    if not brackets_over(body, limit):
        return False  # the common case: not enough brackets to nest that deep
    s = _STRING.sub(b"", body).translate(_SQUARE, _NOT_BRACKETS)
    while s and limit > 0:
        shorter = s.replace(b"[]", b"")
        if len(shorter) * 8 > len(s) * 7:
            break
        s = shorter
        limit -= 1  # one level gone
    if s.count(b"[") <= limit:
        return False
    if s[:1] != b"[":
        return False  # a closer first: not JSON, and the decoder says so
    runs = list(map(len, _RUNS.findall(s)))  # openers, closers, openers, ...
    peaks = map(operator.sub, itertools.accumulate(runs[0::2]), itertools.chain((0,), itertools.accumulate(runs[1::2])))
    return any(map(limit.__lt__, peaks))


class BadForm(ValueError):
    """A multipart body the gateway cannot read its ``model`` from; the message says why."""


_DISPOSITION = re.compile(rb"(?i)^content-disposition[ \t]*:[ \t]*form-data[ \t]*(;.*)?$")
_NAME = re.compile(rb'(?i);[ \t]*name[ \t]*=[ \t]*(?:"([^"]*)"|([^;\s"]+))')
_BOUNDARY = re.compile(rb'(?i);[ \t]*boundary[ \t]*=[ \t]*(?:"([^"]{1,70})"|([^;\s"]{1,70}))')


def form_fields(content_type: bytes | None, body: bytes, names: tuple[bytes, ...] = (b"model",)) -> dict[bytes, bytes]:
    """The values of the parts named ``names`` in a ``multipart/form-data`` body (RFC 7578),
    read in place: the parts are found with ``bytes.find`` (C speed) and none is copied but
    those asked for; a file part is skipped over. Raises BadForm naming what is wrong."""
    ctype = content_type or b""
    if ctype.partition(b";")[0].strip().lower() != b"multipart/form-data":
        shown = ctype[:60].decode("latin-1") or "none"
        raise BadForm(f"the body must be multipart/form-data (Content-Type was {shown!r})")
    m = _BOUNDARY.search(ctype)
    if m is None:
        raise BadForm("the Content-Type multipart/form-data has no boundary=... parameter (1 to 70 characters)")
    delim = b"--" + (m.group(1) or m.group(2))
    pos = 0 if body.startswith(delim) else body.find(b"\r\n" + delim)
    if pos < 0:
        raise BadForm("the body has no part: its boundary from the Content-Type never occurs in it")
    pos = body.index(delim, pos) + len(delim)
    found: dict[bytes, bytes] = {}
    part = 0
    while True:
        if body.startswith(b"--", pos):
            return found  # the closing delimiter
        if not body.startswith(b"\r\n", pos):
            raise BadForm(f"part {part} of the form: its boundary line does not end with CRLF")
        head_end = body.find(b"\r\n\r\n", pos + 2)
        end = body.find(b"\r\n" + delim, pos + 2) if head_end >= 0 else -1
        if head_end < 0 or end < 0 or end < head_end:
            what = "headers do not end with an empty line" if head_end < 0 or (0 <= end < head_end) else "part is not closed by the boundary"
            raise BadForm(f"part {part} of the form: its {what} (a body cut short?)")
        name = None
        for line in body[pos + 2 : head_end].split(b"\r\n"):
            d = _DISPOSITION.match(line)
            if d is not None:
                n = _NAME.search(d.group(1) or b"")
                if n is not None:
                    name = n.group(1) if n.group(1) is not None else n.group(2)
        if name is None:
            raise BadForm(f"part {part} of the form has no 'Content-Disposition: form-data; name=...' header")
        if name in names and name not in found:
            found[name] = body[head_end + 4 : end]
        pos = end + 2 + len(delim)
        part += 1


class GatewayApp:
    def __init__(
        self, router: Router, forwarder: Forwarder, metrics: GatewayMetrics, *, max_body_bytes: int, keys: ApiKeys | None, bounds: GatewaySection | None = None
    ):
        self.router = router
        self.forwarder = forwarder
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.keys = keys
        # The other resource bounds (max_connections, ...): the defaults unless given.
        self.bounds = bounds or GatewaySection(max_body_bytes=max_body_bytes, max_buffered_body_bytes=max(max_body_bytes, 256 * 1024 * 1024))
        self.max_json_depth = self.bounds.max_json_depth
        self.first_seen: dict[str, int] = {}  # model -> when this gateway first saw it ready ("created")
        self.replicas: KvMirror[Replica] | None = None  # the replica records' KvMirror (the service sets it): GET /sd/engines

    def server(self) -> HttpServer:
        b = self.bounds
        server = HttpServer(
            self.handle,
            max_body_bytes=self.max_body_bytes,
            error_body=errors.refusal,
            max_connections=b.max_connections,
            request_read_timeout=b.request_read_timeout,
            max_buffered_body_bytes=b.max_buffered_body_bytes,
            on_refused=self.metrics.refused,
        )
        self.metrics.server = server
        return server

    async def handle(self, request: Request) -> Response | Stream:
        """The routes: POST the proxied paths (the two generation ones first: one compare each,
        then one dict lookup for the rest); GET (and HEAD) the rest; anything else -> fallback."""
        method = request.method
        path = request.path
        if method == "POST":
            if path == "/v1/chat/completions":
                return await self._generate(request, "/v1/chat/completions")
            if path == "/v1/completions":
                return await self._generate(request, "/v1/completions")
            form = _PROXIED.get(path)
            if form is not None:
                return await (self._form(request, path) if form else self._generate(request, path))
        elif method == "GET" or method == "HEAD":
            if path == "/v1/models":
                return self.models(request)
            if path == "/healthz":
                return self.healthz()
            if path == "/metrics":
                return self.metrics_text()
            if path == "/sd/engines":
                return self.engine_targets(request)
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
        depth = self.max_json_depth
        if brackets_over(body, depth) and json_depth_over(body, depth):
            return self._refused(request, started, self._too_deep())
        try:
            # One pass over the body: the model, stream, and what the router keys on.
            head = prefix.read(body)
            model = head.model
        except RecursionError:  # deeper than the decoder goes (a max_json_depth set very high)
            return self._refused(request, started, self._too_deep())
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
            return await self.forwarder.forward(request, path, body, model, head.stream is True, fields=head)
        except UnknownModel as e:
            return self._refused(request, started, errors.not_found(f"{e}; GET /v1/models lists the models served"), UNKNOWN_MODEL)
        except NoReadyReplica as e:
            return self._refused(request, started, errors.unavailable(str(e), e.retry_after), model)

    async def _form(self, request: Request, path: str) -> Response | Stream:
        """A multipart form (audio): the model from its ``model`` field; the body forwarded as sent."""
        started = time.perf_counter()
        if self.keys is not None and not self.keys.allows(request.header("authorization")):
            return self._refused(request, started, errors.unauthorized(_NEED_KEY))
        if request.too_large:
            return self._refused(request, started, errors.too_large(self.max_body_bytes))
        content_type = request.headers.get(b"content-type")
        try:
            raw = form_fields(content_type, request.body).get(b"model")
            model = raw.decode("utf-8").strip() if raw is not None else ""
        except BadForm as e:
            return self._refused(request, started, errors.bad_request(f"malformed multipart form: {e}", code="invalid_form"))
        except UnicodeDecodeError:
            return self._refused(request, started, errors.bad_request("the form field 'model' is not UTF-8", code="invalid_form", param="model"))
        if not model:
            return self._refused(
                request, started, errors.bad_request("the form field 'model' is required: name one of GET /v1/models", code="missing_field", param="model")
            )
        try:
            # form_fields read a multipart Content-Type, so there is one ("or" only for the type)
            return await self.forwarder.forward(request, path, request.body, model, False, content_type or b"")
        except UnknownModel as e:
            return self._refused(request, started, errors.not_found(f"{e}; GET /v1/models lists the models served"), UNKNOWN_MODEL)
        except NoReadyReplica as e:
            return self._refused(request, started, errors.unavailable(str(e), e.retry_after), model)

    def _too_deep(self) -> Response:
        self.metrics.refused("json_too_deep")
        return errors.bad_request(f"JSON nested deeper than {self.max_json_depth} levels", code="invalid_json")

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

    def engine_targets(self, request: Request) -> Response:
        """Prometheus http_sd: every ready leader's metrics endpoint (promsd.py). The
        same API keys as the rest: it names every engine's address."""
        if not self._authorized(request):
            return errors.unauthorized(_NEED_KEY)
        if self.replicas is None:
            return errors.error_response(503, "the replica records are not loaded yet", code="not_ready", headers={"Retry-After": "1"})
        return Response.json(engine_targets(list(self.replicas.items.values())))

    def fallback(self, request: Request) -> Response:
        allowed = _KNOWN_PATHS.get(request.path)
        if allowed is not None:
            return errors.error_response(405, f"{request.method} {request.path}: use {allowed}", code="method_not_allowed", headers={"Allow": allowed})
        return errors.not_found(f"{request.method} {request.path}: no such endpoint", code="not_found", param=None)
