"""``llmgw nats``: run the embedded nats-server in place of this process."""

from __future__ import annotations

import os
from pathlib import Path

from llmgw.shared import natsbin
from llmgw.shared.errors import ConfigError


def run(args) -> int:
    if not Path(args.config).is_file():
        raise ConfigError(f"--config {args.config}: no such file; render one with 'llmgw ctl nats-config --out FILE'")
    binary = natsbin.find()
    extra = [a for a in args.extra if a != "--"]
    # exec, not spawn: signals (reload, stop) from systemd or a shell reach the server itself.
    os.execv(binary, [binary, "-c", args.config, *extra])
    return 0  # pragma: no cover
