"""An operator's session with a running cluster: connect under the operator
certificate, read a bucket whole, call a service's API.

``llmgw ctl`` opens one per command; the console (``tui/feed.py``) keeps one
open for as long as it runs. What they show of the records is computed by the
read model (``shared/readmodel.py``), not here.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NoKeysError

from llmgw.shared import bus
from llmgw.shared import subjects as S
from llmgw.shared.config import default_operator_config, load_service_config
from llmgw.shared.errors import BusError, ConfigError, LlmgwError, WireError
from llmgw.shared.schemas import ApiError, decode


class ApiFailed(LlmgwError):
    code = "api"


class NotProvisioned(LlmgwError):
    """A bucket or the event stream does not exist yet: the service that creates it has not started."""

    code = "not_provisioned"


# Who creates each bucket (and the event stream) on its first start: named when one is missing.
_CREATOR = {S.BUCKET_NODES: "registry", S.BUCKET_LEASES: "health monitor", S.BUCKET_DEPLOYMENTS: "scheduler", S.BUCKET_REPLICAS: "scheduler"}


class Session:
    def __init__(self, args):
        path = getattr(args, "config", None) or default_operator_config()
        if not Path(path).exists():
            raise ConfigError(f"no operator configuration at {path}; pass --config, set LLMGW_CONFIG, or run 'llmgw up' (it writes .llmgw/operator.yaml)")
        self.cfg = load_service_config(path)
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None

    async def __aenter__(self):
        import logging

        # A short-lived tool: connection chatter would bury the answer.
        quiet = logging.getLogger("llmgw.ctl.bus")
        quiet.setLevel(max(logging.WARNING, logging.getLogger().level))
        self.nc = await bus.connect(
            self.cfg.server, self.cfg.tls_files(), name="ctl", logger=quiet, initial_attempts=3, reconnect_base=0.2, reconnect_max=1.0, connect_timeout=3
        )
        self.js = self.nc.jetstream(timeout=5)
        return self

    async def __aexit__(self, *exc):
        if self.nc is None:
            return
        try:
            await asyncio.wait_for(self.nc.close(), 3)
        except Exception:
            pass

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

    async def read_bucket(self, bucket: str, schema, *, missing: str = "") -> dict:
        """The bucket's records; a bucket not created yet reads as empty, unless it is
        the verb's own (``missing`` names what it lists): then one line says so."""
        try:
            kv = await self.jetstream.key_value(bucket)
        except BucketNotFoundError:
            if missing:
                raise NotProvisioned(
                    f"no {missing} yet: the bucket {bucket} does not exist (has the {_CREATOR.get(bucket, 'control plane')} started?)"
                ) from None
            return {}  # not created yet: nothing there
        keys: list[str] = []
        for attempt in range(4):
            try:
                keys = await kv.keys()
                break
            except NoKeysError:
                # nats-py's key listing can end early when it races its own
                # consumer; an empty answer from a bucket holding values is retried.
                info = await self.jetstream.stream_info(S.kv_stream(bucket))
                if not info.state.messages:
                    return {}
                await asyncio.sleep(0.1 * (attempt + 1))
        else:
            raise BusError(f"could not list the keys of {bucket}; try again")
        out = {}
        for k in keys:
            try:
                entry = await kv.get(k)
            except KeyNotFoundError:
                continue  # deleted between the listing and the read
            if entry.value is None:  # kv.get raises for a deleted key; no value is the same absence
                continue
            try:
                out[k] = decode(entry.value, schema)
            except WireError as e:
                print(f"llmgw: warning: {bucket}/{k} skipped: {e}", file=sys.stderr)
        return out

    async def call(self, service: str, verb: str, payload: bytes, timeout: float = 10.0) -> bytes:
        try:
            reply = await self.connection.request(S.api(service, verb), payload, timeout=timeout)
        except Exception as e:
            raise BusError(f"the {service} did not answer {verb} ({type(e).__name__}); is 'llmgw {service}' running?") from None
        if reply.headers and reply.headers.get("Nats-Service-Error-Code"):
            try:
                err = decode(reply.data, ApiError)
                raise ApiFailed(err.description)
            except WireError:
                raise ApiFailed(reply.headers.get("Nats-Service-Error", "request failed")) from None
        return reply.data
