"""Simulated nodes for a machine with neither GPUs nor InfiniBand.

Each simulated node gets what a real node has, shaped the same way, so the
agent runs unmodified: its own certificate, a fake ``nvidia-smi`` printing its
GPUs in the real ``--format=csv,noheader,nounits`` shape, a sysfs-shaped
``ib_root`` with its fabric's HCAs ACTIVE, an ``agent.yaml`` in the seed's
format, and its own loopback address (node01 = 127.0.1.1, …) so engines bind
per node and "node02 has no port open" can be read off the kernel's socket
table. Every process of a simulated node carries ``LLMGW_SIM_NODE=<node>`` in
its environment, which is how ``kill-node`` finds the agent and all its
engines to kill them at once, as a dying machine would.

The fault verbs that target engines (``hang-engine``, ``resume-engine``,
``stall-replica``) find them the way the agent does: from the engine
directories under each node's work dir (``spec.json`` says which replica and
rank, ``pid`` which process, with its start time so a reused pid is never
signalled). Only this cluster's directory is looked at.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import string
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

from llmgw.shared import pki, procfs
from llmgw.shared.durations import format_duration
from llmgw.shared.errors import ConfigError

SIM_ENV = "LLMGW_SIM_NODE"
# Which cluster (the resolved DIR of `llmgw up`) a simulated node's processes belong to.
CLUSTER_ENV = "LLMGW_SIM_CLUSTER"
HCAS_PER_NODE = ("mlx5_0", "mlx5_1")
GPU_NAME = "NVIDIA H200"
GPU_MEMORY_MIB = 143771


@dataclass(frozen=True)
class SimNodeSpec:
    node_id: str
    fabric: str | None
    gpus: int
    mgmt_addr: str


def fabric_name(i: int) -> str:
    """ib-a, ib-b, … ib-z, ib-aa …"""
    letters = string.ascii_lowercase
    name = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        name = letters[r] + name
    return f"ib-{name}"


def layout(nodes: int = 4, fabrics: int = 2, gpus_per_node: int = 8) -> list[SimNodeSpec]:
    """The seed's shape generalised: nodes split evenly over fabrics, in order.

    ``fabrics=0`` gives nodes with no fabric (single-node replicas only).
    """
    if nodes < 1 or nodes > 250:
        raise ConfigError(f"--nodes {nodes}: between 1 and 250 simulated nodes (one loopback address each)")
    if fabrics < 0 or fabrics > nodes:
        raise ConfigError(f"--fabrics {fabrics}: between 0 and the number of nodes ({nodes})")
    if gpus_per_node < 0 or gpus_per_node > 64:
        raise ConfigError(f"--gpus-per-node {gpus_per_node}: between 0 and 64")
    out = []
    per = -(-nodes // fabrics) if fabrics else 0
    for i in range(nodes):
        fab = fabric_name(i // per) if fabrics else None
        out.append(SimNodeSpec(node_id=f"node{i + 1:02d}", fabric=fab, gpus=gpus_per_node, mgmt_addr=f"127.0.1.{i + 1}"))
    return out


def gpu_uuid(node: str, index: int) -> str:
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{node}.gpu{index}.llmgw.sim"))


def gpu_bus_id(index: int) -> str:
    return f"00000000:{0x18 + index * 0x10:02X}:00.0"


def nvidia_smi_lines(spec: SimNodeSpec) -> list[str]:
    return [f"{i}, {gpu_uuid(spec.node_id, i)}, {GPU_NAME}, {GPU_MEMORY_MIB}, {gpu_bus_id(i)}" for i in range(spec.gpus)]


def _write_exec(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


# The simulated nvidia-smi: a small Python script (run by the interpreter
# that wrote it) that answers the three queries the agent makes in the real
# output shape, reading one state file per GPU (gpu-state/<index>.json, written
# by 'llmgw sim gpu-fault' / removed by 'gpu-ok'): {"xid": 79} -> the GPU is
# lost, nvidia-smi prints "Unable to determine the device handle for GPU…"
# in its place and exits 15 (its man page: "GPU is lost"); {"xid": 48|94|95}
# or {"ecc": N} -> a non-zero uncorrected volatile ECC count; {"xid": 63|64}
# or {"pending": true} -> retired_pages.pending "Yes". Compute processes are
# the processes of this simulated machine — running in its directory (engines
# run in their engine dirs under its work dir) — with CUDA_VISIBLE_DEVICES
# set, as the driver would list them: the engines, or anything else started so.
_FAKE_SMI = r"""
import json, os, sys

NODE, STATE, HOME = {node!r}, {state!r}, {home!r}
GPUS = {gpus!r}  # [index, uuid, name, memory MiB, bus id]
ECC_XIDS, PENDING_XIDS = (48, 94, 95), (63, 64)
MIB_PER_ENGINE = 1024


def state(i):
    try:
        with open(os.path.join(STATE, f"{{i}}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {{}}


def lost(i, st):
    return st.get("xid") == 79


def apps():
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if not (os.readlink(f"/proc/{{entry}}/cwd") + "/").startswith(HOME + "/"):
                continue  # another machine's process (another node, another cluster)
            with open(f"/proc/{{entry}}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        cvd = next((e[len(b"CUDA_VISIBLE_DEVICES="):] for e in env if e.startswith(b"CUDA_VISIBLE_DEVICES=")), None)
        if not cvd:
            continue
        for tok in cvd.decode().split(","):
            if tok.strip().isdigit():
                out.append((int(entry), int(tok)))
    return out


args = sys.argv[1:]
if args == ["--llmgw-fault-dir"]:  # not the real tool's: where 'llmgw sim gpu-fault' writes
    print(STATE)
    sys.exit(0)
query = next((a for a in args if a.startswith("--query-")), "")
if not query or "--format=csv,noheader,nounits" not in args:
    print("llmgw's simulated nvidia-smi answers only --query-gpu=… and --query-compute-apps=… with --format=csv,noheader,nounits", file=sys.stderr)
    sys.exit(2)
rc = 0
if query.startswith("--query-compute-apps="):
    by_index = {{g[0]: g for g in GPUS}}
    for pid, i in apps():
        if i in by_index and not lost(i, state(i)):
            print(f"{{pid}}, {{MIB_PER_ENGINE}}, {{by_index[i][1]}}")
    sys.exit(0)
fields = query.partition("=")[2].split(",")
for index, uuid, name, mem, bus in GPUS:
    st = state(index)
    if lost(index, st):
        print(f"Unable to determine the device handle for GPU{{bus}}: Unknown Error")
        rc = 15
        continue
    xid = st.get("xid")
    ecc = int(st.get("ecc", 1 if xid in ECC_XIDS else 0))
    pending = "Yes" if st.get("pending") or xid in PENDING_XIDS else "No"
    values = {{
        "index": index, "uuid": uuid, "name": name, "memory.total": mem, "pci.bus_id": bus,
        "ecc.errors.uncorrected.volatile.total": ecc, "retired_pages.pending": pending,
    }}
    if any(f not in values for f in fields):
        bad = next(f for f in fields if f not in values)
        print(f'Field "{{bad}}" is not a valid field to query.')
        sys.exit(2)
    print(", ".join(str(values[f]) for f in fields))
sys.exit(rc)
"""


def gpu_state_dir(node_dir: Path) -> Path:
    return Path(node_dir) / "gpu-state"


def write_fake_nvidia_smi(path: Path, spec: SimNodeSpec, *, state_dir: Path | None = None, home: Path | None = None, python: str = "") -> None:
    """The node's simulated nvidia-smi at ``path``.

    ``state_dir``: where its per-GPU fault files are read (default: the node's
    directory's gpu-state/, beside bin/); ``home``: the processes whose working
    directory lies under it are this machine's (default: the node's directory;
    a node that is a machine of its own, a container, gives ``/``);
    ``python``: the interpreter that runs it (default: this one; the script
    needs only the standard library, so any Python 3 on the node will do).
    """
    import sys

    node_dir = path.parent.parent
    gpus = [[i, gpu_uuid(spec.node_id, i), GPU_NAME, GPU_MEMORY_MIB, gpu_bus_id(i)] for i in range(spec.gpus)]
    state = str(Path(state_dir or gpu_state_dir(node_dir)).resolve())
    where = str(Path(home or node_dir).resolve()).rstrip("/")
    _write_exec(
        path,
        f"#!{python or sys.executable} -I\n"
        f"# Simulated nvidia-smi for {spec.node_id}: answers --query-gpu=… and --query-compute-apps=…\n"
        "# in the real '--format=csv,noheader,nounits' shape; per-GPU faults from <state>/<index>.json.\n"
        + _FAKE_SMI.format(node=spec.node_id, state=state, home=where, gpus=gpus),
    )


def write_node_devices(
    node_dir: Path, spec: SimNodeSpec, hcas: tuple[str, ...], *, state_dir: Path | None = None, home: Path | None = None, python: str = ""
) -> None:
    """A simulated machine's devices under ``node_dir``: bin/nvidia-smi and an
    ib/ tree of ``hcas`` with their ports ACTIVE (what ``llmgw up`` and the
    compose kit's nodes both run on)."""
    write_fake_nvidia_smi(Path(node_dir) / "bin" / "nvidia-smi", spec, state_dir=state_dir, home=home, python=python)
    (Path(node_dir) / "ib").mkdir(parents=True, exist_ok=True)
    write_ib_root(Path(node_dir) / "ib", hcas)


def write_ib_root(root: Path, hcas: tuple[str, ...]) -> None:
    for hca in hcas:
        port = root / hca / "ports" / "1"
        port.mkdir(parents=True, exist_ok=True)
        (port / "state").write_text("4: ACTIVE\n")
        (port / "phys_state").write_text("5: LinkUp\n")
        (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
        (port / "link_layer").write_text("InfiniBand\n")


# --------------------------------------------------------------------------
# hardware faults of a simulated node, through the files a real node has
# --------------------------------------------------------------------------

# What each fault writes into a simulated port's sysfs files (ib_core's words).
PORT_UP = ("4: ACTIVE", "5: LinkUp")
PORT_DOWN = ("1: DOWN", "3: Disabled")
SIM_XIDS = (48, 63, 64, 79, 94, 95)


def _agent_yaml(agent_config: Path) -> dict:
    try:
        return yaml.safe_load(Path(agent_config).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{agent_config}: cannot read it: {e}") from None


def set_hca_port(agent_config: Path, hca: str, *, up: bool) -> tuple[Path, str, str]:
    """Write the ``state``/``phys_state`` files of every port of ``hca`` under
    the node's ``discovery.ib_root``; returns (port dir, state before, state now)."""
    cfg = _agent_yaml(agent_config)
    try:
        root = Path(cfg["discovery"]["ib_root"])
    except (KeyError, TypeError):
        raise ConfigError(f"{agent_config}: no discovery.ib_root") from None
    if not hca or "/" in hca or hca in (".", ".."):
        raise ConfigError(f"{hca!r} is not an HCA name")
    ports = root / hca / "ports"
    present = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    if not ports.is_dir():
        raise ConfigError(f"no HCA {hca!r} under {root} (present: {', '.join(present) or 'none'})")
    state, phys = PORT_UP if up else PORT_DOWN
    last = None
    for port in sorted(p for p in ports.iterdir() if p.name.isdigit()):
        before = (port / "state").read_text().strip() if (port / "state").exists() else ""
        # Through a temp file and rename: the agent never reads half a state.
        for name, value in (("phys_state", phys), ("state", state)):
            tmp = port / f".{name}.tmp"
            tmp.write_text(value + "\n")
            os.replace(tmp, port / name)
        last = (port, before, state)
    if last is None:
        raise ConfigError(f"HCA {hca} has no ports under {ports}")
    return last


def set_gpu_fault(agent_config: Path, index: int, *, xid: int | None = None, ecc: int | None = None) -> Path | None:
    """Make the node's simulated nvidia-smi report a fault on GPU ``index``
    (``xid``/``ecc``), or clear it (both None). Returns the state file written."""
    cfg = _agent_yaml(agent_config)
    node_dir = Path(agent_config).resolve().parent
    # The GPUs are what its nvidia-smi lists, lost ones included (one line each);
    # it says itself where it reads its faults.
    smi = str((cfg.get("discovery") or {}).get("nvidia_smi", "") or "")
    if smi and not os.path.isabs(smi):
        smi = str(node_dir / smi)  # relative to agent.yaml, as the agent reads it
    try:
        out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=15).stdout
        said = subprocess.run([smi, "--llmgw-fault-dir"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigError(f"cannot run the simulated nvidia-smi {smi!r}: {e}") from None
    if said.returncode != 0 or not said.stdout.strip():
        raise ConfigError(f"{smi} is not llmgw's simulated nvidia-smi (it does not say where it reads faults); a real GPU's faults are not made this way")
    gpus = len([line for line in out.splitlines() if line.strip()])
    if not 0 <= index < gpus:
        raise ConfigError(f"no GPU {index} on {cfg.get('node_id', node_dir.name)} (it has GPUs 0..{gpus - 1})")
    if xid is not None and xid not in SIM_XIDS:
        raise ConfigError(f"XID {xid} is not one the simulated nvidia-smi shows; choose one of {', '.join(map(str, SIM_XIDS))}")
    if ecc is not None and ecc < 0:
        raise ConfigError(f"--ecc must be a count >= 0, got {ecc}")
    d = Path(said.stdout.strip())
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot write the simulated GPU faults under {d}: {e.strerror or e}") from None
    path = d / f"{index}.json"
    if xid is None and ecc is None:
        path.unlink(missing_ok=True)
        return None
    body: dict = {}
    if xid is not None:
        body["xid"] = xid
    if ecc is not None:
        body["ecc"] = ecc
    tmp = d / f".{index}.json.tmp"
    tmp.write_text(json.dumps(body) + "\n")
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class Timings:
    heartbeat_interval: float = 5.0
    stop_timeout: float = 10.0
    health_interval: float = 1.0
    reconnect_base: float = 0.5
    reconnect_max: float = 5.0
    # The agent's progress probes; None leaves the agent's default.
    probe_interval: float | None = None
    probe_timeout: float | None = None
    stall_after: float | None = None
    # How often agents re-read their GPUs and HCAs; None leaves the agent's default (10s).
    discovery_interval: float | None = None


@dataclass(frozen=True)
class SimNode:
    spec: SimNodeSpec
    dir: Path

    @property
    def config(self) -> Path:
        return self.dir / "agent.yaml"

    @property
    def work_dir(self) -> Path:
        return self.dir / "work"

    @property
    def log(self) -> Path:
        return self.dir / "agent.log"


def write_node(root: Path, pki_dir: Path, server_url: str | list[str], spec: SimNodeSpec, timings: Timings) -> SimNode:
    """Onboard one simulated node: certificate, fake devices, agent.yaml (the seed's format)."""
    d = root / "nodes" / spec.node_id
    d.mkdir(parents=True, exist_ok=True)
    certs = d / "tls"
    if not (certs / f"{spec.node_id}.pem").exists():
        pki.issue(pki_dir, spec.node_id, "node", certs)
    write_fake_nvidia_smi(d / "bin" / "nvidia-smi", spec)
    hcas = HCAS_PER_NODE if spec.fabric else ()
    write_ib_root(d / "sys-class-infiniband", hcas)
    (d / "sys-class-infiniband").mkdir(exist_ok=True)
    config = {
        "node_id": spec.node_id,
        "server": server_url,
        "tls": {
            "ca": str((pki_dir / pki.CA_CERT).resolve()),
            "cert": str((certs / f"{spec.node_id}.pem").resolve()),
            "key": str((certs / f"{spec.node_id}-key.pem").resolve()),
        },
        "mgmt_addr": spec.mgmt_addr,
        "mgmt_interface": "lo",
        "heartbeat_interval": format_duration(timings.heartbeat_interval),
        "reconnect_base": format_duration(timings.reconnect_base),
        "reconnect_max": format_duration(timings.reconnect_max),
        "fabrics": [{"name": spec.fabric, "hcas": list(hcas)}] if spec.fabric else [],
        "discovery": {
            "nvidia_smi": str((d / "bin" / "nvidia-smi").resolve()),
            "ib_root": str((d / "sys-class-infiniband").resolve()),
            "prefer_nvml": False,
            "skip_gpus": False,
            **({"interval": format_duration(timings.discovery_interval)} if timings.discovery_interval is not None else {}),
        },
        "supervisor": {
            "work_dir": str((d / "work").resolve()),
            "log_lines": 200,
            "stop_timeout": format_duration(timings.stop_timeout),
            "health_interval": format_duration(timings.health_interval),
            **{
                k: format_duration(v)
                for k, v in (("probe_interval", timings.probe_interval), ("probe_timeout", timings.probe_timeout), ("stall_after", timings.stall_after))
                if v is not None
            },
        },
    }
    header = f"# {spec.node_id} (simulated, fabric {spec.fabric or 'none'})\n# Written by 'llmgw up' in the seed's agent.yaml format.\n"
    (d / "agent.yaml").write_text(header + yaml.safe_dump(config, sort_keys=False))
    return SimNode(spec=spec, dir=d)


def processes_of(node_id: str, cluster: str | None = None) -> list[int]:
    """Every live process (zombies are not) carrying ``LLMGW_SIM_NODE=<node_id>`` (agent and engines) —
    and, given ``cluster``, ``LLMGW_SIM_CLUSTER=<cluster>`` too: two clusters on one
    machine both have a node01, and one's ``kill-node`` or ``down`` must not touch
    the other's."""
    markers = [f"{SIM_ENV}={node_id}".encode()]
    if cluster is not None:
        markers.append(f"{CLUSTER_ENV}={cluster}".encode())
    marked: set[int] = set()
    stats: dict[int, procfs.ProcStat] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        st = procfs.stat(pid)
        if st is None or st.state in ("Z", "X"):
            continue  # gone, or dead and waiting to be reaped: nothing runs there
        stats[pid] = st
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if all(m in env for m in markers):
            marked.add(pid)
    # A process that renames itself (vLLM's VLLM::EngineCore and VLLM::Worker_PP0,
    # through setproctitle) writes its title over the memory /proc/<pid>/environ
    # reads, so its marker is gone. It is still in the session its engine's
    # wrapper leads and the process group its engine leads: every member of a
    # session or group a marked process leads is the node's too.
    return sorted(marked | {pid for pid, st in stats.items() if st.sid in marked or st.pgid in marked})


def kill_node(node_id: str, cluster: str | None = None) -> list[int]:
    """SIGKILL the agent and every engine of a simulated node at once, as a machine dies."""
    pids = [p for p in processes_of(node_id, cluster) if p != os.getpid()]
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds for ``pids`` to be gone (or zombies); those still running."""
    deadline = time.monotonic() + timeout
    left = list(pids)
    while True:
        left = [p for p in left if (st := procfs.stat(p)) is not None and st.state not in ("Z", "X")]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def cluster_env(cluster_dir, node_id: str) -> dict[str, str]:
    """The environment that marks a simulated node's agent (and, inherited, its
    engines) as this cluster's node."""
    return {SIM_ENV: node_id, CLUSTER_ENV: str(Path(cluster_dir).resolve())}


# --------------------------------------------------------------------------
# engines of a simulated node, for the fault verbs
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class SimEngine:
    """One running engine process of a simulated node, as its directory records it."""

    node_id: str
    replica_id: str
    generation: int
    rank: int
    engine: str
    pid: int
    start_time: int

    @property
    def label(self) -> str:
        role = "leader" if self.rank == 0 else "worker"
        return f"{self.replica_id} rank {self.rank}, {role}, generation {self.generation}"

    def state(self) -> str:
        """The kernel's process state letter: ``T`` for stopped, ``S``/``R`` running."""
        st = procfs.stat(self.pid)
        return st.state if st is not None and st.start_time == self.start_time else "gone"


def node_work_dir(agent_config: Path) -> Path:
    """The agent's ``supervisor.work_dir``, read from its agent.yaml."""
    try:
        cfg = yaml.safe_load(Path(agent_config).read_text()) or {}
        return Path(cfg["supervisor"]["work_dir"])
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        raise ConfigError(f"{agent_config}: cannot read supervisor.work_dir: {e}") from None


def running_engines(node_id: str, work_dir: Path) -> list[SimEngine]:
    """Every live engine recorded under ``work_dir``, newest generation first, then by rank."""
    from llmgw.shared.errors import WireError

    from ..agent.enginedir import EngineDir

    root = Path(work_dir) / "engines"
    out: list[SimEngine] = []
    if not root.is_dir():
        return out
    for path in sorted(root.iterdir()):
        if not path.is_dir() or path.name.startswith("."):
            continue
        d = EngineDir(path)
        try:
            spec, pids = d.read_spec(), d.read_pid()
        except (WireError, OSError):
            continue
        if pids is None or not procfs.is_alive(pids.pid, pids.start_time):
            continue
        c = spec.command
        out.append(SimEngine(node_id, c.replica_id, c.generation, c.rank, c.engine, pids.pid, pids.start_time))
    out.sort(key=lambda e: (e.replica_id, -e.generation, e.rank))
    return out


def vllm_engine_cores(e: SimEngine) -> list[int]:
    """The ``VLLM::EngineCore`` processes of a vLLM leader: children it starts and
    names through setproctitle (``/proc/<pid>/comm`` keeps 15 bytes of it)."""
    if not procfs.is_alive(e.pid, e.start_time):
        return []
    out = []
    for pid in sorted(procfs.tree(e.pid) - {e.pid}):
        try:
            with open(f"/proc/{pid}/comm", "rb") as f:
                if f.read().startswith(b"VLLM::EngineCor"):
                    out.append(pid)
        except OSError:
            continue
    return out


def signal_engine(e: SimEngine, sig: signal.Signals, *, group: bool = True) -> bool:
    """Send ``sig`` to the engine (its whole process group by default) if it is still that process."""
    if group:
        return procfs.signal_group(e.pid, e.start_time, sig)
    if not procfs.is_alive(e.pid, e.start_time):
        return False
    try:
        os.kill(e.pid, sig)
    except ProcessLookupError:
        return False
    return True
