"""TLS files a configuration names, checked and loaded with the standard library.

Two kinds: ``TlsFiles``, the CA, certificate and key a process connects to the
bus with (mutual TLS, ``shared/bus.py``), and the gateway's HTTPS pair for its
clients (``server_context``). Both are checked when a configuration is read
(``shared/config.py``) and loaded again where they are used, by the same code,
so a file the loader accepted is one the service can use.

This module imports neither the NATS client nor the CA tooling
(``shared/pki.py``, which needs ``cryptography``): reading a YAML file must not
load either. ``TlsFiles.identity`` reads the certificate's identity through
``pki`` and imports it when it is called.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError


@dataclass(frozen=True)
class TlsFiles:
    """The bus client's files: the CA it trusts, its certificate and its key."""

    ca: str
    cert: str
    key: str

    def check(self, where: str = "tls") -> None:
        for field in ("ca", "cert", "key"):
            path = getattr(self, field)
            if not path:
                raise ConfigError(f"{where}.{field}: a path is required")
            if not Path(path).is_file():
                raise ConfigError(f"{where}.{field}: file {path} does not exist")

    def context(self) -> ssl.SSLContext:
        self.check()
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
            ctx.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"cannot load TLS files (ca={self.ca}, cert={self.cert}, key={self.key}): {e}") from None
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx

    def identity(self) -> tuple[str, str]:
        """(role, name) this certificate speaks as."""
        from . import pki  # the CA tooling (cryptography) only when a process connects, not when a file is read

        return pki.identity_of(self.cert)


def server_context(source: str, cert: str, key: str, where: str = "gateway") -> ssl.SSLContext:
    """An HTTPS context serving ``cert`` (a PEM chain) with ``key``, or a
    ConfigError naming ``source`` (the configuration file) and the key at fault.
    Relative paths were made relative to the configuration file when it was read."""
    cert_path, key_path = Path(cert), Path(key)
    for what, p in (("tls_cert", cert_path), ("tls_key", key_path)):
        if not p.is_file():
            raise ConfigError(f"{source}: {where}.{what}: {p} does not exist")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_path, key_path)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"{source}: {where}.tls_cert/tls_key: {cert_path} and {key_path} are not a PEM certificate and its key ({e})") from None
    return ctx
