"""Gateway overhead, side by side: clients straight to a ``sim`` engine (a),
through ``llmgw gateway`` (b), and through the LiteLLM proxy (c).

Not a test: it prints figures. Run from the repository root::

    python -m bench.gateway [--seconds 3] [--rounds 2] [--litellm /tmp/litellm-venv/bin/litellm]

One ``sim`` engine (zero load time, ``--token-rate 0``: no simulated delay)
serves all three. Both gateways run as their own single process (LiteLLM:
one uvicorn worker, its default; llmgw: one process), fed the same engine;
``--workers 1,2`` adds llmgw with 2 worker processes (``llmgw gateway --workers
2``, target ``llmgw-w2``; its CPU is the workers' summed).
llmgw's gateway gets its routing the real way: a nats-server with one ready
Replica record written under the scheduler's identity. The load generator is
one asyncio process (uvloop when installed) with keep-alive connections: a
lean bare-protocol client by default, aiohttp's with ``--client aiohttp``;
for each cell (mode x clients) the targets take turns (a b c a b c ...) so
drift hits all of them. Everything shares this machine's cores, so the direct
figures are the machine's limit, not the engine's.

Latency is per request, end to end (for streams: to the last byte). "Added"
is the target's percentile minus the direct percentile of the same cell.
"CPU µs/req" is each process's user + system time (/proc) over the requests
answered in its turns. Omit LiteLLM with ``--litellm ''`` (or when it is not
installed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from llmgw.shared.natsserver import NatsServer, free_port
from tests import spawning
from tests.gateway_helpers import HOST, Board, Sim, replica, wait_for

MODEL = "sim"
MASTER_KEY = "sk-bench-0000"  # LiteLLM refuses to start without one (or a "dangerous" flag)
BODY_TOKENS = 8


@dataclass
class Target:
    name: str
    url: str  # base, e.g. http://127.0.0.1:8080
    headers: dict = field(default_factory=dict)
    pid: int | None = None  # the proxy's process (none for direct)


@dataclass
class Sample:
    latencies: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    cpu: dict = field(default_factory=dict)  # process name -> CPU seconds spent during the runs

    @property
    def count(self) -> int:
        return len(self.latencies)

    def cpu_us(self, name: str) -> float | None:
        """CPU microseconds ``name`` spent per answered request."""
        spent = self.cpu.get(name)
        return None if spent is None or not self.count else spent / self.count * 1e6


def cpu_seconds(pid: int, children: bool = False) -> float | None:
    """User + system CPU time of a process so far (Linux /proc; None elsewhere); with
    ``children``, plus its live children's (the workers of ``llmgw gateway --workers N``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    if children:
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            kids = []
        total += sum(cpu_seconds(int(k)) or 0.0 for k in kids)
    return total


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class AiohttpClient:
    """aiohttp's client, keep-alive: what many Python programs would use."""

    name = "aiohttp"

    async def __aenter__(self):
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False))
        return self

    async def __aexit__(self, *exc):
        await self.session.close()

    async def exchange(self, target: Target, body: bytes, stream: bool) -> tuple[bool, float | None]:
        """One request; (answered well, when its first chunk came)."""
        first = None
        try:
            async with self.session.post(f"{target.url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json", **target.headers}) as r:
                if stream:
                    tail = b""
                    async for chunk in r.content.iter_any():
                        if first is None:
                            first = time.perf_counter()
                        tail = (tail + chunk)[-64:]
                    return r.status == 200 and b"[DONE]" in tail, first
                data = await r.read()
                return r.status == 200 and b'"choices"' in data, None
        except aiohttp.ClientError:
            return False, None


class LeanClient:
    """A keep-alive HTTP/1.1 client on a bare asyncio Protocol (the gateway's own
    upstream client, used here only as a load generator): about a third of
    aiohttp's CPU per request, so on a shared 2-core machine less of the CPU
    the targets need goes to generating their load (wrk's reason to exist)."""

    name = "lean"

    async def __aenter__(self):
        from llmgw.services.gateway.upstream import UpstreamClient

        self.client = UpstreamClient(connect_timeout=10.0, read_timeout=60.0, keepalive=60.0)
        self.extra: dict[str, bytes] = {}  # target -> its header lines, encoded once
        return self

    async def __aexit__(self, *exc):
        await self.client.close()

    async def exchange(self, target: Target, body: bytes, stream: bool) -> tuple[bool, float | None]:
        from llmgw.services.gateway.upstream import UpstreamError

        extra = self.extra.get(target.name)
        if extra is None:
            extra = self.extra[target.name] = "".join(f"{k}: {v}\r\n" for k, v in target.headers.items()).encode()
        first = None
        try:
            conn = await self.client.post(target.url, "/v1/chat/completions", body, extra)
        except (UpstreamError, OSError):
            return False, None
        try:
            if stream:
                tail = b""
                while chunk := await conn.read_some():
                    if first is None:
                        first = time.perf_counter()
                    tail = (tail + chunk)[-64:]
                ok = conn.status == 200 and b"[DONE]" in tail
            else:
                ok = conn.status == 200 and b'"choices"' in await conn.read()
        except (UpstreamError, OSError):
            conn.close()
            return False, None
        conn.release()
        return ok, first


CLIENTS = {"lean": LeanClient, "aiohttp": AiohttpClient}


async def drive(
    session: LeanClient | AiohttpClient, target: Target, clients: int, stream: bool, seconds: float, into: Sample, rate: float = 0.0, watch: dict | None = None
) -> None:
    """``clients`` closed-loop clients (each sends its next request when the last one ends), or,
    with ``rate``, clients paced to that many requests per second in total (open loop)."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "how fast is the gateway"}], "max_tokens": BODY_TOKENS, "stream": stream}
    ).encode()
    deadline = time.perf_counter() + seconds

    async def client(k: int) -> None:
        due = time.perf_counter() + (k / rate if rate else 0.0)
        while time.perf_counter() < deadline:
            if rate:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                due += clients / rate
            t0 = time.perf_counter()
            ok, first = await session.exchange(target, body, stream)
            end = time.perf_counter()
            if not ok:
                into.errors += 1
                continue
            into.latencies.append(end - t0)
            if first is not None:
                into.first.append(first - t0)

    watch = watch or {}
    before = {name: cpu_seconds(pid, name == "proxy") for name, pid in watch.items()}
    start = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    into.seconds += time.perf_counter() - start
    for name, pid in watch.items():
        after = cpu_seconds(pid, name == "proxy")
        if after is not None and before[name] is not None:
            into.cpu[name] = into.cpu.get(name, 0.0) + after - before[name]


def child_count(pid: int) -> int:
    """How many children ``pid`` has (a multi-worker gateway's forked workers)."""
    return len(Path(f"/proc/{pid}/task/{pid}/children").read_text().split())


async def wait_http(url: str, proc: subprocess.Popen, what: str, log: Path, timeout: float = 120.0, headers: dict | None = None) -> None:
    async with aiohttp.ClientSession() as s:

        async def up():
            if proc.poll() is not None:
                raise SystemExit(f"{what} exited {proc.returncode}; its log:\n{log.read_text()[-3000:]}")  # noqa: ASYNC240 - once, on the way out
            try:
                async with s.get(url, headers=headers or {}) as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False

        await wait_for(up, what, timeout=timeout, interval=0.2)


def find_litellm(arg: str | None) -> str | None:
    if arg is not None:
        return arg or None
    for candidate in (shutil.which("litellm"), "/tmp/litellm-venv/bin/litellm"):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0, help="length of one run (default 3)")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds of load per target and mode before measuring (default 1)")
    ap.add_argument("--rounds", type=int, default=2, help="turns each target takes per cell (default 2: a b c a b c)")
    ap.add_argument("--clients", default="1,16,64", help="concurrent clients per cell (default 1,16,64)")
    ap.add_argument("--litellm", default=None, help="path of the litellm command ('' to skip; default: PATH, then /tmp/litellm-venv/bin/litellm)")
    ap.add_argument("--paced", type=float, default=0.0, help="also run 16 clients paced to this many req/s in total, below saturation (llmgw and direct)")
    ap.add_argument("--client", choices=sorted(CLIENTS), default="lean", help="the load generator's HTTP client (default lean; see LeanClient)")
    ap.add_argument("--access-log", action="store_true", help="run llmgw's gateway with gateway.access_log on (to a file)")
    ap.add_argument("--modes", default="plain,stream", help="which answers to measure (default plain,stream)")
    ap.add_argument("--json", help="also write the raw figures here")
    ap.add_argument("--workers", default="1", help="llmgw gateways to compare by worker processes, e.g. 1,2 (default 1; targets llmgw, llmgw-w2, ...)")
    args = ap.parse_args()
    clients_list = [int(c) for c in args.clients.split(",")]
    modes = [{"plain": False, "stream": True}[m] for m in args.modes.split(",")]
    litellm = find_litellm(args.litellm)

    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    procs: list[subprocess.Popen] = []  # LiteLLM (its own session: killed as a group)
    gateways: list[subprocess.Popen] = []
    nats = NatsServer(root=work / "nats")
    sim = None
    board = None
    try:
        nats.prepare()
        nats.start()
        sim = Sim(work, "engine", MODEL, token_rate=0.0)
        gw_tls = nats.issue("gateway", "gateway")
        board = await Board.open(nats)  # its reload admits the gateway's certificate too
        await sim.wait_serving()
        await board.put(replica("sim-1", MODEL, sim.endpoint))

        targets = [Target("direct", sim.endpoint)]
        for workers in (int(w) for w in args.workers.split(",")):
            gw_port = free_port(HOST)
            conf = {
                "server": nats.url,
                "tls": {"ca": gw_tls.ca, "cert": gw_tls.cert, "key": gw_tls.key},
                "gateway": {"listen": f"{HOST}:{gw_port}", "access_log": args.access_log},
            }
            (work / f"gateway-{workers}.yaml").write_text(yaml.safe_dump(conf))
            gw_log = work / f"gateway-{workers}.log"
            argv = [
                sys.executable,
                "-m",
                "llmgw.services",
                "--log-level",
                "warning",
                "gateway",
                "-c",
                str(work / f"gateway-{workers}.yaml"),
                "--workers",
                str(workers),
            ]
            gw = await spawning.start_logged(argv, gw_log)
            gateways.append(gw)
            name = "llmgw" if workers == 1 else f"llmgw-w{workers}"
            await wait_http(f"http://{HOST}:{gw_port}/v1/models", gw, name, gw_log)
            if workers > 1:  # every worker routing (each answers /v1/models only once its records are in)
                await wait_for(lambda pid=gw.pid, workers=workers: child_count(pid) == workers, f"{name}'s workers", timeout=60)
                await asyncio.sleep(2.0)  # their mirrors load after the fork: a settle, not a measurement
            targets.append(Target(name, f"http://{HOST}:{gw_port}", pid=gw.pid))
        litellm_note = "not run (--litellm '')" if args.litellm == "" else "not installed"
        if litellm:
            lport = free_port(HOST)
            lconf = {"model_list": [{"model_name": MODEL, "litellm_params": {"model": f"openai/{MODEL}", "api_base": f"{sim.endpoint}/v1", "api_key": "none"}}],
                     "general_settings": {"master_key": MASTER_KEY}}  # fmt: skip
            (work / "litellm.yaml").write_text(yaml.safe_dump(lconf))
            lenv = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "DISABLE_SCHEMA_UPDATE": "True", "LITELLM_LOG": "ERROR"}
            l_log = work / "litellm.log"
            lp = await spawning.start_logged([litellm, "--config", str(work / "litellm.yaml"), "--host", HOST, "--port", str(lport), "--num_workers", "1"],
                                             l_log, env=lenv, start_new_session=True)  # fmt: skip
            procs.append(lp)
            auth = {"Authorization": f"Bearer {MASTER_KEY}"}
            await wait_http(f"http://{HOST}:{lport}/v1/models", lp, "litellm", l_log, headers=auth)
            targets.append(Target("litellm", f"http://{HOST}:{lport}", auth, pid=lp.pid))
            litellm_note = (await spawning.run([litellm, "--version"], capture_output=True, text=True)).stdout.strip() or "litellm"

        def watch(t: Target) -> dict:
            return {"client": os.getpid(), "engine": sim.proc.pid, **({"proxy": t.pid} if t.pid else {})}

        results: dict[tuple, Sample] = {}
        async with CLIENTS[args.client]() as session:
            for t in targets:  # warm every path (imports, pools, caches) before measuring
                await drive(session, t, 4, False, args.warmup, Sample())
                await drive(session, t, 4, True, args.warmup, Sample())
            for stream in modes:
                for clients in clients_list:
                    for _ in range(args.rounds):
                        for t in targets:
                            sample = results.setdefault((stream, clients, t.name), Sample())
                            await drive(session, t, clients, stream, args.seconds, sample, watch=watch(t))
            if args.paced:
                for _ in range(args.rounds):
                    for t in [t for t in targets if t.name != "litellm"]:  # LiteLLM cannot keep up with a rate the others idle at
                        await drive(session, t, 16, False, args.seconds, results.setdefault(("paced", 16, t.name), Sample()), rate=args.paced)

        rows = []
        print(f"\nmachine: {os.cpu_count()} cores; {args.rounds} rounds x {args.seconds:g}s per target and cell; "
              f"max_tokens {BODY_TOKENS}; load generator: {args.client} client; llmgw access log: {'on' if args.access_log else 'off'}; "
              f"litellm: {litellm_note}\n")  # fmt: skip
        print(
            "| mode | clients | target | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | first chunk p50 ms | errors | CPU µs/req: proxy | engine | client |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")

        def cpu_cells(s: Sample) -> str:
            return " | ".join("–" if (us := s.cpu_us(n)) is None else f"{us:.0f}" for n in ("proxy", "engine", "client"))

        for stream in modes:
            for clients in clients_list:
                direct = results[(stream, clients, "direct")]
                for t in targets:
                    s = results[(stream, clients, t.name)]
                    p50, p99 = pct(s.latencies, 0.5) * 1e3, pct(s.latencies, 0.99) * 1e3
                    d50, d99 = pct(direct.latencies, 0.5) * 1e3, pct(direct.latencies, 0.99) * 1e3
                    added = "" if t.name == "direct" else f"{p50 - d50:.2f} | {p99 - d99:.2f}"
                    added = added or "– | –"
                    first = f"{pct(s.first, 0.5) * 1e3:.2f}" if s.first else "–"
                    rps = s.count / s.seconds if s.seconds else 0.0
                    mode = "stream" if stream else "plain"
                    print(f"| {mode} | {clients} | {t.name} | {rps:,.0f} | {p50:.2f} | {p99:.2f} | {added} | {first} | {s.errors} | {cpu_cells(s)} |")
                    rows.append({"stream": stream, "clients": clients, "target": t.name, "rps": rps, "p50_ms": p50, "p99_ms": p99,
                                 "added_p50_ms": p50 - d50, "added_p99_ms": p99 - d99, "requests": s.count, "errors": s.errors,
                                 "mean_ms": statistics.fmean(s.latencies) * 1e3 if s.latencies else None,
                                 "cpu_us_per_request": {n: s.cpu_us(n) for n in ("proxy", "engine", "client")}})  # fmt: skip
        if args.paced:
            direct = results[("paced", 16, "direct")]
            for t in [t for t in targets if t.name != "litellm"]:
                s = results[("paced", 16, t.name)]
                p50, p99 = pct(s.latencies, 0.5) * 1e3, pct(s.latencies, 0.99) * 1e3
                d50, d99 = pct(direct.latencies, 0.5) * 1e3, pct(direct.latencies, 0.99) * 1e3
                added = "– | –" if t.name == "direct" else f"{p50 - d50:.2f} | {p99 - d99:.2f}"
                print(f"| plain, paced {args.paced:g} req/s | 16 | {t.name} | {s.count / s.seconds:,.0f} | {p50:.2f} | {p99:.2f} | {added} | – | {s.errors} |")
                rows.append({"stream": False, "paced": args.paced, "clients": 16, "target": t.name, "rps": s.count / s.seconds,
                             "p50_ms": p50, "p99_ms": p99, "added_p50_ms": p50 - d50, "added_p99_ms": p99 - d99})  # fmt: skip
        if args.json:
            await asyncio.to_thread(Path(args.json).write_text, json.dumps({"litellm": litellm_note, "cores": os.cpu_count(), "rows": rows}, indent=1))
        return 0
    finally:
        for p in procs + gateways:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM) if p in procs else p.terminate()  # a gateway passes it on to its workers
                except ProcessLookupError:
                    pass
        for p in procs + gateways:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if board is not None:
            await board.close()
        if sim is not None:
            sim.kill()
        nats.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    try:  # the load generator must not be what is measured: the lighter loop leaves more CPU to the targets
        import uvloop
    except ImportError:
        sys.exit(asyncio.run(main()))
    sys.exit(uvloop.run(main()))
