"""Connecting to the bus under a certificate, and provisioning JetStream.

Every llmgw process connects through :func:`connect`: mutual TLS with its own
certificate, an inbox prefix derived from that certificate's identity (so its
replies are in a space no other identity may read), and reconnects that back
off exponentially between ``reconnect_base`` and ``reconnect_max`` with jitter,
so a restarted server is not hit by every agent of the cluster at once.

Agents also spread their *first* connect (``first_delay``, drawn by
:func:`first_connect_delay`): after a power event thousands of nodes boot
within the same seconds and would otherwise open their TLS connections in
the same instant.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BucketNotFoundError, NotFoundError

from . import pki
from . import subjects as S
from .errors import BusError, ConfigError

log = logging.getLogger("llmgw.bus")


@dataclass(frozen=True)
class TlsFiles:
    ca: str
    cert: str
    key: str

    def check(self, where: str = "tls") -> None:
        for field in ("ca", "cert", "key"):
            path = getattr(self, field)
            if not path:
                raise ConfigError(f"{where}.{field}: a path is required")
            if not Path(path).is_file():
                raise ConfigError(f"{where}.{field}: file {path} does not exist")

    def context(self) -> ssl.SSLContext:
        self.check()
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
            ctx.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"cannot load TLS files (ca={self.ca}, cert={self.cert}, key={self.key}): {e}") from None
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx

    def identity(self) -> tuple[str, str]:
        """(role, name) this certificate speaks as."""
        return pki.identity_of(self.cert)


def backoff_delay(attempt: int, base: float, maximum: float, rng: random.Random | None = None) -> float:
    """Exponential backoff with +-20 % jitter, capped at ``maximum``."""
    uniform = rng.uniform if rng is not None else random.uniform
    delay = min(maximum, base * (2 ** max(0, attempt)))
    return max(0.0, delay * uniform(0.8, 1.2)) if delay > 0 else 0.0


def first_connect_delay(reconnect_base: float, rng: random.Random | None = None) -> float:
    """How long an agent waits before its first connect: uniform in [0, ``reconnect_base``).

    ``reconnect_base`` is already how long a client may wait before it tries
    the bus again, so the first try is spread over the same span: 10,000 nodes
    powered on together arrive over ``reconnect_base`` (1 s by default: 10,000
    handshakes/s at worst instead of all at once), and a first attempt that
    still fails backs off with jitter from there. The cluster's size is not
    known to an agent at start, so the spread cannot be scaled to it; a test
    with compressed timings (``reconnect_base: 100ms``) waits at most that.
    """
    uniform = rng.uniform if rng is not None else random.uniform
    return uniform(0.0, reconnect_base) if reconnect_base > 0 else 0.0


Callback = Callable[[], Awaitable[None]]

# A first-connect attempt may take this many connect timeouts in all (TCP, INFO,
# TLS, PONG, on each of its two tries) before it is given up and retried.
ATTEMPT_TIMEOUTS = 10


async def connect(
    servers: str | list[str],
    tls: TlsFiles,
    *,
    name: str,
    reconnect_base: float = 1.0,
    reconnect_max: float = 30.0,
    connect_timeout: float = 5.0,
    initial_attempts: int = 0,
    on_disconnect: Callback | None = None,
    on_reconnect: Callback | None = None,
    on_error: Callable[[Exception], Awaitable[None]] | None = None,
    logger: logging.Logger | None = None,
    pending_size: int = 256 * 1024,
    first_delay: float = 0.0,
) -> NATS:
    """Connect under ``tls``'s identity. Retries the first connect with backoff.

    ``pending_size`` bounds what nats-py buffers while disconnected and replays
    on reconnect. The control-plane services pass 0: a publish while
    disconnected then raises at once (``OutboundBufferLimitError``) instead of
    being buffered, timing out, being reported failed — and then applied when
    the server returns (a lease written late over a newer one). Agents keep a
    small buffer: what they publish (heartbeats, statuses) is true when it
    arrives, and the health monitor drops heartbeats whose sequence is old.

    ``initial_attempts`` bounds the first connection's attempts (0 = forever,
    as a service under systemd wants); each failure is logged with the reason
    and the next delay, so a wrong address or refused certificate is visible.

    ``first_delay`` seconds pass before the first attempt (agents: a draw of
    :func:`first_connect_delay`); it is logged, so a slow start says why.
    """
    lg = logger or log
    ctx = tls.context()
    role, ident = tls.identity()
    urls = [servers] if isinstance(servers, str) else list(servers)
    if not urls:
        raise ConfigError("no NATS server URL given")

    def pick(pool, _info):
        # Prefer the server tried least; delay grows with its failed attempts.
        best = min(pool, key=lambda s: s.reconnects)
        return best, backoff_delay(best.reconnects, reconnect_base, reconnect_max)

    async def disconnected():
        if nc.is_closed or nc.is_draining:
            return  # our own close, not an outage
        lg.warning("disconnected from NATS; reconnecting (backoff %.1fs..%.1fs)", reconnect_base, reconnect_max)
        if on_disconnect:
            await on_disconnect()

    async def reconnected():
        lg.info("reconnected to NATS at %s", nc.connected_url.netloc if nc.connected_url else "?")
        if on_reconnect:
            await on_reconnect()

    async def error(e: Exception):
        lg.warning("NATS: %s", e or type(e).__name__)
        if on_error:
            await on_error(e)

    if first_delay > 0:
        lg.info(
            "first connect to NATS in %.2fs (spread over reconnect_base %.2fs, so nodes starting together do not connect at once)", first_delay, reconnect_base
        )
        await asyncio.sleep(first_delay)
    attempt = 0
    while True:
        nc = NATS()
        try:
            # nats-py bounds most steps of a connect, not all of them (drains, the
            # close of a failed attempt): in a 3,000-agent bench run on a loaded
            # machine two agents never returned from their first connect (which
            # step hung is not known). An agent whose first connect never ends
            # never starts, so the attempt as a whole is bounded, and so is the
            # close of a failed one below.
            await asyncio.wait_for(
                nc.connect(
                    servers=urls,
                    tls=ctx,
                    tls_hostname=None,
                    name=f"{role}:{ident}:{name}",
                    inbox_prefix=S.inbox_prefix(role, ident),
                    connect_timeout=connect_timeout,  # type: ignore[arg-type]  # nats-py annotates int; it is seconds for asyncio.wait_for, a float works
                    allow_reconnect=True,
                    # One try per server here: our own loop below does the first
                    # connect's retries (with logging); reconnects are unbounded.
                    max_reconnect_attempts=1,
                    reconnect_time_wait=reconnect_base,  # type: ignore[arg-type]  # nats-py annotates int; it is seconds for asyncio.sleep, a float works
                    reconnect_to_server_handler=pick,
                    disconnected_cb=disconnected,
                    reconnected_cb=reconnected,
                    error_cb=error,
                    # Buffer little (or nothing, for services) while disconnected:
                    # heartbeats and statuses are re-sent fresh after a reconnect.
                    pending_size=pending_size,
                ),
                ATTEMPT_TIMEOUTS * connect_timeout + 2 * reconnect_base,
            )
            if not nc.is_connected:
                # nats-py raises only on an -ERR in place of the handshake's PONG; an EOF there
                # (the server closing the connection before accepting it: under TLS 1.3 a
                # refused certificate's alert comes after the client's side of the handshake
                # completed) returns as if connected, and the read loop finds the EOF later.
                # Checked before anything awaits, so this is exactly "no PONG came".
                raise ConnectionRefusedError("the server closed the connection before accepting it (a refused certificate or identity?)")
            nc.options["max_reconnect_attempts"] = -1
            # connected_url is set by a connect that returned; "?" only guards the type
            lg.info("connected to NATS at %s as %s/%s", nc.connected_url.netloc if nc.connected_url else "?", role, ident)
            return nc
        except Exception as e:  # nats-py raises a variety here; all mean "not now"
            attempt += 1
            with_reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if initial_attempts and attempt >= initial_attempts:
                raise BusError(f"cannot connect to NATS at {', '.join(urls)} as {role}/{ident}: {with_reason}") from None
            delay = backoff_delay(attempt - 1, reconnect_base, reconnect_max)
            lg.warning("cannot reach NATS at %s (%s); retrying in %.1fs", ", ".join(urls), with_reason, delay)
            try:
                await asyncio.wait_for(nc.close(), connect_timeout)
            except Exception:
                pass
            await asyncio.sleep(delay)


# --------------------------------------------------------------------------
# JetStream provisioning
# --------------------------------------------------------------------------

# History kept per key: deployments keep a few versions so an operator can see
# what was applied before; everything else is current state only.
_HISTORY = {S.BUCKET_DEPLOYMENTS: 5}
EVENT_MAX_AGE = 7 * 24 * 3600.0
EVENT_MAX_MSGS = 1_000_000


async def ensure_bucket(js: JetStreamContext, bucket: str, *, replicas: int = 1):
    """Open ``bucket``, creating it if it is missing. Safe to race."""
    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        pass
    try:
        return await js.create_key_value(
            # Not allow_direct: a direct get answers the raw stored value to any reply
            # subject the requester names, so anyone with read rights could replay
            # a record onto a node subject; gets go through the stream leader.
            KeyValueConfig(bucket=bucket, history=_HISTORY.get(bucket, 1), replicas=replicas, storage=StorageType.FILE)
        )
    except Exception as e:
        # Another instance may have created it between our look and our create.
        try:
            return await js.key_value(bucket)
        except BucketNotFoundError:
            raise BusError(f"cannot create bucket {bucket}: {e}") from None


async def ensure_event_stream(js: JetStreamContext, *, replicas: int = 1) -> None:
    try:
        await js.stream_info(S.EVENT_STREAM)
        return
    except NotFoundError:
        pass
    cfg = StreamConfig(
        name=S.EVENT_STREAM,
        subjects=[S.ALL_EVENTS],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=EVENT_MAX_AGE,
        max_msgs=EVENT_MAX_MSGS,
        num_replicas=replicas,
    )
    try:
        await js.add_stream(cfg)
    except Exception as e:
        try:
            await js.stream_info(S.EVENT_STREAM)
        except NotFoundError:
            raise BusError(f"cannot create stream {S.EVENT_STREAM}: {e}") from None


async def ensure_replicas(js: JetStreamContext, stream: str, replicas: int, *, logger: logging.Logger | None = None) -> str | None:
    """Set ``stream``'s replica count to ``replicas`` if it differs (a cluster grown
    from 1 to 3 servers raises its streams to R3). Returns what changed, or None.

    A count the cluster cannot hold (R3 on fewer than 3 servers) is refused by
    the server; that is logged and the stream is left as it is.
    """
    lg = logger or log
    info = await js.stream_info(stream)
    have = info.config.num_replicas or 1
    if have == replicas:
        return None
    cfg = info.config
    cfg.num_replicas = replicas
    try:
        await js.update_stream(cfg)
    except Exception as e:
        lg.warning("stream %s has %d replicas, configured %d; the server refused the change: %s", stream, have, replicas, e)
        return None
    change = f"stream {stream}: replicas {have} -> {replicas}"
    lg.info("%s", change)
    return change


async def provision(
    js: JetStreamContext,
    buckets: tuple[str, ...] = S.BUCKETS,
    *,
    events: bool = True,
    replicas: int = 1,
    adjust: bool = False,
    changes: list[str] | None = None,
    logger: logging.Logger | None = None,
) -> dict:
    """Create what is missing. Returns the opened buckets.

    With ``adjust`` (only for streams the caller may update: its own buckets and
    the event stream), an existing stream whose replica count differs from
    ``replicas`` is updated to it, each change logged and appended to ``changes``.
    """
    out = {}
    for b in buckets:
        out[b] = await ensure_bucket(js, b, replicas=replicas)
    if events:
        await ensure_event_stream(js, replicas=replicas)
    if adjust:
        for st in [S.kv_stream(b) for b in buckets] + ([S.EVENT_STREAM] if events else []):
            change = await ensure_replicas(js, st, replicas, logger=logger)
            if change and changes is not None:
                changes.append(change)
    return out
