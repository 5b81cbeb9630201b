"""``llmgw ctl nats-config``."""

from __future__ import annotations

import sys

from llmgw.shared.files import write_atomic
from llmgw.shared.natsconf import ServerOptions, render


def run(args) -> int:
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
