"""What this node has: GPUs (nvidia-smi or NVML) and the InfiniBand HCAs of its fabrics.

GPU discovery failing is an error (``DiscoveryError``): a GPU node that cannot
see its GPUs is misconfigured, and reporting "no GPUs" would quietly take it
out of scheduling instead of saying why. A node without GPUs says so with
``discovery.skip_gpus``. HCA problems are never raised: they are facts the
scheduler needs (a fabric whose HCA is down must not get a multi-node replica),
so they are reported in the inventory and as warnings.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.shared.errors import LlmgwError
from llmgw.shared.schemas import FabricMembership, Gpu, Hca, HcaPort

from .config import AgentConfig

log = logging.getLogger("llmgw.agent.discovery")

__all__ = [
    "NVIDIA_SMI_ARGS",
    "Discovery",
    "DiscoveryError",
    "discover",
    "parse_nvidia_smi_csv",
    "query_nvidia_smi",
    "query_nvml",
    "read_hca",
]

QUERY_FIELDS = ("index", "uuid", "name", "memory.total", "pci.bus_id")
NVIDIA_SMI_ARGS = (f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits")
NVIDIA_SMI_TIMEOUT = 15.0

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
                f"nvidia-smi output line {lineno}: expected {len(QUERY_FIELDS)} comma-separated fields "
                f"({', '.join(QUERY_FIELDS)}), got {len(fields)}: {line!r}"
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


def query_nvidia_smi(path_or_empty: str = "", *, timeout: float = NVIDIA_SMI_TIMEOUT) -> list[Gpu]:
    """Run nvidia-smi (the configured path, else the one on PATH) and parse its GPUs.

    It runs in its own session so that a timeout kills it and anything it
    started; a process that will not die (nvidia-smi stuck in the driver, which
    happens when a GPU falls off the bus) is abandoned rather than waited for.
    """
    binary = _resolve_nvidia_smi(path_or_empty)
    argv = [binary, *NVIDIA_SMI_ARGS]
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
    if proc.returncode != 0:
        said = _trim(err) or _trim(out)
        # With a driver but no GPU, nvidia-smi says so on stdout and exits non-zero (6).
        if "no devices were found" in (out + err).lower():
            return []
        how = f"was killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited with code {proc.returncode}"
        raise DiscoveryError(f"{binary} {how}: {said or '(no output)'}")
    try:
        return parse_nvidia_smi_csv(out)
    except DiscoveryError as e:
        raise DiscoveryError(f"{binary}: {e}") from None


# --------------------------------------------------------------------------
# NVML
# --------------------------------------------------------------------------


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def query_nvml() -> list[Gpu]:
    """GPUs through NVML (``pynvml`` from the ``nvidia-ml-py`` package)."""
    try:
        import pynvml  # type: ignore[import-not-found]
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
        except Exception:  # noqa: BLE001 - shutdown failing changes nothing we report
            pass


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
    if not name or "/" in name or name in (".", ".."):
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


def discover(cfg: AgentConfig) -> Discovery:
    """GPUs, the configured fabrics' HCAs, and whether each fabric is usable now.

    Raises ``DiscoveryError`` when GPUs cannot be listed. HCA problems become
    warnings and an unusable fabric, never an exception.
    """
    warnings: list[str] = []
    gpus = _gpus(cfg, warnings)
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
    return Discovery(gpus=gpus, hcas=list(hcas.values()), fabrics=fabrics, warnings=warnings)
