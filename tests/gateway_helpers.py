"""Real parts for gateway tests and ``bench/gateway.py``: ``sim`` engine
processes, replica records written under the scheduler's identity, and an
in-process gateway under its own certificate. Nothing here imports pytest, so
the benchmark reuses it as is.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from llmgw.shared import bus
from llmgw.shared import subjects as S
from llmgw.shared.config import GatewaySection, ServiceConfig, TlsSection
from llmgw.shared.natsserver import NatsServer, free_port
from llmgw.shared.schemas import DeploymentSpec, Replica, ReplicaMember, encode
from llmgw.shared.states import EngineState

from .waiting import _UNSET, eventually

HOST = "127.0.0.1"


class Sim:
    """One single-node ``llmgw engine sim`` process serving ``model`` on HOST."""

    def __init__(self, log_dir: Path, name: str, model: str, *, token_rate: float = 0.0, extra: tuple[str, ...] = (), workers: int = 0):
        """``workers``: ranks beyond the leader, each its own process (a multi-node replica's group)."""
        self.name = name
        self.model = model
        self.log_path = Path(log_dir) / f"{name}.log"
        self._args = (Path(log_dir), token_rate, extra, workers)
        self.workers: list[subprocess.Popen] = []
        self._start()

    def _start(self) -> None:
        log_dir, token_rate, extra, workers = self._args
        self.port = free_port(HOST)
        rdv = free_port(HOST)

        def argv(rank: int) -> list[str]:
            return [
                sys.executable, "-m", "llmgw.services", "engine", "sim", "--model", self.model, "--nnodes", str(workers + 1), "--rank", str(rank),
                "--leader-addr", HOST, "--rendezvous-port", str(rdv), "--host", HOST, "--port", str(self.port),
                "--load-time", "0", "--token-rate", str(token_rate), *extra,
            ]  # fmt: skip

        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(argv(0), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.workers = []
        for rank in range(1, workers + 1):
            with open(log_dir / f"{self.name}-rank{rank}.log", "wb") as out:
                self.workers.append(subprocess.Popen(argv(rank), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def wait_serving(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        restarts = 0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # A free port can be taken between free_port() and the engine's bind (another
                # test's connection, say): that is the harness's race, not the engine's fault.
                if "address already in use" in self.log() and restarts < 3:
                    restarts += 1
                    self.kill()
                    self._start()
                    continue
                raise AssertionError(f"sim {self.name} exited {self.proc.returncode}:\n{self.log()}")
            if "serving" in self.log():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"sim {self.name} not serving after {timeout:g}s:\n{self.log()}")

    def kill(self) -> None:
        for proc in (self.proc, *self.workers):
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    async def metrics(self) -> str:
        async with aiohttp.ClientSession() as s, s.get(f"{self.endpoint}/metrics") as r:
            return await r.text()

    async def metric(self, name: str) -> float:
        return metric_sum(await self.metrics(), name)


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of every sample of ``name`` whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.MULTILINE):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


async def start_sims(log_dir: Path, specs: list[tuple[str, str, float]], workers: int = 0) -> list[Sim]:
    """Start (name, model, token_rate) sims together and wait until all serve."""
    sims = [Sim(log_dir, name, model, token_rate=rate, workers=workers) for name, model, rate in specs]
    try:
        await asyncio.gather(*(s.wait_serving() for s in sims))
    except BaseException:
        for s in sims:
            s.kill()
        raise
    return sims


def replica(
    rid: str, model: str, endpoint: str = "", state: str = "ready", deployment: str | None = None, node: str = "node01", engine: str = "sim"
) -> Replica:
    port = int(endpoint.rsplit(":", 1)[1]) if endpoint else 0
    engine_state = {"ready": EngineState.READY, "degraded": EngineState.STALLED, "failed": EngineState.EXITED}.get(state, EngineState.STARTING)
    member = ReplicaMember(node_id=node, rank=0, role="leader", gpus=[0], http_port=port, serves_http=bool(endpoint), engine_state=engine_state)
    return Replica(
        id=rid, deployment=deployment or model, model=model, engine=engine, generation=1, state=state,
        members=[member], endpoint=endpoint if state == "ready" else "", created_at=time.time(), since=time.time(),
    )  # fmt: skip


class Board:
    """Writes replica and deployment records the way the scheduler does (its identity, its buckets)."""

    def __init__(self, nc, kv: dict):
        self.nc = nc
        self.replicas = kv[S.BUCKET_REPLICAS]
        self.deployments = kv[S.BUCKET_DEPLOYMENTS]

    @classmethod
    async def open(cls, server: NatsServer, *, reload: bool = True) -> Board:
        tls = server.issue("scheduler", "scheduler")
        if reload:
            server.reload()
        nc = await bus.connect(server.url, tls, name="board", initial_attempts=3, reconnect_base=0.1, reconnect_max=0.5)
        kv = await bus.provision(nc.jetstream(), (S.BUCKET_REPLICAS, S.BUCKET_DEPLOYMENTS))
        return cls(nc, kv)

    async def put(self, rep: Replica) -> None:
        await self.replicas.put(rep.id, encode(rep))

    async def delete(self, rid: str) -> None:
        await self.replicas.delete(rid)

    async def deploy(self, name: str, model: str) -> None:
        spec = DeploymentSpec(name=name, model=model, engine="sim", replicas=1, gpus_per_node=1)
        await self.deployments.put(name, encode(spec))

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.close()


def gateway_config(server: NatsServer, name: str = "gateway", **gateway) -> ServiceConfig:
    """A gateway ServiceConfig under a fresh certificate (render + reload the server before use)."""
    tls = server.issue(name, "gateway")
    gateway.setdefault("listen", f"{HOST}:0")
    return ServiceConfig(
        server=[server.url],
        tls=TlsSection(ca=tls.ca, cert=tls.cert, key=tls.key),
        reconnect_base=0.1,
        reconnect_max=0.5,
        source=f"<test gateway {name}>",
        gateway=GatewaySection(**gateway),
    )


async def start_gateway(cfg: ServiceConfig):
    from llmgw.services.gateway.service import Gateway

    gw = Gateway(cfg)
    await gw.start()
    return gw


async def wait_for(predicate, what: str, timeout: float = 10.0, interval: float = 0.02, *, expected=_UNSET):
    """Await ``predicate()`` (sync or async) until truthy, or equal to ``expected`` when
    given; fail naming ``what`` and the last value seen."""
    return await eventually(predicate, expected, what=what, timeout=timeout, interval=interval)
