"""What one client connection costs nats-server, by the number of identities it knows.

Not a test: it prints figures. Run from the repository root::

    .venv/bin/python bench/nats_auth.py                       # 100 and 10,000 identities
    .venv/bin/python bench/nats_auth.py --identities 2000 --connects 500

For each size: a real nats-server configured as llmgw configures it (one user per
identity, ``verify_and_map``, every key pinned), then ``--connects`` sequential
TLS connects and closes by one node, and the server's CPU (``/proc/<pid>/stat``)
per connect. Rows:

- a node as issued now: its certificate carries a URI SAN
  (``urn:llmgw:node:<id>``) and its user is named by it, which nats-server finds
  by map look-up;
- a node issued before client certificates carried the SAN: no SAN, its user
  named by the subject (``natsconf.user_name``), which nats-server finds by
  walking every configured user and parsing each name as a DN — the cost that
  grows with the identities. The control-plane bench's restart phase found the per-connection
  cost growing with the cluster (docs/performance.md); this isolates it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import nats
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

sys.path.insert(0, str(Path(__file__).resolve().parent))
from control_plane import cpu_seconds, one_ledger_write  # a sibling script, not a package

from llmgw.shared import pki
from llmgw.shared.natsserver import NatsServer
from llmgw.shared.tls import TlsFiles


def without_san(srv: NatsServer, issued: TlsFiles, node: str, out: Path) -> TlsFiles:
    """``node``'s certificate as issued before URI SANs: same key (so the same pin), no SAN."""
    key = serialization.load_pem_private_key(Path(issued.key).read_bytes(), None)
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "node"), x509.NameAttribute(NameOID.COMMON_NAME, node)])
    cert = pki._sign(
        srv.pki_dir, subject=subject, public_key=key.public_key(), usage=ExtendedKeyUsageOID.CLIENT_AUTH,
        sans=[], not_before=now - dt.timedelta(minutes=5), not_after=now + dt.timedelta(days=1),
    )  # fmt: skip
    out.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return TlsFiles(issued.ca, str(out), issued.key)


async def per_connect(srv: NatsServer, files: TlsFiles, connects: int) -> tuple[float, float]:
    """(server CPU ms, wall ms) per sequential connect + close."""
    ctx = files.context()
    assert srv.proc is not None
    c0, t0 = cpu_seconds(srv.proc.pid), time.monotonic()
    for _ in range(connects):
        nc = await nats.connect(srv.url, tls=ctx, tls_hostname=None, allow_reconnect=False, connect_timeout=5)
        await nc.close()
    return 1000 * (cpu_seconds(srv.proc.pid) - c0) / connects, 1000 * (time.monotonic() - t0) / connects


def measure(identities: int, connects: int) -> list[tuple[str, float, float]]:
    root = Path(tempfile.mkdtemp(prefix="llmgw-natsauth-"))
    srv = NatsServer(root=root)
    srv.prepare()
    width = max(5, len(str(identities)))
    names = [f"node{i:0{width}d}" for i in range(1, identities + 1)]
    with one_ledger_write(srv.pki_dir):
        tls = {n: srv.issue(n, "node") for n in names}
    legacy = without_san(srv, tls[names[0]], names[0], root / "legacy.pem")
    # Its ledger entry as one from before: rendered as a subject-named user.
    ledger = json.loads((srv.pki_dir / pki.LEDGER).read_text())
    ledger["entries"][f"node/{names[0]}"]["sans"] = []
    (srv.pki_dir / pki.LEDGER).write_text(json.dumps(ledger))
    srv.render()
    if f'"{pki.subject_dn("node", names[0])}"' not in srv.conf_path.read_text():
        raise SystemExit(f"expected a user named by {names[0]}'s subject in {srv.conf_path}")
    srv.launch()
    try:
        srv.wait_ready()
        rows = []
        for label, files in (
            ("as issued now: user named by its URI SAN", tls[names[1 % identities]]),
            ("issued before: no SAN, user named by subject", legacy),
            ("as issued now (again)", tls[names[2 % identities]]),
        ):
            cpu, wall = asyncio.run(per_connect(srv, files, connects))
            rows.append((label, cpu, wall))
        return rows
    finally:
        srv.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--identities", default="100,10000", help="comma-separated sizes (default 100,10000)")
    ap.add_argument("--connects", type=int, default=300, help="sequential connects per row (default 300)")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.identities.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--identities: comma-separated whole numbers, not {args.identities!r}")
    if not sizes or min(sizes) < 3 or args.connects < 1:
        ap.error("--identities: each at least 3; --connects: at least 1")
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # nats-py's TLS close warns on every connect
    print("| identities | client | nats-server CPU per connect | wall per connect |\n|---|---|---|---|", flush=True)
    for n in sizes:
        for label, cpu, wall in measure(n, args.connects):
            print(f"| {n} | {label} | {cpu:.2f} ms | {wall:.2f} ms |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
