"""What this node has: GPUs (nvidia-smi or NVML) and the InfiniBand HCAs of its fabrics.

GPU discovery failing is an error (``DiscoveryError``): a GPU node that cannot
see its GPUs is misconfigured, and reporting "no GPUs" would quietly take it
out of scheduling instead of saying why. A node without GPUs says so with
``discovery.skip_gpus``. HCA problems are never raised: they are facts the
scheduler needs (a fabric whose HCA is down must not get a multi-node replica),
so they are reported in the inventory and as warnings.

GPU *health* (``docs/hardware.md``) is read on every discovery too
and is never an exception either: a GPU the driver reports lost ("Unable to
determine the device handle for GPU…: GPU is lost"), with uncorrectable ECC
errors, retired pages pending or (NVML) a critical XID is listed with
``healthy=False`` and ``problem`` in the driver's words; memory held by
processes llmgw did not launch is ``foreign_mib``/``foreign_pids``. The
scheduler fails the replica holding an unhealthy GPU and places nothing on it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from llmgw.shared.addresses import Resolution, resolve_mgmt
from llmgw.shared.errors import LlmgwError
from llmgw.shared.names import hca_problem
from llmgw.shared.schemas import FabricMembership, Gpu, Hca, HcaPort

from .config import AgentConfig

log = logging.getLogger("llmgw.agent.discovery")

__all__ = [
    "NVIDIA_SMI_ARGS",
    "Discovery",
    "DiscoveryError",
    "discover",
    "parse_compute_apps_csv",
    "parse_gpu_health_csv",
    "parse_nvidia_smi_csv",
    "query_nvidia_smi",
    "query_nvml",
    "read_hca",
    "split_device_errors",
]

QUERY_FIELDS = ("index", "uuid", "name", "memory.total", "pci.bus_id")
NVIDIA_SMI_ARGS = (f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits")
NVIDIA_SMI_TIMEOUT = 15.0
# Health, per GPU (``nvidia-smi --help-query-gpu``): the volatile uncorrected
# ECC count (since the driver loaded) and whether retired pages are pending a
# reset. "[N/A]" where the GPU has no ECC or uses row remapping instead.
HEALTH_FIELDS = ("index", "pci.bus_id", "ecc.errors.uncorrected.volatile.total", "retired_pages.pending")
HEALTH_ARGS = (f"--query-gpu={','.join(HEALTH_FIELDS)}", "--format=csv,noheader,nounits")
# Processes using GPUs, to find memory held by processes llmgw did not start.
APPS_FIELDS = ("pid", "used_memory", "gpu_uuid")
APPS_ARGS = (f"--query-compute-apps={','.join(APPS_FIELDS)}", "--format=csv,noheader,nounits")
# What nvidia-smi prints for a GPU it cannot open (fallen off the bus, XID 79):
# "Unable to determine the device handle for GPU0000:38:00.0: Unknown Error",
# or "...: GPU is lost.  Reboot the system to recover this GPU".
_DEVICE_ERROR = re.compile(r"unable to determine the device handle for gpu\s*([0-9a-fA-F:.]+)\s*:\s*(.*)", re.IGNORECASE)
# Critical XIDs (NVIDIA's XID catalog, docs/hardware.md): the GPU takes no new
# work and the replica on it fails.
CRITICAL_XIDS = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    94: "contained ECC error",
    95: "uncontained ECC error",
}

# What nvidia-smi and NVML print where a value does not apply (MIG, vGPU, …).
_NOT_AVAILABLE = {"[n/a]", "n/a", "[not supported]", "not supported", "[unknown error]", ""}

_MIB = 1024 * 1024


class DiscoveryError(LlmgwError):
    """GPUs could not be listed; the message names the tool and what it said."""

    code = "discovery"


@dataclass
class Discovery:
    gpus: list[Gpu] = field(default_factory=list)
    hcas: list[Hca] = field(default_factory=list)
    fabrics: list[FabricMembership] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # What mgmt_addr resolves to, and which of those are this machine's:
    # looked up at every discovery, so a DNS change is seen within one interval.
    mgmt: Resolution | None = None


# --------------------------------------------------------------------------
# nvidia-smi
# --------------------------------------------------------------------------


def _memory_mib(text: str, lineno: int, line: str) -> int | None:
    value = text.strip()
    if value.lower() in _NOT_AVAILABLE:
        return None
    if value.endswith("MiB"):  # the same query without "nounits"
        value = value[:-3].strip()
    try:
        mib = int(value)
    except ValueError:
        raise DiscoveryError(f"nvidia-smi output line {lineno}: memory.total {text.strip()!r} is not a number of MiB: {line!r}") from None
    if mib < 0:
        raise DiscoveryError(f"nvidia-smi output line {lineno}: negative memory.total {mib}: {line!r}")
    return mib


def parse_nvidia_smi_csv(text: str) -> list[Gpu]:
    """GPUs from ``nvidia-smi --query-gpu=index,uuid,name,memory.total,pci.bus_id --format=csv,noheader,nounits``.

    Tolerates what real output varies in: blank lines, spaces around fields,
    ``[N/A]`` memory (MIG, vGPU: reported as None), Windows line ends, and the
    header line and ``MiB`` units of the same query run without
    ``noheader,nounits``. Anything else is an error naming the line, never a
    GPU with a guessed field.
    """
    gpus: list[Gpu] = []
    seen: dict[int, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        fields = [f.strip() for f in line.split(",")]
        if fields[0].lower() == "index":
            continue  # a header: "index, uuid, name, memory.total [MiB], pci.bus_id"
        if len(fields) != len(QUERY_FIELDS):
            raise DiscoveryError(
                f"nvidia-smi output line {lineno}: expected {len(QUERY_FIELDS)} comma-separated fields ({', '.join(QUERY_FIELDS)}), got {len(fields)}: {line!r}"
            )
        index_s, uuid, name, memory, bus_id = fields
        try:
            index = int(index_s)
        except ValueError:
            raise DiscoveryError(f"nvidia-smi output line {lineno}: index {index_s!r} is not a number: {line!r}") from None
        if index < 0:
            raise DiscoveryError(f"nvidia-smi output line {lineno}: negative index {index}: {line!r}")
        if index in seen:
            raise DiscoveryError(f"nvidia-smi output line {lineno}: GPU index {index} already seen on line {seen[index]}")
        if uuid.lower() in _NOT_AVAILABLE or not name:
            raise DiscoveryError(f"nvidia-smi output line {lineno}: GPU {index} has no uuid or name: {line!r}")
        seen[index] = lineno
        gpus.append(
            Gpu(
                index=index,
                uuid=uuid,
                name=name,
                memory_mib=_memory_mib(memory, lineno, line),
                pci_bus_id="" if bus_id.lower() in _NOT_AVAILABLE else bus_id,
            )
        )
    return gpus


def split_device_errors(text: str) -> tuple[str, dict[str, str]]:
    """``text`` without nvidia-smi's per-GPU "Unable to determine the device
    handle" lines, and those errors by PCI bus id (upper case, as listed):
    ``{"00000000:38:00.0": "Unknown Error"}``. nvidia-smi prints such a line
    in place of a GPU it cannot open (one that fell off the bus) and lists the
    others as usual."""
    kept, errors = [], {}
    for line in text.splitlines():
        m = _DEVICE_ERROR.search(line)
        if m:
            errors[_bus_key(m.group(1))] = m.group(2).strip() or "unknown error"
        else:
            kept.append(line)
    return "\n".join(kept), errors


def _bus_key(bus_id: str) -> str:
    """PCI bus ids compare without case and without the domain's leading zeros
    (nvidia-smi prints ``00000000:38:00.0``, its error lines ``0000:38:00.0``)."""
    bus_id = bus_id.strip().rstrip(".:").upper()
    domain, sep, rest = bus_id.partition(":")
    return f"{int(domain, 16):08X}:{rest}" if sep and rest.count(":") == 1 and all(c in "0123456789ABCDEF" for c in domain) else bus_id


def parse_gpu_health_csv(text: str) -> dict[int, str]:
    """GPU index -> problem ("" when healthy), from
    ``nvidia-smi --query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total,retired_pages.pending --format=csv,noheader,nounits``.

    ``[N/A]`` (no ECC, or row remapping instead of page retirement) is no
    problem. A line of another shape is an error naming it.
    """
    out: dict[int, str] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        fields = [f.strip() for f in line.split(",")]
        if fields[0].lower() == "index":
            continue
        if len(fields) != len(HEALTH_FIELDS):
            raise DiscoveryError(
                f"nvidia-smi health line {lineno}: expected {len(HEALTH_FIELDS)} fields ({', '.join(HEALTH_FIELDS)}), got {len(fields)}: {line!r}"
            )
        index_s, _bus, ecc, pending = fields
        try:
            index = int(index_s)
        except ValueError:
            raise DiscoveryError(f"nvidia-smi health line {lineno}: index {index_s!r} is not a number: {line!r}") from None
        problems = []
        if ecc.lower() not in _NOT_AVAILABLE:
            try:
                n = int(ecc)
            except ValueError:
                raise DiscoveryError(f"nvidia-smi health line {lineno}: ECC count {ecc!r} is not a number: {line!r}") from None
            if n > 0:
                problems.append(f"{n} uncorrectable ECC error{'s' if n != 1 else ''} (volatile)")
        if pending.lower() in ("yes", "1", "true"):
            problems.append("retired pages pending (a GPU reset retires them)")
        out[index] = "; ".join(problems)
    return out


def parse_compute_apps_csv(text: str) -> list[tuple[int, int, str]]:
    """(pid, used MiB, GPU uuid) from
    ``nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader,nounits``.
    No process prints nothing (or "No running processes found")."""
    out = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.lower().startswith(("pid", "no running")):
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != len(APPS_FIELDS):
            raise DiscoveryError(f"nvidia-smi compute-apps line {lineno}: expected pid, used_memory, gpu_uuid, got {line!r}")
        pid_s, mem, uuid = fields
        try:
            pid = int(pid_s)
        except ValueError:
            raise DiscoveryError(f"nvidia-smi compute-apps line {lineno}: pid {pid_s!r} is not a number: {line!r}") from None
        mem = mem[:-3].strip() if mem.endswith("MiB") else mem
        used = int(mem) if mem.isdigit() else 0  # "[N/A]" without the right to see it
        out.append((pid, used, uuid))
    return out


def _trim(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _resolve_nvidia_smi(path_or_empty: str) -> str:
    if path_or_empty and "/" in path_or_empty:
        p = Path(path_or_empty)
        if not p.exists():
            raise DiscoveryError(f"nvidia-smi: {p} (discovery.nvidia_smi) does not exist")
        if not p.is_file() or not os.access(p, os.X_OK):
            raise DiscoveryError(f"nvidia-smi: {p} (discovery.nvidia_smi) is not an executable file")
        return str(p)
    name = path_or_empty or "nvidia-smi"
    found = shutil.which(name)
    if not found:
        raise DiscoveryError(
            f"{name} not found on PATH ({os.environ.get('PATH', '')}); set discovery.nvidia_smi to its full path "
            "(containerized driver installs often put it elsewhere), or discovery.skip_gpus on a node without GPUs"
        )
    return found


def _run_smi(binary: str, args: tuple[str, ...], timeout: float) -> tuple[int, str, str]:
    """Run nvidia-smi in its own session, so that a timeout kills it and anything
    it started; a process that will not die (stuck in the driver, which happens
    when a GPU falls off the bus) is abandoned rather than waited for."""
    argv = [binary, *args]
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )
    except OSError as e:
        raise DiscoveryError(f"cannot run {binary}: {e.strerror or e}") from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.communicate(timeout=2.0)
            stuck = ""
        except subprocess.TimeoutExpired:
            stuck = "; it did not die on SIGKILL either (stuck in the driver?) and was abandoned"
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        raise DiscoveryError(f"{binary} did not answer within {timeout:g}s and was killed{stuck}") from None
    return proc.returncode, out, err


def _failed(binary: str, rc: int, out: str, err: str) -> DiscoveryError:
    said = _trim(err) or _trim(out)
    how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
    return DiscoveryError(f"{binary} {how}: {said or '(no output)'}")


def query_nvidia_smi_lost(path_or_empty: str = "", *, timeout: float = NVIDIA_SMI_TIMEOUT, strict: bool = True) -> tuple[list[Gpu], dict[str, str]]:
    """The GPUs nvidia-smi lists, and the ones it cannot open by PCI bus id.

    A GPU that fell off the bus makes nvidia-smi print "Unable to determine
    the device handle for GPU…" in its place and exit non-zero; the others are
    still listed, so that is not a failure of discovery but a fact about one GPU.
    """
    binary = _resolve_nvidia_smi(path_or_empty)
    rc, out, err = _run_smi(binary, NVIDIA_SMI_ARGS, timeout)
    out, lost_out = split_device_errors(out)
    err, lost_err = split_device_errors(err)
    lost = {**lost_out, **lost_err}
    if rc != 0 and not lost:
        # With a driver but no GPU, nvidia-smi says so on stdout and exits non-zero (6).
        if "no devices were found" in (out + err).lower():
            return [], {}
        raise _failed(binary, rc, out, err)
    try:
        gpus = parse_nvidia_smi_csv(out)
    except DiscoveryError as e:
        raise DiscoveryError(f"{binary}: {e}") from None
    if rc != 0 and not gpus and (strict or not lost):
        raise _failed(binary, rc, out, "\n".join(f"Unable to determine the device handle for GPU{b}: {m}" for b, m in lost.items()))
    return gpus, lost


def query_nvidia_smi(path_or_empty: str = "", *, timeout: float = NVIDIA_SMI_TIMEOUT) -> list[Gpu]:
    """Run nvidia-smi (the configured path, else the one on PATH) and parse its GPUs.

    A GPU nvidia-smi cannot open is left out (``query_nvidia_smi_lost`` names
    it); when it can open none and exits non-zero, that is an error.
    """
    return query_nvidia_smi_lost(path_or_empty, timeout=timeout)[0]


def query_nvidia_smi_health(path_or_empty: str = "", *, timeout: float = NVIDIA_SMI_TIMEOUT) -> dict[int, str]:
    """GPU index -> problem ("" if none) from nvidia-smi's ECC and retired-page fields."""
    binary = _resolve_nvidia_smi(path_or_empty)
    rc, out, err = _run_smi(binary, HEALTH_ARGS, timeout)
    out, _lost = split_device_errors(out)  # lost GPUs are found by the inventory query
    if rc != 0 and not _lost and not split_device_errors(err)[1]:
        raise _failed(binary, rc, out, err)
    return parse_gpu_health_csv(out)


def query_compute_apps(path_or_empty: str = "", *, timeout: float = NVIDIA_SMI_TIMEOUT) -> list[tuple[int, int, str]]:
    binary = _resolve_nvidia_smi(path_or_empty)
    rc, out, err = _run_smi(binary, APPS_ARGS, timeout)
    out, _lost = split_device_errors(out)
    if rc != 0 and not _lost and not split_device_errors(err)[1]:
        raise _failed(binary, rc, out, err)
    return parse_compute_apps_csv(out)


# --------------------------------------------------------------------------
# NVML
# --------------------------------------------------------------------------


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def query_nvml() -> list[Gpu]:
    """GPUs through NVML (``pynvml`` from the ``nvidia-ml-py`` package)."""
    try:
        import pynvml
    except ImportError:
        raise DiscoveryError(
            "NVML discovery needs the nvidia-ml-py package, which is not installed: pip install 'llmgw[nvml]' "
            "(or set discovery.prefer_nvml: false to use nvidia-smi)"
        ) from None
    nvml_error = getattr(pynvml, "NVMLError", Exception)
    try:
        pynvml.nvmlInit()
    except nvml_error as e:
        raise DiscoveryError(f"NVML could not be initialised: {e}") from None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                memory: int | None = int(pynvml.nvmlDeviceGetMemoryInfo(h).total) // _MIB
            except nvml_error:
                memory = None  # not supported on this device (MIG, vGPU)
            try:
                bus_id = _text(pynvml.nvmlDeviceGetPciInfo(h).busId)
            except nvml_error:
                bus_id = ""
            gpus.append(
                Gpu(
                    index=i,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                    name=_text(pynvml.nvmlDeviceGetName(h)),
                    memory_mib=memory,
                    pci_bus_id=bus_id,
                )
            )
        return gpus
    except nvml_error as e:
        raise DiscoveryError(f"NVML query failed: {e}") from None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _installed_pynvml():
    """The ``pynvml`` module when nvidia-ml-py is installed, else None."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class NvmlHealth:
    """GPU health through NVML, kept across discoveries for its XID event set.

    ``read(gpus)`` returns index -> problem ("" when healthy) and index ->
    [(pid, MiB)] of every compute process. Critical XIDs arrive as events
    (``nvmlDeviceRegisterEvents(…, nvmlEventTypeXidCriticalError, set)``, then
    ``nvmlEventSetWait(set, 0)`` drains what is queued without blocking); an
    XID is remembered for the agent's life (the GPU needs servicing; the
    agent restarted after it starts afresh). Without ``pynvml`` it is not
    created (``available`` False) and nvidia-smi answers instead.
    """

    def __init__(self, pynvml=None):
        self.nvml = pynvml if pynvml is not None else _installed_pynvml()
        self.available = self.nvml is not None
        self.events = None
        self.xids: dict[int, str] = {}  # index -> "XID 79: GPU has fallen off the bus"
        self.initialised = False

    def _init(self) -> None:
        if self.initialised:
            return
        n = self.nvml
        n.nvmlInit()
        self.initialised = True
        try:
            self.events = n.nvmlEventSetCreate()
            for i in range(n.nvmlDeviceGetCount()):
                try:
                    n.nvmlDeviceRegisterEvents(n.nvmlDeviceGetHandleByIndex(i), n.nvmlEventTypeXidCriticalError, self.events)
                except n.NVMLError as e:  # not supported (vGPU, some MIG setups): ECC and lost still work
                    log.info("NVML: XID events not available for GPU %d: %s", i, e)
        except n.NVMLError as e:
            log.info("NVML: no event set, XIDs come only from ECC counters: %s", e)
            self.events = None

    def _drain_xids(self, by_uuid: dict[str, int]) -> None:
        n = self.nvml
        if self.events is None:
            return
        while True:
            try:
                data = n.nvmlEventSetWait(self.events, 0)
            except n.NVMLError:  # NVML_ERROR_TIMEOUT: nothing queued
                return
            xid = int(getattr(data, "eventData", 0))
            if xid not in CRITICAL_XIDS:
                continue
            try:
                index = by_uuid.get(_text(n.nvmlDeviceGetUUID(data.device)), -1)
            except n.NVMLError:
                index = -1
            if index >= 0:
                self.xids[index] = f"XID {xid}: {CRITICAL_XIDS[xid]}"

    def read(self, gpus: list[Gpu]) -> tuple[dict[int, str], dict[int, list[tuple[int, int]]]]:
        n = self.nvml
        try:
            self._init()
        except n.NVMLError as e:
            raise DiscoveryError(f"NVML could not be initialised: {e}") from None
        self._drain_xids({g.uuid: g.index for g in gpus})
        problems: dict[int, str] = {}
        apps: dict[int, list[tuple[int, int]]] = {}
        lost_error = getattr(n, "NVMLError_GPUIsLost", None)
        for g in gpus:
            said: list[str] = []
            if g.index in self.xids:
                said.append(self.xids[g.index])
            try:
                h = n.nvmlDeviceGetHandleByIndex(g.index)
                try:
                    ecc = int(n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC))
                    if ecc > 0:
                        said.append(f"{ecc} uncorrectable ECC error{'s' if ecc != 1 else ''} (volatile)")
                except n.NVMLError as e:
                    if lost_error is not None and isinstance(e, lost_error):
                        raise
                try:
                    if int(n.nvmlDeviceGetRetiredPagesPendingStatus(h)):
                        said.append("retired pages pending (a GPU reset retires them)")
                except n.NVMLError as e:
                    if lost_error is not None and isinstance(e, lost_error):
                        raise
                try:
                    apps[g.index] = [(int(p.pid), int(p.usedGpuMemory or 0) // _MIB) for p in n.nvmlDeviceGetComputeRunningProcesses(h)]
                except n.NVMLError as e:
                    if lost_error is not None and isinstance(e, lost_error):
                        raise
            except n.NVMLError as e:
                said.append(f"GPU is lost (NVML: {e})" if lost_error is not None and isinstance(e, lost_error) else f"NVML cannot read it: {e}")
            problems[g.index] = "; ".join(said)
        return problems, apps


# --------------------------------------------------------------------------
# InfiniBand HCAs from sysfs
# --------------------------------------------------------------------------


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def _word(value: str) -> str:
    """``4: ACTIVE`` -> ``ACTIVE``; a value without a number is kept as is."""
    head, sep, tail = value.partition(":")
    return tail.strip() if sep and head.strip().isdigit() else value.strip()


def read_hca(ib_root: str | os.PathLike, name: str) -> Hca:
    """One HCA from ``ib_root/<name>/ports/<n>/{state,phys_state,rate,link_layer}``.

    Usable when it exists and has at least one ACTIVE port; otherwise
    ``problem`` says why, in the words sysfs uses.
    """
    root = Path(ib_root)
    if hca_problem(name):
        return Hca(name=name, usable=False, problem=f"{name!r} is not an HCA name")
    if not root.is_dir():
        return Hca(name=name, usable=False, problem=f"not found: {root} does not exist (no InfiniBand driver loaded?)")
    hca_dir = root / name
    if not hca_dir.is_dir():
        present = sorted(p.name for p in root.iterdir())
        seen = f"present: {', '.join(present)}" if present else f"{root} is empty"
        return Hca(name=name, usable=False, problem=f"not found under {root} ({seen})")
    ports_dir = hca_dir / "ports"
    numbers = sorted(int(p.name) for p in ports_dir.iterdir() if p.name.isdigit()) if ports_dir.is_dir() else []
    if not numbers:
        return Hca(name=name, usable=False, problem=f"has no ports under {ports_dir}")
    ports, described = [], []
    for n in numbers:
        d = ports_dir / str(n)
        state, phys = _read(d / "state"), _read(d / "phys_state")
        ports.append(
            HcaPort(
                port=n,
                state=_word(state) or "UNKNOWN",
                phys_state=_word(phys),
                rate=_read(d / "rate"),
                link_layer=_read(d / "link_layer"),
            )
        )
        described.append(f"port {n} is {state or 'without a state file'}" + (f" ({phys})" if phys else ""))
    if any(p.state == "ACTIVE" for p in ports):
        return Hca(name=name, ports=ports, usable=True)
    return Hca(name=name, ports=ports, usable=False, problem=f"no ACTIVE port: {'; '.join(described)}")


# --------------------------------------------------------------------------
# Everything
# --------------------------------------------------------------------------


def _gpus(cfg: AgentConfig, warnings: list[str]) -> list[Gpu]:
    d = cfg.discovery
    if d.skip_gpus:
        return []
    if d.prefer_nvml:
        try:
            return query_nvml()
        except DiscoveryError as e:
            msg = f"NVML discovery failed, falling back to nvidia-smi: {e}"
            log.warning("%s", msg)
            warnings.append(msg)
    return query_nvidia_smi(d.nvidia_smi)


# The pids named per GPU (its memory counts them all): a GPU shared by many strangers is told by a few.
MAX_FOREIGN_PIDS = 32
_HEALTH_WARNED: set[str] = set()


def _health_warning(msg: str) -> None:
    """Health that cannot be read is logged once per distinct message (it would
    repeat every discovery.interval), and the GPUs are reported as listed."""
    if msg not in _HEALTH_WARNED:
        if len(_HEALTH_WARNED) > 100:
            _HEALTH_WARNED.clear()
        _HEALTH_WARNED.add(msg)
        log.warning("%s", msg)


def _lost_problem(bus_id: str, said: str) -> str:
    return f"GPU is lost (XID 79, fallen off the bus?): nvidia-smi: Unable to determine the device handle for GPU {bus_id}: {said}"


def gpu_health(
    cfg: AgentConfig,
    gpus: list[Gpu],
    warnings: list[str],
    *,
    lost: dict[str, str] | None = None,
    previous: list[Gpu] | None = None,
    known_pids: set[int] | Callable[[], set[int]] | None = None,
    nvml: NvmlHealth | None = None,
) -> list[Gpu]:
    """``gpus`` with health filled in (and GPUs nvidia-smi lost put back from ``previous``, unhealthy).

    ``known_pids``: every process of the engines llmgw launched (None: do not
    judge foreign processes, e.g. before the supervisor adopted its engines).
    Health that cannot be read is a warning, never a DiscoveryError: the
    inventory still lists the GPUs.
    """
    out = _with_lost(gpus, dict(lost or {}), previous or [], warnings)
    problems, apps = _read_health(cfg.discovery.nvidia_smi, [g for g in out if g.healthy], {g.index: g.uuid for g in out}, nvml, known_pids is not None)
    foreign: dict[str, tuple[int, list[int]]] = {}
    if known_pids is not None:
        # Asked after the GPU's process list was read, so an engine launched
        # meanwhile is known by then rather than taken for a stranger.
        ours = known_pids() if callable(known_pids) else known_pids
        for pid, mib, uuid in apps or []:
            if pid in ours:
                continue
            mib_sum, pids = foreign.get(uuid, (0, []))
            foreign[uuid] = (mib_sum + mib, [*pids, pid])
    final = []
    for g in out:
        problem = problems.get(g.index, "")
        if not g.healthy:  # lost: nothing else is readable
            final.append(g)
            continue
        mib, pids = foreign.get(g.uuid, (0, []))
        # Within the wire bounds (shared/schemas.py), or the registry would refuse the whole inventory.
        final.append(
            msgspec.structs.replace(
                g, healthy=not problem, problem=_trim(problem, 1000), foreign_mib=min(mib, 2**31), foreign_pids=sorted(pids)[:MAX_FOREIGN_PIDS]
            )
        )
    return final


def _with_lost(gpus: list[Gpu], lost: dict[str, str], previous: list[Gpu], warnings: list[str]) -> list[Gpu]:
    """``gpus`` and, unhealthy, the GPUs of ``previous`` that nvidia-smi now names only by
    the PCI address it cannot open (``lost``: address -> what it said)."""
    out = list(gpus)
    if not lost:
        return out
    listed = {_bus_key(g.pci_bus_id) for g in out}
    for g in previous:
        key = _bus_key(g.pci_bus_id)
        if key in lost and key not in listed and all(o.index != g.index for o in out):
            out.append(msgspec.structs.replace(g, healthy=False, problem=_trim(_lost_problem(g.pci_bus_id, lost.pop(key)), 1000)))
    for key, said in lost.items():
        if key not in listed:
            msg = f"nvidia-smi cannot open the GPU at {key} ({said}) and no earlier inventory says which one it is"
            log.warning("%s", msg)
            warnings.append(msg)
    out.sort(key=lambda g: g.index)
    return out


def _read_health(
    nvidia_smi: str, healthy: list[Gpu], uuid_of: dict[int, str], nvml: NvmlHealth | None, want_apps: bool
) -> tuple[dict[int, str], list[tuple[int, int, str]] | None]:
    """Each GPU's problem by index, and the compute processes as (pid, MiB, GPU uuid)
    when ``want_apps``: through NVML when it is there, else (or when it fails) nvidia-smi.
    What cannot be read is a warning and reads as nothing."""
    if nvml is not None and nvml.available:
        try:
            found, by_index = nvml.read(healthy)
            return found, [(pid, mib, uuid_of[i]) for i, procs in by_index.items() for pid, mib in procs]
        except DiscoveryError as e:
            _health_warning(f"GPU health through NVML failed, trying nvidia-smi: {e}")
    problems: dict[int, str] = {}
    apps: list[tuple[int, int, str]] | None = None
    try:
        problems = query_nvidia_smi_health(nvidia_smi)
    except DiscoveryError as e:
        _health_warning(f"GPU health not read: {e}")
    if want_apps:
        try:
            apps = query_compute_apps(nvidia_smi)
        except DiscoveryError as e:
            _health_warning(f"GPU processes not read: {e}")
    return problems, apps


def discover(
    cfg: AgentConfig,
    *,
    previous: list[Gpu] | None = None,
    known_pids: set[int] | Callable[[], set[int]] | None = None,
    nvml: NvmlHealth | None = None,
) -> Discovery:
    """GPUs with their health, the configured fabrics' HCAs, and whether each fabric is usable now.

    Raises ``DiscoveryError`` when GPUs cannot be listed. HCA problems become
    warnings and an unusable fabric, never an exception; so does GPU health.
    ``previous``: the GPUs of the last inventory, so a GPU that has fallen off
    the bus (nvidia-smi names only its PCI address) is reported by its index.
    """
    warnings: list[str] = []
    d = cfg.discovery
    if d.skip_gpus:
        gpus: list[Gpu] = []
    elif d.prefer_nvml:
        gpus = _gpus(cfg, warnings)
        gpus = gpu_health(cfg, gpus, warnings, previous=previous, known_pids=known_pids, nvml=nvml)
    else:
        listed, lost = query_nvidia_smi_lost(d.nvidia_smi, strict=not previous)
        gpus = gpu_health(cfg, listed, warnings, lost=lost, previous=previous, known_pids=known_pids)
    hcas: dict[str, Hca] = {}
    fabrics: list[FabricMembership] = []
    for fabric in cfg.fabrics:
        # Membership is configuration, never inferred: OpenSM's default subnet
        # prefix (fe80::) is the same on every fabric, so a matching GID prefix
        # proves nothing, and a wrong guess yields a replica that starts, passes
        # health checks and hangs on its first all-reduce. Sysfs can only tell
        # us that the configured HCAs exist and have an ACTIVE port.
        problems = []
        for name in fabric.hcas:
            hca = hcas.get(name)
            if hca is None:
                hca = hcas[name] = read_hca(cfg.discovery.ib_root, name)
                if not hca.usable:
                    msg = f"HCA {name} (fabric {fabric.name}) is not usable: {hca.problem}"
                    log.warning("%s", msg)
                    warnings.append(msg)
            if not hca.usable:
                problems.append(f"{name}: {hca.problem}")
        fabrics.append(
            FabricMembership(
                name=fabric.name,
                hcas=list(fabric.hcas),
                usable=not problems,
                problem="; ".join(problems),
            )
        )
    return Discovery(gpus=gpus, hcas=list(hcas.values()), fabrics=fabrics, warnings=warnings, mgmt=resolve_mgmt(cfg.mgmt_addr))
