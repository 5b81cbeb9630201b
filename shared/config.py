"""Configuration files of the control-plane services and of operators.

A configuration is read once at start and validated when it is constructed:
an unknown key (with the closest known one suggested), a wrong type, a bad
duration or a missing file is refused with a message naming the file and the
key path, so a typo never silently becomes a default.

One file per service instance (each has its own certificate)::

    server: tls://10.0.0.140:4222       # or a list, for a clustered server
    tls: {ca: ca.pem, cert: scheduler.pem, key: scheduler-key.pem}
    metrics_listen: 127.0.0.1:9102      # "" turns the metrics endpoint off
    kv_replicas: 1                      # 3 on a clustered server
    health:    {heartbeat_interval: 5s, suspect_after_missed: 3, node_lost_after: 60s}
    scheduler: {reconcile_interval: 1s, port_base: 20000, port_count: 2000}
    gateway:   {listen: 127.0.0.1:8080}

``operator.yaml`` (for ``llmgw ctl`` and ``llmgw tui``) has the first two keys only.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from .bus import TlsFiles
from .durations import parse_duration
from .errors import ConfigError
from .files import write_atomic

# Marks a float field as a duration ("5s", "1m", 500ms, or seconds).
DURATION = {"duration": True}


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def build(cls: type, data: Any, where: str, source: str) -> Any:
    """Construct dataclass ``cls`` from a mapping, checking keys and types strictly."""
    prefix = f"{source}: " if source else ""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}{where or 'top level'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known keys: {', '.join(fields)})"
            raise ConfigError(f"{prefix}unknown key '{_join(where, key)}'{hint}")
    kwargs = {}
    for name, f in fields.items():
        path = _join(where, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{prefix}missing required key '{path}'")
            continue
        kwargs[name] = _convert(hints[name], data[name], path, source, f.metadata)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{prefix}{e}") from None


def _join(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def _convert(tp: Any, value: Any, path: str, source: str, meta: Any) -> Any:
    prefix = f"{source}: " if source else ""
    if meta and meta.get("duration"):
        return parse_duration(value, f"{prefix}{path}")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, path, source, meta)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, source)
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{prefix}{path}: expected a list, got {type(value).__name__}")
        items = [_convert(inner, v, f"{path}[{i}]", source, None) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{prefix}{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{prefix}{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{prefix}{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{prefix}{path}: expected a string, got {type(value).__name__}")
        return str(value)
    return value


class _StrictSafeLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, except that a key given twice is an error.

    Plain ``safe_load`` keeps the last of two ``server:`` lines without a word,
    which turns a half-edited file into a silent misconfiguration.
    """


def _construct_mapping(loader: _StrictSafeLoader, node: yaml.MappingNode, deep: bool = False):
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            continue  # SafeConstructor reports unhashable keys itself
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"key {key!r} appears twice (first on line {seen[key] + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictSafeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml_any(path: str | os.PathLike) -> Any:
    """Parse a YAML file strictly (a key given twice is an error), naming file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: configuration file does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a YAML configuration file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read configuration: {e}") from None
    try:
        return yaml.load(text, Loader=_StrictSafeLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        what = e.problem or e.context or "invalid YAML"
        raise ConfigError(f"{where}: YAML syntax error: {what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: YAML syntax error: {e}") from None


def read_yaml(path: str | os.PathLike) -> dict:
    """A configuration file whose top level is a mapping (an empty file is an empty one)."""
    data = read_yaml_any(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level")
    return data


DEFAULT_NATS_PORT = 4222


def nats_url_problem(url: str) -> str | None:
    """What is wrong with ``url`` as a NATS server URL, or None when it is fine."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        return f"{url!r} is not a valid URL ({e}); expected e.g. tls://HOST:{DEFAULT_NATS_PORT}"
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        host = parts.hostname or "HOST"
        return (
            f"{url!r} is an HTTP(S) endpoint from the earlier design; the control plane is now "
            f"reached through NATS: write the NATS server's URL, e.g. tls://{host}:{DEFAULT_NATS_PORT}"
        )
    if scheme not in ("nats", "tls"):
        return f"{url!r}: expected a NATS URL with scheme tls:// or nats://, e.g. tls://HOST:{DEFAULT_NATS_PORT}"
    if not parts.hostname:
        return f"{url!r} has no host; expected e.g. tls://HOST:{DEFAULT_NATS_PORT}"
    if parts.username or parts.password:
        return f"{url!r} carries credentials; identities are certificates only"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return f"{url!r}: a NATS URL is only scheme://host:port"
    if port == 0:
        return f"{url!r}: port 0 is not a server port"
    return None


# --------------------------------------------------------------------------
# the service and operator configurations
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsSection:
    ca: str
    cert: str
    key: str


@dataclass(frozen=True)
class HealthSection:
    heartbeat_interval: float = field(default=5.0, metadata=DURATION)
    suspect_after_missed: int = 3
    node_lost_after: float = field(default=60.0, metadata=DURATION)
    leader_ttl: float = field(default=5.0, metadata=DURATION)
    # After the monitor reconnects to the bus or takes over, no node goes suspect or
    # lost for this long: the agents' worst reconnect time. 0 (the default) derives
    # it from this file: reconnect_max + 20 % jitter + one heartbeat_interval (41 s
    # with the defaults), assuming the agents use the same reconnect_max.
    reconnect_grace: float = field(default=0.0, metadata=DURATION)

    def __post_init__(self):
        if self.reconnect_grace < 0:
            raise ConfigError("health.reconnect_grace: must not be negative (0 derives it from reconnect_max)")
        if self.heartbeat_interval <= 0 or self.node_lost_after <= 0:
            raise ConfigError("health: heartbeat_interval and node_lost_after must be positive")
        if self.suspect_after_missed < 1:
            raise ConfigError("health.suspect_after_missed: must be at least 1")
        if self.node_lost_after <= self.heartbeat_interval * self.suspect_after_missed:
            raise ConfigError(
                "health.node_lost_after must be longer than suspect_after_missed × heartbeat_interval "
                f"({self.suspect_after_missed} × {self.heartbeat_interval:g}s), or nodes go lost before suspect"
            )


@dataclass(frozen=True)
class SchedulerSection:
    reconcile_interval: float = field(default=1.0, metadata=DURATION)
    port_base: int = 20000
    port_count: int = 2000
    leader_ttl: float = field(default=5.0, metadata=DURATION)
    command_timeout: float = field(default=5.0, metadata=DURATION)
    # A degraded replica (its leader makes no progress) is failed and rebuilt
    # after this long; it returns to ready if tokens flow again before.
    hang_timeout: float = field(default=30.0, metadata=DURATION)
    # Crash loops: after a replica of a deployment fails before serving, the
    # next attempt waits backoff_base, doubling per consecutive failure up to
    # backoff_max; a replica that becomes ready resets it.
    backoff_base: float = field(default=5.0, metadata=DURATION)
    backoff_max: float = field(default=300.0, metadata=DURATION)
    # A node implicated in this many replica failures within auto_cordon_window
    # is cordoned, but never more than auto_cordon_max_share of a fabric's
    # nodes (0 turns auto-cordon off).
    auto_cordon_after: int = 3
    auto_cordon_window: float = field(default=600.0, metadata=DURATION)
    auto_cordon_max_share: float = 0.25

    def __post_init__(self):
        if not (1024 <= self.port_base and self.port_base + self.port_count <= 65536 and self.port_count >= 2):
            raise ConfigError("scheduler: port_base..port_base+port_count must lie within 1024..65535")
        if self.hang_timeout <= 0:
            raise ConfigError("scheduler.hang_timeout: must be positive")
        if self.backoff_base < 0 or self.backoff_max < self.backoff_base:
            raise ConfigError("scheduler: backoff_base must not be negative, and backoff_max not below it")
        if self.auto_cordon_after < 1 or self.auto_cordon_window <= 0:
            raise ConfigError("scheduler: auto_cordon_after must be at least 1 and auto_cordon_window positive")
        if not 0 <= self.auto_cordon_max_share <= 1:
            raise ConfigError(f"scheduler.auto_cordon_max_share: a share between 0 and 1, got {self.auto_cordon_max_share}")


@dataclass(frozen=True)
class GatewaySection:
    listen: str = "127.0.0.1:8080"
    max_body_bytes: int = 4 * 1024 * 1024
    upstream_timeout: float = field(default=600.0, metadata=DURATION)
    connect_timeout: float = field(default=2.0, metadata=DURATION)
    api_keys_file: str = ""
    # HTTPS for clients: a PEM certificate (chain) and its key; both or neither.
    # Without them the API is plain HTTP (behind a TLS-terminating proxy, say).
    tls_cert: str = ""
    tls_key: str = ""
    # One log line per generation request (llmgw.gateway.access); off: a cost per request.
    access_log: bool = False
    cooldown: float = field(default=10.0, metadata=DURATION)
    failures_before_cooldown: int = 3
    # What a 503 (no ready replica) tells clients to wait before trying again.
    retry_after: float = field(default=5.0, metadata=DURATION)
    # Requests in flight on a replica that sends no byte for this long count
    # against it at once (passive detection), and the agents hear of it.
    stall_after: float = field(default=5.0, metadata=DURATION)
    # How often traffic evidence goes to the agents of busy replicas' leaders.
    traffic_interval: float = field(default=1.0, metadata=DURATION)
    # Bounds on what clients (and replicas) can make the gateway hold (docs/operations.md).
    # Client connections open at once; more are answered 503 and closed.
    max_connections: int = 4096
    # A request's head and body must arrive within this of its first byte, however it trickles (408).
    request_read_timeout: float = field(default=30.0, metadata=DURATION)
    # Request bodies held at once, all connections together (503 beyond).
    max_buffered_body_bytes: int = 256 * 1024 * 1024
    # A non-streamed answer from a replica larger than this is refused (502).
    max_response_bytes: int = 64 * 1024 * 1024
    # JSON bodies nested deeper than this are refused (400).
    max_json_depth: int = 64
    # Which replica gets a request (docs/architecture.md, "Routing"): "prefix" sends a
    # conversation where its prompt prefix is cached (rendezvous hashing, the same in
    # every gateway) within a bounded load; "least-outstanding": the least busy.
    routing: str = "prefix"
    # Bounded loads: no replica holds more than ceil(routing_load_bound x mean) + routing_load_slack in flight.
    routing_load_bound: float = 1.15
    routing_load_slack: int = 2
    # How much of a prompt's start (bytes) names its conversation.
    routing_prefix_chars: int = 16384
    # Gateway processes on one port (SO_REUSEPORT), each its own NATS connection and
    # mirrors; 0: one per core this process may run on. 'llmgw gateway --workers N' overrides.
    workers: int = 0

    def __post_init__(self):
        if not (type(self.workers) is int and 0 <= self.workers <= 1024):
            raise ConfigError(f"gateway.workers: must be a whole number from 0 (one per core) to 1024, got {self.workers!r}")
        if self.routing not in ("prefix", "least-outstanding"):
            raise ConfigError(f"gateway.routing: {self.routing!r} is not one of prefix, least-outstanding")
        if not (isinstance(self.routing_load_bound, (int, float)) and 1.0 <= self.routing_load_bound <= 100):
            raise ConfigError(f"gateway.routing_load_bound: must be a number from 1 (strict balance) up, e.g. 1.25; got {self.routing_load_bound!r}")
        if not 0 <= self.routing_load_slack <= 1000:
            raise ConfigError(f"gateway.routing_load_slack: must be between 0 and 1000 requests, got {self.routing_load_slack}")
        if not 64 <= self.routing_prefix_chars <= 1024 * 1024:
            raise ConfigError(f"gateway.routing_prefix_chars: must be between 64 and 1048576, got {self.routing_prefix_chars}")
        for name in ("max_connections", "max_buffered_body_bytes", "max_response_bytes", "max_json_depth"):
            if getattr(self, name) < 1:
                raise ConfigError(f"gateway.{name}: must be at least 1")
        if self.request_read_timeout <= 0:
            raise ConfigError("gateway.request_read_timeout: must be positive")
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ConfigError(
                f"gateway.max_buffered_body_bytes ({self.max_buffered_body_bytes}) is smaller than max_body_bytes ({self.max_body_bytes}): one body could never be held"
            )
        if self.max_body_bytes < 1:
            raise ConfigError("gateway.max_body_bytes: must be at least 1")
        if self.upstream_timeout <= 0 or self.connect_timeout <= 0:
            raise ConfigError("gateway: upstream_timeout and connect_timeout must be positive")
        if self.cooldown < 0 or self.retry_after < 0:
            raise ConfigError("gateway: cooldown and retry_after must not be negative")
        if self.failures_before_cooldown < 1:
            raise ConfigError("gateway.failures_before_cooldown: must be at least 1")
        if self.stall_after <= 0 or self.traffic_interval <= 0:
            raise ConfigError("gateway: stall_after and traffic_interval must be positive")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("gateway: tls_cert and tls_key go together (HTTPS needs both)")


@dataclass(frozen=True)
class ServiceConfig:
    server: list[str]
    tls: TlsSection
    metrics_listen: str = ""
    kv_replicas: int = 1
    reconnect_base: float = field(default=1.0, metadata=DURATION)
    reconnect_max: float = field(default=30.0, metadata=DURATION)
    health: HealthSection = field(default_factory=HealthSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    gateway: GatewaySection = field(default_factory=GatewaySection)
    source: str = field(default="", metadata={"internal": True})

    def tls_files(self) -> TlsFiles:
        return TlsFiles(ca=self.tls.ca, cert=self.tls.cert, key=self.tls.key)

    @property
    def reconnect_grace(self) -> float:
        """health.reconnect_grace, or when 0 the agents' worst reconnect time:
        reconnect_max with its +20 % jitter, plus a heartbeat to be heard."""
        h = self.health
        return h.reconnect_grace or self.reconnect_max * 1.2 + h.heartbeat_interval


def _resolve(base: Path, p: str) -> str:
    return str(p if os.path.isabs(p) else (base / p).resolve())


def load_service_config(path: str | os.PathLike) -> ServiceConfig:
    """Load and check a service (or operator) configuration file."""
    data = read_yaml(path)
    if "source" in data:
        raise ConfigError(f"{path}: unknown key 'source'")
    cfg = build(ServiceConfig, data, "", str(path))
    base = Path(path).resolve().parent
    tls = TlsSection(**{k: _resolve(base, getattr(cfg.tls, k)) for k in ("ca", "cert", "key")})
    for k in ("ca", "cert", "key"):
        if not Path(getattr(tls, k)).is_file():
            raise ConfigError(f"{path}: tls.{k}: file {getattr(tls, k)} does not exist")
    for url in cfg.server:
        problem = nats_url_problem(url)
        if problem:
            raise ConfigError(f"{path}: server: {problem}")
    if cfg.reconnect_base > cfg.reconnect_max:
        raise ConfigError(f"{path}: reconnect_base ({cfg.reconnect_base:g}s) is longer than reconnect_max ({cfg.reconnect_max:g}s)")
    # The gateway's files, like tls paths, are relative to this file.
    files = {k: _resolve(base, v) for k in ("api_keys_file", "tls_cert", "tls_key") if (v := getattr(cfg.gateway, k))}
    return dataclasses.replace(cfg, tls=tls, gateway=dataclasses.replace(cfg.gateway, **files), source=str(path))


def default_operator_config() -> str:
    """Where ``llmgw ctl`` and ``llmgw tui`` look when --config is not given."""
    return os.environ.get("LLMGW_CONFIG") or str(Path(".llmgw") / "operator.yaml")


def write_config(path: str | os.PathLike, data: dict) -> None:
    write_atomic(path, yaml.safe_dump(data, sort_keys=False), mode=0o600)
