"""Builders and process hygiene for the agent's and supervisor's tests.

The tests run real engines (``llmgw engine sim``) in sessions of their own,
exactly as the agent starts them, so ending the test's process tree does not
end them: ``kill_engines`` does, from the pid files in the work dir, and every
fixture that starts engines calls it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

from llmgw.services.agent.enginedir import EngineDir
from llmgw.shared import procfs
from llmgw.shared import subjects as S
from llmgw.shared.errors import WireError
from llmgw.shared.natsserver import free_port
from llmgw.shared.schemas import Heartbeat, Inventory, LaunchCommand, StatusReport, decode
from llmgw.shared.tls import TlsFiles

from .waiting import eventually as _eventually

PYTHON = sys.executable
GPU_NAME = "NVIDIA H200"
GPU_MIB = 143771
HCAS = ("mlx5_0", "mlx5_1")


def gpu_uuid(node: str, index: int) -> str:
    return f"GPU-{zlib.crc32(node.encode()):08x}-63cc-b45e-8ae5-d8c543a4{index:04d}"


def bus_id(index: int) -> str:
    return f"00000000:{0x18 + 0x10 * index:02X}:00.0"


# --------------------------------------------------------------------------
# builders
# --------------------------------------------------------------------------


def make_launch(
    replica_id: str = "r1",
    *,
    generation: int = 1,
    rank: int = 0,
    nnodes: int = 1,
    gpus: tuple[int, ...] = (0,),
    rendezvous_port: int | None = None,
    http_port: int | None = None,
    load_time: str = "0.2s",
    extra: tuple[str, ...] = (),
) -> LaunchCommand:
    return LaunchCommand(
        replica_id=replica_id,
        generation=generation,
        deployment="chat",
        model="sim-7b",
        engine="sim",
        nnodes=nnodes,
        rank=rank,
        leader_addr="127.0.0.1",
        rendezvous_port=rendezvous_port or free_port(),
        http_port=http_port or free_port(),
        gpus=list(gpus),
        engine_args=["--load-time", load_time, *extra],
    )


def fake_nvidia_smi(path: Path, node: str, count: int = 8) -> Path:
    """A shell script answering the agent's query like nvidia-smi on an H200 node."""
    lines = "\n".join(f"{i}, {gpu_uuid(node, i)}, {GPU_NAME}, {GPU_MIB}, {bus_id(i)}" for i in range(count))
    path.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        "  *--query-gpu=index,uuid,name,memory.total,pci.bus_id*--format=csv,noheader,nounits*) ;;\n"
        '  *) echo "fake nvidia-smi: unexpected arguments: $*" >&2; exit 2;;\n'
        "esac\n"
        f"cat <<'CSV'\n{lines}\nCSV\n"
    )
    path.chmod(0o755)
    return path


def fake_ib_root(root: Path, hcas: tuple[str, ...] = HCAS) -> Path:
    """``/sys/class/infiniband`` as sysfs shows two ACTIVE HDR ports."""
    for h in hcas:
        port = root / h / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text("4: ACTIVE\n")
        (port / "phys_state").write_text("5: LinkUp\n")
        (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
        (port / "link_layer").write_text("InfiniBand\n")
    return root


def write_agent_yaml(
    path: Path,
    *,
    node_id: str,
    server: str,
    tls: TlsFiles,
    work_dir: Path,
    nvidia_smi: Path,
    ib_root: Path,
    fabric: str = "ib-a",
    hcas: tuple[str, ...] = HCAS,
    mgmt_addr: str = "127.0.0.1",
    inventory_interval: str | None = None,
) -> Path:
    """An agent.yaml in the shape onboard-node.sh writes, with test timings."""
    path.write_text(
        f"""# {node_id}
#
# Written the way onboard-node.sh writes it, with timings compressed for tests.
node_id: {node_id}
server: "{server}"
tls:
  ca: {tls.ca}
  cert: {tls.cert}
  key: {tls.key}
mgmt_addr: "{mgmt_addr}"
mgmt_interface: lo
heartbeat_interval: 500ms
reconnect_base: 100ms
reconnect_max: 1s
{f"inventory_interval: {inventory_interval}" if inventory_interval else ""}
fabrics:
  - name: {fabric}
    hcas: [{", ".join(hcas)}]
discovery:
  nvidia_smi: "{nvidia_smi}"
  ib_root: {ib_root}
  prefer_nvml: false
  skip_gpus: false
supervisor:
  work_dir: {work_dir}
  log_lines: 40
  # Generous: a clean stop must end in exit 0 even on a loaded CI machine;
  # the SIGKILL escalation has its own test with an engine that ignores SIGTERM.
  stop_timeout: 5s
  health_interval: 200ms
"""
    )
    return path


# --------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------


def recorded_engines(work_dir: Path) -> dict[str, tuple[int, int]]:
    """engine dir name -> (pid, start time), from the pid files."""
    out = {}
    root = Path(work_dir) / "engines"
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        try:
            rec = EngineDir(d).read_pid()
        except (WireError, OSError):
            continue
        if rec is not None:
            out[d.name] = (rec.pid, rec.start_time)
    return out


def kill_engines(work_dir: Path) -> None:
    """SIGKILL every engine group and wrapper recorded under ``work_dir`` that is still the recorded process."""
    root = Path(work_dir) / "engines"
    if not root.is_dir():
        return
    for d in root.iterdir():
        try:
            rec = EngineDir(d).read_pid()
        except (WireError, OSError):
            continue
        if rec is None:
            continue
        procfs.signal_group(rec.pid, rec.start_time, signal.SIGKILL)
        if rec.wrapper_pid and procfs.is_alive(rec.wrapper_pid, rec.wrapper_start_time):
            try:
                os.kill(rec.wrapper_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def group_alive(pid: int, started: int) -> bool:
    """Is the engine still there, or anything left in its process group?"""
    if procfs.is_alive(pid, started):
        return True
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Members may be zombies awaiting their reaper: those are dead.
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = procfs.stat(int(entry))
            if st and st.pgid == pid and st.state not in ("Z", "X"):
                return True
    return False


async def eventually(check: Callable[[], object], what: str, timeout: float = 20.0, step: float = 0.05):
    """Poll ``check`` until it returns something truthy; fail naming ``what`` and the last value seen."""
    return await _eventually(check, what=what, timeout=timeout, interval=step)


class AgentProcess:
    """``python -m llmgw.services agent --config …`` as a real subprocess, logging to a file."""

    def __init__(self, config: Path, log_path: Path):
        self.config, self.log_path = config, log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> AgentProcess:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [PYTHON, "-m", "llmgw.services", "agent", "--config", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def terminate(self, timeout: float = 15.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


class Tap:
    """An operator listening to everything one node publishes, decoded."""

    def __init__(self, node: str):
        self.node = node
        self.inventories: list[Inventory] = []
        self.heartbeats: list[Heartbeat] = []
        self.statuses: list[StatusReport] = []
        self.order: list[tuple[str, object]] = []  # (kind, message) in arrival order

    async def start(self, nc) -> Tap:
        """Subscribe on ``nc``, a connection under an operator identity."""
        kinds = {S.inventory(self.node): ("inventory", Inventory, self.inventories),
                 S.heartbeat(self.node): ("heartbeat", Heartbeat, self.heartbeats),
                 S.status(self.node): ("status", StatusReport, self.statuses)}  # fmt: skip

        async def cb(msg):
            kind, schema, into = kinds[msg.subject]
            m = decode(msg.data, schema)
            into.append(m)
            self.order.append((kind, m))

        await nc.subscribe(S.node_space(self.node), cb=cb)
        await nc.flush()
        return self

    def engine(self, replica_id: str, rank: int, boot_id: str | None = None):
        """The latest fact about one engine, from any report (optionally of one boot)."""
        for r in reversed(self.statuses):
            if boot_id and r.boot_id != boot_id:
                continue
            for f in r.engines:
                if f.replica_id == replica_id and f.rank == rank:
                    return f
        return None


class CuttableLink:
    """A TCP forwarder between the agent and the server that the test can cut.

    A real network fault, seen only by the agent: the operator watching stays
    connected to the server directly, so it sees everything the agent sends
    once the link is back, and nothing is lost to its own reconnect.
    """

    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.port = free_port()
        self.up = True
        self._conns: set[asyncio.StreamWriter] = set()
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"tls://127.0.0.1:{self.port}"

    async def start(self) -> CuttableLink:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.up:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._conns |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._conns -= {writer, up_writer}

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()

    def cut(self) -> None:
        """Drop every connection and refuse new ones until ``restore``."""
        self.up = False
        for w in list(self._conns):
            w.transport.abort()

    def restore(self) -> None:
        self.up = True

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
