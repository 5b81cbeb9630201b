"""The node agent's configuration: ``agent.yaml``, as the onboarding script writes it.

Everything is checked at load, before the agent connects anywhere: a typo in a
key, a wrong type, a missing certificate or an address from the earlier HTTPS
design is refused with one message that names the file, the key path
(``supervisor.stop_timeout``, ``fabrics[1].hcas``) and what was expected. An
agent that starts with a half-understood configuration is worse than one that
does not start: it publishes an inventory the scheduler believes.

Unknown keys are refused, unlike unknown fields on the wire (see
``shared/schemas.py``): a misspelt ``heartbeat_intervall`` silently falling back
to the default is exactly the kind of surprise this file exists to prevent.

Relative paths (tls files, ``ib_root``, ``work_dir``, and an ``nvidia_smi`` that
contains a ``/``) are resolved against the directory of the configuration file,
so a configuration and its certificates can be moved together. A bare
``nvidia_smi: nvidia-smi`` is looked up on ``PATH`` like an empty one.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from llmgw.shared.bus import TlsFiles
from llmgw.shared.config import nats_url_problem, read_yaml_any
from llmgw.shared.durations import format_duration, parse_duration
from llmgw.shared.errors import ConfigError, LlmgwError
from llmgw.shared.names import check_name

__all__ = [
    "AgentConfig",
    "DiscoveryConfig",
    "FabricConfig",
    "SupervisorConfig",
    "check_identity",
    "load_agent_config",
]



@dataclass(frozen=True)
class FabricConfig:
    """An InfiniBand fabric this node is cabled to, and the HCAs that reach it."""

    name: str
    hcas: tuple[str, ...]


@dataclass(frozen=True)
class DiscoveryConfig:
    nvidia_smi: str = ""  # empty: look on PATH
    ib_root: str = "/sys/class/infiniband"
    prefer_nvml: bool = False
    skip_gpus: bool = False
    # GPUs (health too) and HCA ports are re-read this often; a change is
    # published at once (issue #14, docs/hardware.md).
    interval: float = 10.0


@dataclass(frozen=True)
class SupervisorConfig:
    work_dir: str = "/var/lib/llmgw-agent"
    log_lines: int = 512
    stop_timeout: float = 60.0
    health_interval: float = 2.0
    # Progress probes of the ready leaders (see supervisor.py): a one-token
    # canary every probe_interval when no real request completed in it, which
    # must answer within probe_timeout; requests in flight that a gateway saw
    # get no byte for stall_after also make the leader stalled.
    probe_interval: float = 5.0
    probe_timeout: float = 3.0
    stall_after: float = 5.0


@dataclass(frozen=True)
class AgentConfig:
    node_id: str
    servers: tuple[str, ...]
    tls: TlsFiles
    mgmt_addr: str
    mgmt_interface: str = "eth0"
    heartbeat_interval: float = 5.0
    # A full status report goes out this often even when nothing changed (and
    # at once after a reconnect or a stall of the agent's own loop), so the
    # scheduler's view of this node, and its fencing, never rests on one lost
    # message. A full report of 100 engines is ~100 KiB at most; once in 30 s
    # is noise next to the heartbeats. Checked on each heartbeat tick, so a
    # value below heartbeat_interval means one with every heartbeat.
    full_report_interval: float = 30.0
    reconnect_base: float = 1.0
    reconnect_max: float = 30.0
    fabrics: tuple[FabricConfig, ...] = ()
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    inventory_interval: float = 300.0
    source: str = ""  # the file this was loaded from, for messages


# --------------------------------------------------------------------------
# YAML: safe, and refusing duplicate keys
# --------------------------------------------------------------------------


# --------------------------------------------------------------------------
# Typed readers; each names the file and the key path in its errors
# --------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer", float: "a number"}.get(
        type(value), type(value).__name__
    )


class _Ctx:
    """Where we are: the file, for every message."""

    def __init__(self, path: Path):
        self.path = path
        self.dir = path.parent

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.path}: {key}: {message}")

    def mapping(self, value: Any, key: str, known: tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, Any]:
        label = key or "top level"
        if not isinstance(value, dict):
            raise ConfigError(f"{self.path}: {label}: expected a mapping of keys, got {_type_name(value)}")
        for k in value:
            if not isinstance(k, str) or k not in known:
                close = difflib.get_close_matches(str(k), known, n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                where = f"{key}.{k}" if key else str(k)
                raise ConfigError(f"{self.path}: {where}: unknown key{hint} (known keys here: {', '.join(known)})")
        for k in required:
            if k not in value:
                where = f"{key}.{k}" if key else k
                raise ConfigError(f"{self.path}: {where}: required key is missing")
        return value

    def string(self, value: Any, key: str, *, allow_empty: bool = False) -> str:
        if not isinstance(value, str):
            raise self.fail(key, f"expected a string, got {_type_name(value)} {value!r}")
        value = value.strip()
        if not value and not allow_empty:
            raise self.fail(key, "must not be empty")
        return value

    def boolean(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {_type_name(value)} {value!r}")
        return value

    def positive_int(self, value: Any, key: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected a whole number, got {_type_name(value)} {value!r}")
        if value <= 0:
            raise self.fail(key, f"must be greater than 0, got {value}")
        return value

    def interval(self, value: Any, key: str) -> float:
        seconds = parse_duration(value, f"{self.path}: {key}")
        if seconds <= 0:
            raise self.fail(key, f"must be greater than 0, got {value!r}")
        return seconds

    def path_value(self, value: Any, key: str) -> str:
        text = self.string(value, key)
        return str(self.resolve(text))

    def resolve(self, text: str) -> Path:
        p = Path(os.path.expanduser(text))
        return p if p.is_absolute() else (self.dir / p)


# --------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------

_TOP_KEYS = (
    "node_id",
    "server",
    "tls",
    "mgmt_addr",
    "mgmt_interface",
    "heartbeat_interval",
    "full_report_interval",
    "reconnect_base",
    "reconnect_max",
    "inventory_interval",
    "fabrics",
    "discovery",
    "supervisor",
)
_TOP_REQUIRED = ("node_id", "server", "tls", "mgmt_addr")
_TLS_KEYS = ("ca", "cert", "key")
_FABRIC_KEYS = ("name", "hcas")
_DISCOVERY_KEYS = ("nvidia_smi", "ib_root", "prefer_nvml", "skip_gpus", "interval")
_SUPERVISOR_KEYS = ("work_dir", "log_lines", "stop_timeout", "health_interval", "probe_interval", "probe_timeout", "stall_after")

# An HCA name becomes a sysfs path component and part of NCCL_IB_HCA.
_HCA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# Linux interface names: at most 15 bytes (IFNAMSIZ - 1), no '/', ':' or whitespace.
_IFNAME = re.compile(r"[A-Za-z0-9_.-]{1,15}")
_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def _server_url(ctx: _Ctx, value: Any, key: str) -> str:
    url = ctx.string(value, key)
    problem = nats_url_problem(url)
    if problem:
        raise ctx.fail(key, problem)
    return url


def _servers(ctx: _Ctx, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (_server_url(ctx, value, "server"),)
    if isinstance(value, list):
        if not value:
            raise ctx.fail("server", "the list is empty; give at least one NATS URL, e.g. tls://HOST:4222")
        urls = tuple(_server_url(ctx, v, f"server[{i}]") for i, v in enumerate(value))
        if len(set(urls)) != len(urls):
            raise ctx.fail("server", "the same URL is listed twice")
        return urls
    raise ctx.fail("server", f"expected a NATS URL or a list of them, got {_type_name(value)}")


def _tls(ctx: _Ctx, value: Any) -> TlsFiles:
    m = ctx.mapping(value, "tls", _TLS_KEYS, _TLS_KEYS)
    paths = {}
    for k in _TLS_KEYS:
        p = ctx.path_value(m[k], f"tls.{k}")
        if not Path(p).is_file():
            raise ctx.fail(f"tls.{k}", f"file {p} does not exist" + ("" if Path(p).parent.is_dir() else f" (nor does {Path(p).parent})"))
        paths[k] = p
    return TlsFiles(ca=paths["ca"], cert=paths["cert"], key=paths["key"])


def _mgmt_addr(ctx: _Ctx, value: Any) -> str:
    addr = ctx.string(value, "mgmt_addr")
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        if not _HOSTNAME.fullmatch(addr):
            raise ctx.fail(
                "mgmt_addr",
                f"{addr!r} is neither an IP address nor a hostname; give the address engines on this node "
                "are reachable on (no scheme, no port)",
            ) from None
        return addr
    if ip.is_unspecified:
        raise ctx.fail(
            "mgmt_addr",
            f"{addr} is the wildcard address; other nodes and the gateway must reach engines here, "
            "so give this node's own address",
        )
    return addr


def _ifname(ctx: _Ctx, value: Any) -> str:
    name = ctx.string(value, "mgmt_interface")
    if not _IFNAME.fullmatch(name):
        raise ctx.fail("mgmt_interface", f"{name!r} is not a network interface name (at most 15 letters, digits, '_', '.', '-')")
    return name


def _fabrics(ctx: _Ctx, value: Any) -> tuple[FabricConfig, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ctx.fail("fabrics", f"expected a list of {{name, hcas}} (or [] for no fabric), got {_type_name(value)}")
    out: list[FabricConfig] = []
    owner: dict[str, str] = {}
    for i, item in enumerate(value):
        key = f"fabrics[{i}]"
        m = ctx.mapping(item, key, _FABRIC_KEYS, _FABRIC_KEYS)
        name = ctx.string(m["name"], f"{key}.name")
        try:
            check_name(name, "fabric name")
        except LlmgwError as e:
            raise ctx.fail(f"{key}.name", str(e)) from None
        if any(f.name == name for f in out):
            raise ctx.fail(f"{key}.name", f"fabric {name!r} is listed twice")
        hcas = m["hcas"]
        if not isinstance(hcas, list):
            raise ctx.fail(f"{key}.hcas", f"expected a list of HCA names such as [mlx5_0, mlx5_1], got {_type_name(hcas)}")
        if not hcas:
            raise ctx.fail(f"{key}.hcas", f"fabric {name!r} lists no HCA; a fabric is reached through at least one")
        names: list[str] = []
        for j, h in enumerate(hcas):
            hk = f"{key}.hcas[{j}]"
            h = ctx.string(h, hk)
            if not _HCA_NAME.fullmatch(h):
                raise ctx.fail(hk, f"{h!r} is not an HCA name (as under /sys/class/infiniband, e.g. mlx5_0)")
            if h in names:
                raise ctx.fail(hk, f"HCA {h!r} is listed twice in fabric {name!r}")
            if h in owner:
                raise ctx.fail(hk, f"HCA {h!r} is already in fabric {owner[h]!r}; a port is cabled to one fabric")
            owner[h] = name
            names.append(h)
        out.append(FabricConfig(name=name, hcas=tuple(names)))
    return tuple(out)


def _discovery(ctx: _Ctx, value: Any) -> DiscoveryConfig:
    if value is None:
        return DiscoveryConfig()
    m = ctx.mapping(value, "discovery", _DISCOVERY_KEYS)
    d = DiscoveryConfig()
    smi = d.nvidia_smi
    if "nvidia_smi" in m and m["nvidia_smi"] is not None:
        smi = ctx.string(m["nvidia_smi"], "discovery.nvidia_smi", allow_empty=True)
        if "/" in smi:
            smi = str(ctx.resolve(smi))
    ib_root = ctx.path_value(m["ib_root"], "discovery.ib_root") if "ib_root" in m else d.ib_root
    return DiscoveryConfig(
        nvidia_smi=smi,
        ib_root=ib_root,
        prefer_nvml=ctx.boolean(m["prefer_nvml"], "discovery.prefer_nvml") if "prefer_nvml" in m else d.prefer_nvml,
        skip_gpus=ctx.boolean(m["skip_gpus"], "discovery.skip_gpus") if "skip_gpus" in m else d.skip_gpus,
        interval=_discovery_interval(ctx, m["interval"]) if "interval" in m else d.interval,
    )


# Each round runs nvidia-smi up to three times; more often than this would
# spend a core on it, less often than this leaves a dead port unseen too long.
DISCOVERY_INTERVAL_MIN, DISCOVERY_INTERVAL_MAX = 0.2, 3600.0


def _discovery_interval(ctx: _Ctx, value: Any) -> float:
    seconds = ctx.interval(value, "discovery.interval")
    if not DISCOVERY_INTERVAL_MIN <= seconds <= DISCOVERY_INTERVAL_MAX:
        raise ctx.fail(
            "discovery.interval",
            f"must be between {format_duration(DISCOVERY_INTERVAL_MIN)} and {format_duration(DISCOVERY_INTERVAL_MAX)}, got {value!r}",
        )
    return seconds


def _supervisor(ctx: _Ctx, value: Any) -> SupervisorConfig:
    if value is None:
        return SupervisorConfig()
    m = ctx.mapping(value, "supervisor", _SUPERVISOR_KEYS)
    d = SupervisorConfig()
    probe_interval = ctx.interval(m["probe_interval"], "supervisor.probe_interval") if "probe_interval" in m else d.probe_interval
    probe_timeout = ctx.interval(m["probe_timeout"], "supervisor.probe_timeout") if "probe_timeout" in m else d.probe_timeout
    if probe_timeout > probe_interval:
        key = "supervisor.probe_timeout" if "probe_timeout" in m else "supervisor.probe_interval"
        raise ctx.fail(
            key,
            f"probe_timeout ({format_duration(probe_timeout)}) must not exceed probe_interval ({format_duration(probe_interval)}): "
            "a canary is judged before the next one is due",
        )
    return SupervisorConfig(
        probe_interval=probe_interval,
        probe_timeout=probe_timeout,
        stall_after=ctx.interval(m["stall_after"], "supervisor.stall_after") if "stall_after" in m else d.stall_after,
        work_dir=ctx.path_value(m["work_dir"], "supervisor.work_dir") if "work_dir" in m else d.work_dir,
        log_lines=ctx.positive_int(m["log_lines"], "supervisor.log_lines") if "log_lines" in m else d.log_lines,
        stop_timeout=ctx.interval(m["stop_timeout"], "supervisor.stop_timeout") if "stop_timeout" in m else d.stop_timeout,
        health_interval=ctx.interval(m["health_interval"], "supervisor.health_interval")
        if "health_interval" in m
        else d.health_interval,
    )


def load_agent_config(path: str | os.PathLike) -> AgentConfig:
    """Read and check ``agent.yaml``; raise ``ConfigError`` naming file and key on any problem."""
    p = Path(os.path.expanduser(os.fspath(path))).absolute()
    data = read_yaml_any(p)
    ctx = _Ctx(p)
    if data is None:
        raise ConfigError(f"{p}: the configuration is empty; it needs at least {', '.join(_TOP_REQUIRED)}")
    m = ctx.mapping(data, "", _TOP_KEYS, _TOP_REQUIRED)

    node_id = ctx.string(m["node_id"], "node_id")
    try:
        check_name(node_id, "node id")
    except LlmgwError as e:
        raise ctx.fail("node_id", str(e)) from None

    defaults = AgentConfig(node_id="x", servers=(), tls=TlsFiles("", "", ""), mgmt_addr="x")

    def opt(key: str, reader: Callable[[Any, str], Any], default: Any) -> Any:
        return reader(m[key], key) if key in m else default

    cfg = AgentConfig(
        node_id=node_id,
        servers=_servers(ctx, m["server"]),
        tls=_tls(ctx, m["tls"]),
        mgmt_addr=_mgmt_addr(ctx, m["mgmt_addr"]),
        mgmt_interface=_ifname(ctx, m["mgmt_interface"]) if "mgmt_interface" in m else defaults.mgmt_interface,
        heartbeat_interval=opt("heartbeat_interval", ctx.interval, defaults.heartbeat_interval),
        full_report_interval=opt("full_report_interval", ctx.interval, defaults.full_report_interval),
        reconnect_base=opt("reconnect_base", ctx.interval, defaults.reconnect_base),
        reconnect_max=opt("reconnect_max", ctx.interval, defaults.reconnect_max),
        inventory_interval=opt("inventory_interval", ctx.interval, defaults.inventory_interval),
        fabrics=_fabrics(ctx, m.get("fabrics")),
        discovery=_discovery(ctx, m.get("discovery")),
        supervisor=_supervisor(ctx, m.get("supervisor")),
        source=str(p),
    )
    if cfg.reconnect_base > cfg.reconnect_max:
        raise ctx.fail(
            "reconnect_base",
            f"{cfg.reconnect_base:g}s is greater than reconnect_max ({cfg.reconnect_max:g}s); "
            "the backoff starts at reconnect_base and grows up to reconnect_max",
        )
    return cfg


def check_identity(cfg: AgentConfig) -> None:
    """Refuse a certificate that does not speak for ``cfg.node_id`` as a node.

    The control plane would refuse it anyway (identity is the certificate), but
    only after the agent connected and published under a name it may not use;
    saying so at start, with both values, saves the afternoon.
    """
    where = cfg.source or "agent configuration"
    try:
        role, name = cfg.tls.identity()
    except LlmgwError as e:
        raise ConfigError(f"{where}: tls.cert: {e}") from None
    problems = []
    if name != cfg.node_id:
        problems.append(f"its common name is {name!r} but node_id is {cfg.node_id!r}")
    if role != "node":
        problems.append(f"its role (OU) is {role!r}, expected 'node'")
    if problems:
        raise ConfigError(
            f"{where}: tls.cert: certificate {cfg.tls.cert} (CN={name}, OU={role}) cannot act as node "
            f"{cfg.node_id}: {'; '.join(problems)}. Issue one with 'llmgw ctl cert issue-client {cfg.node_id}'"
        )
