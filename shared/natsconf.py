"""Render a complete nats-server configuration from the PKI ledger.

The output is JSON, which nats-server's configuration parser accepts as-is;
rendering JSON means no hand-rolled quoting of subjects such as ``$JS.API.>``.
Each identity in the ledger that is neither revoked nor expired becomes one
user (``verify_and_map``), named by its certificate's URI SAN
(``pki.identity_uri``), or by its subject for a certificate issued before
client certificates carried one (``user_name``); nothing else can connect. After re-rendering, ``nats-server --signal reload`` applies the new
user list to open connections too, which is how a revoke takes effect.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from . import pki
from .errors import ConfigError
from .names import check_name
from .permissions import Permissions, for_identity


@dataclass
class ServerOptions:
    listen: str = "127.0.0.1:4222"
    monitor: str | None = "127.0.0.1:8222"
    store_dir: str = "./jetstream"
    server_name: str = "llmgw"
    server_cert: str | None = None
    server_key: str | None = None
    max_memory: int = 256 * 1024**2
    max_file: int = 4 * 1024**3
    pid_file: str | None = None
    # Clustered: this server's route address (HOST:PORT) and every server's
    # (HOST:PORT, its own included; nats-server ignores a route to itself).
    cluster_listen: str | None = None
    routes: list[str] = field(default_factory=list)
    cluster_name: str = "llmgw"
    route_cert: str | None = None  # default PKI/certs/route/<server_name>.pem
    route_key: str | None = None


@dataclass(frozen=True)
class Peer:
    """One server of a cluster as ``llmgw ctl nats-config --server`` names it."""

    name: str
    host: str
    port: int = 4222
    cluster_port: int = 6222
    monitor_port: int | None = 8222

    @property
    def url(self) -> str:
        return f"tls://{self.host}:{self.port}"


def check_cluster_size(n: int) -> None:
    """A JetStream cluster needs a majority: 1 server, or an odd number from 3 on."""
    if n == 1 or (n >= 3 and n % 2 == 1):
        return
    if n < 1:
        raise ConfigError(f"{n} NATS servers: there must be at least 1 (use 1, or an odd number of 3 or more)")
    raise ConfigError(
        f"{n} NATS servers: use 1, or an odd number of 3 or more (JetStream needs a majority of them up; {n} servers survive no more losses than {n - 1} do)"
    )


def parse_peer(spec: str) -> Peer:
    """``NAME=HOST[:PORT[:CLUSTER_PORT[:MONITOR_PORT|off]]]``."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise ConfigError(f"--server {spec!r}: expected NAME=HOST[:PORT[:CLUSTER_PORT[:MONITOR_PORT]]], e.g. nats1=10.0.0.11")
    check_name(name, "server name")
    if rest.startswith("["):
        raise ConfigError(f"--server {spec!r}: IPv6 addresses are not supported here; use a host name")
    host, *ports = rest.split(":")
    if not host or len(ports) > 3:
        raise ConfigError(f"--server {spec!r}: expected NAME=HOST[:PORT[:CLUSTER_PORT[:MONITOR_PORT]]]")

    def number(what: str, p: str) -> int:
        if not p.isdigit() or not (0 < int(p) < 65536):
            raise ConfigError(f"--server {spec!r}: {what} {p!r} is not a port number")
        return int(p)

    port = number("port", ports[0]) if len(ports) > 0 else 4222
    cport = number("cluster port", ports[1]) if len(ports) > 1 else 6222
    # only the monitor port may be turned off
    mport: int | None = 8222
    if len(ports) > 2:
        mport = None if ports[2] in ("off", "none") else number("monitor port", ports[2])
    return Peer(name=name, host=host, port=port, cluster_port=cport, monitor_port=mport)


def cluster_options(
    peers: list[Peer],
    store_root: str | os.PathLike,
    *,
    pid_dir: str | os.PathLike | None = None,
    cluster_name: str = "llmgw",
) -> list[ServerOptions]:
    """One ServerOptions per server: its own JetStream store ``<store_root>/<name>``;
    routes to every server when there are several."""
    check_cluster_size(len(peers))
    names = [p.name for p in peers]
    if len(set(names)) != len(names):
        raise ConfigError(f"server names must differ: {', '.join(names)}")
    addrs = [(p.host, p.port) for p in peers] + [(p.host, p.cluster_port) for p in peers]
    if len(set(addrs)) != len(addrs):
        raise ConfigError("two servers (or a server's client and cluster ports) share an address and port")
    routes = [f"{p.host}:{p.cluster_port}" for p in peers] if len(peers) > 1 else []
    out = []
    for p in peers:
        out.append(
            ServerOptions(
                listen=f"{p.host}:{p.port}",
                monitor=f"{p.host}:{p.monitor_port}" if p.monitor_port else None,
                store_dir=str(Path(store_root) / p.name),
                server_name=p.name,
                pid_file=str(Path(pid_dir) / f"{p.name}.pid") if pid_dir else None,
                cluster_listen=f"{p.host}:{p.cluster_port}" if routes else None,
                routes=routes,
                cluster_name=cluster_name,
            )
        )
    return out


def _host_port(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not (0 < int(port) < 65536):
        raise ConfigError(f"{what} {value!r}: expected HOST:PORT, e.g. 127.0.0.1:4222")
    return host or "0.0.0.0", int(port)


def _perm_block(p: Permissions) -> dict:
    block: dict = {}
    pub: dict = {}
    if p.publish:
        pub["allow"] = p.publish
    if p.publish_deny:
        pub["deny"] = p.publish_deny
    # An explicit empty allow list means "nothing": without it NATS would allow all.
    block["publish"] = pub or {"allow": []}
    sub: dict = {}
    if p.subscribe:
        sub["allow"] = p.subscribe
    if p.subscribe_deny:
        sub["deny"] = p.subscribe_deny
    block["subscribe"] = sub or {"allow": []}
    if p.allow_responses:
        block["allow_responses"] = True
    return block


def _cluster_block(pki_path: Path, opts: ServerOptions) -> dict:
    """Routes between the servers over mutual TLS with llmgw's route certificates.

    Every route certificate is signed by the authority (``ca_file``, ``verify``)
    *and* pinned: a node's or service's certificate, from the same authority,
    cannot open a route and so read and write everything.
    """
    chost, cport = _host_port(opts.cluster_listen or "", "cluster listen")
    default_cert, default_key = pki.route_cert_paths(pki_path, opts.server_name)
    cert = Path(opts.route_cert) if opts.route_cert else default_cert
    key = Path(opts.route_key) if opts.route_key else default_key
    if not cert.exists() or not key.exists():
        raise ConfigError(
            f"no route certificate for server {opts.server_name} at {cert}; run 'llmgw ctl cert issue-route {opts.server_name} {chost} --dir {pki_path}' first"
        )
    routes = pki.active_routes(pki_path)
    if not any(e.name == opts.server_name for e in routes):
        raise ConfigError(f"the ledger has no valid route certificate for {opts.server_name}; re-issue it with 'llmgw ctl cert issue-route'")
    for r in opts.routes:
        _host_port(r, "route")
    return {
        "name": opts.cluster_name,
        "host": chost,
        "port": cport,
        "tls": {
            "cert_file": str(cert.resolve()),
            "key_file": str(key.resolve()),
            "ca_file": str((pki_path / pki.CA_CERT).resolve()),
            "verify": True,
            "pinned_certs": [e.spki_sha256 for e in routes],
            "timeout": 5,
        },
        # Explicit routes are dialled again and again: a peer down at start or
        # restarted later rejoins without anything else to do.
        "routes": [f"nats-route://{r}" for r in opts.routes],
    }


def user_name(entry: pki.LedgerEntry) -> str:
    """The nats-server user an issued identity maps to.

    Its URI SAN when the certificate carries one: nats-server looks SANs up as
    user names in a map, where a subject is matched by parsing every
    configured user's name as a DN, on every connection. A certificate without
    it (issued before) keeps its subject-named user until it is re-issued."""
    uri = pki.identity_uri(entry.role, entry.name)
    return uri if uri in entry.sans else entry.subject


def render(pki_dir: str | os.PathLike, opts: ServerOptions) -> str:
    pki_path = Path(pki_dir).resolve()
    if not pki.has_ca(pki_path):
        raise ConfigError(f"no authority in {pki_path}; run 'llmgw ctl cert init-ca --dir {pki_path}' first")
    cert = Path(opts.server_cert) if opts.server_cert else pki_path / pki.SERVER_CERT
    key = Path(opts.server_key) if opts.server_key else pki_path / pki.SERVER_KEY
    if not cert.exists() or not key.exists():
        raise ConfigError(f"no server certificate at {cert}; run 'llmgw ctl cert issue-server HOST… --dir {pki_path}' first")
    host, port = _host_port(opts.listen, "--listen")
    users = []
    pins = []
    for entry in pki.active_identities(pki_path):
        if not entry.spki_sha256:
            raise ConfigError(f"ledger entry {entry.key} has no key fingerprint; re-issue it with 'llmgw ctl cert issue-…'")
        users.append({"user": user_name(entry), "permissions": _perm_block(for_identity(entry.role, entry.name))})
        pins.append(entry.spki_sha256)
    conf: dict = {
        "server_name": opts.server_name,
        "host": host,
        "port": port,
        # Keep payloads within what the schemas accept (schemas.MAX_PAYLOAD).
        "max_payload": 1048576,
        "tls": {
            "cert_file": str(cert.resolve()),
            "key_file": str(key.resolve()),
            "ca_file": str((pki_path / pki.CA_CERT).resolve()),
            "verify_and_map": True,
            # Only the ledger's current certificates: a re-issued identity's old
            # certificate (same subject, other key) is refused too, and a reload
            # closes connections made with certificates no longer pinned.
            "pinned_certs": pins,
            "timeout": 5,
        },
        "authorization": {"users": users},
        "jetstream": {
            "store_dir": str(Path(opts.store_dir).resolve()),
            "max_memory_store": opts.max_memory,
            "max_file_store": opts.max_file,
        },
    }
    if opts.monitor:
        mhost, mport = _host_port(opts.monitor, "--monitor")
        conf["http"] = f"{mhost}:{mport}"
    if opts.pid_file:
        conf["pid_file"] = str(Path(opts.pid_file).resolve())
    if opts.cluster_listen:
        conf["cluster"] = _cluster_block(pki_path, opts)
    header = (
        "# Rendered by 'llmgw ctl nats-config' from the PKI ledger; do not edit by hand.\n"
        f"# {len(users)} identities. Re-render and 'nats-server --signal reload' after issuing or revoking.\n"
    )
    return header + json.dumps(conf, indent=2) + "\n"


def render_cluster(pki_dir: str | os.PathLike, opts: list[ServerOptions]) -> dict[str, str]:
    """Each server's configuration (``server_name`` → text), from the same ledger:
    the same users and permissions on every server."""
    check_cluster_size(len(opts))
    return {o.server_name: render(pki_dir, o) for o in opts}


__all__ = ["Peer", "ServerOptions", "check_cluster_size", "cluster_options", "parse_peer", "render", "render_cluster", "user_name"]
