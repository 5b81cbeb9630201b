"""``llmgw gateway`` with the official ``openai`` client, in front of real
``sim`` engine processes, fed replica records on a real nats-server.

Records are written under the scheduler's identity (the only writer the
server allows), so a stale record — one that still says ready while its engine
is dead, as between a crash and the scheduler noticing — is made the way it
happens: by killing the engine and leaving the record alone.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import aiohttp
import openai
import pytest
import yaml

from llmgw.shared.natsserver import free_port

from . import spawning
from .gateway_helpers import HOST, Board, gateway_config, metric_sum, replica, start_gateway, start_sims, wait_for

pytestmark = pytest.mark.timeout(60)

HELLO = [{"role": "user", "content": "Which fabric holds the replica?"}]


@pytest.fixture
async def stack(nats_server, tmp_path):
    """Sims, a record board and gateways; everything started is stopped, pass or fail."""

    class Stack:
        def __init__(self):
            self.sims: list = []
            self.gateways: list = []
            self.board: Board | None = None

        async def start(self, sims, *, gateway: bool = True, workers: int = 0, **gateway_opts):
            """Start sims [(name, model, token_rate)] (each with ``workers`` more ranks) and a
            gateway; returns (sims, gateway, client)."""
            cfg = gateway_config(nats_server, f"gw{len(self.gateways)}", **gateway_opts) if gateway else None
            starting = asyncio.ensure_future(start_sims(tmp_path, sims, workers))  # engines boot while NATS is set up
            self.board = await Board.open(nats_server)  # its reload admits the gateway's certificate too
            running = await starting
            self.sims += running
            if cfg is None:
                return running, None, None
            gw = await start_gateway(cfg)
            self.gateways.append(gw)
            return running, gw, client_for(gw)

        async def gateway(self, **gateway_opts):
            cfg = gateway_config(nats_server, f"gw{len(self.gateways)}", **gateway_opts)
            nats_server.reload()
            gw = await start_gateway(cfg)
            self.gateways.append(gw)
            return gw, client_for(gw)

    s = Stack()
    yield s
    for gw in s.gateways:
        await gw.stop()
    for sim in s.sims:
        sim.kill()
    if s.board:
        await s.board.close()


async def _sum(values) -> float:
    return sum(await values)


def base_url(gw) -> str:
    return f"http://{HOST}:{gw.port}"


def client_for(gw, **kw) -> openai.AsyncOpenAI:
    kw.setdefault("api_key", "unused")
    return openai.AsyncOpenAI(base_url=f"{base_url(gw)}/v1", max_retries=0, timeout=15, **kw)


async def model_ids(client) -> list[str]:
    return sorted(m.id for m in (await client.models.list()).data)


def gw_metric(gw, name: str, **labels) -> float:
    return metric_sum(gw.metrics.render().decode(), name, **labels)


async def metric_is(gw, value: float, name: str, **labels) -> None:
    """The gateway counts a request as it finishes, which can be just after the client
    has its answer: wait for the exact value (and fail with the last one seen)."""
    await wait_for(lambda: gw_metric(gw, name, **labels), f"{name}{labels or ''} == {value}", expected=value)


async def test_openai_client_chat_and_completions_streaming_and_not(stack):
    (a, b), gw, client = await stack.start([("a", "org/alpha", 0.0), ("b", "org/beta", 0.0)])
    board = stack.board
    await board.put(replica("alpha-1", "org/alpha", a.endpoint))
    await board.put(replica("beta-1", "org/beta", b.endpoint))
    await board.put(replica("gamma-1", "org/gamma", state="launching"))
    await board.deploy("delta", "org/delta")  # applied, no replica yet
    # the replicas and the deployment come through two buckets: wait for everything this test relies on
    await wait_for(
        lambda: (gw.router.models(), gw.router.known("org/gamma"), gw.router.known("org/delta")),
        "both ready models routed, gamma and delta known",
        expected=(["org/alpha", "org/beta"], True, True),
    )
    assert await model_ids(client) == ["org/alpha", "org/beta"]

    raw = await client.chat.completions.with_raw_response.create(model="org/alpha", messages=HELLO, max_tokens=12)
    assert raw.headers["x-llmgw-replica"] == "alpha-1"
    chat = raw.parse()
    text = chat.choices[0].message.content
    assert chat.object == "chat.completion" and chat.model == "org/alpha" and text
    assert chat.usage.completion_tokens == len(text.split()) <= 12
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    stream = await client.chat.completions.create(model="org/alpha", messages=HELLO, max_tokens=12, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert len(chunks) > 3  # passed through chunk by chunk, not merged into one
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    done = await client.completions.create(model="org/beta", prompt="GPUs on one fabric", max_tokens=5)
    assert done.object == "text_completion" and done.model == "org/beta" and 0 < done.usage.completion_tokens <= 5
    pieces = [
        p
        async for p in await client.completions.create(
            model="org/beta", prompt="GPUs on one fabric", max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
    ]
    assert "".join(p.choices[0].text for p in pieces if p.choices) == done.choices[0].text
    assert pieces[-1].usage.completion_tokens == done.usage.completion_tokens
    await metric_is(gw, 1, "llmgw_gateway_time_to_first_token_seconds_count", model="org/beta")
    await metric_is(gw, 2, "llmgw_gateway_requests_total", model="org/alpha", status="200")

    # A replica's state change reaches /v1/models and routing live.
    await board.put(replica("beta-1", "org/beta", b.endpoint, state="failed"))
    await board.put(replica("gamma-1", "org/gamma", b.endpoint))  # the same engine now "serves" gamma
    await wait_for(lambda: gw.router.models() == ["org/alpha", "org/gamma"], "beta gone and gamma ready")
    assert await model_ids(client) == ["org/alpha", "org/gamma"]
    assert (await client.models.retrieve("org/gamma")).id == "org/gamma"

    # Known but not ready: 503 with Retry-After; unknown: 404.
    for model in ("org/beta", "org/delta"):
        with pytest.raises(openai.InternalServerError) as err:
            await client.chat.completions.create(model=model, messages=HELLO)
        assert err.value.status_code == 503 and int(err.value.response.headers["Retry-After"]) >= 1
        assert err.value.body["code"] == "no_ready_replica" and model in err.value.message
    with pytest.raises(openai.NotFoundError) as err:
        await client.chat.completions.create(model="org/nothing", messages=HELLO)
    assert err.value.body["code"] == "model_not_found"
    await board.delete("beta-1")
    await wait_for(lambda: not gw.router.known("org/beta"), "beta's record deleted")
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="org/beta", prompt="x")
    await metric_is(gw, 2, "llmgw_gateway_requests_total", model="_unknown", status="404")

    # An engine's own error answer (a bad parameter) is passed through as is.
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model="org/alpha", messages=HELLO, max_tokens=-1)
    assert err.value.body["param"] == "max_tokens"


async def test_load_spreads_over_two_ready_replicas(stack):
    (a, b), gw, client = await stack.start([("a", "org/alpha", 200.0), ("b", "org/alpha", 200.0)])
    await stack.board.put(replica("alpha-1", "org/alpha", a.endpoint))
    await stack.board.put(replica("alpha-2", "org/alpha", b.endpoint))
    await wait_for(lambda: len(list(gw.router.backends())) == 2, "two replicas routed")

    answers = await asyncio.gather(*(client.chat.completions.create(model="org/alpha", messages=HELLO, max_tokens=6) for _ in range(64)))
    assert all(r.choices[0].message.content for r in answers)

    async def served():  # counted by the engines themselves, as each request ends
        return [await a.metric("vllm:request_success_total"), await b.metric("vllm:request_success_total")]

    await wait_for(lambda: _sum(served()), "64 requests counted by the engines", expected=64)
    served = await served()
    assert max(served) <= 0.6 * 64, served
    await metric_is(gw, 0, "llmgw_gateway_inflight_requests")


async def test_dead_replicas_mid_stream_before_first_byte_and_all_gone(stack):
    (slow1, slow2, fast), gw, client = await stack.start(
        [("slow1", "org/alpha", 10.0), ("slow2", "org/alpha", 10.0), ("fast", "org/alpha", 0.0)], failures_before_cooldown=2, cooldown=60
    )
    board = stack.board

    # 1. Killed in the middle of a stream: the client gets an error event, promptly.
    await board.put(replica("slow-1", "org/alpha", slow1.endpoint))
    await wait_for(lambda: gw.router.models() == ["org/alpha"], "slow-1 routed")
    stream = await client.chat.completions.create(model="org/alpha", messages=HELLO, max_tokens=200, stream=True, extra_body={"ignore_eos": True})
    seen = 0
    with pytest.raises(openai.APIError) as err:
        async for _ in stream:
            seen += 1
            if seen == 3:
                slow1.kill()
    assert not isinstance(err.value, openai.APITimeoutError)
    assert "broke" in err.value.message and err.value.body["code"] == "upstream_error"
    await metric_is(gw, 1, "llmgw_gateway_upstream_errors_total", replica="slow-1", kind="stream_broken")

    # 2. Its record still says ready (the scheduler has not noticed): connection
    #    refused there, retried on the other. With the broken stream that is
    #    two failures in a row, which takes it out of rotation.
    await board.put(replica("slow-2", "org/alpha", slow2.endpoint))
    await wait_for(lambda: len(list(gw.router.backends())) == 2, "slow-2 routed")
    for _ in range(4):
        done = await client.completions.create(model="org/alpha", prompt="p", max_tokens=2)
        assert done.usage.completion_tokens == 2
    await metric_is(gw, 1, "llmgw_gateway_upstream_errors_total", replica="slow-1", kind="connect")
    await metric_is(gw, 1, "llmgw_gateway_replica_cooling", replica="slow-1")
    await metric_is(gw, 1, "llmgw_gateway_cooldowns_total", replica="slow-1")
    await metric_is(gw, 1, "llmgw_gateway_retries_total", model="org/alpha")

    # 3. Killed after accepting a request but before its first byte: the
    #    request is answered by another replica, and the client never knows.
    await board.put(replica("slow-1", "org/alpha", state="failed"))
    await board.put(replica("fast-1", "org/alpha", state="launching"))
    await wait_for(lambda: [b.id for b in gw.router.backends()] == ["slow-2"], "only slow-2 routed")
    pending = asyncio.create_task(client.chat.completions.with_raw_response.create(model="org/alpha", messages=HELLO, max_tokens=40))
    await wait_for(lambda: slow2.metric("vllm:num_requests_running"), "slow-2 generating", timeout=10)
    await board.put(replica("fast-1", "org/alpha", fast.endpoint))
    await wait_for(lambda: len(list(gw.router.backends())) == 2, "fast-1 routed")
    slow2.kill()
    raw = await asyncio.wait_for(pending, 15)
    assert raw.headers["x-llmgw-replica"] == "fast-1"
    assert raw.parse().usage.completion_tokens > 0
    await metric_is(gw, 1, "llmgw_gateway_upstream_errors_total", replica="slow-2", kind="broken")

    # 4. The last one dies too, its record still ready: 502, not a hang.
    await board.put(replica("slow-2", "org/alpha", state="failed"))
    await wait_for(lambda: [b.id for b in gw.router.backends() if b.routable] == ["fast-1"], "only fast-1 routed")
    fast.kill()
    with pytest.raises(openai.InternalServerError) as err:
        await client.chat.completions.create(model="org/alpha", messages=HELLO)
    assert err.value.status_code == 502 and err.value.body["code"] == "upstream_error"
    assert "no other is ready" in err.value.message


async def test_timeout_and_client_disconnect_cancel_upstream(stack):
    (slow,), gw, _ = await stack.start([("slow", "org/alpha", 20.0)])
    await stack.board.put(replica("slow-1", "org/alpha", slow.endpoint))
    await wait_for(lambda: gw.router.models() == ["org/alpha"], "slow-1 routed")
    url = f"{base_url(gw)}/v1/chat/completions"

    async with aiohttp.ClientSession() as http:
        # A stream whose client leaves: the engine stops generating for it.
        body = {"model": "org/alpha", "messages": HELLO, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        resp = await http.post(url, json=body)
        assert resp.status == 200 and (await resp.content.readline()).startswith(b"data: {")
        assert await slow.metric("vllm:num_requests_running") == 1
        resp.close()
        await wait_for(lambda: _zero(slow.metric("vllm:num_requests_running")), "the engine to drop the abandoned stream")
        await wait_for(lambda: gw_metric(gw, "llmgw_gateway_requests_total", status="499") == 1, "the gateway to count the client gone")

        # A plain request whose client leaves while it waits: counted, not left in flight.
        waiting = asyncio.create_task(http.post(url, json={**body, "stream": False}))
        await wait_for(lambda: gw_metric(gw, "llmgw_gateway_inflight_requests") == 1, "the request in flight")
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await wait_for(lambda: gw_metric(gw, "llmgw_gateway_requests_total", status="499") == 2, "the second leaving counted")
        await metric_is(gw, 0, "llmgw_gateway_inflight_requests")

    # An engine silent for longer than upstream_timeout: 504 (plain) / an error event (stream).
    gw2, client2 = await stack.gateway(upstream_timeout=0.5)
    await wait_for(lambda: gw2.router.models() == ["org/alpha"], "the second gateway routing")
    with pytest.raises(openai.APIStatusError) as err:
        await client2.chat.completions.create(model="org/alpha", messages=HELLO, max_tokens=200, extra_body={"ignore_eos": True})
    assert err.value.status_code == 504 and err.value.body["code"] == "upstream_timeout"
    await metric_is(gw2, 1, "llmgw_gateway_upstream_errors_total", kind="timeout")


async def _zero(value) -> bool:
    return (await value) == 0


async def test_keys_limits_and_bad_bodies_reach_no_replica(stack, nats_server, tmp_path):
    """The gateway as a process (``llmgw gateway -c``), with API keys and a small body limit."""
    (sim,), _, _ = await stack.start([("a", "org/alpha", 0.0)], gateway=False)
    await stack.board.put(replica("alpha-1", "org/alpha", sim.endpoint))

    hashed = await spawning.run([sys.executable, "-m", "llmgw.services.gateway.auth", "hash", "s3cret"], capture_output=True, text=True, check=True)
    (tmp_path / "keys").write_text(f"# ops team\n{hashed.stdout.strip()}  # rotated monthly\n\n")
    tls = nats_server.issue("gw-proc", "gateway")
    nats_server.reload()
    port = free_port(HOST)
    conf = {
        "server": nats_server.url,
        "tls": {"ca": tls.ca, "cert": tls.cert, "key": tls.key},
        "gateway": {"listen": f"{HOST}:{port}", "api_keys_file": "keys", "max_body_bytes": 4096},
    }
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(conf))
    proc = await spawning.start_logged(
        [sys.executable, "-m", "llmgw.services", "gateway", "-c", str(tmp_path / "gateway.yaml"), "--workers", "1"], tmp_path / "gateway.log"
    )
    base = f"http://{HOST}:{port}"
    try:
        async with aiohttp.ClientSession() as http:

            async def ready():
                if proc.poll() is not None:
                    raise AssertionError((tmp_path / "gateway.log").read_text())
                try:
                    async with http.get(f"{base}/healthz") as r:
                        return r.status == 200 and (await r.json())["models"] == ["org/alpha"]
                except aiohttp.ClientConnectionError:
                    return False

            await wait_for(ready, "the gateway process serving org/alpha", timeout=20)
            keyed = {"Authorization": "Bearer s3cret"}
            chat = {"model": "org/alpha", "messages": HELLO, "max_tokens": 3}
            refused = [
                ({}, json.dumps(chat).encode(), 401, "invalid_api_key"),
                ({"Authorization": "Bearer wrong"}, json.dumps(chat).encode(), 401, "invalid_api_key"),
                ({"Authorization": "Basic s3cret"}, json.dumps(chat).encode(), 401, "invalid_api_key"),
                (keyed, b"{not json", 400, "invalid_json"),
                (keyed, b"", 400, "invalid_json"),
                (keyed, b"[1, 2]", 400, "invalid_json"),
                (keyed, b'{"messages": []}', 400, "missing_field"),
                (keyed, b'{"model": 7}', 400, "invalid_value"),
                (keyed, json.dumps({**chat, "pad": "x" * 5000}).encode(), 413, "request_too_large"),
            ]
            for headers, body, status, code in refused:
                async with http.post(f"{base}/v1/chat/completions", data=body, headers={**headers, "Content-Type": "application/json"}) as r:
                    assert r.status == status, (headers, body[:40], await r.text())
                    error = (await r.json())["error"]
                    assert error["code"] == code and error["message"], error

            async def chunked():  # no Content-Length: the limit holds on what is read
                yield b'{"model": "org/alpha", "pad": "'
                for _ in range(10):
                    yield b"y" * 1000
                yield b'"}'

            async with http.post(f"{base}/v1/chat/completions", data=chunked(), headers=keyed) as r:
                assert r.status == 413
            async with http.get(f"{base}/v1/models") as r:
                assert r.status == 401
            async with http.get(f"{base}/v1/chat/completions", headers=keyed) as r:
                assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
            async with http.get(f"{base}/v1/nothing", headers=keyed) as r:
                assert r.status == 404
            async with http.get(f"{base}/metrics") as r:
                metrics = await r.text()
            assert metric_sum(metrics, "llmgw_gateway_requests_total", status="401") == 3
            assert metric_sum(metrics, "llmgw_gateway_replica_requests_total") == 0
            assert await sim.metric("vllm:prompt_tokens_total") == 0  # nothing reached the engine

        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0, timeout=10)
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="org/alpha", messages=HELLO)
        client = client.with_options(api_key="s3cret")
        assert await model_ids(client) == ["org/alpha"]
        answer = await client.chat.completions.create(model="org/alpha", messages=HELLO, max_tokens=3)
        assert answer.usage.completion_tokens == 3
        assert await sim.metric("vllm:request_success_total") == 1

        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "gateway serving the OpenAI API" in (tmp_path / "gateway.log").read_text()


async def test_https_for_clients_with_a_certificate_from_the_llmgw_pki(stack, nats_server, tmp_path):
    """gateway.tls_cert/tls_key: the openai client over HTTPS (trusting the llmgw CA); plain HTTP is not answered."""
    import ssl

    from llmgw.shared import pki

    try:  # the openai client's HTTP library: httpx2 in openai 3, httpx before
        import httpx2 as httpx
    except ImportError:
        import httpx

    issued = pki.issue_server(nats_server.pki_dir, [HOST], tmp_path / "gw-tls")
    (sim,), _, _ = await stack.start([("a", "alpha", 0.0)], gateway=False)
    await stack.board.put(replica("alpha-1", "alpha", sim.endpoint))
    gw, _ = await stack.gateway(tls_cert=str(issued.cert_path), tls_key=str(issued.key_path))
    async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(issued.ca_path))) as http:
        client = openai.AsyncOpenAI(base_url=f"https://{HOST}:{gw.port}/v1", api_key="unused", max_retries=0, timeout=15, http_client=http)
        await wait_for(lambda: model_ids(client), "alpha listed over HTTPS")
        reply = await client.chat.completions.create(model="alpha", messages=HELLO, max_tokens=3)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
        chunks = [c async for c in await client.chat.completions.create(model="alpha", messages=HELLO, max_tokens=3, stream=True)]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    # A client that does not trust the certificate is refused by its own TLS, before any request.
    async with httpx.AsyncClient() as untrusting:
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await untrusting.get(f"https://{HOST}:{gw.port}/healthz")
    # Plain HTTP to the HTTPS port gets no HTTP answer.
    async with aiohttp.ClientSession() as plain:
        with pytest.raises(aiohttp.ClientError):
            async with plain.get(f"{base_url(gw)}/healthz") as r:
                await r.read()


async def test_access_log_has_a_line_per_answer_when_asked_for(stack, caplog):
    (sim,), _gw, client = await stack.start([("a", "alpha", 0.0)], access_log=True)
    _quiet, quiet_client = await stack.gateway()  # the default: no access log
    await stack.board.put(replica("alpha-1", "alpha", sim.endpoint))
    await wait_for(lambda: model_ids(client), "alpha listed")
    await wait_for(lambda: model_ids(quiet_client), "alpha listed by the quiet gateway")
    caplog.set_level("INFO", logger="llmgw.gateway.access")
    await client.chat.completions.create(model="alpha", messages=HELLO, max_tokens=2, extra_headers={"X-Request-Id": "req-42"})
    async for _ in await client.completions.create(model="alpha", prompt="hi", max_tokens=2, stream=True):
        pass
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope", messages=HELLO)
    await quiet_client.chat.completions.create(model="alpha", messages=HELLO, max_tokens=2)
    lines = [r.getMessage() for r in caplog.records if r.name == "llmgw.gateway.access"]
    assert len(lines) == 3, lines  # nothing from the quiet gateway
    assert lines[0].startswith(f'{HOST} "POST /v1/chat/completions" 200 model=alpha replica=alpha-1 ') and lines[0].endswith("request_id=req-42")
    assert '"POST /v1/completions" 200 model=alpha replica=alpha-1 ' in lines[1]
    assert '"POST /v1/chat/completions" 404 model=_unknown replica=- ' in lines[2]


def test_access_log_is_written_even_when_the_service_logs_only_warnings():
    import logging

    from llmgw.services.gateway.access import AccessLog

    logger = logging.getLogger("llmgw.test.access")
    logger.setLevel(logging.WARNING)
    AccessLog(logger)
    assert logger.isEnabledFor(logging.INFO)


def test_bad_tls_configuration_names_the_file(tmp_path):
    from llmgw.shared.config import GatewaySection
    from llmgw.shared.errors import ConfigError
    from llmgw.shared.tls import server_context

    with pytest.raises(ConfigError, match="tls_cert and tls_key go together"):
        GatewaySection(tls_cert="gw.pem")
    with pytest.raises(ConfigError, match=r"gateway.yaml: gateway.tls_cert: .*gw.pem does not exist"):
        server_context(str(tmp_path / "gateway.yaml"), str(tmp_path / "gw.pem"), str(tmp_path / "gw-key.pem"))
    (tmp_path / "gw.pem").write_text("not a certificate\n")
    (tmp_path / "gw-key.pem").write_text("not a key\n")
    with pytest.raises(ConfigError, match="are not a PEM certificate and its key"):
        server_context(str(tmp_path / "gateway.yaml"), str(tmp_path / "gw.pem"), str(tmp_path / "gw-key.pem"))


def test_bad_configuration_is_one_clear_error(tmp_path):
    from llmgw.services.gateway.auth import ApiKeys
    from llmgw.shared.config import GatewaySection
    from llmgw.shared.errors import ConfigError

    (tmp_path / "keys").write_text("s3cret\n")
    with pytest.raises(ConfigError, match="line 1: expected a SHA-256 hex digest"):
        ApiKeys.load(tmp_path / "keys")
    (tmp_path / "empty").write_text("# nobody yet\n")
    with pytest.raises(ConfigError, match="holds no keys"):
        ApiKeys.load(tmp_path / "empty")
    with pytest.raises(ConfigError, match="does not exist"):
        ApiKeys.load(tmp_path / "missing")
    with pytest.raises(ConfigError, match="listen: 'localhost' is not HOST:PORT"):
        GatewaySection(listen="localhost")
    with pytest.raises(ConfigError, match="failures_before_cooldown"):
        GatewaySection(failures_before_cooldown=0)
