"""``llmgw ctl nats-config``: one server's configuration, or each server's of a cluster."""

from __future__ import annotations

import sys
from pathlib import Path

from llmgw.shared.errors import ConfigError
from llmgw.shared.files import write_atomic
from llmgw.shared.natsconf import ServerOptions, cluster_options, parse_peer, render, render_cluster


def run(args) -> int:
    if getattr(args, "servers", None):
        return _cluster(args)
    if getattr(args, "out_dir", None):
        raise ConfigError("--out-dir goes with --server NAME=HOST (a cluster); for one server use --out FILE")
    text = render(
        args.pki,
        ServerOptions(
            listen=args.listen,
            monitor=None if args.monitor in ("off", "", "none") else args.monitor,
            store_dir=args.store_dir,
            server_name=args.server_name,
        ),
    )
    if not args.out:
        sys.stdout.write(text)
        return 0
    # Atomic: a server reloading mid-write must never read half a config.
    write_atomic(args.out, text, mode=0o600)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _cluster(args) -> int:
    if args.out:
        raise ConfigError("--out writes one file; with --server use --out-dir DIR (one NAME.conf per server)")
    peers = [parse_peer(s) for s in args.servers]
    texts = render_cluster(args.pki, cluster_options(peers, args.store_dir))
    if not args.out_dir:
        for name, text in texts.items():
            sys.stdout.write(f"# ---- {name}.conf ----\n{text}")
        return 0
    for name, text in texts.items():
        path = Path(args.out_dir) / f"{name}.conf"
        write_atomic(path, text, mode=0o600)
        print(f"wrote {path}", file=sys.stderr)
    if len(peers) > 1:
        print(
            f"{len(peers)} servers: set 'server:' in every agent.yaml, service and operator config to all of "
            f"{', '.join(p.url for p in peers)}, and 'kv_replicas: 3' in the services' configs "
            "(at their next start they raise existing buckets to it, and log each change)",
            file=sys.stderr,
        )
    return 0
