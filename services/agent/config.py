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
The structs below are the schema (``shared/structconf.py`` reads the file into
them and words msgspec's refusals); each checks its own values as it is built.

Relative paths (tls files, ``ib_root``, ``work_dir``, ``cache.dir``, ``cache.mirror``, and an ``nvidia_smi`` that
contains a ``/``) are resolved against the directory of the configuration file,
so a configuration and its certificates can be moved together. A bare
``nvidia_smi: nvidia-smi`` is looked up on ``PATH`` like an empty one.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated

import msgspec

from llmgw.shared.config import TlsSection, check_servers, listed, read_yaml_any, resolve_path, resolve_tls
from llmgw.shared.durations import format_duration
from llmgw.shared.errors import ConfigError, LlmgwError
from llmgw.shared.names import check_name, hca_problem
from llmgw.shared.structconf import Duration, Invalid, Section, convert
from llmgw.shared.tls import TlsFiles

__all__ = [
    "AgentConfig",
    "CacheConfig",
    "DiscoveryConfig",
    "FabricConfig",
    "SupervisorConfig",
    "check_identity",
    "load_agent_config",
]

# Linux interface names: at most 15 bytes (IFNAMSIZ - 1), no '/', ':' or whitespace.
_IFNAME = re.compile(r"[A-Za-z0-9_.-]{1,15}")
_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")

# Each round runs nvidia-smi up to three times; more often than this would
# spend a core on it, less often than this leaves a dead port unseen too long.
DISCOVERY_INTERVAL_MIN, DISCOVERY_INTERVAL_MAX = 0.2, 3600.0
PROBE_TIMEOUT = 3.0


def _positive(owner: Section, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if value <= 0:
            raise Invalid(name, f"must be greater than 0, got {value:g}{'s' if isinstance(value, float) else ''}")


def _named(key: str, value: str, what: str) -> None:
    if not value:
        raise Invalid(key, "must not be empty")
    try:
        check_name(value, what)
    except LlmgwError as e:
        raise Invalid(key, str(e)) from None


class FabricConfig(Section, frozen=True):
    """An InfiniBand fabric this node is cabled to, and the HCAs that reach it."""

    name: str
    hcas: Annotated[tuple[str, ...], msgspec.Meta(description="a list of HCA names such as [mlx5_0, mlx5_1]")]

    def __post_init__(self):
        _named("name", self.name, "fabric name")
        if not self.hcas:
            raise Invalid("hcas", f"fabric {self.name!r} lists no HCA; a fabric is reached through at least one")
        for j, h in enumerate(self.hcas):
            if problem := hca_problem(h):
                raise Invalid(f"hcas[{j}]", f"{h!r} is not an HCA name (as under /sys/class/infiniband, e.g. mlx5_0): {problem}")
            if h in self.hcas[:j]:
                raise Invalid(f"hcas[{j}]", f"HCA {h!r} is listed twice in fabric {self.name!r}")


class DiscoveryConfig(Section, frozen=True):
    nvidia_smi: str = ""  # empty: look on PATH
    ib_root: str = "/sys/class/infiniband"
    prefer_nvml: bool = False
    skip_gpus: bool = False
    # GPUs (health too) and HCA ports are re-read this often; a change is
    # published at once (docs/hardware.md).
    interval: Duration = 10.0

    def __post_init__(self):
        _positive(self, "interval")
        if not DISCOVERY_INTERVAL_MIN <= self.interval <= DISCOVERY_INTERVAL_MAX:
            raise Invalid(
                "interval",
                f"must be between {format_duration(DISCOVERY_INTERVAL_MIN)} and {format_duration(DISCOVERY_INTERVAL_MAX)}, "
                f"got {format_duration(self.interval)}",
            )


class SupervisorConfig(Section, frozen=True):
    work_dir: str = "/var/lib/llmgw-agent"
    log_lines: int = 512
    stop_timeout: Duration = 60.0
    health_interval: Duration = 2.0
    # Progress probes of the ready leaders (see supervisor.py): a one-token
    # canary every probe_interval when no real request completed in it, which
    # must answer within probe_timeout; requests in flight that a gateway saw
    # get no byte for stall_after also make the leader stalled.
    probe_interval: Duration = 5.0
    probe_timeout: Duration = PROBE_TIMEOUT
    stall_after: Duration = 5.0

    def __post_init__(self):
        if not self.work_dir:
            raise Invalid("work_dir", "must not be empty")
        _positive(self, "log_lines", "probe_interval", "probe_timeout", "stall_after", "stop_timeout", "health_interval")
        if self.probe_timeout > self.probe_interval:
            # Blame the one that was set: a shorter probe_interval under the default timeout.
            raise Invalid(
                "probe_interval" if self.probe_timeout == PROBE_TIMEOUT else "probe_timeout",
                f"probe_timeout ({format_duration(self.probe_timeout)}) must not exceed probe_interval ({format_duration(self.probe_interval)}): "
                "a canary is judged before the next one is due",
            )


# Sizes in files: a bare number of bytes, or a number with a unit (decimal KB..TB
# and binary KiB..TiB, as df and disk vendors write them).
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_UNITS = {"b": 1, **{f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgt")}, **{f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgt")}}


def parse_size(value: int | str, key: str) -> int:
    """Bytes from ``500GiB``, ``2TB``, ``1073741824``; ``Invalid`` naming ``key`` otherwise."""
    if isinstance(value, bool):
        raise Invalid(key, f"must be a size such as 200GiB or a number of bytes, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.fullmatch(value)
        if m is None:
            raise Invalid(key, f"{value!r} is not a size: write a number of bytes or one with a unit (KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 200GiB")
        n = int(float(m[1]) * _UNITS[(m[2] or "B").lower()])
    if n <= 0:
        raise Invalid(key, f"must be greater than 0, got {value!r}")
    return n


class CacheConfig(Section, frozen=True):
    """The node's model cache (services/agent/modelcache.py, docs/node-onboarding.md)."""

    # Local disk the agent copies weights into; created if missing.
    dir: str = ""
    # The most the cache holds, all entries together; least recently used
    # entries no engine runs from are evicted to make room.
    budget: Annotated[int | str, msgspec.Meta(description="a size such as 200GiB or a number of bytes")] = "100GiB"
    # Where a deployment's ``weights_model`` is looked up (<mirror>/<org>/<name>);
    # "" refuses deployments that name a model id.
    mirror: str = ""
    # Progress is reported at most this often while a copy runs.
    progress_interval: Duration = 1.0
    # The most a copy reads per second (a size such as 500MiB); unset: as fast
    # as source and disk allow. A limit leaves the node's disk and network to
    # the engines that serve while a spare's weights are copied beside them.
    copy_rate: Annotated[int | str | None, msgspec.Meta(description="a size per second such as 500MiB")] = None

    def __post_init__(self):
        if not self.dir:
            raise Invalid("dir", "must not be empty: give a directory on local disk with room for the budget")
        parse_size(self.budget, "budget")
        if self.copy_rate is not None:
            parse_size(self.copy_rate, "copy_rate")
        _positive(self, "progress_interval")

    @property
    def copy_rate_bytes(self) -> int | None:
        return parse_size(self.copy_rate, "copy_rate") if self.copy_rate is not None else None

    @property
    def budget_bytes(self) -> int:
        return parse_size(self.budget, "budget")


class AgentConfig(Section, frozen=True):
    node_id: str
    servers: Annotated[tuple[str, ...], msgspec.Meta(description="a NATS URL or a list of them")] = msgspec.field(name="server")
    tls: TlsFiles
    mgmt_addr: str
    mgmt_interface: str = "eth0"
    heartbeat_interval: Duration = 5.0
    # A full status report goes out this often even when nothing changed (and
    # at once after a reconnect or a stall of the agent's own loop), so the
    # scheduler's view of this node, and its fencing, never rests on one lost
    # message. A full report of 100 engines is ~100 KiB at most; once in 30 s
    # is noise next to the heartbeats. Checked on each heartbeat tick, so a
    # value below heartbeat_interval means one with every heartbeat.
    full_report_interval: Duration = 30.0
    reconnect_base: Duration = 1.0
    reconnect_max: Duration = 30.0
    fabrics: Annotated[tuple[FabricConfig, ...], msgspec.Meta(description="a list of {name, hcas} (or [] for no fabric)")] = ()
    discovery: DiscoveryConfig = msgspec.field(default_factory=DiscoveryConfig)
    supervisor: SupervisorConfig = msgspec.field(default_factory=SupervisorConfig)
    # None: no model cache; a deployment with a weights source is then launched
    # with its engine pointed at the source itself.
    cache: CacheConfig | None = None
    inventory_interval: Duration = 300.0
    source: str = ""  # the file this was loaded from, for messages

    not_in_files = ("source",)

    def __post_init__(self):
        _named("node_id", self.node_id, "node id")
        check_servers(self.servers)
        _check_mgmt_addr(self.mgmt_addr)
        if not _IFNAME.fullmatch(self.mgmt_interface):
            raise Invalid("mgmt_interface", f"{self.mgmt_interface!r} is not a network interface name (at most 15 letters, digits, '_', '.', '-')")
        _positive(self, "heartbeat_interval", "full_report_interval", "reconnect_base", "reconnect_max", "inventory_interval")
        if self.reconnect_base > self.reconnect_max:
            raise Invalid(
                "reconnect_base",
                f"{self.reconnect_base:g}s is greater than reconnect_max ({self.reconnect_max:g}s); "
                "the backoff starts at reconnect_base and grows up to reconnect_max",
            )


def _check_mgmt_addr(addr: str) -> None:
    if not addr:
        raise Invalid("mgmt_addr", "must not be empty")
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        if not _HOSTNAME.fullmatch(addr):
            raise Invalid(
                "mgmt_addr",
                f"{addr!r} is neither an IP address nor a hostname; give the address engines on this node are reachable on (no scheme, no port)",
            ) from None
        return
    if ip.is_unspecified:
        raise Invalid(
            "mgmt_addr",
            f"{addr} is the wildcard address; other nodes and the gateway must reach engines here, so give this node's own address",
        )


def _check_fabrics(fabrics: tuple[FabricConfig, ...]) -> None:
    """The fabrics against each other. Checked when the file is read rather than in
    ``AgentConfig`` itself: discovery stays correct on a configuration that breaks
    this, and its tests build one to show it."""
    owner: dict[str, str] = {}
    for i, fabric in enumerate(fabrics):
        if any(f.name == fabric.name for f in fabrics[:i]):
            raise Invalid(f"fabrics[{i}].name", f"fabric {fabric.name!r} is listed twice")
        for j, h in enumerate(fabric.hcas):
            if h in owner:
                raise Invalid(f"fabrics[{i}].hcas[{j}]", f"HCA {h!r} is already in fabric {owner[h]!r}; a port is cabled to one fabric")
            owner[h] = fabric.name


def load_agent_config(path: str | os.PathLike) -> AgentConfig:
    """Read and check ``agent.yaml``; raise ``ConfigError`` naming file and key on any problem."""
    p = Path(os.path.expanduser(os.fspath(path))).absolute()
    source = str(p)
    data = read_yaml_any(p)
    if data is None:
        required = [f.encode_name for f in msgspec.structs.fields(AgentConfig) if f.required]
        raise ConfigError(f"{p}: the configuration is empty; it needs at least {', '.join(required)}")
    if isinstance(data, dict):
        data = listed(data, "server")
    cfg = convert(data, AgentConfig, source)
    # TlsFiles is a dataclass, whose unknown keys msgspec would drop; the
    # services' tls section has the same keys and refuses others.
    convert(data["tls"], TlsSection, source, at="tls")
    try:
        _check_fabrics(cfg.fabrics)
    except Invalid as e:
        raise ConfigError(f"{p}: {e}") from None
    d, s = cfg.discovery, cfg.supervisor
    smi = resolve_path(p.parent, d.nvidia_smi) if "/" in d.nvidia_smi else d.nvidia_smi
    c = cfg.cache
    if c is not None:
        c = msgspec.structs.replace(c, dir=resolve_path(p.parent, c.dir), mirror=resolve_path(p.parent, c.mirror) if c.mirror else "")
    return msgspec.structs.replace(
        cfg,
        cache=c,
        tls=TlsFiles(**resolve_tls(cfg.tls, p.parent, source)),
        discovery=msgspec.structs.replace(d, nvidia_smi=smi, ib_root=resolve_path(p.parent, d.ib_root)),
        supervisor=msgspec.structs.replace(s, work_dir=resolve_path(p.parent, s.work_dir)),
        source=source,
    )


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
