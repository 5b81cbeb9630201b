"""``llmgw ctl cert …``: the authority's commands."""

from __future__ import annotations

import json

from llmgw.shared import pki


def init_ca(args) -> int:
    path = pki.init_ca(args.dir, common_name=args.cn, days=args.days)
    print(f"authority created: {path}")
    print(f"keep {path.parent / pki.CA_KEY} on this host only; share {path.name} with every node and service")
    return 0


def _report(issued: pki.Issued) -> None:
    print(f"issued {issued.entry.subject} (serial {issued.entry.serial}, valid until {issued.entry.not_after})")
    print(f"  certificate: {issued.cert_path}")
    print(f"  key:         {issued.key_path} (0600)")
    print(f"  authority:   {issued.ca_path}")


def issue_client(args) -> int:
    _report(pki.issue(args.dir, args.node, "node", args.out, days=args.days))
    print("the NATS server accepts it after 'llmgw ctl nats-config' and a reload")
    return 0


def issue_service(args) -> int:
    _report(pki.issue(args.dir, args.name, args.role, args.out, days=args.days))
    return 0


def issue_server(args) -> int:
    _report(pki.issue_server(args.dir, args.hosts, args.out, days=args.days))
    return 0


def issue_route(args) -> int:
    _report(pki.issue_route(args.dir, args.name, args.hosts, args.out, days=args.days))
    print("the cluster's servers accept it as a route after 'llmgw ctl nats-config --server …' and a restart or reload")
    return 0


def list_certs(args) -> int:
    entries = pki.ledger(args.dir)
    if args.output == "json":
        print(json.dumps([{**e.__dict__, "expired": e.expired()} for e in entries], indent=2))
        return 0
    rows = [("ROLE", "NAME", "SERIAL", "NOT AFTER", "STATUS")]
    for e in entries:
        status = "revoked" if e.revoked else "expired" if e.expired() else "valid"
        rows.append((e.role, e.name, e.serial[:16], e.not_after, status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())  # every row has the header's columns
    return 0


def revoke(args) -> int:
    entry = pki.revoke(args.dir, args.name, args.role)
    print(f"revoked {entry.subject} at {entry.revoked_at}")
    print("re-render with 'llmgw ctl nats-config' and reload the server ('nats-server --signal reload') to close its connections")
    return 0
