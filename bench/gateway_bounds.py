"""The gateway under resource attacks (slow clients, floods, oversized bodies), while a
well-behaved client keeps asking. Not a test: it prints figures. Run from the
repository root::

    python -m bench.gateway_bounds [--phase 12] [--nofile 1024] [--max-connections 400]

One ``llmgw gateway`` process (``RLIMIT_NOFILE`` set to ``--nofile`` for it,
as a 1,024 limit was where the attack was found) in front of a ``sim`` engine
(model ``sim``, the good client's) and a tiny HTTP replica in this process
(model ``big``) whose every answer is ``--big-mib`` MiB. Phases, each
``--phase`` seconds, one after the other:

* ``baseline``: no attack;
* ``slow-headers``: 500 connections each sending its head one byte a second;
* ``half-bodies``: 100 POSTs declaring 4 MiB and sending all but 1 KiB of it;
* ``big-answer``: one request for a ``--big-mib`` MiB answer at a time;
* ``descriptors``: 1,100 idle connections (more than the descriptor limit).

For each phase: the gateway's peak RSS and open descriptors (sampled from
/proc every 50 ms), its RSS after the phase's attackers left, the good
client's success rate and latency (one keep-alive connection, sequential
requests; a refused or failed request counts as a failure and the client
reconnects), what the attackers got back, and the gateway's own counters
(``llmgw_gateway_bounded_total`` by reason, cool-downs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from llmgw.shared.natsserver import NatsServer, free_port
from tests import spawning
from tests.gateway_helpers import HOST, Board, Sim, metric_sum, replica, wait_for

MiB = 1024 * 1024


# -- the processes ------------------------------------------------------------------------
def proc_status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0]) * 1024
    return out


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class BigReplica:
    """Answers every request with ``size`` bytes (chunked), as fast as it is read."""

    def __init__(self, size: int):
        self.size = size
        self.sent = 0
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, HOST, 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader, writer) -> None:
        piece = b"x" * MiB
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
                sent = 0
                while sent < self.size:
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    sent += len(piece)
                    self.sent += len(piece)
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


# -- an HTTP/1.1 exchange on raw streams -----------------------------------------------------
def post(model: str, extra: dict | None = None) -> bytes:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, **(extra or {})}).encode()
    return b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def read_answer(r: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, keep-alive) of one answer with a Content-Length (all of the gateway's whole answers)."""
    status_line = await r.readline()
    if not status_line:
        raise ConnectionResetError("closed before an answer")
    status = int(status_line.split()[1])
    length, keep = 0, True
    while (line := await r.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        if name.lower() == "content-length":
            length = int(value)
        elif name.lower() == "connection" and value.strip().lower() == "close":
            keep = False
    return status, await r.readexactly(length), keep


class GoodClient:
    """Sequential requests on one keep-alive connection (a new one after any failure)."""

    def __init__(self, port: int):
        self.port = port
        self.ok: list[float] = []
        self.failed: dict[str, int] = {}
        self.stop = False
        self.conn = None

    def reset(self) -> None:
        self.ok, self.failed = [], {}

    async def run(self) -> None:
        while not self.stop:
            t0 = time.perf_counter()
            try:
                if self.conn is None:
                    self.conn = await asyncio.wait_for(asyncio.open_connection(HOST, self.port), 5)
                r, w = self.conn
                w.write(post("sim"))
                status, _body, keep = await asyncio.wait_for(read_answer(r), 10)
                if status == 200:
                    self.ok.append(time.perf_counter() - t0)
                else:
                    self.failed[str(status)] = self.failed.get(str(status), 0) + 1
                if not keep:
                    w.close()
                    self.conn = None
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
                kind = type(e).__name__
                self.failed[kind] = self.failed.get(kind, 0) + 1
                if self.conn is not None:
                    self.conn[1].close()
                self.conn = None
                await asyncio.sleep(0.05)


# -- the attacks -------------------------------------------------------------------------------
class Tally:
    def __init__(self):
        self.outcomes: dict[str, int] = {}

    def add(self, what: str) -> None:
        self.outcomes[what] = self.outcomes.get(what, 0) + 1

    def __str__(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())) or "-"


async def _outcome(r: asyncio.StreamReader, tally: Tally, timeout: float) -> None:
    try:
        status, _, _ = await asyncio.wait_for(read_answer(r), timeout)
        tally.add(str(status))
    except TimeoutError:
        tally.add("still open at the phase's end")
    except (ConnectionError, asyncio.IncompleteReadError):
        tally.add("closed without an answer")


async def slow_headers(port: int, n: int, seconds: float, tally: Tally) -> None:
    async def one():
        try:
            r, w = await asyncio.open_connection(HOST, port)
        except OSError:
            tally.add("connect failed")
            return
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")
        answer = asyncio.ensure_future(_outcome(r, tally, seconds))
        line = b"X-Slow: 1\r\n"
        i = 0
        with contextlib.suppress(ConnectionError):
            while not answer.done():
                w.write(line[i % len(line) : i % len(line) + 1])
                i += 1
                await asyncio.sleep(1.0)
        await answer
        w.close()

    await asyncio.gather(*(one() for _ in range(n)))


async def half_bodies(port: int, n: int, seconds: float, tally: Tally) -> None:
    declared = 4 * MiB
    piece = b" " * (declared - 1024)

    async def one():
        try:
            r, w = await asyncio.open_connection(HOST, port)
        except OSError:
            tally.add("connect failed")
            return
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % declared)
        w.write(piece)
        await _outcome(r, tally, seconds)
        w.close()

    await asyncio.gather(*(one() for _ in range(n)))


async def big_answers(port: int, seconds: float, tally: Tally) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            r, w = await asyncio.open_connection(HOST, port)
        except OSError:
            tally.add("connect failed")
            await asyncio.sleep(0.1)
            continue
        w.write(post("big"))
        await _outcome(r, tally, max(1.0, deadline - time.monotonic()))
        w.close()


async def idle_connections(port: int, n: int, seconds: float, tally: Tally) -> None:
    conns = []
    for _ in range(n):
        try:
            conns.append(await asyncio.open_connection(HOST, port))
        except OSError:
            tally.add("connect failed")
    await asyncio.gather(*(_outcome(r, tally, seconds) for r, _ in conns))
    for _, w in conns:
        w.close()


# -- the run ---------------------------------------------------------------------------------
async def metrics_text(port: int) -> str:
    r, w = await asyncio.open_connection(HOST, port)
    w.write(b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n")
    _, body, _ = await asyncio.wait_for(read_answer(r), 10)
    w.close()
    return body.decode()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000 if s else float("nan")


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", type=float, default=12.0, help="seconds per phase")
    ap.add_argument("--nofile", type=int, default=1024, help="the gateway's RLIMIT_NOFILE")
    ap.add_argument("--max-connections", type=int, default=384, help="gateway.max_connections (384 x 2 + 256 = 1024)")
    ap.add_argument("--read-timeout", type=float, default=5.0, help="gateway.request_read_timeout")
    ap.add_argument("--no-bound-settings", action="store_true", help="write no bound setting in gateway.yaml (to run a gateway from before them)")
    ap.add_argument("--big-mib", type=int, default=400, help="the size of each big answer")
    args = ap.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # this process holds the attackers' sockets
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    work = Path(tempfile.mkdtemp(prefix="llmgw-bounds-"))
    nats = NatsServer(root=work / "nats")
    sim = board = gw = None
    try:
        nats.prepare()
        nats.start()
        sim = Sim(work, "engine", "sim", token_rate=0.0)
        big = BigReplica(args.big_mib * MiB)
        await big.start()
        tls = nats.issue("gateway", "gateway")
        board = await Board.open(nats)
        await sim.wait_serving()
        await board.put(replica("sim-1", "sim", sim.endpoint))
        await board.put(replica("big-1", "big", f"http://{HOST}:{big.port}"))
        port = free_port(HOST)
        gateway = {"listen": f"{HOST}:{port}"}
        if not args.no_bound_settings:
            gateway.update(max_connections=args.max_connections, request_read_timeout=args.read_timeout)
        (work / "gateway.yaml").write_text(yaml.safe_dump({"server": nats.url, "tls": {"ca": tls.ca, "cert": tls.cert, "key": tls.key}, "gateway": gateway}))
        log = work / "gateway.log"
        nofile = args.nofile
        gw = await spawning.start_logged(
            [sys.executable, "-m", "llmgw.services", "--log-level", "warning", "gateway", "-c", str(work / "gateway.yaml"), "--workers", "1"],
            log, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)),
        )  # fmt: skip

        async def routable():
            if gw.poll() is not None:
                raise SystemExit(f"the gateway exited {gw.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(OSError, asyncio.TimeoutError, ValueError, IndexError, asyncio.IncompleteReadError):
                r, w = await asyncio.open_connection(HOST, port)
                w.write(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
                _, body, _ = await asyncio.wait_for(read_answer(r), 2)
                w.close()
                return b'"sim"' in body and b'"big"' in body
            return False

        await wait_for(routable, "the gateway routes both models", timeout=60, interval=0.2)

        good = GoodClient(port)
        good_task = asyncio.ensure_future(good.run())
        phases = [
            ("baseline", lambda t: asyncio.sleep(args.phase)),
            ("slow-headers x500", lambda t: slow_headers(port, 500, args.phase, t)),
            ("half-bodies x100 (4 MiB)", lambda t: half_bodies(port, 100, args.phase, t)),
            (f"big-answer ({args.big_mib} MiB)", lambda t: big_answers(port, args.phase, t)),
            ("descriptors x1100 idle", lambda t: idle_connections(port, 1100, args.phase, t)),
        ]
        settings = "no bound settings" if args.no_bound_settings else f"max_connections {args.max_connections}, request_read_timeout {args.read_timeout:g}s"
        print(f"gateway: RLIMIT_NOFILE {nofile}, {settings}; {args.phase:g}s per phase; machine: {os.cpu_count()} cores")
        print()
        print("| phase | gateway peak RSS MB | RSS after MB | peak open fds | good client ok | failed | p50 ms | p99 ms | attackers got |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, attack in phases:
            good.reset()
            tally = Tally()
            peak_rss = peak_fds = 0
            running = asyncio.ensure_future(attack(tally))
            t_end = time.monotonic() + args.phase + 5
            while not running.done() and time.monotonic() < t_end:
                st = proc_status(gw.pid)
                peak_rss = max(peak_rss, st["VmRSS"])
                peak_fds = max(peak_fds, open_fds(gw.pid))
                await asyncio.sleep(0.05)
            if not running.done():
                running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
            ok, failed, lat = len(good.ok), dict(good.failed), list(good.ok)
            await asyncio.sleep(1.0)  # the attackers' connections close; what they held is let go
            after = proc_status(gw.pid)["VmRSS"]
            total = ok + sum(failed.values())
            fails = ", ".join(f"{k} {v}" for k, v in failed.items()) or "0"
            print(
                f"| {name} | {peak_rss / MiB:.0f} | {after / MiB:.0f} | {peak_fds} | {ok}/{total} ({100 * ok / max(total, 1):.1f} %) | {fails} | {pct(lat, 0.5):.1f} | {pct(lat, 0.99):.1f} | {tally} |"
            )
        good.stop = True
        await asyncio.wait_for(good_task, 15)
        text = await metrics_text(port)
        print()
        bounded = {
            reason: metric_sum(text, "llmgw_gateway_bounded_total", reason=reason)
            for reason in ("connection_limit", "read_timeout", "body_buffer_full", "response_too_large", "out_of_fds")
        }
        cooled = metric_sum(text, "llmgw_gateway_cooldowns_total")
        print("gateway counters: " + ", ".join(f"{k} {v:.0f}" for k, v in bounded.items()) + f"; cool-downs {cooled:.0f}")
        print(f"gateway peak RSS over the whole run (VmHWM): {proc_status(gw.pid)['VmHWM'] / MiB:.0f} MB; the big replica sent {big.sent / MiB:.0f} MiB in all")
        warnings = [line for line in log.read_text().splitlines() if "WARNING" in line or "ERROR" in line]
        print(f"gateway log: {len(warnings)} warning/error lines" + "".join(f"\n    {w[:200]}" for w in warnings[:12]))
        return 0
    finally:
        if gw is not None and gw.poll() is None:
            gw.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                gw.wait(10)
        if board is not None:
            await board.close()
        if sim is not None:
            sim.kill()
        nats.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:
        sys.exit(asyncio.run(main()))
    sys.exit(uvloop.run(main()))
