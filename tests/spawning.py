"""Starting a process from async code without stalling the event loop.

The services under test (health monitor, scheduler, in-process gateways) run on
the test's own event loop. ``subprocess.Popen`` forks and execs synchronously;
on a loaded machine that can take long enough for a heartbeat or a watch to
fall behind, which reads as a fault the test never injected. So async code
starts its processes through here: the fork/exec runs in a worker thread.
Nothing here imports pytest, so ``bench/`` may use it too.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _start_logged(argv: Sequence[str], log: Path, popen_kw: dict[str, Any]) -> subprocess.Popen:
    # The child keeps its own copy of the log's descriptor; ours closes when Popen returns.
    with open(log, "wb") as out:
        return subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, **popen_kw)


async def start_logged(argv: Sequence[str], log: Path, **popen_kw: Any) -> subprocess.Popen:
    """Start ``argv`` with stdout and stderr written to ``log`` (truncated first)."""
    return await asyncio.to_thread(_start_logged, argv, log, popen_kw)


async def start(argv: Sequence[str], **popen_kw: Any) -> subprocess.Popen:
    """Start ``argv`` (``subprocess.Popen`` keywords as given)."""
    return await asyncio.to_thread(subprocess.Popen, list(argv), **popen_kw)


async def run(argv: Sequence[str], **run_kw: Any) -> subprocess.CompletedProcess:
    """Run ``argv`` to completion (``subprocess.run`` keywords as given)."""
    return await asyncio.to_thread(subprocess.run, list(argv), **run_kw)
