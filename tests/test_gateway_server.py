"""The gateway's routes (server.py) on its own HTTP server: HEAD on GET
routes, path parameters, the catch-all 404 / 405, Expect: 100-continue, the
body limit on a chunked upload — through a real HTTP client."""

from __future__ import annotations

import aiohttp

from llmgw.services.gateway.metrics import GatewayMetrics
from llmgw.services.gateway.proxy import Forwarder, Upstream
from llmgw.services.gateway.router import Router
from llmgw.services.gateway.server import GatewayApp


async def _serve():
    router = Router(cooldown=1.0, failures_before_cooldown=3, retry_after=1.0)
    metrics = GatewayMetrics(router)
    app = GatewayApp(router, Forwarder(router, Upstream(None), metrics), metrics, max_body_bytes=1000, keys=None)
    server = app.server()
    port = await server.start("127.0.0.1", 0)
    return server, f"http://127.0.0.1:{port}"


async def test_routes_head_expect_and_limits():
    runner, base = await _serve()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.head(base + "/healthz") as r:
                assert r.status == 200 and await r.read() == b""
            async with s.get(base + "/healthz") as r:
                assert r.status == 200 and (await r.json())["status"] == "ok"
            async with s.get(base + "/v1/models") as r:
                assert r.status == 200 and (await r.json()) == {"object": "list", "data": []}
            async with s.get(base + "/v1/models/org%2Fname") as r:
                assert r.status == 404 and "'org/name'" in (await r.json())["error"]["message"]
            async with s.post(base + "/v1/models") as r:
                assert r.status == 405 and r.headers["Allow"] == "GET"
            async with s.get(base + "/v1/chat/completions") as r:
                assert r.status == 405 and r.headers["Allow"] == "POST"
            async with s.get(base + "/nowhere") as r:
                body = await r.json()
                assert r.status == 404 and body["error"]["code"] == "not_found"
            async with s.post(base + "/v1/chat/completions", data=b'{"model": "m"}', expect100=True) as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"

            async def chunks():
                for _ in range(20):
                    yield b" " * 100

            async with s.post(base + "/v1/completions", data=chunks()) as r:
                assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"
            async with s.get(base + "/metrics") as r:
                assert r.status == 200 and b"llmgw_gateway_requests" in await r.read()
    finally:
        await runner.close(1.0)
