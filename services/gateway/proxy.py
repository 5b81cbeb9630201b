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

import logging
import time

from llmgw.shared.config import GatewaySection
from llmgw.shared.schemas import Replica
from llmgw.shared.states import ReplicaState

from . import errors, prefix
from .access import AccessLog
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
_STREAM_HEAD = b"Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\n"


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
    def __init__(self, router: Router, upstream: Upstream, metrics: GatewayMetrics, access: AccessLog | None = None, *, stall_after: float = 5.0):
        self.router = router
        self.upstream = upstream
        self.metrics = metrics
        self.access = access
        self.stall_after = stall_after
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
        status = CLIENT_CLOSED  # what is counted if the client's leaving cancels us
        try:
            try:
                resp, status = await self._attempt(request, backend, path, body, model, started, stream, form)
            except _Retryable as first:
                self.metrics.retried(model, first.kind)
                try:
                    backend = self.router.pick(model, exclude=backend)
                except NoReadyReplica:
                    resp = errors.bad_gateway(f"the replica of '{model}' failed ({first}) and no other is ready")
                    status = resp.status
                else:
                    try:
                        resp, status = await self._attempt(request, backend, path, body, model, started, stream, form)
                    except _Retryable as second:
                        resp = errors.bad_gateway(f"two replicas of '{model}' failed: {first}; then {second}")
                        status = resp.status
            return resp
        finally:
            seconds = time.perf_counter() - started
            self.metrics.answered(model, status, seconds, backend.id)
            if self.access is not None:
                self.access.answered(request, model, status, seconds, backend.id)

    async def _attempt(
        self, request: Request, b: Backend, path: str, body: bytes, model: str, started: float, stream: bool, form: bytes = b""
    ) -> tuple[Response | Stream, int]:
        """One try on ``b``: the response and the status to count. Raises _Retryable while nothing was sent."""
        self.metrics.attempt(b.id)
        client = self.upstream.started
        upstream: Connection | None = None
        finished = False  # the upstream answer was read to its end: its connection may be reused
        extra = b""
        if rid := request.headers.get(b"x-request-id"):
            extra = _request_id_line(rid)
        if form:
            extra += b"Content-Type: " + form + b"\r\n"
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
            except Abandoned as e:  # the sweep or a record change gave up on it; already counted there
                self.metrics.upstream_error(b.id, e.kind)
                raise _Retryable(e.kind, str(e)) from None
            except ConnectTimeout as e:
                raise self._ejected(b, "connect", f"replica {b.id} did not accept a connection in time: {_describe(e)}") from None
            except BadEndpoint as e:
                raise self._ejected(b, "endpoint", f"replica {b.id} has an unusable endpoint: {_describe(e.os_error)}") from None
            except OutOfDescriptors as e:  # the gateway's shortage: the replica is not blamed, nor another tried
                self.metrics.refused("out_of_fds")
                self.out_of_fds_log.warning(
                    "gateway out of file descriptors connecting to replica %s: %s; answering 503 (raise LimitNOFILE or lower max_connections)", b.id, e
                )
                resp = errors.out_of_descriptors()
                return resp, resp.status
            except TooLarge as e:  # the answer is the replica's word, only too long to pass on: not a failure
                self.metrics.refused("response_too_large")
                self.metrics.upstream_error(b.id, "too_large")
                self.too_large_log.warning("replica %s: %s; answered 502", b.id, e)
                self.dropped += client.max_response_bytes
                resp = errors.response_too_large(b.id, client.max_response_bytes)
                return resp, resp.status
            except ReadTimeout:
                self.metrics.upstream_error(b.id, "timeout")
                self._count_failure(b)
                resp = errors.gateway_timeout(f"replica {b.id} of '{model}' sent nothing for {self.upstream.cfg.upstream_timeout:g}s")
                return resp, resp.status
            except ConnectFailed as e:
                raise self._ejected(b, "connect", f"cannot connect to replica {b.id}: {_describe(e.os_error)}") from None
            except (Broken, OSError) as e:  # OSError: the socket broke under a write
                raise self._failed(b, "broken", f"replica {b.id} failed before answering: {_describe(e)}") from None

            if streaming:
                self.metrics.first_token(model, time.perf_counter() - started)
                relayed, status, finished = await self._relay_stream(request, b, upstream, first, model)
                return relayed, status
            finished = True
            if upstream.status >= 500:
                self.metrics.upstream_error(b.id, f"http_{upstream.status}")
                self._count_failure(b)
            else:
                self.router.succeeded(b)
            resp = Response(upstream.status, data, b.head, upstream.content_type or "application/json")
            return resp, upstream.status
        finally:
            self.router.release(b)
            if upstream is not None:
                b.flights.discard(upstream)
                # Close rather than pool a connection whose answer was not read to
                # the end: that is what tells the engine to stop (client left, broke).
                upstream.release() if finished else upstream.close()

    async def _relay_stream(self, request: Request, b: Backend, upstream: Connection, first: bytes, model: str) -> tuple[Stream, int, bool]:
        """Pass the stream through; returns the response, the status to count, and whether upstream ended cleanly."""
        pending = first
        most = self.upstream.started.max_response_bytes
        upstream.answered = True  # from here on the client has bytes: no retry, an error event at worst
        try:
            resp = request.start_stream(200, _STREAM_HEAD + b.head, "text/event-stream")
            while True:
                # Pass each arrival on at once, up to its last whole event.
                if pending.endswith(b"\n\n"):
                    await resp.write(pending)
                    pending = b""
                else:
                    cut = _event_boundary(pending)
                    if cut:
                        await resp.write(pending[:cut])
                        pending = pending[cut:]
                try:
                    chunk = await upstream.read_some()
                except ReadTimeout:
                    await self._end_broken(
                        resp, b, model, "timeout", f"replica {b.id} sent nothing for {self.upstream.cfg.upstream_timeout:g}s", "upstream_timeout"
                    )
                    return resp, 200, False
                except Abandoned as e:  # counted against the replica where it was decided
                    message = f"{e}; the stream cannot be resumed elsewhere, send the request again"
                    await self._end_broken(resp, b, model, e.kind, message, "replica_unavailable", count=False)
                    return resp, 200, False
                except (Broken, OSError) as e:
                    await self._end_broken(resp, b, model, "stream_broken", f"the stream from replica {b.id} broke: {_describe(e)}", "upstream_error")
                    return resp, 200, False
                if not chunk:
                    break
                pending += chunk
                if len(pending) > most:  # one event that never ends
                    upstream.close()
                    self.metrics.refused("response_too_large")
                    message = f"replica {b.id} sent an event over {most} bytes (gateway.max_response_bytes)"
                    await self._end_broken(resp, b, model, "too_large", message, "upstream_response_too_large", count=False)
                    return resp, 200, False
            if pending:
                await resp.write(pending)
            await resp.end()
        except ConnectionResetError:  # the client left mid-stream; closing upstream tells the engine
            return resp, CLIENT_CLOSED, False
        self.router.succeeded(b)
        return resp, 200, True

    async def _end_broken(self, resp: Stream, b: Backend, model: str, kind: str, message: str, code: str, count: bool = True) -> None:
        self.metrics.upstream_error(b.id, kind)
        self.metrics.stream_error(model, kind)
        if count:
            self._count_failure(b)
        # A half-received event is dropped: the error event must start on a boundary.
        # Then [DONE], as a stream that ends normally: clients that stop reading
        # only on it (rather than at the end of the body) stop here too.
        await resp.write(errors.sse_error(message, code=code) + errors.SSE_DONE)
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
