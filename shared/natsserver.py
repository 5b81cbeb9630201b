"""Run a real nats-server under llmgw's PKI: used by ``llmgw up`` and the tests.

It creates (or reuses) an authority in ``<dir>/pki``, issues the server's own
certificate, renders the configuration from the ledger on free ports, starts the
binary, and waits until JetStream answers. ``issue`` + ``reload`` onboard an
identity into a running server; ``revoke`` + ``reload`` throw one out.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from . import natsbin, pki
from .errors import BusError
from .files import write_atomic
from .natsconf import ServerOptions, check_cluster_size, render
from .tls import TlsFiles


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class NatsServer:
    root: Path
    host: str = "127.0.0.1"
    port: int = 0
    monitor_port: int = 0
    proc: subprocess.Popen | None = None
    extra_hosts: list[str] = field(default_factory=list)
    log_file: Path | None = None  # where the server's output goes (default ROOT/nats-server.log)
    # Clustered (see NatsCluster): this server's name, its route port, every
    # server's route address, and the cluster's shared authority.
    name: str = "llmgw"
    cluster_port: int = 0
    routes: list[str] = field(default_factory=list)
    shared_pki: Path | None = None

    @property
    def pki_dir(self) -> Path:
        return self.shared_pki or self.root / "pki"

    @property
    def conf_path(self) -> Path:
        return self.root / "nats.conf"

    @property
    def url(self) -> str:
        return f"tls://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"

    @property
    def log_path(self) -> Path:
        return self.log_file or self.root / "nats-server.log"

    def prepare(self) -> None:
        """Authority, server certificate and ports; idempotent."""
        self.root.mkdir(parents=True, exist_ok=True)
        if not pki.has_ca(self.pki_dir):
            pki.init_ca(self.pki_dir)
        if not (self.pki_dir / pki.SERVER_CERT).exists():
            pki.issue_server(self.pki_dir, [self.host, "localhost", *self.extra_hosts])
        self.port = self.port or free_port(self.host)
        self.monitor_port = self.monitor_port or free_port(self.host)

    @property
    def certs_dir(self) -> Path:
        """Where issued identities go: beside the (shared) authority."""
        return self.shared_pki.parent / "certs" if self.shared_pki else self.root / "certs"

    def issue(self, name: str, role: str) -> TlsFiles:
        """Issue a certificate (not yet accepted until render + reload)."""
        issued = pki.issue(self.pki_dir, name, role, self.certs_dir / role)
        return TlsFiles(ca=str(issued.ca_path), cert=str(issued.cert_path), key=str(issued.key_path))

    def tls_for(self, name: str, role: str) -> TlsFiles:
        d = self.certs_dir / role
        return TlsFiles(ca=str(self.pki_dir / pki.CA_CERT), cert=str(d / f"{name}.pem"), key=str(d / f"{name}-key.pem"))

    def render(self) -> None:
        text = render(
            self.pki_dir,
            ServerOptions(
                listen=f"{self.host}:{self.port}",
                monitor=f"{self.host}:{self.monitor_port}",
                store_dir=str(self.root / "jetstream"),
                pid_file=str(self.root / "nats-server.pid"),
                server_name=self.name,
                cluster_listen=f"{self.host}:{self.cluster_port}" if self.routes else None,
                routes=list(self.routes),
            ),
        )
        write_atomic(self.conf_path, text, mode=0o600)

    def start(self, timeout: float = 15.0) -> None:
        self.prepare()
        self.render()
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the process on the rendered config without waiting (a cluster's
        members wait for each other: none is healthy before a majority is up)."""
        binary = natsbin.find()
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [binary, "-c", str(self.conf_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def kill(self) -> None:
        """SIGKILL, as a machine dies: no goodbye to clients or peers."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def wait_ready(self, timeout: float = 15.0, *, js_current: bool = False) -> None:
        """Until /healthz answers 200: JetStream enabled, or (``js_current``, for a
        cluster member) also in contact with a meta leader and its assets current."""
        deadline = time.monotonic() + timeout
        url = f"{self.monitor_url}/healthz" + ("" if js_current else "?js-enabled-only=true")
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc and self.proc.poll() is not None:
                raise BusError(f"nats-server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError) as e:
                last = str(e)
            time.sleep(0.05)
        raise BusError(f"nats-server not ready after {timeout:.0f}s ({last}); see {self.log_path}")

    def reload(self) -> None:
        """Re-render from the ledger and signal the server to apply it."""
        self.render()
        if not self.proc or self.proc.poll() is not None:
            raise BusError("nats-server is not running")
        # nats-server applies a reload asynchronously: return once it has (its
        # config_load_time moves when the reload is complete), not after a guessed
        # pause that a loaded machine outlasts.
        before = self._config_load_time()
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BusError(f"nats-server exited with {self.proc.returncode} on reload; see {self.log_path}")
            now = self._config_load_time()
            if now is not None and now != before:
                return
            time.sleep(0.01)
        raise BusError(f"nats-server did not apply the reload within 15s; see {self.log_path}")

    def _config_load_time(self) -> str | None:
        import json

        try:
            with urllib.request.urlopen(f"{self.monitor_url}/varz", timeout=2) as r:
                return str(json.load(r).get("config_load_time", ""))
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def stop(self, timeout: float = 5.0) -> None:
        if not self.proc or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)


@dataclass
class NatsCluster:
    """N nats-servers (1, or odd from 3) under one authority, routes over mutual TLS.

    Each member lives in ``ROOT/<name>`` (config, JetStream store, log) and
    listens on its own loopback address (``hosts``, e.g. 127.0.0.1-3) or, when
    the hosts repeat, on its own ports. ``kill(i)`` / ``restart(i)`` stop one as
    a machine dies and start it again on the same config and store.
    """

    root: Path
    size: int = 3
    hosts: list[str] = field(default_factory=list)
    members: list[NatsServer] = field(default_factory=list)

    @property
    def pki_dir(self) -> Path:
        return self.root / "pki"

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    def prepare(self) -> None:
        check_cluster_size(self.size)
        self.root.mkdir(parents=True, exist_ok=True)
        hosts = self.hosts or ["127.0.0.1"] * self.size
        if len(hosts) != self.size:
            raise BusError(f"{len(hosts)} hosts for {self.size} servers")
        if not pki.has_ca(self.pki_dir):
            pki.init_ca(self.pki_dir)
        if not self.members:
            self.members = [NatsServer(root=self.root / f"nats{i + 1}", host=h, name=f"nats{i + 1}", shared_pki=self.pki_dir) for i, h in enumerate(hosts)]
        for m in self.members:
            m.root.mkdir(parents=True, exist_ok=True)
            m.port = m.port or free_port(m.host)
            m.monitor_port = m.monitor_port or free_port(m.host)
            if self.size > 1:
                m.cluster_port = m.cluster_port or free_port(m.host)
        if not (self.pki_dir / pki.SERVER_CERT).exists():
            pki.issue_server(self.pki_dir, [*sorted(set(hosts)), "localhost"])
        routes = [f"{m.host}:{m.cluster_port}" for m in self.members] if self.size > 1 else []
        for m in self.members:
            m.routes = routes
            cert, _ = pki.route_cert_paths(self.pki_dir, m.name)
            if routes and not cert.exists():
                pki.issue_route(self.pki_dir, m.name, [m.host, "localhost"])

    def issue(self, name: str, role: str) -> TlsFiles:
        issued = pki.issue(self.pki_dir, name, role, self.root / "certs" / role)
        return TlsFiles(ca=str(issued.ca_path), cert=str(issued.cert_path), key=str(issued.key_path))

    def tls_for(self, name: str, role: str) -> TlsFiles:
        d = self.root / "certs" / role
        return TlsFiles(ca=str(self.pki_dir / pki.CA_CERT), cert=str(d / f"{name}.pem"), key=str(d / f"{name}-key.pem"))

    def render(self) -> None:
        for m in self.members:
            m.render()

    def start(self, timeout: float = 30.0) -> None:
        self.prepare()
        self.render()
        for m in self.members:
            m.launch()
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for m in self.members:
            if m.proc is None or m.proc.poll() is None:
                m.wait_ready(max(1.0, deadline - time.monotonic()), js_current=True)

    def kill(self, index: int) -> None:
        self.members[index].kill()

    def restart(self, index: int, timeout: float = 30.0) -> None:
        m = self.members[index]
        m.launch()
        m.wait_ready(timeout, js_current=True)

    def reload(self) -> None:
        """Re-render every member from the ledger and have each running one apply it."""
        for m in self.members:
            if m.proc and m.proc.poll() is None:
                m.reload()
            else:
                m.render()

    def stop(self, timeout: float = 5.0) -> None:
        for m in self.members:
            m.stop(timeout)
