"""Render a complete nats-server configuration from the PKI ledger.

The output is JSON, which nats-server's configuration parser accepts as-is;
rendering JSON means no hand-rolled quoting of subjects such as ``$JS.API.>``.
Each identity in the ledger that is neither revoked nor expired becomes one
user named by its certificate subject (``verify_and_map``); nothing else can
connect. After re-rendering, ``nats-server --signal reload`` applies the new
user list to open connections too, which is how a revoke takes effect.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from . import pki
from .errors import ConfigError
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


def render(pki_dir: str | os.PathLike, opts: ServerOptions) -> str:
    pki_path = Path(pki_dir).resolve()
    if not pki.has_ca(pki_path):
        raise ConfigError(f"no authority in {pki_path}; run 'llmgw ctl cert init-ca --dir {pki_path}' first")
    cert = Path(opts.server_cert) if opts.server_cert else pki_path / pki.SERVER_CERT
    key = Path(opts.server_key) if opts.server_key else pki_path / pki.SERVER_KEY
    if not cert.exists() or not key.exists():
        raise ConfigError(
            f"no server certificate at {cert}; run 'llmgw ctl cert issue-server HOST… --dir {pki_path}' first"
        )
    host, port = _host_port(opts.listen, "--listen")
    users = []
    pins = []
    for entry in pki.active_identities(pki_path):
        if not entry.spki_sha256:
            raise ConfigError(f"ledger entry {entry.key} has no key fingerprint; re-issue it with 'llmgw ctl cert issue-…'")
        users.append({"user": entry.subject, "permissions": _perm_block(for_identity(entry.role, entry.name))})
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
    header = (
        "# Rendered by 'llmgw ctl nats-config' from the PKI ledger; do not edit by hand.\n"
        f"# {len(users)} identities. Re-render and 'nats-server --signal reload' after issuing or revoking.\n"
    )
    return header + json.dumps(conf, indent=2) + "\n"


__all__ = ["ServerOptions", "render"]
