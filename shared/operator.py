"""An operator's session with a running cluster: connect under the operator
certificate, read a bucket whole, call a service's endpoint.

``llmgw ctl`` opens one per command; the console (``tui/feed.py``) keeps one
open for as long as it runs. What they show of the records is computed by the
read model (``shared/readmodel.py``), not here; which buckets and endpoints
there are, and what they hold, by ``shared/buckets.py`` and ``shared/api.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError

from . import api, bus
from .buckets import Bucket, spoken
from .config import ServiceConfig, default_operator_config, load_service_config
from .errors import BusError, ConfigError, LlmgwError
from .kvmirror import open_mirror

T = TypeVar("T")
Req = TypeVar("Req")
Rep = TypeVar("Rep")

# Reading a bucket whole: every value it held when asked, within this long.
READ_TIMEOUT = 30.0


class NotProvisioned(LlmgwError):
    """A bucket or the event stream does not exist yet: the service that creates it has not started."""

    code = "not_provisioned"


def load_operator_config(path: str | None) -> ServiceConfig:
    """The operator's configuration: ``path``, else LLMGW_CONFIG, else what ``llmgw up`` wrote."""
    path = path or default_operator_config()
    if not Path(path).exists():
        raise ConfigError(f"no operator configuration at {path}; pass --config, set LLMGW_CONFIG, or run 'llmgw up' (it writes .llmgw/operator.yaml)")
    return load_service_config(path)


def not_provisioned(what: str, stream) -> NotProvisioned:
    """``llmgw ctl``'s one line for a bucket or stream that is not there yet, naming its owner."""
    kind = f"the bucket {stream.name}" if isinstance(stream, Bucket) else f"the event stream {stream.name}"
    return NotProvisioned(f"no {what} yet: {kind} does not exist (has the {spoken(stream.owner)} started?)")


class OperatorSession:
    """A connection under the operator certificate (``cfg``), and what an operator does with it."""

    def __init__(self, cfg: ServiceConfig, *, name: str = "ctl"):
        self.cfg = cfg
        self.name = name
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None

    async def connect(
        self,
        *,
        initial_attempts: int = 3,
        connect_timeout: float = 3,
        reconnect_base: float = 0.2,
        reconnect_max: float = 1.0,
        on_disconnect: Callable[[], Awaitable[None]] | None = None,
        on_reconnect: Callable[[], Awaitable[None]] | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        """Connect (``BusError`` when the server cannot be had within ``initial_attempts``).

        The defaults are a short-lived tool's: a few quick tries, connection chatter
        kept out of the answer."""
        if logger is None:
            logger = logging.getLogger(f"llmgw.{self.name}.bus")
            logger.setLevel(max(logging.WARNING, logging.getLogger().level))
        self.nc = await bus.connect(
            self.cfg.server,
            self.cfg.tls_files(),
            name=self.name,
            logger=logger,
            initial_attempts=initial_attempts,
            reconnect_base=reconnect_base,
            reconnect_max=reconnect_max,
            connect_timeout=connect_timeout,
            on_disconnect=on_disconnect,
            on_reconnect=on_reconnect,
        )
        self.js = self.nc.jetstream(timeout=5)

    async def close(self, timeout: float = 3) -> None:
        if self.nc is None or self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.close(), timeout)
        except Exception:
            pass

    async def __aenter__(self) -> OperatorSession:
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # A verb used before the session connected is a bug; these say so plainly
    # instead of failing on None somewhere inside nats-py.
    @property
    def connection(self) -> NATS:
        if self.nc is None:
            raise BusError("not connected to NATS yet")
        return self.nc

    @property
    def jetstream(self) -> JetStreamContext:
        if self.js is None:
            raise BusError("not connected to NATS yet")
        return self.js

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def read(self, bucket: Bucket[T], *, missing: str = "") -> dict[str, T]:
        """The bucket's records, through a ``KvMirror`` read once (every value the
        bucket held when asked; one that does not decode is logged and left out).

        A bucket not created yet reads as empty, unless it is the verb's own
        (``missing`` names what it lists): then one line says so."""
        try:
            mirror = await open_mirror(self.jetstream, bucket, timeout=READ_TIMEOUT)
        except BucketNotFoundError:
            if missing:
                raise not_provisioned(missing, bucket) from None
            return {}  # not created yet: nothing there
        except TimeoutError:
            raise BusError(f"could not read {bucket.name} within {READ_TIMEOUT:.0f}s; try again") from None
        try:
            return dict(mirror.items)
        finally:
            await mirror.stop()

    async def call(self, endpoint: api.Endpoint[Req, Rep], request: Req, *, timeout: float = 10.0) -> Rep:
        """Ask a service (``api.call``): its reply, ``ApiFailed`` when it refused, ``BusError`` when none answered."""
        return await api.call(self.connection, endpoint, request, timeout=timeout)
