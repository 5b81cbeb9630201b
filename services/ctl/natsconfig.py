"""``llmgw ctl nats-config``."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Atomic: a server reloading mid-write must never read half a config.
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, out)
    print(f"wrote {out}", file=sys.stderr)
    return 0
