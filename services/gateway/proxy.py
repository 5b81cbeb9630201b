"""Forwarding one request to a replica, with one retry on another.

The client is sent nothing until the chosen replica has produced something:
the whole body of a plain answer, or the first chunk of a stream. Until then a
failed attempt is invisible to the client, so it is retried once on another
ready replica. After that the bytes are the replica's own, passed through as
they arrive; a stream that breaks is ended with an OpenAI error event on an
event boundary (the client never sees half an event) and closed cleanly.

An upstream *answer* with an error status (a 400 for a bad parameter, a 500)
is the replica's word and is passed through as is; 5xx ones count towards the
replica's cool-down. A timeout (no byte for ``upstream_timeout``) is answered
with 504 and not retried: the wait has already been spent once.

A client that leaves cancels its handler (``httpserver.py``); the upstream
connection is then closed, not returned to the pool, which is how
an engine learns to stop generating.

Moving requests off a sick replica (gray failures: a hung engine, a stalled
collective, while ``/health`` may still say 200):

* a refused connection (or an endpoint that cannot be parsed) takes the
  replica out of rotation at once (``Router.eject``), and the request is
  retried elsewhere;
* when a replica's record leaves *ready* (``on_replica``: degraded, failed,
  gone), every request in flight on it that has sent nothing to its client is
  abandoned upstream (``Connection.abort`` closes that connection) and retried
  once on another ready replica, transparently. A stream already under way is
  ended with an error event at once if the replica is failed or gone; on a
  degraded one it may go on while tokens flow, and the stall watch below ends
  it if they stop;
* the stall watch (``sweep``, every ``tick`` from the service, never a timer
  per request): a replica with streams in flight that has sent no byte to any
  of them for ``stall_after`` is stalled — ejected at once, its requests that
  sent nothing are retried elsewhere, its streams under way end with an error
  event. Only streams are evidence: a plain answer arrives whole at its end, so
  a long one is silent by nature; plain requests alone are left to the agent's
  canary (and the control plane's verdict, which reaches ``on_replica``).

What is the gateway's own trouble is not held against a replica: running out
of file descriptors opening its connection (``OutOfDescriptors``) is answered
503 "gateway out of file descriptors" with no failure counted, no cool-down,
no retry, and logged at most once per ``LOG_EVERY`` seconds. A plain answer
over ``max_response_bytes`` is cut off (its connection closed) and answered
502, not retried — another replica would answer as much — and not counted
either; a stream is relayed as read (``upstream.py`` stops reading while the
client is slow), and one event over ``max_response_bytes`` ends it with an
error event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.shared.config import GatewaySection
from llmgw.shared.schemas import Replica
from llmgw.shared.states import ReplicaState

from . import continuation, errors, prefix
from .access import AccessLog
from .continuation import StreamRelay
from .httpserver import Request, Response, Stream, Throttled
from .metrics import GatewayMetrics
from .router import Backend, NoReadyReplica, Router, routable
from .upstream import (
    Abandoned,
    BadEndpoint,
    Broken,
    ConnectFailed,
    Connection,
    ConnectTimeout,
    OutOfDescriptors,
    ReadTimeout,
    TooLarge,
    UpstreamClient,
)

log = logging.getLogger("llmgw.gateway")

# Headers sent upstream are fixed (upstream.py: Content-Type: application/json,
# the body was checked to be JSON; for a multipart form, the client's own
# Content-Type, whose boundary the body needs) plus the client's X-Request-Id: nothing else
# of the client's (its API key above all) travels to the engine.
CLIENT_CLOSED = 499  # nginx's code for "the client went away"
# No proxy buffering (nginx honours X-Accel-Buffering) or caching on the way to the client.
# What can end a try before the replica's answer starts: _unanswered says what each means.
_BEFORE_ANSWER = (Abandoned, ConnectTimeout, BadEndpoint, OutOfDescriptors, TooLarge, ReadTimeout, ConnectFailed, Broken, OSError)
_STREAM_HEAD = b"Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\n"


# A client opts out of stream migration with this header ("off", "0", "false", "no").
OPT_OUT = b"x-llmgw-migration"
_OFF = (b"off", b"0", b"false", b"no")
# How long asking a replica to count the text already sent may take.
TOKENIZE_TIMEOUT = 5.0


@dataclass
class _Break:
    """A stream's upstream failed after its client got bytes."""

    kind: str  # metrics' word: timeout, stream_broken, left_ready, stalled, too_large, ...
    message: str
    code: str  # the error event's code
    count: bool = True  # held against the replica (not when decided elsewhere)
    final: bool = False  # no other replica would do better: not continued


@dataclass(frozen=True)
class Migration:
    """One stream moved (or not) from one replica to another: what the event says."""

    request: str  # the stream's id as its client sees it
    model: str
    before: str  # replica ids
    after: str
    cause: str
    outcome: str  # continued, refused, no_replica, failed
    detail: str = ""


class _Retryable(Exception):
    """The attempt failed before the client was sent anything."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


def _describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) < 200 else text[:200] + "…"


def _request_id_line(value: bytes) -> bytes:
    """The client's X-Request-Id (the bytes it sent) as a header line for the engine; dropped if it cannot be one."""
    return b"" if b"\r" in value or b"\n" in value else b"X-Request-Id: " + value + b"\r\n"


def _event_boundary(buf: bytes) -> int:
    """Length of ``buf`` up to and including its last complete SSE event."""
    i = buf.rfind(b"\n\n")
    j = buf.rfind(b"\r\n\r\n")
    return max(i + 2 if i >= 0 else 0, j + 4 if j >= 0 else 0)


class Upstream:
    """The one client to every replica (``upstream.py``), with a connection pool per endpoint."""

    def __init__(self, cfg: GatewaySection):
        self.cfg = cfg
        self.client: UpstreamClient | None = None

    async def start(self) -> None:
        # read_timeout: the longest silence allowed from a replica (before its answer or
        # between chunks); keep-alive 4 s: under uvicorn's 5 s, so we never reuse a socket
        # vLLM is closing. The pool has no limit: engines queue (and report it), not us.
        self.client = UpstreamClient(
            connect_timeout=self.cfg.connect_timeout, read_timeout=self.cfg.upstream_timeout, keepalive=4.0, max_response_bytes=self.cfg.max_response_bytes
        )

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    @property
    def started(self) -> UpstreamClient:
        """The client; forwarding before ``start`` is a bug, said as one."""
        if self.client is None:
            raise RuntimeError("the upstream client is not started")
        return self.client


class Forwarder:
    def __init__(
        self,
        router: Router,
        upstream: Upstream,
        metrics: GatewayMetrics,
        access: AccessLog | None = None,
        *,
        stall_after: float = 5.0,
        max_migrations: int = 2,
        stream_migration: bool = True,
        max_text: int = 512 * 1024,
    ):
        self.router = router
        self.upstream = upstream
        self.metrics = metrics
        self.access = access
        self.stall_after = stall_after
        self.max_migrations = max_migrations  # more replicas a request may be moved to
        self.stream_migration = stream_migration
        self.max_text = max_text
        self.on_migration: Callable[[Migration], None] | None = None  # the service publishes these as events
        self.out_of_fds_log = Throttled(log)
        self.too_large_log = Throttled(log)
        self.dropped = 0  # bytes of answers read and let go unsent (too large): so far, in all

    async def forward(
        self, request: Request, path: str, body: bytes, model: str, stream: bool = False, form: bytes = b"", fields: prefix.Fields | None = None
    ) -> Response | Stream:
        """Answer ``request`` from a replica of ``model``; raises UnknownModel / NoReadyReplica before any attempt.
        ``stream``: the client asked for a stream (what the stall watch goes by).
        ``form``: the client's Content-Type when the body is not JSON (a multipart form), sent on as is.
        ``fields``: the JSON body as the server decoded it (``prefix.read``), what the router
        keys on; none for a form (placed by load). ``body`` itself is sent on untouched."""
        started = time.perf_counter()
        backend = self.router.pick(model, fields=fields)
        relay = self._relay_for(request, path, body) if stream else None
        tried = [backend]
        failures: list[str] = []
        status = CLIENT_CLOSED  # what is counted if the client's leaving cancels us
        try:
            while True:
                try:
                    resp, status, broke = await self._attempt(request, backend, path, body, model, started, stream, form, relay)
                    if broke is not None and relay is not None and isinstance(resp, Stream):
                        # The first attempt's connection and count are released by now.
                        try:
                            await self._continue(request, resp, relay, model, backend, broke, tried)
                        except ConnectionResetError:  # the client left mid-stream
                            status = CLIENT_CLOSED
                    return resp
                except _Retryable as failed:
                    self.metrics.retried(model, failed.kind)
                    failures.append(str(failed))
                    if len(tried) > self.max_migrations:
                        resp = errors.bad_gateway(f"{len(tried)} replicas of '{model}' failed: {'; then '.join(failures)}")
                        status = resp.status
                        return resp
                    try:
                        backend = self.router.pick(model, exclude=tried)
                    except NoReadyReplica:
                        first = f"({failures[0]})" if len(failures) == 1 else f"({len(failures)} times: {'; then '.join(failures)})"
                        resp = errors.bad_gateway(f"the replica of '{model}' failed {first} and no other is ready")
                        status = resp.status
                        return resp
                    tried.append(backend)
        finally:
            seconds = time.perf_counter() - started
            last = tried[-1].id
            self.metrics.answered(model, status, seconds, last)
            if self.access is not None:
                self.access.answered(request, model, status, seconds, last)

    def _relay_for(self, request: Request, path: str, body: bytes) -> StreamRelay | None:
        """The record a stream keeps to be continued elsewhere, unless migration is off
        (the gateway's setting, the client's header) or the path has no continuation."""
        if not self.stream_migration or self.max_migrations <= 0 or path not in (continuation.CHAT, continuation.COMPLETIONS):
            return None
        opt = request.headers.get(OPT_OUT)
        if opt is not None and opt.strip().lower() in _OFF:
            return None
        return StreamRelay(path, body, max_migrations=self.max_migrations, max_text=self.max_text)

    async def _attempt(
        self,
        request: Request,
        b: Backend,
        path: str,
        body: bytes,
        model: str,
        started: float,
        stream: bool,
        form: bytes = b"",
        relay: StreamRelay | None = None,
    ) -> tuple[Response | Stream, int, _Break | None]:
        """One try on ``b``: the response, the status to count, and how its stream broke
        when it is to be continued elsewhere. Raises _Retryable while nothing was sent."""
        self.metrics.attempt(b.id)
        client = self.upstream.started
        upstream: Connection | None = None
        finished = False  # the upstream answer was read to its end: its connection may be reused
        extra = b""
        if rid := request.headers.get(b"x-request-id"):
            extra = _request_id_line(rid)
        if form:
            extra += b"Content-Type: " + form + b"\r\n"
        if relay is not None:  # asking a replica that reports token ids for them
            body = relay.upstream_body(b.engine)
        try:
            try:
                upstream = await client.post(b.endpoint, path, body, extra, b.flights, stream, not form)
                streaming = upstream.status == 200 and upstream.mimetype == "text/event-stream"
                if streaming:
                    first = await upstream.read_some()
                    if not first:
                        raise Broken("the replica ended the stream before its first byte")
                else:
                    data = await upstream.read()
            except _BEFORE_ANSWER as e:
                resp = self._unanswered(b, model, e)
                return resp, resp.status, None

            if streaming:
                self.metrics.first_token(model, time.perf_counter() - started)
                relayed, status, finished, broke = await self._relay_stream(request, b, upstream, first, model, relay)
                return relayed, status, broke
            finished = True
            if upstream.status >= 500:
                self.metrics.upstream_error(b.id, f"http_{upstream.status}")
                self._count_failure(b)
            else:
                self.router.succeeded(b)
            resp = Response(upstream.status, data, b.head, upstream.content_type or "application/json")
            return resp, upstream.status, None
        finally:
            self._let_go(b, upstream, finished)

    def _let_go(self, b: Backend, upstream: Connection | None, finished: bool) -> None:
        """An attempt on ``b`` is over: its count released, its connection pooled if its
        answer was read to the end, else closed — which is what tells the engine to stop
        (the client left, the stream broke)."""
        self.router.release(b)
        if upstream is not None:
            b.flights.discard(upstream)
            upstream.release() if finished else upstream.close()

    def _unanswered(self, b: Backend, model: str, e: BaseException) -> Response:
        """What a failure before the replica's answer came means: raises _Retryable when
        another replica may be tried, else returns the answer for the client."""
        client = self.upstream.started
        if isinstance(e, Abandoned):  # the sweep or a record change gave up on it; already counted there
            self.metrics.upstream_error(b.id, e.kind)
            raise _Retryable(e.kind, str(e)) from None
        if isinstance(e, ConnectTimeout):
            raise self._ejected(b, "connect", f"replica {b.id} did not accept a connection in time: {_describe(e)}") from None
        if isinstance(e, BadEndpoint):
            raise self._ejected(b, "endpoint", f"replica {b.id} has an unusable endpoint: {_describe(e.os_error)}") from None
        if isinstance(e, OutOfDescriptors):  # the gateway's shortage: the replica is not blamed, nor another tried
            self.metrics.refused("out_of_fds")
            self.out_of_fds_log.warning(
                "gateway out of file descriptors connecting to replica %s: %s; answering 503 (raise LimitNOFILE or lower max_connections)", b.id, e
            )
            return errors.out_of_descriptors()
        if isinstance(e, TooLarge):  # the answer is the replica's word, only too long to pass on: not a failure
            self.metrics.refused("response_too_large")
            self.metrics.upstream_error(b.id, "too_large")
            self.too_large_log.warning("replica %s: %s; answered 502", b.id, e)
            self.dropped += client.max_response_bytes
            return errors.response_too_large(b.id, client.max_response_bytes)
        if isinstance(e, ReadTimeout):
            self.metrics.upstream_error(b.id, "timeout")
            self._count_failure(b)
            return errors.gateway_timeout(f"replica {b.id} of '{model}' sent nothing for {self.upstream.cfg.upstream_timeout:g}s")
        if isinstance(e, ConnectFailed):
            raise self._ejected(b, "connect", f"cannot connect to replica {b.id}: {_describe(e.os_error)}") from None
        # Broken, or OSError: the socket broke under a write
        raise self._failed(b, "broken", f"replica {b.id} failed before answering: {_describe(e)}") from None

    async def _relay_stream(
        self, request: Request, b: Backend, upstream: Connection, first: bytes, model: str, relay: StreamRelay | None
    ) -> tuple[Stream, int, bool, _Break | None]:
        """Pass the stream through; returns the response, the status to count, whether
        upstream ended cleanly, and how it broke when it is to be continued (``relay``)."""
        upstream.answered = True  # from here on the client has bytes: no retry, a continuation or an error event
        resp = request.start_stream(200, _STREAM_HEAD + b.head, "text/event-stream")
        try:
            broke = await self._pump(resp, b, upstream, first, relay, False)
            if broke is None:
                await resp.end()
                self.router.succeeded(b)
                return resp, 200, True, None
            self._charge(b, broke)
            if relay is None or broke.final:
                await self._end_broken(resp, model, broke, "" if broke.final else "; send the request again")
                return resp, 200, False, None
        except ConnectionResetError:  # the client left mid-stream; closing upstream tells the engine
            return resp, CLIENT_CLOSED, False, None
        return resp, 200, False, broke

    async def _pump(self, resp: Stream, b: Backend, upstream: Connection, pending: bytes, relay: StreamRelay | None, continuing: bool) -> _Break | None:
        """Relay ``upstream``'s events to the client as they arrive, each whole; None when
        it ended, a _Break when it failed. ``continuing``: this is a continuation (its events
        rewritten as the client's stream goes on); ConnectionResetError: the client left."""
        most = self.upstream.started.max_response_bytes
        while True:
            # Pass each arrival on at once, up to its last whole event.
            cut = len(pending) if pending.endswith(b"\n\n") else _event_boundary(pending)
            if cut:
                await self._write(resp, pending[:cut], relay, continuing)
                pending = pending[cut:]
            try:
                chunk = await upstream.read_some()
            except ReadTimeout:
                return _Break("timeout", f"replica {b.id} sent nothing for {self.upstream.cfg.upstream_timeout:g}s", "upstream_timeout")
            except Abandoned as e:  # counted against the replica where it was decided
                return _Break(e.kind, str(e), "replica_unavailable", count=False)
            except (Broken, OSError) as e:
                return _Break("stream_broken", f"the stream from replica {b.id} broke: {_describe(e)}", "upstream_error")
            if not chunk:
                break
            pending += chunk
            if len(pending) > most:  # one event that never ends: another replica would send the same
                upstream.close()
                self.metrics.refused("response_too_large")
                message = f"replica {b.id} sent an event over {most} bytes (gateway.max_response_bytes)"
                return _Break("too_large", message, "upstream_response_too_large", count=False, final=True)
        if pending:
            await self._write(resp, pending, relay, continuing)
        return None

    async def _write(self, resp: Stream, data: bytes, relay: StreamRelay | None, continuing: bool) -> None:
        if relay is None:
            await resp.write(data)
            return
        if continuing:  # a continuation's events, as the client's stream goes on
            data = relay.rewritten(data)
            if not data:
                return
            if relay.moving is not None:  # its first bytes to the client: the gap it saw
                self.metrics.migration_gap(time.perf_counter() - relay.last_write)
                self._moved(relay, "continued")
        relay.sent(data)  # kept with the token ids the gateway asked for
        await resp.write(continuation.strip_token_ids(data) if relay.strip else data)
        relay.last_write = time.perf_counter()

    # -- stream migration --------------------------------------------------------------
    async def _continue(self, request: Request, resp: Stream, relay: StreamRelay, model: str, b: Backend, broke: _Break, tried: list[Backend]) -> None:
        """Go on with the client's stream on other replicas, while they fail and the
        budget lasts; end it with the error event when it cannot be continued exactly."""
        while True:
            why = relay.why_not()
            if why is not None:
                self._migrated(relay, model, b, None, broke.kind, "refused", why)
                await self._end_broken(resp, model, broke, f"; it cannot be continued elsewhere: {why}")
                return
            try:
                nb = self.router.pick(model, exclude=tried)
            except NoReadyReplica:
                self._migrated(relay, model, b, None, broke.kind, "no_replica", "no other replica is ready")
                await self._end_broken(resp, model, broke, "; no other replica is ready to continue it")
                return
            why = relay.exact_on(nb.engine)
            if why is not None:
                self.router.release(nb)
                self._migrated(relay, model, b, nb, broke.kind, "refused", why)
                await self._end_broken(resp, model, broke, f"; it cannot be continued exactly on replica {nb.id}: {why}")
                return
            tried.append(nb)
            relay.migrations += 1
            relay.moving = Migration("", model, b.id, nb.id, broke.kind, "")
            after = await self._continue_on(request, resp, relay, model, nb)
            if relay.moving is not None:  # it never wrote to the client
                self._moved(relay, "failed", after.message if after else "")
            if after is None:
                return
            self._charge(nb, after)
            if after.final:  # the replica's own word (a 4xx), or an event too large: passed on, not tried elsewhere
                await self._end_broken(resp, model, after)
                return
            b, broke = nb, after

    async def _continue_on(self, request: Request, resp: Stream, relay: StreamRelay, model: str, b: Backend) -> _Break | None:
        """One continuation on ``b``: None when the client's stream ended there, a _Break when it failed."""
        self.metrics.attempt(b.id)
        client = self.upstream.started
        upstream: Connection | None = None
        finished = False
        extra = b""
        if rid := request.headers.get(b"x-request-id"):
            extra = _request_id_line(rid)
        try:
            try:
                t = relay.transcript
                body = relay.decoded()
                tokens = continuation.by_tokens(t)
                if tokens:  # exact: from the token ids, through /v1/completions
                    given = len(t.ids)
                    limit = None if t.finish else await self._context_left(b, relay, model)
                    nxt = None if t.finish else continuation.token_continuation(relay.path, body, t, model, limit)
                    path = continuation.COMPLETIONS
                else:  # the sim's text is an exact prompt
                    given = await self._count_tokens(b, model, t.text, t.chunks)
                    nxt = None if t.finish else continuation.continuation(relay.path, body, t.text, given)
                    path = relay.path
                if nxt is None:  # the answer is whole (its finish was sent, or its budget spent)
                    await self._finish_whole(resp, relay, b, model, given)
                    finished = True
                    return None
                relay.given = given
                relay.chat_from_completion = tokens and relay.chat
                data = continuation.encode(nxt)
                upstream = await client.post(b.endpoint, path, data, extra, b.flights, True)
                if not (upstream.status == 200 and upstream.mimetype == "text/event-stream"):
                    answer = await upstream.read()
                    finished = True
                    return self._refused_continuation(b, upstream.status, answer)
                first = await upstream.read_some()
                if not first:
                    raise Broken("the replica ended the continuation before its first byte")
            except _BEFORE_ANSWER as e:
                try:
                    self._unanswered(b, model, e)
                except _Retryable as failed:
                    return _Break(failed.kind, str(failed), "replica_unavailable", count=False)
                return _Break("unanswered", f"replica {b.id} could not take the continuation: {_describe(e)}", "upstream_error", count=False)
            upstream.answered = True
            broke = await self._pump(resp, b, upstream, first, relay, True)
            if broke is None:
                await resp.end()
                self.router.succeeded(b)
                finished = True
            return broke
        finally:
            self._let_go(b, upstream, finished)

    def _refused_continuation(self, b: Backend, status: int, answer: bytes) -> _Break:
        """A continuation answered with an error: a 5xx is the replica's trouble (another
        may be tried); a 4xx is its word on the request (passed on as the error)."""
        text = answer[:300].decode("utf-8", "replace")
        if status >= 500:
            self.metrics.upstream_error(b.id, f"http_{status}")
            return _Break(f"http_{status}", f"replica {b.id} answered the continuation with {status}: {text}", "upstream_error")
        return _Break("refused", f"replica {b.id} refused the continuation ({status}): {text}", "continuation_refused", count=False, final=True)

    async def _count_tokens(self, b: Backend, model: str, text: str, chunks: int) -> int:
        """The tokens of ``text`` by ``b``'s own tokenizer (``/tokenize``); the chunks that
        carried it when the replica has no such endpoint. Failures to reach ``b`` raise
        as an attempt's do."""
        if not text:
            return 0
        body = continuation.encode({"model": model, "prompt": text, "add_special_tokens": False})
        return await self._tokenize(b, body, chunks)

    async def _context_left(self, b: Backend, relay: StreamRelay, model: str) -> int | None:
        """``b``'s ``max_model_len`` (vLLM's ``/tokenize`` answers it), for a chat that
        named no budget; None when it named one, or ``b`` does not say."""
        body = relay.decoded()
        if any(type(body.get(k)) is int for k in ("max_completion_tokens", "max_tokens")):
            return None
        answer = await self._tokenize(b, continuation.encode({"model": model, "prompt": "a"}), -1, field="max_model_len")
        return answer if answer > 0 else None

    async def _tokenize(self, b: Backend, body: bytes, fallback: int, field: str = "count") -> int:
        """``/tokenize`` on ``b``: the number ``field`` of its answer, or ``fallback`` when it
        answers without one. Bounded by TOKENIZE_TIMEOUT in all (a hung replica is a ReadTimeout)."""
        conn: Connection | None = None
        done = False
        try:
            async with asyncio.timeout(TOKENIZE_TIMEOUT):
                conn = await self.upstream.started.post(b.endpoint, "/tokenize", body)
                answer = await conn.read()
            done = True
        except TimeoutError:
            raise ReadTimeout(f"/tokenize took over {TOKENIZE_TIMEOUT:g}s") from None
        finally:
            if conn is not None:
                conn.release() if done else conn.close()
        count = continuation.token_count(answer, field) if conn is not None and conn.status == 200 else None
        return fallback if count is None else count

    async def _finish_whole(self, resp: Stream, relay: StreamRelay, b: Backend, model: str, given: int) -> None:
        """End a stream whose answer needs no more tokens: its finish (if not sent), the
        usage asked for (its prompt counted by ``b``), [DONE]."""
        t = relay.transcript
        usage = None
        if relay.include_usage and t.usage is None:
            if t.prompt_ids is not None:
                prompt = len(t.prompt_ids)
            else:
                prompt = await self._tokenize(b, continuation.encode(continuation.prompt_request(relay.path, relay.decoded(), model)), -1)
            if prompt >= 0:
                usage = {"prompt_tokens": prompt, "completion_tokens": given, "total_tokens": prompt + given}
        data = continuation.ending(t, relay.chat, None if t.finish else "length", usage)
        self._moved(relay, "continued")
        await resp.write(data)
        relay.sent(data)
        await resp.end()
        self.router.succeeded(b)

    def _migrated(self, relay: StreamRelay, model: str, before: Backend, after: Backend | None, cause: str, outcome: str, detail: str) -> None:
        """A stream that was not moved: counted, logged, an event."""
        relay.moving = Migration("", model, before.id, after.id if after else "", cause, "")
        self._moved(relay, outcome, detail)

    def _moved(self, relay: StreamRelay, outcome: str, detail: str = "") -> None:
        """What came of ``relay.moving``: counted, an event (and a log line when the stream ends with an error)."""
        m = relay.moving
        if m is None:
            return
        relay.moving = None
        self.metrics.migrated(m.model, m.cause, outcome)
        if outcome in ("refused", "no_replica"):
            log.warning("a stream of '%s' on replica %s (%s) was not continued: %s", m.model, m.before, m.cause, detail)
        if self.on_migration is not None:
            rid = relay.transcript.id if isinstance(relay.transcript.id, str) else ""
            self.on_migration(Migration(rid, m.model, m.before, m.after, m.cause, outcome, detail))

    def _charge(self, b: Backend, broke: _Break) -> None:
        """A failed stream counted against its replica (whether or not it goes on elsewhere)."""
        self.metrics.upstream_error(b.id, broke.kind)
        if broke.count:
            self._count_failure(b)

    async def _end_broken(self, resp: Stream, model: str, broke: _Break, why: str = "") -> None:
        """End the client's stream with an error event (the failure was counted already)."""
        self.metrics.stream_error(model, broke.kind)
        # A half-received event is dropped: the error event must start on a boundary.
        # Then [DONE], as a stream that ends normally: clients that stop reading
        # only on it (rather than at the end of the body) stop here too.
        await resp.write(errors.sse_error(broke.message + why, code=broke.code) + errors.SSE_DONE)
        await resp.end()

    def _failed(self, b: Backend, kind: str, detail: str) -> _Retryable:
        self.metrics.upstream_error(b.id, kind)
        self._count_failure(b)
        return _Retryable(kind, detail)

    def _ejected(self, b: Backend, kind: str, detail: str) -> _Retryable:
        """A failure that is a verdict on its own: out of rotation now, and retry elsewhere."""
        self.metrics.upstream_error(b.id, kind)
        self.eject(b, kind, detail)
        return _Retryable(kind, detail)

    def _count_failure(self, b: Backend) -> None:
        if self.router.failed(b):
            self.metrics.cooled(b.id, "failures")
            # One line per cool-down, not per failed request: a dead replica under load must not flood the log.
            log.warning(
                "replica %s (%s) failed %d times in a row; out of rotation for %gs",
                b.id,
                b.endpoint,
                self.router.failures_before_cooldown,
                self.router.cooldown,
            )

    def eject(self, b: Backend, reason: str, detail: str) -> None:
        """Out of rotation at once (passive detection, ahead of the control plane's verdict)."""
        if self.router.eject(b, reason):
            self.metrics.cooled(b.id, reason)
            log.warning("replica %s (%s) out of rotation for %gs at once (%s): %s", b.id, b.endpoint, self.router.cooldown, reason, detail)

    # -- moving requests off a sick replica ---------------------------------------
    def evacuate(self, b: Backend, kind: str, message: str, *, streams_too: bool) -> int:
        """Abandon ``b``'s requests in flight that sent their client nothing (they are
        retried elsewhere) and, with ``streams_too``, its streams under way (they end
        with an error event). Returns how many were abandoned."""
        n = 0
        for conn in list(b.flights):
            if conn.aborted is None and (streams_too or not conn.answered):
                conn.abort(Abandoned(kind, message))
                n += 1
        return n

    def on_replica(self, key: str, old: Replica | None, new: Replica | None) -> None:
        """KvMirror listener, after the router's: a record that left ready takes its requests with it."""
        if routable(new):
            return
        b = self.router.backend(key)
        if b is None or not b.flights:
            return
        state = new.state if new is not None else "gone"
        degraded = state == ReplicaState.DEGRADED
        # Degraded: tokens may still flow on streams under way (the stall watch ends
        # them if not); failed or gone: its engines are being stopped anyway.
        n = self.evacuate(b, "left_ready", f"replica {key} is {state or 'no longer ready'}", streams_too=not degraded)
        if n:
            log.warning("replica %s is %s: %d request(s) in flight on it moved off it", key, state, n)

    def sweep(self, now: float) -> None:
        """The stall watch, run every tick: each replica's silence, and what to do about it.

        ``now`` is ``time.monotonic()`` (the clock ``Connection.send`` stamps with)."""
        stall_after = self.stall_after
        for b in list(self.router.backends()):
            if b.completed != b.progress_mark:
                b.progress_mark = b.completed
                b.progress_at = now
            flights = b.flights
            if not flights:
                b.silent_for = 0.0
                continue
            silence = -1.0
            for conn in flights:
                if conn.rx != conn.rx_mark or conn.paused:  # paused: we stopped reading (a slow client), not the replica
                    conn.rx_mark = conn.rx
                    conn.active_at = now
                if conn.stream:
                    quiet = now - max(conn.active_at, b.progress_at)
                    if silence < 0 or quiet < silence:
                        silence = quiet
            b.silent_for = max(silence, 0.0)
            if not b.routable:
                # Requests that reached it while its record was changing (mid-connect).
                self.evacuate(b, "left_ready", f"replica {b.id} is no longer ready", streams_too=False)
            if silence >= stall_after:
                detail = f"replica {b.id} sent no byte to any of its streams in flight for {silence:.1f}s"
                self.eject(b, "stalled", detail)
                self.evacuate(b, "stalled", detail, streams_too=True)
