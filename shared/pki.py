"""The certificate authority: the one thing in a cluster that cannot be delegated.

A node is who its client certificate says it is. The subject carries both the
name and the role (``CN=node01,OU=node``), so a node called ``scheduler`` is
``CN=scheduler,OU=node`` and can never be mistaken for the service
``CN=scheduler,OU=scheduler``. The NATS server maps each certificate to a
user (``verify_and_map``), so what is written here *is* the authorisation.

Client certificates also carry the same identity as a URI SAN,
``urn:llmgw:<role>:<name>`` (``identity_uri``), and the server's users are
named by it: nats-server tries a certificate's SANs as user names by map
look-up, and only when none matches walks every configured user parsing each
name as a DN — ~1 µs per identity on every connection, 12.8 ms per connect at
10,000 nodes (``bench/nats_auth.py``). Certificates issued before carry no SAN
and keep a subject-named user until they are re-issued.

Layout of a PKI directory (mode 0700)::

    ca.pem          the authority's certificate (share it)
    ca-key.pem      its private key (0600; never leaves this host)
    ledger.json     every certificate issued and revoked, keyed role/name
    server.pem      the NATS server's certificate (issue-server)
    server-key.pem

Issued private keys are written to ``--out`` only, never kept here: re-issuing
is the recovery path for a lost key, and an authority that hoards node keys is
a bigger prize than it needs to be.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import ipaddress
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .errors import PkiError
from .files import write_atomic
from .names import SERVICE_ROLES, check_name, check_role

CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
LEDGER = "ledger.json"
SERVER_CERT = "server.pem"
SERVER_KEY = "server-key.pem"
# A NATS server's certificate for its cluster routes (it both dials and accepts them).
ROUTE_ROLE = "route"

DEFAULT_CA_DAYS = 3650
DEFAULT_CERT_DAYS = 365

_UTC = dt.UTC


def subject_dn(role: str, name: str) -> str:
    """The RFC 2253 string nats-server's verify_and_map matches users against."""
    return f"CN={name},OU={role}"


def identity_uri(role: str, name: str) -> str:
    """The URI SAN every client certificate carries, and its nats-server user name.

    A different namespace from the server's and routes' DNS/IP SANs, and roles
    and names admit no colon, so no other certificate's SAN can equal it."""
    return f"urn:llmgw:{role}:{name}"


@dataclass
class LedgerEntry:
    name: str
    role: str
    serial: str
    subject: str
    not_before: str
    not_after: str
    issued_at: str
    sans: list[str] = field(default_factory=list)
    revoked_at: str | None = None
    # SHA-256 of the certificate's SubjectPublicKeyInfo (hex): what nats-server's
    # ``pinned_certs`` compares, so exactly this certificate is accepted.
    spki_sha256: str = ""

    @property
    def key(self) -> str:
        return f"{self.role}/{self.name}"

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def expired(self, at: dt.datetime | None = None) -> bool:
        at = at or dt.datetime.now(_UTC)
        return dt.datetime.fromisoformat(self.not_after) <= at


@dataclass
class Issued:
    """Where an issue command wrote its files."""

    entry: LedgerEntry
    cert_path: Path
    key_path: Path
    ca_path: Path


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------


def _write_private(path: Path, data: bytes) -> None:
    write_atomic(path, data, mode=0o600)


def _write_public(path: Path, data: bytes) -> None:
    write_atomic(path, data, mode=0o644)


def _new_key() -> ec.EllipticCurvePrivateKey:
    # P-256: small, fast handshakes, accepted by Go's TLS stack (nats-server).
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def spki_sha256(cert: x509.Certificate) -> str:
    spki = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(spki).hexdigest()


def _iso(t: dt.datetime) -> str:
    return t.astimezone(_UTC).isoformat(timespec="seconds")


@contextlib.contextmanager
def _locked(pki: Path):
    """Serialise ledger writers (two onboarding scripts at once must not lose an entry)."""
    pki.mkdir(parents=True, exist_ok=True)
    with open(pki / ".ledger.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# --------------------------------------------------------------------------
# the authority
# --------------------------------------------------------------------------


def init_ca(pki_dir: str | os.PathLike, *, common_name: str = "llmgw CA", days: int = DEFAULT_CA_DAYS) -> Path:
    """Create a new authority in ``pki_dir``. Refuses to replace an existing one."""
    pki = Path(pki_dir)
    if (pki / CA_CERT).exists() or (pki / CA_KEY).exists():
        raise PkiError(
            f"{pki} already holds an authority ({CA_CERT}/{CA_KEY}); refusing to overwrite it — "
            "every certificate it issued would stop working. Use another --dir, or remove it "
            "deliberately."
        )
    pki.mkdir(parents=True, exist_ok=True)
    os.chmod(pki, 0o700)
    key = _new_key()
    now = dt.datetime.now(_UTC)
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmgw"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_private(pki / CA_KEY, _key_pem(key))
    _write_public(pki / CA_CERT, cert.public_bytes(serialization.Encoding.PEM))
    with _locked(pki):
        if not (pki / LEDGER).exists():
            _save_ledger(pki, {})
    return pki / CA_CERT


def has_ca(pki_dir: str | os.PathLike) -> bool:
    pki = Path(pki_dir)
    return (pki / CA_CERT).exists() and (pki / CA_KEY).exists()


def _load_ca(pki: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    if not has_ca(pki):
        raise PkiError(f"no authority in {pki}; run 'llmgw ctl cert init-ca --dir {pki}' first")
    try:
        cert = x509.load_pem_x509_certificate((pki / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((pki / CA_KEY).read_bytes(), password=None)
    except (ValueError, TypeError) as e:
        raise PkiError(f"the authority in {pki} cannot be read: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):  # init_ca makes one; another kind was put there by hand
        raise PkiError(f"the authority key in {pki} is a {type(key).__name__}, not the elliptic-curve key init-ca makes")
    return cert, key


# --------------------------------------------------------------------------
# the ledger
# --------------------------------------------------------------------------


def _load_ledger(pki: Path) -> dict[str, LedgerEntry]:
    path = pki / LEDGER
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text())
        return {k: LedgerEntry(**v) for k, v in raw["entries"].items()}
    except (ValueError, KeyError, TypeError) as e:
        raise PkiError(f"ledger {path} is damaged ({e}); restore it from a backup") from None


def _save_ledger(pki: Path, entries: dict[str, LedgerEntry]) -> None:
    body = {"version": 1, "entries": {k: asdict(v) for k, v in sorted(entries.items())}}
    _write_private(pki / LEDGER, (json.dumps(body, indent=2) + "\n").encode())


def ledger(pki_dir: str | os.PathLike) -> list[LedgerEntry]:
    """Every entry, issued and revoked, ordered by role then name."""
    return sorted(_load_ledger(Path(pki_dir)).values(), key=lambda e: (e.role, e.name))


def active_identities(pki_dir: str | os.PathLike) -> list[LedgerEntry]:
    """Entries the NATS server should accept: not revoked, not expired, not the server."""
    return [e for e in ledger(pki_dir) if not e.revoked and not e.expired() and e.role not in ("server", ROUTE_ROLE)]


def active_routes(pki_dir: str | os.PathLike) -> list[LedgerEntry]:
    """Route certificates the servers of a cluster accept from each other."""
    return [e for e in ledger(pki_dir) if not e.revoked and not e.expired() and e.role == ROUTE_ROLE]


# --------------------------------------------------------------------------
# issuing
# --------------------------------------------------------------------------


def _sign(
    pki: Path,
    *,
    subject: x509.Name,
    public_key,
    usage: x509.ObjectIdentifier,
    sans: list[x509.GeneralName],
    not_before: dt.datetime,
    not_after: dt.datetime,
) -> x509.Certificate:
    ca_cert, ca_key = _load_ca(pki)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=True,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usage if isinstance(usage, list) else [usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def issue(
    pki_dir: str | os.PathLike,
    name: str,
    role: str,
    out_dir: str | os.PathLike | None = None,
    *,
    days: int = DEFAULT_CERT_DAYS,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
) -> Issued:
    """Issue a client certificate for ``name`` in ``role`` and record it in the ledger.

    Files land in ``out_dir`` (default ``PKI/certs/<role>``) as ``<name>.pem`` and
    ``<name>-key.pem``, the names the onboarding script copies. Issuing again
    for the same identity replaces its ledger entry, and the server pins the
    ledger's certificates (``pinned_certs``): the old certificate stops being
    accepted at the next ``nats-config`` + reload, exactly like a revoke.
    """
    check_role(role)
    if role == "server":  # pragma: no cover - guarded by check_role
        raise PkiError("use issue_server for the NATS server's certificate")
    check_name(name, "node id" if role == "node" else f"{role} name")
    pki = Path(pki_dir)
    out = Path(out_dir) if out_dir else pki / "certs" / role
    now = dt.datetime.now(_UTC)
    nb = not_before or now - dt.timedelta(minutes=5)
    na = not_after or now + dt.timedelta(days=days)
    if na <= nb:
        raise PkiError(f"certificate validity ends ({_iso(na)}) before it starts ({_iso(nb)})")
    key = _new_key()
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )
    uri = identity_uri(role, name)
    return _sign_and_record(
        pki, name=name, role=role, subject=subject, key=key, usage=ExtendedKeyUsageOID.CLIENT_AUTH,
        sans=[x509.UniformResourceIdentifier(uri)], not_before=nb, not_after=na, now=now,
        paths=(out / f"{name}.pem", out / f"{name}-key.pem"), ledger_sans=[uri],
    )  # fmt: skip


def _sign_and_record(
    pki: Path, *, name: str, role: str, subject: x509.Name, key, usage, sans: list, not_before, not_after, now,
    paths: tuple[Path, Path], ledger_sans: list[str] | None = None,
) -> Issued:  # fmt: skip
    """Sign, record the identity in the ledger (replacing an earlier entry), and
    write its certificate and key — under the ledger lock, so two issuers never
    interleave."""
    cert_path, key_path = paths
    with _locked(pki):
        cert = _sign(pki, subject=subject, public_key=key.public_key(), usage=usage, sans=sans, not_before=not_before, not_after=not_after)
        entry = LedgerEntry(
            name=name,
            role=role,
            serial=format(cert.serial_number, "x"),
            subject=cert.subject.rfc4514_string(),
            not_before=_iso(not_before),
            not_after=_iso(not_after),
            issued_at=_iso(now),
            spki_sha256=spki_sha256(cert),
            sans=ledger_sans if ledger_sans is not None else [],
        )
        entries = _load_ledger(pki)
        entries[entry.key] = entry
        _write_private(key_path, _key_pem(key))
        _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        _save_ledger(pki, entries)
    return Issued(entry=entry, cert_path=cert_path, key_path=key_path, ca_path=pki / CA_CERT)


def _host_sans(hosts: list[str], kind: str) -> list[x509.GeneralName]:
    """Subject alternative names for ``hosts``: an IP address as one, anything else
    as a DNS name (refused when empty, with spaces, a slash or a colon: no DNS
    name has one, and a colon would let it read as a client's URI user name)."""
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            if not h or any(c.isspace() for c in h) or "/" in h or ":" in h:
                raise PkiError(f"invalid host name {h!r} for the {kind} certificate") from None
            sans.append(x509.DNSName(h))
    return sans


def issue_server(
    pki_dir: str | os.PathLike,
    hosts: list[str],
    out_dir: str | os.PathLike | None = None,
    *,
    days: int = DEFAULT_CERT_DAYS,
) -> Issued:
    """The NATS server's own certificate, valid for every host/IP in ``hosts``."""
    if not hosts:
        raise PkiError("issue-server needs at least one host name or IP address")
    pki = Path(pki_dir)
    out = Path(out_dir) if out_dir else pki
    sans = _host_sans(hosts, "server")
    key = _new_key()
    now = dt.datetime.now(_UTC)
    nb, na = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "server"),
            x509.NameAttribute(NameOID.COMMON_NAME, hosts[0]),
        ]
    )
    with _locked(pki):
        cert = _sign(
            pki,
            subject=subject,
            public_key=key.public_key(),
            usage=ExtendedKeyUsageOID.SERVER_AUTH,
            sans=sans,
            not_before=nb,
            not_after=na,
        )
        entry = LedgerEntry(
            name=hosts[0],
            role="server",
            serial=format(cert.serial_number, "x"),
            subject=cert.subject.rfc4514_string(),
            not_before=_iso(nb),
            not_after=_iso(na),
            issued_at=_iso(now),
            sans=list(hosts),
        )
        entries = _load_ledger(pki)
        entries[entry.key] = entry
        cert_path, key_path = out / SERVER_CERT, out / SERVER_KEY
        _write_private(key_path, _key_pem(key))
        _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        _save_ledger(pki, entries)
    return Issued(entry=entry, cert_path=cert_path, key_path=key_path, ca_path=pki / CA_CERT)


def route_cert_paths(pki_dir: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Where ``issue_route`` writes server ``name``'s route certificate and key by default."""
    d = Path(pki_dir) / "certs" / ROUTE_ROLE
    return d / f"{name}.pem", d / f"{name}-key.pem"


def issue_route(
    pki_dir: str | os.PathLike,
    name: str,
    hosts: list[str],
    out_dir: str | os.PathLike | None = None,
    *,
    days: int = DEFAULT_CERT_DAYS,
) -> Issued:
    """The route certificate of cluster server ``name`` (``CN=<name>,OU=route``).

    Routes are mutual TLS: each server dials its peers' cluster ports and accepts
    theirs with the same certificate, so it is valid for both server and client
    authentication, with every HOST (the addresses peers dial) as a SAN. The
    rendered cluster block pins the ledger's route certificates, so a node's or
    service's certificate from the same authority cannot join as a route.
    """
    check_name(name, "server name")
    if not hosts:
        raise PkiError("issue-route needs at least one host name or IP address that peers dial")
    sans = _host_sans(hosts, "route")
    pki = Path(pki_dir)
    key = _new_key()
    now = dt.datetime.now(_UTC)
    nb, na = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ROUTE_ROLE),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )
    paths = (Path(out_dir) / f"{name}.pem", Path(out_dir) / f"{name}-key.pem") if out_dir else route_cert_paths(pki, name)
    return _sign_and_record(
        pki, name=name, role=ROUTE_ROLE, subject=subject, key=key,
        usage=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        sans=sans, not_before=nb, not_after=na, now=now, paths=paths, ledger_sans=list(hosts),
    )  # fmt: skip


def revoke(pki_dir: str | os.PathLike, name: str, role: str | None = None) -> LedgerEntry:
    """Mark an identity revoked. It is refused from the next nats-config + reload on."""
    pki = Path(pki_dir)
    with _locked(pki):
        entries = _load_ledger(pki)
        matches = [e for e in entries.values() if e.name == name and (role is None or e.role == role)]
        if not matches:
            raise PkiError(f"no certificate named {name!r}{f' with role {role}' if role else ''} in the ledger")
        if len(matches) > 1:
            roles = ", ".join(sorted(e.role for e in matches))
            raise PkiError(f"{name!r} exists in several roles ({roles}); pass --role to choose one")
        entry = matches[0]
        if entry.revoked:
            return entry
        entry.revoked_at = _iso(dt.datetime.now(_UTC))
        _save_ledger(pki, entries)
    return entry


def identity_of(cert_path: str | os.PathLike) -> tuple[str, str]:
    """(role, name) from a certificate file's subject, e.g. ('node', 'node01')."""
    try:
        cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    except FileNotFoundError:
        raise PkiError(f"certificate {cert_path} does not exist") from None
    except ValueError as e:
        raise PkiError(f"{cert_path} is not a PEM certificate: {e}") from None
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ou = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    if not cn or not ou:
        raise PkiError(f"{cert_path} has no CN/OU subject; it was not issued by llmgw")
    return str(ou[0].value), str(cn[0].value)


__all__ = [
    "SERVICE_ROLES",
    "Issued",
    "LedgerEntry",
    "active_identities",
    "has_ca",
    "identity_of",
    "identity_uri",
    "init_ca",
    "issue",
    "issue_server",
    "ledger",
    "revoke",
    "subject_dn",
]
