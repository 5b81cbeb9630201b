"""Configuration files of the control-plane services and of operators.

A configuration is read once at start and validated when it is constructed
(msgspec structs, read through ``shared/structconf.py``): an unknown key (with
the closest known one suggested), a wrong type, a bad duration or a missing
file is refused with a message naming the file and the key path, so a typo
never silently becomes a default.

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

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

import msgspec
import yaml

from .apikeys import read_digests
from .errors import ConfigError
from .files import write_atomic
from .names import host_problem
from .structconf import Duration, Invalid, Section, convert
from .tls import TlsFiles, server_context


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
        return yaml.load(text, Loader=_StrictSafeLoader)
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


def listed(data: dict, key: str) -> dict:
    """``data`` with ``key: URL`` written as the one-element list ``key: [URL]``."""
    return {**data, key: [data[key]]} if isinstance(data.get(key), str) else data


def check_servers(urls: Sequence[str], key: str = "server") -> None:
    """Refuse NATS server URLs no client could use, naming the one at fault (``server[1]``)."""
    if not urls:
        raise Invalid(key, f"the list is empty; give at least one NATS URL, e.g. tls://HOST:{DEFAULT_NATS_PORT}")
    for i, url in enumerate(urls):
        problem = nats_url_problem(url)
        if problem:
            raise Invalid(key if len(urls) == 1 else f"{key}[{i}]", problem)
    if len(set(urls)) != len(urls):
        raise Invalid(key, "the same URL is listed twice")


def resolve_path(base: Path, text: str) -> str:
    """A path from a configuration file: ``~`` expanded, relative to the file's directory."""
    return os.path.abspath(os.path.join(base, os.path.expanduser(text)))


def resolve_tls(tls: Any, base: Path, source: str) -> dict[str, str]:
    """The ``tls`` section's ca, cert and key, resolved against ``base``; each must be a file."""
    paths = {}
    for k in ("ca", "cert", "key"):
        p = Path(resolve_path(base, getattr(tls, k)))
        if not p.is_file():
            nor = "" if p.parent.is_dir() else f" (nor does {p.parent})"
            raise ConfigError(f"{source}: tls.{k}: file {p} does not exist{nor}")
        paths[k] = str(p)
    return paths


# An address a service listens on: ``127.0.0.1:8080``, ``[::1]:8080``, ``:8080``
# (every address) or ``HOST:0`` (any free port). Checked when the file is read, so a
# listener a process opens later (the gateway's, a worker's, the metrics endpoint)
# cannot be refused for its spelling after the process has started.
Listen = Annotated[str, msgspec.Meta(description="HOST:PORT, such as 127.0.0.1:8080")]


def listen_problem(listen: str) -> str:
    """Why ``listen`` is not HOST:PORT, or "" when it is."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        return f"{listen!r} is not HOST:PORT (e.g. 127.0.0.1:8080)"
    host = host.removeprefix("[").removesuffix("]")
    if host and (problem := host_problem(host)):
        return f"{listen!r}: the host {problem}"
    return ""


def parse_listen(listen: str) -> tuple[str, int]:
    """(host, port) of a checked ``Listen``; an empty host is every address (0.0.0.0)."""
    if problem := listen_problem(listen):
        raise ConfigError(problem)
    host, _, port = listen.rpartition(":")
    return host.removeprefix("[").removesuffix("]") or "0.0.0.0", int(port)


# --------------------------------------------------------------------------
# the service and operator configurations
# --------------------------------------------------------------------------


class TlsSection(Section, frozen=True):
    ca: str
    cert: str
    key: str


class HealthSection(Section, frozen=True):
    heartbeat_interval: Duration = 5.0
    suspect_after_missed: int = 3
    node_lost_after: Duration = 60.0
    leader_ttl: Duration = 5.0
    # After the monitor reconnects to the bus or takes over, no node goes suspect or
    # lost for this long: the agents' worst reconnect time. 0 (the default) derives
    # it from this file: reconnect_max + 20 % jitter + one heartbeat_interval (41 s
    # with the defaults), assuming the agents use the same reconnect_max.
    reconnect_grace: Duration = 0.0
    # The monitor's loop lets the bus's input gather this long before reading it
    # (shared/coalesce.py): heartbeats are read ~20 a wake at 10,000 nodes instead
    # of one, for ~45 % less CPU; every answer the monitor gives waits at most this
    # much longer. 0 reads at once.
    io_coalesce: Duration = 0.01

    def __post_init__(self):
        if self.reconnect_grace < 0:
            raise Invalid("reconnect_grace", "must not be negative (0 derives it from reconnect_max)")
        if not 0 <= self.io_coalesce <= 0.1:
            raise Invalid("io_coalesce", f"must be between 0 and 100ms, not {self.io_coalesce:g}s")
        if self.heartbeat_interval <= 0 or self.node_lost_after <= 0:
            raise Invalid("", "heartbeat_interval and node_lost_after must be positive")
        if self.suspect_after_missed < 1:
            raise Invalid("suspect_after_missed", "must be at least 1")
        if self.node_lost_after <= self.heartbeat_interval * self.suspect_after_missed:
            raise Invalid(
                "node_lost_after",
                "must be longer than suspect_after_missed × heartbeat_interval "
                f"({self.suspect_after_missed} × {self.heartbeat_interval:g}s), or nodes go lost before suspect",
            )


class SchedulerSection(Section, frozen=True):
    reconcile_interval: Duration = 1.0
    port_base: int = 20000
    port_count: int = 2000
    # True when every node is one machine (``llmgw up``): a port is handed out on
    # one node at a time, because an engine may bind it on every address of its
    # host (vLLM's rendezvous listens on *:master_port). A real cluster leaves it off.
    nodes_share_ports: bool = False
    leader_ttl: Duration = 5.0
    command_timeout: Duration = 5.0
    # A degraded replica (its leader makes no progress) is failed and rebuilt
    # after this long; it returns to ready if tokens flow again before.
    hang_timeout: Duration = 30.0
    # Crash loops: after a replica of a deployment fails before serving, the
    # next attempt waits backoff_base, doubling per consecutive failure up to
    # backoff_max; a replica that becomes ready resets it.
    backoff_base: Duration = 5.0
    backoff_max: Duration = 300.0
    # A node implicated in this many replica failures within auto_cordon_window
    # is cordoned, but never more than auto_cordon_max_share of a fabric's
    # nodes (0 turns auto-cordon off).
    auto_cordon_after: int = 3
    auto_cordon_window: Duration = 600.0
    auto_cordon_max_share: float = 0.25
    # The safety net under the incremental steps: a full pass (every replica and
    # node looked at afresh) this often, beside the loop (scheduler/fullpass.py).
    full_pass_interval: Duration = 60.0
    # Restart in place: an engine that exits on nodes whose lease and hardware
    # are healthy is relaunched on the same members (same GPUs and ports) up to
    # this many times within restart_window; after that its replica moves
    # (0: always move).
    restart_in_place: int = 2
    restart_window: Duration = 600.0
    # A peer says a ready replica's group broke while every node is healthy:
    # wait this long for its agent to report the engine's exit (the two reports
    # race) and restart in place; else it moves. 0: move at once.
    peer_lost_grace: Duration = 0.5

    def __post_init__(self):
        if self.restart_in_place < 0 or self.restart_window <= 0 or self.peer_lost_grace < 0:
            raise Invalid("", "restart_in_place and peer_lost_grace must not be negative, and restart_window must be positive")
        if self.full_pass_interval <= 0 or self.full_pass_interval < self.reconcile_interval:
            raise Invalid(
                "full_pass_interval",
                f"{self.full_pass_interval:g}s is below reconcile_interval ({self.reconcile_interval:g}s): a full pass is at most one a step",
            )
        if not (1024 <= self.port_base and self.port_base + self.port_count <= 65536 and self.port_count >= 2):
            raise Invalid("", "port_base..port_base+port_count must lie within 1024..65535")
        if self.hang_timeout <= 0:
            raise Invalid("hang_timeout", "must be positive")
        if self.backoff_base < 0 or self.backoff_max < self.backoff_base:
            raise Invalid("", "backoff_base must not be negative, and backoff_max not below it")
        if self.auto_cordon_after < 1 or self.auto_cordon_window <= 0:
            raise Invalid("", "auto_cordon_after must be at least 1 and auto_cordon_window positive")
        if not 0 <= self.auto_cordon_max_share <= 1:
            raise Invalid("auto_cordon_max_share", f"a share between 0 and 1, got {self.auto_cordon_max_share}")


# How the gateway picks a replica (GatewaySection.routing).
Routing = Literal["prefix", "least-outstanding"]


class GatewaySection(Section, frozen=True):
    listen: Listen = "127.0.0.1:8080"
    max_body_bytes: int = 4 * 1024 * 1024
    upstream_timeout: Duration = 600.0
    connect_timeout: Duration = 2.0
    api_keys_file: str = ""
    # HTTPS for clients: a PEM certificate (chain) and its key; both or neither.
    # Without them the API is plain HTTP (behind a TLS-terminating proxy, say).
    tls_cert: str = ""
    tls_key: str = ""
    # One log line per generation request (llmgw.gateway.access); off: a cost per request.
    access_log: bool = False
    cooldown: Duration = 10.0
    failures_before_cooldown: int = 3
    # What a 503 (no ready replica) tells clients to wait before trying again.
    retry_after: Duration = 5.0
    # Requests in flight on a replica that sends no byte for this long count
    # against it at once (passive detection), and the agents hear of it.
    stall_after: Duration = 5.0
    # How often traffic evidence goes to the agents of busy replicas' leaders.
    traffic_interval: Duration = 1.0
    # Bounds on what clients (and replicas) can make the gateway hold (docs/operations.md).
    # Client connections open at once; more are answered 503 and closed.
    max_connections: int = 4096
    # A request's head and body must arrive within this of its first byte, however it trickles (408).
    request_read_timeout: Duration = 30.0
    # Request bodies held at once, all connections together (503 beyond).
    max_buffered_body_bytes: int = 256 * 1024 * 1024
    # A non-streamed answer from a replica larger than this is refused (502).
    max_response_bytes: int = 64 * 1024 * 1024
    # JSON bodies nested deeper than this are refused (400).
    max_json_depth: int = 64
    # Which replica gets a request (docs/architecture.md, "Routing"): "prefix" sends a
    # conversation where its prompt prefix is cached (rendezvous hashing, the same in
    # every gateway) within a bounded load; "least-outstanding": the least busy.
    routing: Routing = "prefix"
    # Bounded loads: no replica holds more than ceil(routing_load_bound x mean) + routing_load_slack in flight.
    routing_load_bound: float = 1.15
    routing_load_slack: int = 2
    # How much of a prompt's start (bytes) names its conversation.
    routing_prefix_chars: int = 16384
    # A stream whose replica fails after its first chunk goes on from another ready
    # replica as a continuation of the text sent (docs/architecture.md, "Stream
    # migration"); a client opts out with the header X-LLMGW-Migration: off.
    stream_migration: bool = True
    # How many more replicas one request may be moved to: a stream continued, a
    # request that sent its client nothing retried (0: never moved).
    max_migrations: int = 2
    # The text a stream keeps to be continued (characters); a longer one ends with the error event.
    stream_migration_max_text: int = 512 * 1024
    # Gateway processes on one port (SO_REUSEPORT), each its own NATS connection and
    # mirrors; 0: one per core this process may run on. 'llmgw gateway --workers N' overrides.
    workers: int = 0

    def __post_init__(self):
        if problem := listen_problem(self.listen):
            raise Invalid("listen", problem)
        if not (type(self.workers) is int and 0 <= self.workers <= 1024):
            raise Invalid("workers", f"must be a whole number from 0 (one per core) to 1024, got {self.workers!r}")
        self._check_routing()
        self._check_bounds()
        self._check_timings()
        if bool(self.tls_cert) != bool(self.tls_key):
            raise Invalid("", "tls_cert and tls_key go together (HTTPS needs both)")

    def _check_routing(self) -> None:
        if self.routing not in get_args(Routing):  # a file's value msgspec checks; this, a program's
            raise Invalid("routing", f"{self.routing!r} is not one of {', '.join(get_args(Routing))}")
        if not (isinstance(self.routing_load_bound, (int, float)) and 1.0 <= self.routing_load_bound <= 100):
            raise Invalid("routing_load_bound", f"must be a number from 1 (strict balance) up, e.g. 1.25; got {self.routing_load_bound!r}")
        if not 0 <= self.routing_load_slack <= 1000:
            raise Invalid("routing_load_slack", f"must be between 0 and 1000 requests, got {self.routing_load_slack}")
        if not 64 <= self.routing_prefix_chars <= 1024 * 1024:
            raise Invalid("routing_prefix_chars", f"must be between 64 and 1048576, got {self.routing_prefix_chars}")

    def _check_bounds(self) -> None:
        for name in ("max_connections", "max_buffered_body_bytes", "max_response_bytes", "max_json_depth"):
            if getattr(self, name) < 1:
                raise Invalid(name, "must be at least 1")
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise Invalid(
                "max_buffered_body_bytes",
                f"{self.max_buffered_body_bytes} is smaller than max_body_bytes ({self.max_body_bytes}): one body could never be held",
            )
        if self.max_body_bytes < 1:
            raise Invalid("max_body_bytes", "must be at least 1")
        if not (type(self.max_migrations) is int and 0 <= self.max_migrations <= 16):
            raise Invalid("max_migrations", f"must be a whole number from 0 (never move a request) to 16, got {self.max_migrations!r}")
        if self.stream_migration_max_text < 1:
            raise Invalid("stream_migration_max_text", "must be at least 1 character")

    def _check_timings(self) -> None:
        if self.request_read_timeout <= 0:
            raise Invalid("request_read_timeout", "must be positive")
        if self.upstream_timeout <= 0 or self.connect_timeout <= 0:
            raise Invalid("", "upstream_timeout and connect_timeout must be positive")
        if self.cooldown < 0 or self.retry_after < 0:
            raise Invalid("", "cooldown and retry_after must not be negative")
        if self.failures_before_cooldown < 1:
            raise Invalid("failures_before_cooldown", "must be at least 1")
        if self.stall_after <= 0 or self.traffic_interval <= 0:
            raise Invalid("", "stall_after and traffic_interval must be positive")


class ServiceConfig(Section, frozen=True):
    server: Annotated[list[str], msgspec.Meta(description="a NATS URL or a list of them")]
    tls: TlsSection
    metrics_listen: Listen = ""  # "": no metrics endpoint
    kv_replicas: int = 1
    reconnect_base: Duration = 1.0
    reconnect_max: Duration = 30.0
    health: HealthSection = msgspec.field(default_factory=HealthSection)
    scheduler: SchedulerSection = msgspec.field(default_factory=SchedulerSection)
    gateway: GatewaySection = msgspec.field(default_factory=GatewaySection)
    # The file this was loaded from, for messages.
    source: str = ""

    not_in_files = ("source",)

    def __post_init__(self):
        check_servers(self.server)
        if self.metrics_listen and (problem := listen_problem(self.metrics_listen)):
            raise Invalid("metrics_listen", problem)
        if self.reconnect_base > self.reconnect_max:
            raise Invalid("reconnect_base", f"{self.reconnect_base:g}s is longer than reconnect_max ({self.reconnect_max:g}s)")

    def tls_files(self) -> TlsFiles:
        return TlsFiles(ca=self.tls.ca, cert=self.tls.cert, key=self.tls.key)

    @property
    def reconnect_grace(self) -> float:
        """health.reconnect_grace, or when 0 the agents' worst reconnect time:
        reconnect_max with its +20 % jitter, plus a heartbeat to be heard."""
        h = self.health
        return h.reconnect_grace or self.reconnect_max * 1.2 + h.heartbeat_interval


def load_service_config(path: str | os.PathLike) -> ServiceConfig:
    """Load and check a service (or operator) configuration file."""
    source = str(path)
    cfg = convert(listed(read_yaml(path), "server"), ServiceConfig, source)
    # Paths (tls, the gateway's files) are relative to the file, so a
    # configuration and its certificates move together.
    base = Path(path).resolve().parent
    tls = TlsSection(**resolve_tls(cfg.tls, base, source))
    files = {k: resolve_path(base, v) for k in ("api_keys_file", "tls_cert", "tls_key") if (v := getattr(cfg.gateway, k))}
    gateway = msgspec.structs.replace(cfg.gateway, **files)
    check_gateway_files(gateway, source)
    return msgspec.structs.replace(cfg, tls=tls, gateway=gateway, source=source)


def check_gateway_files(g: GatewaySection, source: str) -> None:
    """The files the gateway section names, read as the gateway reads them at start:
    the HTTPS certificate and key must load as a pair, the API key file must hold
    digests. Refused here, a bad file is one error when the configuration is read,
    not a gateway (or each of N workers) failing after it started."""
    if g.tls_cert:
        server_context(source, g.tls_cert, g.tls_key)
    if g.api_keys_file:
        try:
            read_digests(g.api_keys_file)
        except ConfigError as e:
            raise ConfigError(f"{source}: gateway.api_keys_file: {e}") from None


def default_operator_config() -> str:
    """Where ``llmgw ctl`` and ``llmgw tui`` look when --config is not given."""
    return os.environ.get("LLMGW_CONFIG") or str(Path(".llmgw") / "operator.yaml")


def write_config(path: str | os.PathLike, data: dict) -> None:
    write_atomic(path, yaml.safe_dump(data, sort_keys=False), mode=0o600)
