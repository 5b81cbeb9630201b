"""``llmgw gateway --workers N``: N gateway processes on one port.

Each worker is a whole, independent gateway (``service.Gateway``): its own NATS
connection, its own mirrors of the records, its own router and upstream pools,
its own listening socket bound with ``SO_REUSEPORT`` on the same address, so the
kernel spreads new connections over them (by a hash of the connection's
addresses). Routing needs no coordination: prefix ownership is rendezvous
hashing over the replica ids every gateway mirrors, the same in every worker;
only the load counts are per worker, as they are per gateway.

The parent does no serving. The configuration was checked whole when it was read
(``shared/config.py``: listen addresses, the HTTPS pair, the key file), so a bad
file is one error, not N crash loops. The parent, started by ``service.main``
(the command's one entry point), reserves the port (a bound, never-listening
``SO_REUSEPORT`` socket: with ``listen: HOST:0`` every worker gets the same port,
and the port stays ours while a worker restarts), starts the workers, and then:

* restarts a worker that exits when not asked to (after ``RESTART_DELAY``,
  doubling up to ``RESTART_MAX`` while it keeps dying within ``STABLE_AFTER``
  of its start), and says so;
* forwards SIGTERM, SIGINT and SIGHUP (API key reload) to every worker;
* exits once it was told to stop and every worker is gone (0, or 1 if a
  worker did not exit cleanly).

Metrics: each worker serves its own ``/metrics``; with ``metrics_listen:
HOST:PORT`` worker *i* listens on ``PORT + i`` (scrape PORT .. PORT+N-1). The
API port's ``/metrics`` answers from whichever worker took the connection.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

from msgspec.structs import replace  # the configuration is msgspec Structs (shared/structconf.py)

from llmgw.shared.config import ServiceConfig, parse_listen
from llmgw.shared.errors import ConfigError

log = logging.getLogger("llmgw.gateway.workers")

RESTART_DELAY = 0.5
RESTART_MAX = 10.0
STABLE_AFTER = 10.0  # a worker up this long had a good run: its next restart waits RESTART_DELAY again
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def reserve(host: str, port: int) -> socket.socket:
    """A bound (not listening) SO_REUSEPORT socket on ``host:port``: it fixes the port the workers share."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ConfigError(f"gateway.listen {host}:{port}: {e.strerror}") from None
    s = socket.socket(family, kind, proto)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind(addr)
    except OSError as e:
        s.close()
        raise ConfigError(f"gateway.listen {host}:{port}: {e.strerror or e}") from None
    return s


def worker_config(cfg: ServiceConfig, index: int, port: int) -> ServiceConfig:
    """Worker ``index``'s configuration: the shared port, and its own metrics port (base + index)."""
    host, _ = parse_listen(cfg.gateway.listen)
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    metrics = cfg.metrics_listen
    if metrics:
        mhost, _, mport = metrics.rpartition(":")  # HOST:PORT, checked when the file was read
        metrics = f"{mhost}:{int(mport) + index}" if int(mport) else metrics  # port 0: any, each its own
        if int(mport) + index > 65535:
            raise ConfigError(f"{cfg.source}: metrics_listen {cfg.metrics_listen}: worker {index} would need port {int(mport) + index}")
    return replace(cfg, metrics_listen=metrics, gateway=replace(cfg.gateway, listen=listen, workers=1))


class Supervisor:
    def __init__(self, args, cfg: ServiceConfig, n: int):
        self.args = args
        self.cfg = cfg
        self.n = n
        # The files and addresses were checked when the configuration was read; what
        # depends on N is checked here: the last worker's metrics port fits.
        worker_config(cfg, n - 1, 1)
        host, port = parse_listen(cfg.gateway.listen)
        self.sock = reserve(host, port)
        self.port = self.sock.getsockname()[1]
        self.procs: dict[int, subprocess.Popen] = {}
        self.started: dict[int, float] = {}
        self.delay: dict[int, float] = {}
        self.stopping = False
        self.unclean = False

    def argv(self, index: int) -> list[str]:
        level = getattr(self.args, "log_level", None) or "info"
        return [sys.executable, "-m", "llmgw.services", "--log-level", level, "gateway", "-c", str(self.args.config), "--worker", f"{index}:{self.port}"]

    def spawn(self, index: int) -> None:
        self.procs[index] = subprocess.Popen(self.argv(index), stdin=subprocess.DEVNULL)
        self.started[index] = time.monotonic()

    def forward(self, signum, _frame=None) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            self.stopping = True
        for p in list(self.procs.values()):
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    def run(self) -> int:
        for sig in _FORWARDED:
            signal.signal(sig, self.forward)
        for i in range(self.n):
            self.spawn(i)
        log.info("gateway: %d workers on port %d (pids %s)", self.n, self.port, " ".join(str(p.pid) for p in self.procs.values()))
        restarts: dict[int, float] = {}  # index -> when to start it again
        while self.procs or (restarts and not self.stopping):
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid, status = 0, 0
            if pid == 0:
                now = time.monotonic()
                for i, when in list(restarts.items()):
                    if self.stopping:
                        del restarts[i]
                    elif now >= when:
                        del restarts[i]
                        self.spawn(i)
                        log.warning("gateway worker %d restarted (pid %d)", i, self.procs[i].pid)
                time.sleep(0.05)
                continue
            index = next((i for i, p in self.procs.items() if p.pid == pid), None)
            if index is None:
                continue
            proc = self.procs.pop(index)
            proc.returncode = os.waitstatus_to_exitcode(status)
            if self.stopping:
                if proc.returncode not in (0, -signal.SIGTERM, -signal.SIGINT):
                    self.unclean = True
                    log.warning("gateway worker %d (pid %d) exited with %s while stopping", index, pid, proc.returncode)
                continue
            ran = time.monotonic() - self.started[index]
            delay = RESTART_DELAY if ran >= STABLE_AFTER else min(self.delay.get(index, RESTART_DELAY / 2) * 2, RESTART_MAX)
            self.delay[index] = delay
            how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"status {proc.returncode}"
            log.warning("gateway worker %d (pid %d) exited with %s after %.1fs; restarting it in %gs", index, pid, how, ran, delay)
            restarts[index] = time.monotonic() + delay
        self.sock.close()
        return 1 if self.unclean else 0
