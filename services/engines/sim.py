"""``llmgw engine sim``: a simulated multi-node LLM engine for the control plane.

It behaves, as seen from outside, like vLLM/SGLang across nodes, without GPUs:

* rank 0 (the leader) binds the rendezvous port and serves nothing until all
  ``nnodes-1`` workers have joined, then "loads" for ``--load-time``, then
  serves the OpenAI API on ``--host:--port``; with ``--weights-cached`` (the
  agent found the weights in the node's model cache, ``--weights DIR``) it
  loads for ``--cached-load-time`` instead;
* ranks >= 1 (workers) join the leader's rendezvous and open no port at all;
* every decode step is a collective across all ranks (see core.py): a worker
  that is SIGSTOPped, or told to stall, holds the leader's generation for as
  long as it does not answer, without anyone being called lost;
* a lost peer (its link drops, or is silent for ``--peer-timeout``) stalls
  generation for good, as a broken NCCL communicator does, or with
  ``--on-peer-loss exit`` ends the process with ``EXIT_PEER_LOST``; either way
  the survivors log ``rank N lost (...)`` (leader) or ``lost the leader (...)``
  (workers), the lines the agent reports as ``peer-lost``;
* SIGUSR1 makes a rank stall silently (the leader stops producing tokens, a
  worker stops acking steps) while ``/health`` still answers 200 - a hung
  collective as seen from outside; SIGUSR2 ends the stall;
* a prefix cache and prefill cost, off by default (``--kv-cache-tokens``,
  ``--block-size``, ``--prefill-rate``; see core.py), so cache-aware routing
  is measurable: a prompt whose start the replica has cached reaches its first
  token sooner, and ``/metrics`` counts the hits under vLLM's names;
* SIGTERM/SIGINT stop it cleanly with 0; ``--ignore-sigterm`` makes it ignore
  SIGTERM so the agent's SIGKILL escalation can be tested.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmgw.shared.durations import format_duration, parse_duration
from llmgw.shared.errors import ConfigError

from .api_requests import MAX_MODEL_LEN
from .binding import explain_bind_error, reserve
from .rendezvous import PEER_TIMEOUT, Leader, Link, join

if TYPE_CHECKING:  # annotations only: workers never load the HTTP and metrics stacks
    from aiohttp import web

    from .core import EngineCore

# 1 is an unexpected crash and 2 a configuration error (see services/cli.py).
EXIT_PEER_LOST = 3
# How long a worker keeps trying to reach a leader that is not up yet.
JOIN_GIVE_UP_AFTER = 120.0
# Stopping waits this long for requests in flight; stalled ones never finish.
HTTP_SHUTDOWN_TIMEOUT = 0.5


def _check_group(a: argparse.Namespace) -> None:
    """The rank within the group, and the leader's listen address."""
    if a.nnodes < 1:
        raise ConfigError(f"--nnodes must be at least 1, got {a.nnodes}")
    if not 0 <= a.rank < a.nnodes:
        raise ConfigError(f"--rank must be between 0 and {a.nnodes - 1} for --nnodes {a.nnodes}, got {a.rank}")
    if not 1 <= a.rendezvous_port <= 65535:
        raise ConfigError(f"--rendezvous-port must be between 1 and 65535, got {a.rendezvous_port}")
    if a.rank != 0:
        return
    if not a.host:
        raise ConfigError("the leader (--rank 0) needs --host, the address it serves HTTP on")
    if a.port is None:
        raise ConfigError("the leader (--rank 0) needs --port, the port it serves HTTP on")
    if not 0 <= a.port <= 65535:
        raise ConfigError(f"--port must be between 0 and 65535, got {a.port}")
    if a.port == a.rendezvous_port:
        raise ConfigError(f"--port and --rendezvous-port must differ (both {a.port})")


@dataclass(frozen=True)
class SimConfig:
    model: str
    served_model: str
    nnodes: int
    rank: int
    leader_addr: str
    rendezvous_port: int
    host: str | None
    port: int | None
    load_time: float  # the weights come from elsewhere (or no cache)
    token_rate: float
    on_peer_loss: str
    ignore_sigterm: bool
    max_num_seqs: int
    peer_timeout: float = PEER_TIMEOUT
    prefill_rate: float = 0.0  # uncached prompt tokens per second; 0: prefill costs nothing
    kv_cache_tokens: int = 0  # prefix cache size in tokens; 0: no prefix cache
    block_size: int = 16
    max_model_len: int = MAX_MODEL_LEN
    cached_load_time: float | None = None  # None: as load_time
    weights: str = ""  # the directory the agent put the weights in ("": none named)
    weights_cached: bool = False

    @property
    def effective_load_time(self) -> float:
        """What loading takes this time: the cached time when the weights were already on the node."""
        return self.cached_load_time if self.weights_cached and self.cached_load_time is not None else self.load_time

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> SimConfig:
        if not a.model.strip():
            raise ConfigError("--model must not be empty")
        served = a.served_model_name if a.served_model_name is not None else a.model
        if not served.strip():
            raise ConfigError("--served-model-name must not be empty")
        _check_group(a)
        if not math.isfinite(a.token_rate) or a.token_rate < 0:
            raise ConfigError(f"--token-rate must be a number of tokens per second >= 0, got {a.token_rate}")
        if a.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be at least 1, got {a.max_num_seqs}")

        def opt(name, default):  # absent (an older caller's Namespace) or None: the default
            value = getattr(a, name, None)
            return default if value is None else value

        prefill_rate = opt("prefill_rate", 0.0)
        if not math.isfinite(prefill_rate) or prefill_rate < 0:
            raise ConfigError(f"--prefill-rate must be a number of prompt tokens per second >= 0 (0: no prefill cost), got {prefill_rate}")
        kv_cache_tokens = opt("kv_cache_tokens", 0)
        if kv_cache_tokens < 0:
            raise ConfigError(f"--kv-cache-tokens must be >= 0 (0: no prefix cache), got {kv_cache_tokens}")
        block_size = opt("block_size", 16)
        if not 1 <= block_size <= 1024:
            raise ConfigError(f"--block-size must be between 1 and 1024 tokens, got {block_size}")
        if kv_cache_tokens and kv_cache_tokens < block_size:
            raise ConfigError(f"--kv-cache-tokens ({kv_cache_tokens}) must hold at least one block of --block-size {block_size} tokens")
        max_model_len = opt("max_model_len", MAX_MODEL_LEN)
        if max_model_len < 16:
            raise ConfigError(f"--max-model-len must be at least 16 tokens, got {max_model_len}")
        cached_load_time = parse_duration(a.cached_load_time, "--cached-load-time") if opt("cached_load_time", None) is not None else None
        weights = opt("weights", "")
        if weights and not os.path.isdir(weights):
            raise ConfigError(f"--weights {weights}: not a directory on this node; the agent stages the weights before it starts the engine")
        weights_cached = bool(opt("weights_cached", False))
        if weights_cached and not weights:
            raise ConfigError("--weights-cached needs --weights, the directory the cached weights are in")
        peer_timeout = parse_duration(a.peer_timeout, "--peer-timeout") if getattr(a, "peer_timeout", None) else PEER_TIMEOUT
        if peer_timeout < 0.2:
            raise ConfigError(f"--peer-timeout must be at least 200ms, got {a.peer_timeout}")
        return cls(
            model=a.model,
            served_model=served,
            nnodes=a.nnodes,
            rank=a.rank,
            leader_addr=a.leader_addr,
            rendezvous_port=a.rendezvous_port,
            host=a.host,
            port=a.port,
            load_time=parse_duration(a.load_time, "--load-time"),
            token_rate=a.token_rate,
            on_peer_loss=a.on_peer_loss,
            ignore_sigterm=a.ignore_sigterm,
            max_num_seqs=a.max_num_seqs,
            peer_timeout=peer_timeout,
            prefill_rate=prefill_rate,
            kv_cache_tokens=kv_cache_tokens,
            block_size=block_size,
            max_model_len=max_model_len,
            cached_load_time=cached_load_time,
            weights=weights,
            weights_cached=weights_cached,
        )


def main(args: argparse.Namespace) -> int:
    cfg = SimConfig.from_args(args)
    if cfg.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        # Until the event loop takes over, a SIGTERM still means a clean exit 0.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return asyncio.run(_run(cfg))


async def _forever() -> None:
    await asyncio.Event().wait()


async def _run(cfg: SimConfig) -> int:
    log = logging.getLogger(f"llmgw.sim.rank{cfg.rank}")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        log.info("%s: stopping", sig.name)
        stop.set()

    for sig in (signal.SIGINT,) if cfg.ignore_sigterm else (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    if cfg.ignore_sigterm:
        log.info("ignoring SIGTERM (--ignore-sigterm); stop with SIGINT or SIGKILL")

    fatal: asyncio.Future[int] = loop.create_future()
    role = LeaderRole(cfg, log, fatal) if cfg.is_leader else WorkerRole(cfg, log)
    # Simulated faults: a silent stall (no word about peers; /health stays 200).
    loop.add_signal_handler(signal.SIGUSR1, role.stall)
    loop.add_signal_handler(signal.SIGUSR2, role.resume)
    work = asyncio.create_task(role.run())
    stopped = asyncio.create_task(stop.wait())
    try:
        waits: set[asyncio.Future[Any]] = {work, stopped, fatal}
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        # A failed start raises here; its one-line error is the whole story.
        rc = work.result() if work in done else fatal.result() if fatal in done else 0
    finally:
        stopped.cancel()
        if not work.done():
            work.cancel()
            # Not "await work": on Python 3.11 asyncio.wait_for can swallow a
            # cancellation that races its inner read completing (the peer
            # closing at the same moment, as when a whole replica is stopped),
            # and the role would then carry on into its idle wait. Bounded
            # here; asyncio.run cancels whatever is left once more.
            await asyncio.wait({work}, timeout=1.0)
        await role.close()
    log.info("stopped (exit %d)", rc)
    return rc


class LeaderRole:
    """Rank 0: rendezvous, load, then serve - and react when a worker is lost."""

    def __init__(self, cfg: SimConfig, log: logging.Logger, fatal: asyncio.Future[int]):
        self.cfg, self.log, self.fatal = cfg, log, fatal
        self.http_sock: socket.socket | None = None
        self.rendezvous: Leader | None = None
        self.runner: web.AppRunner | None = None
        self.core: EngineCore | None = None
        self._stall_pending = ""

    def stall(self) -> None:
        why = "SIGUSR1 (a simulated hung collective)"
        self.log.info("SIGUSR1: generation stalls silently from now on; /health still answers (SIGUSR2 resumes)")
        if self.core is None:
            self._stall_pending = why
        else:
            self.core.stall(why)

    def resume(self) -> None:
        self.log.info("SIGUSR2: generation resumes")
        self._stall_pending = ""
        if self.core is not None:
            self.core.resume()

    async def run(self) -> int:
        # Imported here so workers never load the HTTP and metrics stacks.
        from aiohttp import web

        from .api_server import build_app
        from .core import EngineCore
        from .metrics import EngineMetrics

        cfg = self.cfg
        if cfg.host is None or cfg.port is None:  # SimConfig.from_args requires both of a leader
            raise ConfigError("the leader (--rank 0) needs --host and --port")
        self.http_sock = http_sock = reserve("HTTP", cfg.host, cfg.port)  # held, not listening
        metrics = EngineMetrics(cfg.served_model)
        self.rendezvous = rendezvous = Leader(
            cfg.leader_addr, cfg.rendezvous_port, cfg.nnodes, cfg.model, self._peer_lost, self.log, peer_timeout=cfg.peer_timeout
        )
        collective = rendezvous.collective if cfg.nnodes > 1 else None
        self.core = core = EngineCore(
            metrics, cfg.token_rate, cfg.max_num_seqs, collective=collective,
            prefill_rate=cfg.prefill_rate, cache_tokens=cfg.kv_cache_tokens, block_size=cfg.block_size,
        )  # fmt: skip
        if self._stall_pending:
            core.stall(self._stall_pending)
        await rendezvous.start()
        await rendezvous.formed.wait()

        where = f" from {cfg.weights} ({'cached on this node' if cfg.weights_cached else 'not cached before this launch'})" if cfg.weights else ""
        self.log.info("loading %s%s across %d ranks (%s)", cfg.model, where, cfg.nnodes, format_duration(cfg.effective_load_time))
        await asyncio.sleep(cfg.effective_load_time)
        if core.broken_because:
            # Loading is collective too; with a rank gone it never completes.
            self.log.error("loading stalls: %s", core.broken_because)
            await _forever()

        app = build_app(core, metrics, served_model=cfg.served_model, model=cfg.model, log=self.log, max_model_len=cfg.max_model_len)
        self.runner = runner = web.AppRunner(app)
        await runner.setup()
        site = web.SockSite(runner, http_sock, shutdown_timeout=HTTP_SHUTDOWN_TIMEOUT)
        try:
            await site.start()
        except OSError as e:
            raise explain_bind_error("HTTP", cfg.host, cfg.port, e) from None
        host, port = http_sock.getsockname()[:2]
        self.log.info("serving %s as %r on http://%s:%d", cfg.model, cfg.served_model, host, port)
        await _forever()
        return 0

    def _peer_lost(self, rank: int, why: str) -> None:
        if self.cfg.on_peer_loss == "exit":
            self.log.error("rank %d lost (%s); exiting (--on-peer-loss exit)", rank, why)
            if not self.fatal.done():
                self.fatal.set_result(EXIT_PEER_LOST)
            return
        self.log.error("rank %d lost (%s); generation stalls from now on, as with NCCL (--on-peer-loss stall)", rank, why)
        if self.core is not None:  # made before the rendezvous that reports a loss starts
            self.core.break_group(f"rank {rank} lost: {why}")

    async def close(self) -> None:
        if self.core is not None:
            await self.core.close()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.rendezvous is not None:
            await self.rendezvous.close()
        if self.http_sock is not None:
            self.http_sock.close()


class WorkerRole:
    """Rank >= 1: join the leader, hold the link, listen on nothing."""

    def __init__(self, cfg: SimConfig, log: logging.Logger):
        self.cfg, self.log = cfg, log
        self.link: Link | None = None
        self.stalled = False
        self._held: int | None = None  # the step not acked while stalled

    def stall(self) -> None:
        self.log.info("SIGUSR1: this rank stops acking steps from now on (SIGUSR2 resumes)")
        self.stalled = True

    def resume(self) -> None:
        self.log.info("SIGUSR2: this rank acks steps again")
        self.stalled = False
        if self._held is not None and self.link is not None:
            self.link.send({"op": "ack", "n": self._held})
            self._held = None

    async def run(self) -> int:
        cfg = self.cfg
        self.link = link = await join(
            cfg.leader_addr,
            cfg.rendezvous_port,
            rank=cfg.rank,
            nnodes=cfg.nnodes,
            model=cfg.model,
            source_addr=cfg.host,
            give_up_after=JOIN_GIVE_UP_AFTER,
            log=self.log,
            peer_timeout=cfg.peer_timeout,
        )
        self.log.info("joined the leader at %s:%d as rank %d of %d", cfg.leader_addr, cfg.rendezvous_port, cfg.rank, cfg.nnodes)

        def on_message(msg: dict) -> None:
            op = msg.get("op")
            if op == "step":
                if self.stalled:
                    self._held = msg.get("n")
                else:
                    link.send({"op": "ack", "n": msg.get("n")})
            elif op == "formed":
                self.log.info("all %d ranks joined; the leader is loading", cfg.nnodes)

        why = await link.watch(on_message)
        if cfg.on_peer_loss == "exit":
            self.log.error("lost the leader (%s); exiting (--on-peer-loss exit)", why)
            return EXIT_PEER_LOST
        self.log.error("lost the leader (%s); idling until stopped, as a rank with a broken NCCL group does (--on-peer-loss stall)", why)
        await _forever()
        return 0

    async def close(self) -> None:
        if self.link is not None:
            self.link.close()
